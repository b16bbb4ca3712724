"""The model runner: turns a step plan into one forward pass (or several) and the logits to sample.

It builds the step's `ForwardContext` (positions, slot mapping, block tables, context lengths),
runs the model and returns the logits of every chunk that samples. When a layer answers
``decode_multi_seq_unsupported`` it runs each decode row on its own and the prefill chunks as a
separate pass, instead of one fused batch.
"""

from __future__ import annotations

import logging

import attrs
import torch

from layerzoo.context import ForwardContext
from layerzoo.model import CausalLM
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.decode_capture import DecodeCapture
from layerzoo.runtime.graphs import DecodeGraphRunner, GraphConfig
from layerzoo.runtime.kv_pool import PagedKVCache
from layerzoo.runtime.scheduler import Chunk, StepPlan
from layerzoo.runtime.state_manager import StateManager

log = logging.getLogger(__name__)


def token_slice(chunk: Chunk) -> list[int]:
    """The chunk's input tokens, without building the whole token list of a long sequence."""
    seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens - len(chunk.draft)
    prompt_len = len(seq.prompt_token_ids)
    if start >= prompt_len:
        tokens = seq.output_token_ids[start - prompt_len : end - prompt_len]
    else:
        tokens = (seq.prompt_token_ids + seq.output_token_ids)[start:end]
    return tokens + list(chunk.draft) if chunk.draft else tokens


class SlotTable:
    """Decode-graph slots: a small integer per running sequence, reused after it is released."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.free = list(range(max_slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}

    def slot(self, seq_id: int) -> int:
        if seq_id not in self.slot_of:
            assert self.free, "more running sequences than slots"
            self.slot_of[seq_id] = self.free.pop()
        return self.slot_of[seq_id]

    def release(self, seq_id: int) -> int | None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)
        return slot


def token_at(seq, position: int) -> int:
    prompt_len = len(seq.prompt_token_ids)
    return seq.prompt_token_ids[position] if position < prompt_len else seq.output_token_ids[position - prompt_len]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        blocks: BlockManager,
        *,
        max_slots: int = 64,
        graphs: GraphConfig | None = None,
        states: StateManager | None = None,
        is_boundary=None,
    ):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.device = kv.device
        self.states = states if states is not None and states.active else None
        self.is_boundary = is_boundary  # (seq, position) -> whether a rollback-ring snapshot is taken before it
        caps = model.capabilities
        # In-pass capture only when every layer honours it; else a chunk is split at each capture.
        self.in_pass_capture = caps is not None and caps.replay_tail_split_supported
        if self.states is not None and self.states.has_pool and caps is not None and not self.in_pass_capture:
            lc = next(lc for lc in caps.layers if not lc.supports_replay_tail_split)
            log.info(
                "state snapshots inside a prefill chunk take two passes: layer %d (%s) answers "
                "supports_replay_tail_split False (plugin %s)",
                lc.layer_index, lc.layer_class, lc.answered_by["supports_replay_tail_split"] or "default",
            )
        self.slots = SlotTable(max_slots)
        graph_config = self._graph_config(graphs or GraphConfig())
        self.decode_capture = DecodeCapture(model, kv, self.states, device=self.device) if graph_config.enabled else None
        self.graphs = DecodeGraphRunner(
            model.capabilities,
            graph_config,
            device=self.device,
            poll_fp8=getattr(model, "fp8_calibration_states", None),
            max_slots=max_slots,
            capture_fn=self.decode_capture.capture if self.decode_capture else None,
            replay_fn=self.decode_capture.replay if self.decode_capture else None,
        )
        caps = model.capabilities
        self.per_sequence_decode = caps is not None and caps.decode_multi_seq_veto
        if self.per_sequence_decode:
            cause = next(c for c in caps.disabled() if c.query == "decode_multi_seq_unsupported")
            log.info("%s: decoding each sequence on its own", cause.describe())
        self.per_sequence_verify = caps is not None and caps.verify_multi_veto
        self._verify_route_logged = False

    def _graph_config(self, config: GraphConfig) -> GraphConfig:
        if config.enabled and not config.captures_on(self.device.type):
            # On CPU compiling pays back only after thousands of steps (bench/decode_graphs.py): opt-in.
            return attrs.evolve(config, enabled=False, off_reason="decode compile off on cpu (compile_decode=False)")
        return config

    def release(self, seq) -> None:
        """A sequence gave up its KV (finished, aborted, preempted): free its slot and its graphs."""
        slot = self.slots.release(seq.seq_id)
        if slot is not None:
            self.graphs.free_sequence(slot)
        if self.states is not None:
            self.states.release(seq)

    def passes(self, plan: StepPlan) -> list[tuple[list[Chunk], int]]:
        """The forward passes for a plan: ``(chunks, number of leading decode rows)`` each.

        One-token decodes come first, then speculative verifies (several rows each), then prompt
        chunks. A layer that cannot decode several sequences at once gets one pass per decode; one
        that cannot verify several at once gets one pass per verify.
        """
        decodes = [c for c in plan.decodes if not c.is_verify]
        verifies = [c for c in plan.decodes if c.is_verify]
        if self.per_sequence_verify and len(verifies) > 1 and not self._verify_route_logged:
            cause = next(c for c in self.model.capabilities.disabled() if c.query == "decode_verify_multi_unsupported")
            log.info("%s: verifying each sequence's drafts on its own", cause.describe())
            self._verify_route_logged = True
        if not self.per_sequence_decode and not self.per_sequence_verify:
            return [(decodes + verifies + list(plan.prefills), len(decodes))]
        if self.per_sequence_decode:
            passes = [([d], 1) for d in decodes]
        else:
            passes = [(decodes, len(decodes))] if decodes else []
        rest = list(plan.prefills)
        if self.per_sequence_verify:
            passes += [([v], 0) for v in verifies]
        else:
            rest = verifies + rest
        if rest:
            passes.append((rest, 0))
        return passes

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[Chunk], torch.Tensor]:
        """Run the plan; returns the chunks that sample and their logits ``[S, vocab]`` (fp32)."""
        sampling, logits = [], []
        captures = self._prepare_states(plan)
        for chunks, num_decodes in self.passes(plan):
            for sub, sub_decodes, inner, after in self._capture_passes(chunks, num_decodes, captures):
                if sub_decodes == len(sub) and not any(inner):  # a pure decode pass: graph-eligible
                    rows, out = self._decode(sub, lambda: self._forward(sub, sub_decodes, inner)[1])
                else:
                    rows, out = self._forward(sub, sub_decodes, inner)
                for seq_id, slot in after:
                    self.states.pool.copy(self.states.live[seq_id], slot)
                sampling.extend(rows)
                if out is not None:
                    logits.append(out)
        if not logits:
            return [], torch.empty(0, self.model.config.vocab_size)
        return sampling, torch.cat(logits) if len(logits) > 1 else logits[0]

    # -- recurrent state ------------------------------------------------------------------------

    def _prepare_states(self, plan: StepPlan) -> dict[int, list[tuple[int, int]]]:
        """Give every sequence its state at the chunk start; plan captures (``id(chunk)`` → rows)."""
        if self.states is None:
            return {}
        captures = {}
        # Every sequence's state first: a capture slot may evict a prefix snapshot, and one that a
        # sequence of this step still has to restore must be copied out before that.
        for chunk in plan.chunks:
            self.states.setup(chunk.seq, chunk.start)
        for chunk in plan.chunks:
            planned = self.states.plan_captures(chunk, self.is_boundary) + self.states.plan_draft_captures(chunk)
            if planned:
                captures[id(chunk)] = planned
        return captures

    def _capture_passes(self, chunks: list[Chunk], num_decodes: int, captures):
        """One pass, or several when captures inside chunks cannot be taken in-pass.

        Yields ``(chunks, num_decodes, in-pass captures per chunk, [(seq_id, slot)] to copy after)``.
        A capture before a chunk's first row is a copy now; one after its last row a copy after
        the pass; one in between is handed to the layers (in-pass replay-tail capture) or, when
        some layer cannot honour that, the chunk is split there into consecutive passes.
        """
        if not captures:
            yield chunks, num_decodes, (), []
            return
        pieces: list[list[tuple[Chunk, tuple, list]]] = []  # per chunk: its sub-chunks in order
        for chunk in chunks:
            planned = captures.get(id(chunk), [])
            for row, slot in planned:
                if row == 0:
                    self.states.pool.copy(self.states.live[chunk.seq.seq_id], slot)
            inner = [(r, s) for r, s in planned if 0 < r < chunk.num_tokens]
            at_end = [(chunk.seq.seq_id, s) for r, s in planned if r == chunk.num_tokens]
            # Per-draft states of a verify are always captured in-pass: the state pool's contract
            # (every pool layer splits its rows at ``ctx.ssm`` captures); only snapshot captures
            # depend on the layers' replay-tail answer.
            if self.in_pass_capture or chunk.is_verify or not inner:
                pieces.append([(chunk, tuple(inner), at_end)])
                continue
            subs, lo = [], 0
            for row, slot in inner:
                subs.append((Chunk(chunk.seq, chunk.start + lo, row - lo), (), [(chunk.seq.seq_id, slot)]))
                lo = row
            subs.append((Chunk(chunk.seq, chunk.start + lo, chunk.num_tokens - lo), (), at_end))
            pieces.append(subs)
        for j in range(max(len(p) for p in pieces)):
            this = [p[j] for p in pieces if len(p) > j]
            decodes = num_decodes if j == 0 else 0
            yield [c for c, _, _ in this], decodes, [i for _, i, _ in this], [a for _, _, after in this for a in after]

    def _forward(self, chunks: list[Chunk], num_decodes: int, inner_captures=()):
        ctx = ForwardContext.for_paged(
            seq_ids=[c.seq.seq_id for c in chunks],
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start + c.num_tokens for c in chunks],
            block_tables=[self.blocks.block_table(c.seq.seq_id) for c in chunks],
            block_size=self.kv.block_size,
            num_decodes=num_decodes,
            kv_cache=self.kv,
            device=self.device,
        )
        if self.states is not None:
            ctx.ssm = self.states.step_view(chunks, inner_captures)
            ctx.layer_states = self.states.layer_states(chunks)
        input_ids = torch.tensor([t for c in chunks for t in token_slice(c)], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, ctx)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return [], None
        if not any(chunks[i].is_verify for i in sampling):
            last = ctx.last_token_indices()[sampling]
            return [chunks[i] for i in sampling], self.model.compute_logits(hidden[last])
        # A verify chunk yields logits at every row: its ``1 + len(draft)`` rows, in order.
        ends = ctx.last_token_indices().tolist()
        rows = [r for i in sampling for r in range(ends[i] + 1 - (1 + len(chunks[i].draft) if chunks[i].is_verify else 1), ends[i] + 1)]
        return [chunks[i] for i in sampling], self.model.compute_logits(hidden[rows])

    def finish_verify(self, chunk: Chunk, kept: int) -> None:
        """A verify kept ``kept`` of its rows: keep the recurrent state after them."""
        if self.states is not None:
            self.states.keep_verified_rows(chunk.seq, kept, chunk.num_tokens)

    def _decode(self, chunks: list[Chunk], eager) -> tuple[list[Chunk], torch.Tensor]:
        """A pure decode pass, by a captured step when allowed (``eager()``: the logits otherwise)."""
        slots = [self.slots.slot(c.seq.seq_id) for c in chunks]
        if self.decode_capture is not None:
            self.decode_capture.stage(chunks, [self.blocks.block_table(c.seq.seq_id) for c in chunks])
        return list(chunks), self.graphs.run_decode(slots, eager)
