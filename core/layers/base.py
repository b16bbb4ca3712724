"""The decoder-layer interface the runtime drives, and the common pre-norm block.

A decoder layer is the unit the capability queries ask about. It runs one step through
``prefill`` (a chunk of one or more sequences' prompt tokens) or ``decode`` (one new token per
sequence); both take and return ``(hidden [T, H], residual [T, H] | None)`` and read everything
else from the step's `ForwardContext`.

Room for the layers that come later, with defaults that keep attention layers unchanged:
``kv_cache_spec`` (what the paged KV pool stores per token; None for layers without KV),
``alloc_state``/``release_state`` (own-state layers answering ``uses_ssm_pool`` False), and the
three-phase split prefill of gated-delta-rule layers (``is_ssm_layer``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from layerzoo.layers import fused_decode
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.norm import RMSNorm

_UNPLANNED = object()  # a layer's fused decode plan before its first decode step


class DecoderLayer(nn.Module):
    """Base of every decoder layer. Subclasses set ``layer_kind`` (a registered kind name)."""

    layer_kind: ClassVar[str]
    # Whether the layer splits across tensor-parallel ranks: every weight either carries a shard
    # description or is meant to be replicated, and its output is whole on every rank. Each class
    # says so itself (a subclass does not inherit it: it may add weights or math its base did not
    # split); a layer whose class does not is refused at load with tensor_parallel_size > 1.
    tensor_parallel: ClassVar[bool] = False

    def __init__(self, layer_index: int):
        super().__init__()
        self.layer_index = layer_index

    def forward(self, hidden, residual, ctx: ForwardContext):
        return self.prefill(hidden, residual, ctx) if ctx.is_prefill else self.decode(hidden, residual, ctx)

    def prefill(self, hidden, residual, ctx: ForwardContext):
        raise NotImplementedError

    def decode(self, hidden, residual, ctx: ForwardContext):
        raise NotImplementedError

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec | None:
        """What this layer keeps per token in the KV cache, or None for no KV."""
        return None

    def state_spec(self, dtype: torch.dtype):
        """What the layer keeps in the recurrent-state pool per sequence
        (`layerzoo.runtime.state_pool.StateSpec`), or None for a layer without recurrent state."""
        return None

    # Split prefill of a delta-rule layer (asked through ``is_ssm_layer``): the model runs
    # ``prefill_phase1``, the core's recurrence and ``prefill_phase3`` (see
    # `layerzoo.layers.split_prefill.SplitPrefillLayer`, which declares them).

    def alloc_state(self, seq_id: int) -> Any:
        """A per-sequence state object of the layer's own type (only for ``uses_ssm_pool`` False)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state of its own")

    def keep_verified_rows(self, state: Any, kept: int, run: int) -> None:
        """After a speculative verify of ``run`` rows, make the own state as if only ``kept`` had run
        (own-state layers answering ``keeps_per_draft_states`` True)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-draft states")

    def release_state(self, state: Any) -> None:
        """Free what ``alloc_state`` made; must be idempotent."""


class PreNormDecoderLayer(DecoderLayer):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with the residual adds fused into the norms."""

    def __init__(self, layer_index: int, *, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__(layer_index)
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec | None:
        return self.self_attn.kv_cache_spec(dtype)

    def prefill(self, hidden, residual, ctx: ForwardContext):
        out = self._fused(hidden, residual, ctx)
        return out if out is not None else PreNormDecoderLayer.unfused(self, hidden, residual, ctx)

    def decode(self, hidden, residual, ctx: ForwardContext):
        # this class's arithmetic, as `decode = prefill` gave it, not a subclass's own prefill
        return PreNormDecoderLayer.prefill(self, hidden, residual, ctx)

    def unfused(self, hidden, residual, ctx: ForwardContext):
        """The layer's arithmetic op by op (the fused call's reference)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _fused(self, hidden, residual, ctx: ForwardContext):
        """``(hidden, residual)`` from one C++ call, on CPU where the layer is the plain one and the
        step has few rows (decodes, verifies, short prompts); None for the op-by-op path. Not in a
        compiled step: there its ops are traced or called as extern kernels one by one."""
        if hidden.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        plan = self.__dict__.get("_decode_plan", _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self.__dict__["_decode_plan"] = self._plan_decode()
        return plan.run(hidden, residual, ctx) if plan is not None else None

    def _plan_decode(self):
        """The fused CPU decode plan (`layerzoo.layers.fused_decode`), or None for the Python path."""
        return fused_decode.plan_for(self)
