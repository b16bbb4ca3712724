"""How a delta-rule mixer (Gated DeltaNet, KDA) runs its short conv and its recurrence over the
state pool, one step at a time.

A step's rows are ``[T, ...]``, sequence after sequence, the one-token decode rows first (see
`layerzoo.layers.context.ForwardContext`). Decode rows run as one batch, their states updated in place
in the pool at their slots. Every other sequence runs from its slot's state; the recurrence is split
at its captures (``ctx.ssm.pieces``) and the state at a capture row is copied into the capture
slot, so the rows from a capture row on are those of a pass that starts there (the
``supports_replay_tail_split`` promise). The conv captures the window of raw inputs before each
capture row the same way.

`walk_prompts` is the pool walker of every recurrent layer (the delta rule's `recur_over_pool`,
Mamba2's mixer): it runs the prompt sequences one at a time (one kernel call per sequence and
piece: the one-call route of a delta-rule layer, ``is_ssm_layer`` False) or all in one varlen
call per round of pieces (the split prefill's phase 2, ``is_ssm_layer`` True, and Mamba2: one call
for a step without captures).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from layerzoo.layers.context import ForwardContext
from layerzoo.plugins.ops import kernel

# run(rows, states (one [n, ...] per pool tensor), cu_seqlens [n + 1] | None, longest) -> (out rows, final states)
PieceRun = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]

# Pieces of at most this many rows run the plain recurrence; longer ones the chunked form.
RECURRENT_MAX_ROWS = 8


@attrs.define
class Recurrence:
    """One delta-rule layer's recurrence over a step, as its phase 1 leaves it: ``q, k [T, H, K]``,
    ``v [T, H, V]``, the fp32 log decay ``g`` (``[T, H]`` per head, Gated DeltaNet; ``[T, H, K]``
    per key channel, KDA), ``beta [T, H]`` fp32; q and k are L2-normalised by the kernel and q
    scaled by ``scale``. The state is the pool's ``recurrent[layer]`` ``[P, H, K, V]`` fp32."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float

    def rows(self, rows) -> tuple[torch.Tensor, ...]:
        """``q, k, v, g, beta`` at ``rows`` (a slice or an index tensor)."""
        return self.q[rows], self.k[rows], self.v[rows], self.g[rows], self.beta[rows]


def recur(rec: Recurrence, rows, state: torch.Tensor, cu_seqlens: torch.Tensor | None = None, longest: int = 0):
    """The recurrence of ``rows`` from ``state [N, H, K, V]`` (``N`` sequences delimited by
    ``cu_seqlens [N + 1]``, or one); returns ``(o, final state [N, H, K, V])``. Pieces of at most
    `RECURRENT_MAX_ROWS` rows take the plain recurrence, longer ones the chunked form."""
    q, k, v, g, beta = rec.rows(rows)
    longest = longest or q.shape[0]
    fn = kernel("delta_rule_recurrent" if longest <= RECURRENT_MAX_ROWS else "delta_rule_chunk")
    return fn(q, k, v, g, beta, scale=rec.scale, initial_state=state, cu_seqlens=cu_seqlens, use_qk_l2norm=True)


def _recur_decodes(rec: Recurrence, ctx: ForwardContext, states: torch.Tensor, out: torch.Tensor) -> None:
    """The one-token decode rows on the pool in place, with no host read (so that a decode step
    can be captured whole)."""
    nd = ctx.num_decodes
    if nd:
        fn = kernel("delta_rule_decode")
        q, k, v, g, beta = rec.rows(slice(0, nd))
        out[:nd] = fn(q, k, v, g, beta, scale=rec.scale, state=states, slots=ctx.ssm.slots_tensor[:nd], use_qk_l2norm=True)


def conv_over_pool(layer: int, mixed: torch.Tensor, ctx: ForwardContext, weight: torch.Tensor, conv_op, update_op) -> torch.Tensor:
    """Depthwise causal conv + SiLU of ``mixed [T, C]`` from each sequence's pool conv state
    ``[C, W - 1]``; writes the new states (and the captures' windows). ``weight [C, W]``. The
    prompt sequences run in one varlen call (`walk_prompts`)."""
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

    def run(rows, state, cu_seqlens, longest):
        # the final conv state of a piece is the window of raw inputs before its end row: a
        # capture's window when the piece ends on one
        y, new = conv_op(mixed[rows], weight, None, conv_state=state[0], cu_seqlens=cu_seqlens, activation="silu")
        return y, (new,)

    walk_prompts(ctx, (states,), run, out, varlen=True)
    return out


def recur_over_pool(rec: Recurrence, ctx: ForwardContext, *, varlen: bool) -> torch.Tensor:
    """The recurrence of every sequence of the step from its pool state ``[H, K, V]``; returns
    ``o`` shaped like ``v`` and writes the new states (and the captures' states). ``varlen``: the
    prompt sequences in one call (see `walk_prompts`), else one call per sequence and piece."""
    states = ctx.ssm.pool.recurrent[rec.layer]
    out = torch.empty_like(rec.v)
    _recur_decodes(rec, ctx, states, out)
    if ctx.num_decodes == ctx.num_seqs:  # decode only: no host read
        return out

    def run(rows, state, cu_seqlens, longest):
        o, final = recur(rec, rows, state[0], cu_seqlens, longest)
        return o, (final,)

    walk_prompts(ctx, (states,), run, out, varlen=varlen)
    return out


def walk_prompts(ctx: ForwardContext, pools: tuple[torch.Tensor, ...], run: PieceRun, out: torch.Tensor, *, varlen: bool) -> None:
    """The pool walker of every recurrent layer: runs the step's prompt sequences (the rows after
    the decode rows) from their slots' states in ``pools`` (each ``[P, ...]``), writes their rows
    of ``out`` and their final states (and the captures' states) back.

    A sequence is cut at its captures (``ctx.ssm.pieces``). ``varlen``: one call per round of
    pieces, the r-th pieces of every sequence in the r-th call (one call for a step without
    captures); else one call per sequence and piece. ``run(rows, states, cu_seqlens, longest)``
    gets the step's ``rows`` (a slice or an index tensor), the states ``[n, ...]`` of its ``n``
    sequences, their bounds ``cu_seqlens [n + 1]`` (None for one) and the longest one's rows."""
    ssm = ctx.ssm
    nd, ns = ctx.num_decodes, ctx.num_seqs
    starts = ctx.query_start_tensor().tolist()
    pieces = [ssm.pieces(b, ctx.query_lens[b]) for b in range(nd, ns)]
    slots = ssm.slots_tensor[nd:ns]
    states = [pool.index_select(0, slots) for pool in pools]  # [B, ...] each
    groups = [range(len(pieces))] if varlen else [[i] for i in range(len(pieces))]
    for group in groups:
        for r in range(max(len(pieces[i]) for i in group)):
            # (sequence index among the prompts, first row, end row) of each nonempty r-th piece
            todo = [(i, starts[nd + i] + pieces[i][r][0], starts[nd + i] + pieces[i][r][1])
                    for i in group if r < len(pieces[i]) and pieces[i][r][1] > pieces[i][r][0]]
            if todo:
                _run_round(run, todo, states, out)
            for i in group:
                capture = pieces[i][r][2] if r < len(pieces[i]) else None
                if capture is not None:
                    for pool, state in zip(pools, states):
                        pool[capture].copy_(state[i])
    for pool, state in zip(pools, states):
        pool.index_copy_(0, slots, state.to(pool.dtype))


def _run_round(run: PieceRun, todo: list[tuple[int, int, int]], states: list[torch.Tensor], out: torch.Tensor) -> None:
    """One call over the pieces ``todo`` (``(i, lo, hi)``: from ``states[.][i]``, rows ``[lo, hi)``)."""
    device = out.device
    lens = [hi - lo for _, lo, hi in todo]
    if all(todo[j][2] == todo[j + 1][1] for j in range(len(todo) - 1)):
        rows = slice(todo[0][1], todo[-1][2])
    else:
        rows = torch.cat([torch.arange(lo, hi, device=device) for _, lo, hi in todo])
    whole = len(todo) == states[0].shape[0]  # every sequence, in order: no gather of states
    index = None if whole else torch.tensor([i for i, _, _ in todo], device=device)
    cu = torch.tensor([0, *lens], device=device).cumsum(0) if len(todo) > 1 else None  # one: no varlen bounds
    o, finals = run(rows, tuple(s if whole else s.index_select(0, index) for s in states), cu, max(lens))
    out[rows] = o
    for state, final in zip(states, finals):
        if whole:
            state.copy_(final)
        else:
            state.index_copy_(0, index, final.to(state.dtype))
