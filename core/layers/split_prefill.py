"""The three-phase prefill of a delta-rule layer (the ``is_ssm_layer`` answer), once for every layer.

The layer supplies phase 1 (``prefill_phase1``: norms, projections, short conv, gates; returns the
`Recurrence` and what its phase 3 needs) and phase 3 (``prefill_phase3``: gated norm, output
projection, the rest of the block; returns ``(hidden, residual)``); the core supplies phase 2, the
recurrence over the state pool. The two routes differ in that phase only:

- split (the layer answered ``is_ssm_layer`` True; the model calls `three_phase_step` with
  ``varlen=True``): every prompt sequence of the step in one varlen call;
- one call (the answer False, and every decode step: ``layer(hidden, residual, ctx)``): the
  sequences one at a time (`recur_over_pool` with ``varlen=False``).
"""

from __future__ import annotations

from typing import Any

import torch

from layerzoo.layers.base import DecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.recurrent_pool import Recurrence, recur_over_pool


def recurrence_over_pool(rec: Recurrence, ctx: ForwardContext, varlen: bool) -> torch.Tensor:
    """Phase 2: ``o [T, H, V]`` of the step, the pool's states updated."""
    return recur_over_pool(rec, ctx, varlen=varlen)


def three_phase_step(layer, hidden, residual, ctx: ForwardContext, *, varlen: bool):
    """``layer``'s step as its phase 1, the core's phase 2 and its phase 3; returns ``(hidden, residual)``."""
    rec, carry = layer.prefill_phase1(hidden, residual, ctx)
    return layer.prefill_phase3(recurrence_over_pool(rec, ctx, varlen), carry, ctx)


class SplitPrefillLayer(DecoderLayer):
    """A decoder layer around a delta-rule mixer: it writes the two phases, the core the rest."""

    def prefill_phase1(self, hidden, residual, ctx: ForwardContext) -> tuple[Recurrence, Any]:
        """``(recurrence, carry)``: the recurrence's inputs and what phase 3 needs."""
        raise NotImplementedError(f"{type(self).__name__} has no split prefill")

    def prefill_phase3(self, o: torch.Tensor, carry: Any, ctx: ForwardContext):
        """The recurrence's output ``o [T, H, V]`` → ``(hidden, residual)``."""
        raise NotImplementedError(f"{type(self).__name__} has no split prefill")

    # The one-call route: the step (a decode, or a prefill when the answer is False).
    def prefill(self, hidden, residual, ctx: ForwardContext):
        return three_phase_step(self, hidden, residual, ctx, varlen=False)

    decode = prefill
