"""How a delta-rule mixer (Gated DeltaNet, KDA) runs its short conv and its recurrence over the
state pool, one step at a time.

A step's rows are ``[T, ...]``, sequence after sequence, the one-token decode rows first (see
`layerzoo.context.ForwardContext`). Decode rows run as one batch, their states updated in place
in the pool at their slots. Every other sequence runs from its slot's state; the recurrence is split
at its captures (``ctx.ssm.pieces``) and the state at a capture row is copied into the capture
slot, so the rows from a capture row on are those of a pass that starts there (the
``supports_replay_tail_split`` promise). The conv captures the window of raw inputs before each
capture row the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerzoo.context import ForwardContext

# recur(q, k, v, g, beta, state [N, H, K, V], cu_seqlens | None) -> (o, new state)
RecurFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# recur_decode(q, k, v, g, beta, pool [P, H, K, V], slots [N]) -> o, the pool's rows updated in place
RecurDecodeFn = Callable[..., torch.Tensor]


def conv_over_pool(layer: int, mixed: torch.Tensor, ctx: ForwardContext, weight: torch.Tensor, conv_op, update_op) -> torch.Tensor:
    """Depthwise causal conv + SiLU of ``mixed [T, C]`` from each sequence's pool conv state
    ``[C, W - 1]``; writes the new states (and the captures' windows). ``weight [C, W]``."""
    ssm = ctx.ssm
    states = ssm.pool.conv[layer]
    out = torch.empty_like(mixed)
    nd = ctx.num_decodes
    if nd:
        slots = ssm.slots_tensor[:nd]
        y, new = update_op(mixed[:nd], states.index_select(0, slots), weight, None, activation="silu")
        out[:nd] = y
        states.index_copy_(0, slots, new.to(states.dtype))
    if nd == ctx.num_seqs:  # decode only: no host read (a captured decode step cannot make one)
        return out
    starts = ctx.query_start_tensor().tolist()
    width = weight.shape[1] - 1
    for b in range(nd, ctx.num_seqs):
        lo, hi, slot = starts[b], starts[b + 1], ssm.slots[b]
        prev = states[slot : slot + 1]
        y, new = conv_op(mixed[lo:hi], weight, None, conv_state=prev, activation="silu")
        out[lo:hi] = y
        if ssm.captures_of(b):
            # The window before capture row r: the last `width` raw inputs of [prev | rows].
            history = torch.cat([prev[0].transpose(0, 1), mixed[lo:hi].to(states.dtype)])
            for row, capture in ssm.captures_of(b):
                states[capture].copy_(history[row : row + width].transpose(0, 1))
        states[slot].copy_(new[0])
    return out


def recur_over_pool(
    layer: int, q, k, v, g, beta, ctx: ForwardContext, recur: RecurFn, recur_decode: RecurDecodeFn
) -> torch.Tensor:
    """The recurrence of every sequence of the step from its pool state ``[H, K, V]``; returns
    ``o`` shaped like ``v`` and writes the new states (and the captures' states).

    ``recur_decode`` runs the one-token decode rows on the pool in place with no host read, so
    that a decode step can be captured whole."""
    ssm = ctx.ssm
    states = ssm.pool.recurrent[layer]
    out = torch.empty_like(v)
    nd = ctx.num_decodes
    if nd:
        out[:nd] = recur_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states, ssm.slots_tensor[:nd])
    if nd == ctx.num_seqs:  # decode only: no host read
        return out
    starts = ctx.query_start_tensor().tolist()
    for b in range(nd, ctx.num_seqs):
        begin, slot = starts[b], ssm.slots[b]
        state = states[slot : slot + 1]
        for lo, hi, capture in ssm.pieces(b, ctx.query_lens[b]):
            if hi > lo:
                rows = slice(begin + lo, begin + hi)
                o, state = recur(q[rows], k[rows], v[rows], g[rows], beta[rows], state, None)
                out[rows] = o
            if capture is not None:
                states[capture].copy_(state[0])
        states[slot].copy_(state[0])
    return out
