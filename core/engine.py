"""The foundation's engine: the step pipeline over a simple per-sequence cache.

``step()`` is linear: pick work (prefill one waiting sequence's next chunk, else decode every
running sequence in one batch) → run the model → sample → update the sequences (stop checks,
text, freeing). The runtime's scheduler and paged cache replace the picking and the cache; the
pipeline stays.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import attrs
import torch

from layerzoo.context import ForwardContext
from layerzoo.errors import UserError
from layerzoo.kv_cache import ContiguousKVCache
from layerzoo.model import LoadedModel
from layerzoo.sampling import sample
from layerzoo.sequence import FinishReason, Sequence
from layerzoo.tokenizer import IncrementalDetokenizer, Tokenizer


@attrs.define
class StepOutput:
    """What one step produced for one sequence: the new token and the new text."""

    seq: Sequence
    token_id: int
    text_delta: str


class Engine:
    """Runs sequences to completion, one step at a time."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, *, max_model_len: int | None = None, prefill_chunk: int = 512):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or loaded.config.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.cache = ContiguousKVCache(self.model.kv_cache_specs(), device=loaded.model.model.embed_tokens.weight.device)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._detok: dict[int, IncrementalDetokenizer] = {}

    # -- requests ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if len(seq) >= self.max_model_len:
            raise UserError(
                f"prompt of request {seq.request_id} has {len(seq)} tokens; the model's context "
                f"length is {self.max_model_len}"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.finished:
            seq.finish(FinishReason.ABORT)
        self._free(seq)

    # -- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        if self.waiting:
            seqs, is_prefill = [self.waiting[0]], True
            if seqs[0].seq_id not in self.cache.seqs:
                self.cache.add_sequence(seqs[0].seq_id)
                self._detok[seqs[0].seq_id] = IncrementalDetokenizer(self.tokenizer, seqs[0].prompt_token_ids)
            query_lens = [min(self.prefill_chunk, seqs[0].num_uncached)]
        else:
            seqs, is_prefill = list(self.running), False
            query_lens = [1] * len(seqs)
        ctx = ForwardContext.build(
            [s.seq_id for s in seqs],
            query_lens,
            [s.num_cached + n for s, n in zip(seqs, query_lens)],
            is_prefill=is_prefill,
            kv_cache=self.cache,
            device=self.cache.device,
        )
        input_ids = torch.tensor(
            [t for s, n in zip(seqs, query_lens) for t in s.token_ids[s.num_cached : s.num_cached + n]],
            dtype=torch.long,
            device=self.cache.device,
        )
        hidden = self.model(input_ids, ctx)
        self.cache.commit(ctx)
        for s, n in zip(seqs, query_lens):
            s.num_cached += n
        if is_prefill and seqs[0].num_uncached > 0:
            return []  # a prompt chunk that is not the last samples nothing
        if is_prefill:
            self.running.append(self.waiting.popleft())
        logits = self.model.compute_logits(hidden[ctx.last_token_indices()])
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return [self._append(s, t) for s, t in zip(seqs, tokens)]

    # -- updating sequences ------------------------------------------------------------------

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_token_ids.append(token)
        delta = self._detok[seq.seq_id].feed(token)
        seq.text += delta
        self._check_stop(seq, token)
        if seq.finished:
            delta = self._trim_stop_string(seq, delta)
            self._free(seq)
        return StepOutput(seq, token, delta)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish(FinishReason.STOP, token)
        elif token in p.stop_token_ids:
            seq.finish(FinishReason.STOP, token)
        elif any(s in seq.text for s in p.stop):
            seq.finish(FinishReason.STOP, next(s for s in p.stop if s in seq.text))
        elif p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            seq.finish(FinishReason.LENGTH)
        elif len(seq) >= self.max_model_len:
            seq.finish(FinishReason.LENGTH)

    def _trim_stop_string(self, seq: Sequence, delta: str) -> str:
        """Cut the text at a matched stop string (it is not part of the output)."""
        if not isinstance(seq.stop_reason, str):
            return delta
        before = len(seq.text) - len(delta)
        seq.text = seq.text[: seq.text.index(seq.stop_reason)]
        return seq.text[before:] if len(seq.text) > before else ""

    def _free(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.cache.free_sequence(seq.seq_id)
        self._detok.pop(seq.seq_id, None)

    def run(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.add(seq)
        while self.has_unfinished():
            self.step()
