"""From a step's new tokens to what a caller sees: text, stop strings, logprobs.

Each sequence has an incremental detokenizer. After the scheduler appended a step's tokens, the
new ones are detokenized one by one; a stop string ends the text where it starts and drops the
tokens after the one that completed it (accepted speculative drafts), so outputs equal plain
decoding. Logprobs of plain sampled rows, and prompt logprobs, are recorded here too. Finishing a
sequence on a stop string is the scheduler's: `process` returns the stop string it found.
"""

from __future__ import annotations

from layerzoo.runtime.sequence import Sequence
from layerzoo.tokenization.detokenizer import IncrementalDetokenizer
from layerzoo.tokenization.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        self._detok[seq.seq_id] = self._new(seq)

    def remove(self, seq: Sequence) -> None:
        self._detok.pop(seq.seq_id, None)

    def _new(self, seq: Sequence) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def reset(self, seq: Sequence, text: str) -> None:
        """Restart ``seq``'s detokenizer after its output was rewound to ``text``."""
        detok = self._new(seq)
        for token in seq.output_token_ids:
            detok.feed(token)
        self._detok[seq.seq_id] = detok
        seq.text = text

    def record_logprobs(self, seq: Sequence, logprob, top) -> None:
        """The sampled token's logprob (and the top ones) for a request that asked for them."""
        if seq.logprobs is None or logprob is None or not seq.output_token_ids:
            return
        entry = dict(top or [])
        entry[seq.output_token_ids[-1]] = logprob
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    @staticmethod
    def record_prompt_logprobs(seq: Sequence, entries: list[dict[int, float]]) -> None:
        """The next prompt positions' logprob entries, computed by a step's prompt rows."""
        if seq.prompt_logprobs is None:
            return
        seq.prompt_logprobs.extend(entries)
        assert len(seq.prompt_logprobs) <= len(seq.prompt_token_ids), (len(seq.prompt_logprobs), len(seq.prompt_token_ids))

    def process(self, seq: Sequence, num_new: int) -> str | None:
        """Detokenize the step's ``num_new`` new tokens; the stop string that ended the text, if any."""
        detok = self._detok.get(seq.seq_id)
        if detok is None or not seq.output_token_ids or num_new <= 0:
            return None
        first = len(seq.output_token_ids) - num_new
        for index in range(first, len(seq.output_token_ids)):
            delta = detok.feed(seq.output_token_ids[index])
            seq.text += delta
            stop = self._stop_string(seq, delta)
            if stop is not None:
                del seq.output_token_ids[index + 1 :]
                return stop
        return None

    @staticmethod
    def _stop_string(seq: Sequence, delta: str) -> str | None:
        stops = seq.params.stop
        if not stops or not delta or seq.finished:
            return None
        # Only the new text, and the stop string's length before it, can hold a new match.
        start = max(0, len(seq.text) - len(delta) - max(map(len, stops)) + 1)
        hits = [(i, s) for s in stops if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return None
        cut, stop = min(hits)
        seq.text = seq.text[:cut]
        return stop
