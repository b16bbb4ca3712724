"""Incremental detokenization: generated token ids to text, one token at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from layerzoo.tokenization.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    `feed(token_id)` returns only the text that token completed. Text is held back while the
    decoded window ends in U+FFFD (a multi-byte character split across byte-level tokens), so a
    partial character is never emitted. Each step decodes a small window of recent ids (the
    prefix/read offsets of vLLM's `detokenize_incrementally`), not the whole sequence.
    """

    # How many prompt tokens to keep in front of the first generated one, for context-dependent
    # decoders (SentencePiece drops the leading space of a sequence's first token).
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = list(prompt_ids or ())[-self.PROMPT_CONTEXT :]
        # `_ids[_prefix:_read]` decoded to text already emitted; `_ids[_read:]` not emitted yet.
        self._ids: list[int] = prompt
        self._prefix = 0
        self._read = len(prompt)
        self.text = ""
        self.token_ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one generated token; return the new text it completes ("" if none yet)."""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        # Drop what no later window will need, so every step stays small.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text still held back at the end of generation (may hold U+FFFD for a cut character)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._ids = self._ids[len(self._ids) - 1 :] if self._ids else []
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta
