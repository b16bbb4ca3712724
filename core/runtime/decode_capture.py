"""Captured decode steps: what `DecodeGraphRunner` captures and replays, on CUDA and on CPU.

A decode pass of ``n`` one-token rows runs, once captured, over *static buffers* of ``bucket``
rows (input ids, positions, slot mapping, block tables of a fixed width, context lengths,
state-pool slots) and a *static* `ForwardContext` built over them at capture. Each step stages
its live rows into the buffers and replays; the model's Python code does not run again.

* CUDA: a CUDA graph per key (`layerzoo.runtime.graphs.cuda_capture_fn`), all in one memory pool.
* CPU: the step ``model(ids, ctx) -> logits`` under ``torch.compile(dynamic=False, fullgraph=True)``,
  one compiled function per batch bucket (specialised once per table width); each key keeps its
  own static context, so what a context holds besides the buffers (own-state objects, the
  sequences of the capture) stays what it was at capture, exactly as a CUDA graph's addresses do.

Padding: rows ``n..bucket-1`` are throwaway rows with the id `PAD_ID` (their sequence id and graph
slot). They decode token 0 at position 0 into each pool's padding row, one per pool and never a
sequence's: the KV pool's `PagedKVCache.pad_block` (read only that block), the state pool's
`StatePool.pad_slot`, and a throwaway own state per own-state layer; nothing returns more than
the ``n`` live rows. A capture itself runs on padding only (CUDA's warm-up, CPU's compiling call),
so it never advances a live sequence's state: a failed capture leaves the step to run eagerly.

Block tables are padded to a power-of-two width (at least `MIN_WIDTH` blocks) so a step attends over
at most twice the longest context; each width is one more CUDA graph or compiled specialisation.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from layerzoo.layers.context import ForwardContext
from layerzoo.runtime.graphs import (
    PAD_ID,
    CaptureFailed,
    CudaGraph,
    StaleReplay,
    cuda_capture_fn,
    cuda_replay_fn,
    new_graph_pool,
)

log = logging.getLogger(__name__)

MIN_WIDTH = 4  # blocks: the narrowest block-table width a step is padded to


def width_for(blocks: int) -> int:
    """The table width a step whose longest table has ``blocks`` blocks is padded to."""
    width = MIN_WIDTH
    while width < blocks:
        width *= 2
    return width


@attrs.define
class LiveDecode:
    """The step being run: its decode rows and where their tokens go (host values)."""

    seq_ids: tuple[int, ...]  # [n]
    tokens: list[int]  # [n] the token each row feeds
    context_lens: list[int]  # [n] tokens in the cache after the step
    block_tables: list[list[int]]  # [n] each row's blocks
    state_slots: tuple[int, ...] | None  # [n] state-pool slots (pool models)
    layer_states: dict[int, tuple[Any, ...]] | None  # own-state layers: layer -> [n] states

    @property
    def width(self) -> int:
        return width_for(max(len(t) for t in self.block_tables))


@attrs.define
class StaticBuffers:
    """One bucket's fixed inputs at one table width; rows past the live batch hold padding."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int64
    context_lens: torch.Tensor  # [B] int64
    state_slots: torch.Tensor | None  # [B] int64, pool models only

    @classmethod
    def allocate(cls, bucket: int, width: int, device, with_states: bool) -> StaticBuffers:
        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        return cls(zeros(bucket), zeros(bucket), zeros(bucket), zeros(bucket, width), zeros(bucket), zeros(bucket) if with_states else None)


@attrs.define
class Captured:
    """One table width of a captured key: the static context and the artifact that runs it."""

    ctx: ForwardContext
    buffers: StaticBuffers
    run: Callable[[], torch.Tensor]  # replays over the staged buffers; returns logits [B, vocab]


@attrs.define
class CapturedDecode:
    """A key's handle (what `DecodeGraphRunner` keeps per ``(bucket, slots)``)."""

    bucket: int
    seq_ids: tuple[int, ...]  # the sequences of the capture, padded with PAD_ID
    context_lens: tuple[int, ...]  # their context lengths at capture (padded rows: 1)
    state_slots: tuple[int, ...] | None
    layer_states: dict[int, tuple[Any, ...]] | None  # own states of the capture (padded rows: throwaway)
    widths: dict[int, Captured] = attrs.field(factory=dict)


def decode_logits(model, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """``input_ids [B]`` of a static decode context → logits ``[B, vocab]`` (what is captured)."""
    return model.compute_logits(model(input_ids, ctx))


class DecodeCapture:
    """Builds, captures and replays static decode steps for one model runner.

    ``capture`` and ``replay`` are `DecodeGraphRunner`'s ``capture_fn`` and ``replay_fn``; the
    runner calls `stage` with the step's rows first.
    """

    def __init__(self, model, kv, pool=None, own_layers=None, *, device: torch.device):
        assert kv.pad_block is not None, "decode graphs need the KV pool's padding block (PagedKVCache(pad_block=True))"
        self.model, self.kv = model, kv
        self.device = torch.device(device)
        self.pool = pool  # the state pool (models with pool layers), or None
        self.own_layers = dict(own_layers or {})  # own-state layers: layer index -> layer
        self._pad_states: dict[int, Any] | None = None
        self._buffers: dict[tuple[int, int], StaticBuffers] = {}
        self._compiled: dict[int, Callable] = {}  # CPU: batch bucket -> compiled step
        self._cuda_pool = None
        self.live: LiveDecode | None = None
        self.compiles = 0  # CPU: graphs handed to the compiler (a graph break would show as more)
        self.artifacts = 0  # captured (key, width) pairs

    # -- the step ------------------------------------------------------------------------------

    def stage(self, chunks: Sequence, block_tables: Sequence[Sequence[int]], state_slots=None, layer_states=None) -> None:
        """Remember the decode rows of the step about to run (host values only, nothing built):
        their blocks, their state-pool slots (pool models) and own-layer states (layer -> [n])."""
        for c in chunks:
            assert c.num_tokens == 1 and not c.draft and c.start + 1 == len(c.seq), "only one-token decode rows are captured"
        self.live = LiveDecode(
            seq_ids=tuple(c.seq.seq_id for c in chunks),
            tokens=[c.seq.output_token_ids[-1] if c.seq.output_token_ids else c.seq.prompt_token_ids[-1] for c in chunks],
            context_lens=[c.start + 1 for c in chunks],
            block_tables=[list(t) for t in block_tables],
            state_slots=tuple(state_slots) if self.pool is not None else None,
            layer_states=layer_states if self.own_layers else None,
        )

    def capture(self, bucket: int, slots: tuple[int, ...]) -> CapturedDecode:
        """A new key: bake in the live sequences (own states, ids) and capture the current width."""
        live = self.live
        assert live is not None, "stage() the step before capturing"
        pads = bucket - len(live.seq_ids)
        assert pads >= 0
        pad_states = self._pad_own_states()
        handle = CapturedDecode(
            bucket=bucket,
            seq_ids=live.seq_ids + (PAD_ID,) * pads,
            context_lens=tuple(live.context_lens) + (1,) * pads,
            state_slots=live.state_slots + (self.pool.pad_slot,) * pads if self.pool is not None else None,
            layer_states=(
                {i: states + (pad_states[i],) * pads for i, states in live.layer_states.items()}
                if live.layer_states is not None else None
            ),
        )
        self._captured(handle, live.width)
        return handle

    def replay(self, handle: CapturedDecode, live_rows: int) -> torch.Tensor:
        """Stage the live rows into the key's buffers (padding the rest) and replay: ``[bucket, vocab]``."""
        live = self.live
        assert live is not None and len(live.seq_ids) == live_rows
        captured = self._captured(handle, live.width)
        self._write(captured.buffers, live)
        compiles = self.compiles
        out = captured.run()
        if self.compiles != compiles:
            # Dynamo found Python state the step was compiled with changed and traced it again: the
            # output is right, but the step is not static (it would recompile on and on).
            raise StaleReplay("decode step recompiled at replay (state it depends on changed outside the graph)", out)
        return out

    # -- capture -------------------------------------------------------------------------------

    def _captured(self, handle: CapturedDecode, width: int) -> Captured:
        if width not in handle.widths:
            try:
                handle.widths[width] = self._capture_width(handle, width)
            except Exception as exc:  # noqa: BLE001 - captures run on padding only: nothing live moved
                raise CaptureFailed(str(exc)) from exc
            self.artifacts += 1
        return handle.widths[width]

    def _capture_width(self, handle: CapturedDecode, width: int) -> Captured:
        buffers = self._buffers_for(handle.bucket, width)
        ctx = self._static_context(handle, buffers)
        self._write(buffers, None)  # capture on padding only: no live sequence moves
        if self.device.type == "cuda":
            graph = self._capture_cuda(handle, ctx, buffers)
            return Captured(ctx, buffers, lambda: cuda_replay_fn(graph, handle.bucket))
        step = self._compiled_step(handle.bucket)
        pad_ctx = self._static_context(handle, buffers, padding_only=True)
        # Eagerly first: lazy one-time work (a kernel op resolving its backend) is not traced.
        decode_logits(self.model, buffers.input_ids, pad_ctx)
        step(self.model, buffers.input_ids, pad_ctx)  # compiles (once per bucket and width)
        return Captured(ctx, buffers, lambda: step(self.model, buffers.input_ids, ctx))

    def _capture_cuda(self, handle: CapturedDecode, ctx: ForwardContext, buffers: StaticBuffers) -> CudaGraph:
        if self._cuda_pool is None:
            self._cuda_pool = new_graph_pool()
        # The warm-up runs the step, over throwaway own states; the capture only records, and must
        # record the addresses of the key's own context.
        contexts = iter([self._static_context(handle, buffers, padding_only=True)])

        def step() -> torch.Tensor:
            return decode_logits(self.model, buffers.input_ids, next(contexts, ctx))

        return cuda_capture_fn(step, pool=self._cuda_pool, warmup=1)

    def _compiled_step(self, bucket: int) -> Callable:
        """``torch.compile`` of `decode_logits` for one batch bucket, with a code object of its own:
        dynamo keeps its compiled specialisations (and its recompile limit) per code object, so
        each bucket's widths do not crowd out another bucket's."""
        if bucket not in self._compiled:
            code = decode_logits.__code__.replace(co_name=f"decode_logits_b{bucket}")
            fn = types.FunctionType(code, decode_logits.__globals__, code.co_name)
            self._compiled[bucket] = torch.compile(fn, backend=self._backend, dynamic=False, fullgraph=True)
        return self._compiled[bucket]

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(gm, example_inputs)

    # -- buffers and contexts --------------------------------------------------------------------

    def _buffers_for(self, bucket: int, width: int) -> StaticBuffers:
        """Shared by every key of a bucket and width: keys differ in their context, not their inputs."""
        key = (bucket, width)
        if key not in self._buffers:
            self._buffers[key] = StaticBuffers.allocate(bucket, width, self.device, self.pool is not None)
        return self._buffers[key]

    def _pad_own_states(self) -> dict[int, Any]:
        if self._pad_states is None:
            self._pad_states = {i: layer.alloc_state(PAD_ID) for i, layer in self.own_layers.items()}
        return self._pad_states

    def _static_context(self, handle: CapturedDecode, buffers: StaticBuffers, *, padding_only: bool = False) -> ForwardContext:
        """A decode context over ``buffers``; its Python fields are the capture's (``padding_only``:
        every row a padded row, for a capture's own run)."""
        bucket = handle.bucket
        ctx = ForwardContext(
            positions=buffers.positions,
            seq_ids=(PAD_ID,) * bucket if padding_only else handle.seq_ids,
            query_lens=(1,) * bucket,
            context_lens=(1,) * bucket if padding_only else handle.context_lens,
            num_decodes=bucket,
            slot_mapping=buffers.slot_mapping,
            block_tables=buffers.block_tables,
            context_lens_tensor=buffers.context_lens,
            kv_cache=self.kv,
            shape_static=True,
        )
        # Built here, not inside the capture: a layer asking for it must not build a tensor there.
        ctx._query_starts[0] = torch.arange(bucket + 1, device=self.device)
        if self.pool is not None:
            from layerzoo.runtime.state_pool import SsmStep

            slots = (self.pool.pad_slot,) * bucket if padding_only else handle.state_slots
            ctx.ssm = SsmStep(pool=self.pool, slots=slots)
            ctx.ssm._slots_tensor = buffers.state_slots  # the static buffer, rewritten each step
        if self.own_layers:
            pad = self._pad_own_states()
            ctx.layer_states = (
                {i: (state,) * bucket for i, state in pad.items()} if padding_only else handle.layer_states
            )
        return ctx

    def _write(self, buffers: StaticBuffers, live: LiveDecode | None) -> None:
        """Stage ``live`` into the first rows and padding into the rest (``None``: padding only)."""
        bucket, width = buffers.block_tables.shape
        pad, bs = self.kv.pad_block, self.kv.block_size
        n = 0 if live is None else len(live.seq_ids)
        tables = torch.full((bucket, width), pad, dtype=torch.long)
        ids, positions = torch.zeros(bucket, dtype=torch.long), torch.zeros(bucket, dtype=torch.long)
        slot_mapping = torch.full((bucket,), pad * bs, dtype=torch.long)
        lens = torch.ones(bucket, dtype=torch.long)
        if n:
            for row, table in enumerate(live.block_tables):
                tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
            ids[:n] = torch.tensor(live.tokens, dtype=torch.long)
            lens[:n] = torch.tensor(live.context_lens, dtype=torch.long)
            positions[:n] = lens[:n] - 1
            slot_mapping[:n] = tables[torch.arange(n), positions[:n] // bs] * bs + positions[:n] % bs
        buffers.input_ids.copy_(ids)
        buffers.positions.copy_(positions)
        buffers.slot_mapping.copy_(slot_mapping)
        buffers.block_tables.copy_(tables)
        buffers.context_lens.copy_(lens)
        if buffers.state_slots is not None:
            slots = torch.full((bucket,), self.pool.pad_slot, dtype=torch.long)
            if n:
                slots[:n] = torch.tensor(live.state_slots, dtype=torch.long)
            buffers.state_slots.copy_(slots)

    def summary(self) -> dict[str, int]:
        return {"artifacts": self.artifacts, "compiles": self.compiles}
