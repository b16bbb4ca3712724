"""How a recurrent layer reads and writes its state in the pool, one step at a time.

A step's rows are ``[T, ...]``, sequence after sequence, the one-token decode rows first (see
`layerzoo.context.ForwardContext`). Decode rows are handled as one batch (gather their states by
slot, one recurrent step, scatter back). Every other sequence runs its rows piece by piece, split
at its captures (``ctx.ssm.pieces``): each piece starts from the state the previous one left, and
after a piece that ends on a capture the state is copied into the capture slot, so the rows from a
capture row on are those of a pass that starts there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerzoo.context import ForwardContext

# fn(rows, conv_state [1, *conv], recurrent_state [1, *rec]) -> (out_rows, conv_state, recurrent_state)
PieceFn = Callable[[object, torch.Tensor, torch.Tensor], tuple[object, torch.Tensor, torch.Tensor]]


def gather_states(ctx: ForwardContext, layer: int, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """States ``[n, *conv]``, ``[n, *rec]`` of the step's sequences ``first..last-1`` (copies)."""
    pool, slots = ctx.ssm.pool, ctx.ssm.slots_tensor[first:last]
    return pool.conv[layer].index_select(0, slots), pool.recurrent[layer].index_select(0, slots)


def scatter_states(ctx: ForwardContext, layer: int, first: int, last: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
    pool, slots = ctx.ssm.pool, ctx.ssm.slots_tensor[first:last]
    pool.conv[layer].index_copy_(0, slots, conv.to(pool.conv[layer].dtype))
    pool.recurrent[layer].index_copy_(0, slots, rec.to(pool.recurrent[layer].dtype))


def run_prefill_sequences(ctx: ForwardContext, layer: int, rows_of: Callable[[int, int], object], fn: PieceFn) -> list:
    """Run ``fn`` over each non-decode sequence's rows, piece by piece; returns the outputs in order.

    ``rows_of(lo, hi)`` slices the layer's per-token inputs ``[lo, hi)`` of the step (global rows).
    """
    outputs = []
    starts = ctx.query_start_tensor().tolist()
    pool = ctx.ssm.pool
    for b in range(ctx.num_decodes, ctx.num_seqs):
        conv, rec = gather_states(ctx, layer, b, b + 1)
        begin = starts[b]
        for lo, hi, capture in ctx.ssm.pieces(b, ctx.query_lens[b]):
            if hi > lo:
                out, conv, rec = fn(rows_of(begin + lo, begin + hi), conv, rec)
                outputs.append(out)
            if capture is not None:
                pool.copy_layer(layer, conv[0], rec[0], capture)
        scatter_states(ctx, layer, b, b + 1, conv, rec)
    return outputs
