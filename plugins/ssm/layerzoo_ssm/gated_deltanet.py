"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5, over the recurrent-state pool.

Per token: project to q, k, v (key heads ``Hk``, value heads ``Hv``), the output gate z and the
gate inputs b, a; run the short causal conv over ``[q | k | v]`` (SiLU); then the gated delta
rule with ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, q and k
L2-normalised and repeated to ``Hv`` heads; then ``w * norm(o) * silu(z)`` per head and the
output projection.

The step runs in the three phases of `layerzoo.layers.split_prefill`: ``prefill_phase1`` (input
norm, projections, conv, gates), the core's recurrence of every sequence from its pool state
(all prompts in one varlen call when the layer answers ``is_ssm_layer``) and ``prefill_phase3``
(gated norm, output projection, MLP). A
capture row splits a sequence's recurrence there and copies the conv and recurrent state at that
row into the capture slot: rows from it on come out as a pass starting there would make them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import set_shard
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import StateSpec
from layerzoo.layers.linear import fuse_linears
from layerzoo.layers.parallel_linear import column_parallel_linear, local_heads, row_parallel_linear, split_heads, split_rows
from layerzoo.layers.recurrent_pool import Recurrence, conv_over_pool
from layerzoo.layers.split_prefill import SplitPrefillLayer
from layerzoo.plugins.ops import kernel
from layerzoo_ssm import GDN_KIND
from layerzoo_ssm.norms import GatedRMSNorm, ZeroCenteredRMSNorm


class GatedDeltaNet(nn.Module):
    """The token mixer. ``layout`` is ``"grouped"`` (Qwen3-Next's fused ``in_proj_qkvz``/``in_proj_ba``,
    interleaved per key-head group) or ``"split"`` (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, already in conv order).

    Tensor parallel: split by head. Each rank keeps ``Hk / N`` key heads and the ``Hv / N`` value
    heads grouped onto them (both layouts keep a key head's value heads next to it, so contiguous
    shards stay whole groups): its slice of every input projection, of the conv channels
    (``[q | k | v]``, each split), of ``dt_bias``/``A_log``; ``out_proj`` is row-parallel. The head
    counts and dims below are this rank's, so the state spec (conv and recurrent state) is per rank.
    """

    def __init__(self, config, layer_index: int, layout: str):
        super().__init__()
        assert layout in ("grouped", "split")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (expected 'silu')")
        self.layer_index = layer_index
        self.layout = layout
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads  # all ranks'
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if hv % hk:
            raise ValueError(f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})")
        what = f"the Gated DeltaNet of layer {layer_index}"
        split_heads(hk, 1, what)  # refuses key heads that do not split across the ranks
        self.num_k_heads, self.num_v_heads = local_heads(hk), local_heads(hv)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        full_key, full_value = hk * self.head_k_dim, hv * self.head_v_dim
        conv_shard = split_rows((full_key, full_key, full_value), what)
        if layout == "grouped":
            self.in_proj_qkvz = column_parallel_linear(
                hidden, 2 * full_key + 2 * full_value, shard=split_rows(2 * full_key + 2 * full_value, what)
            )
            self.in_proj_ba = column_parallel_linear(hidden, 2 * hv, shard=split_rows(2 * hv, what))
        else:
            self.in_proj_qkv = column_parallel_linear(hidden, 2 * full_key + full_value, shard=conv_shard)
            self.in_proj_z = column_parallel_linear(hidden, full_value, shard=split_rows(full_value, what))
            self.in_proj_b = column_parallel_linear(hidden, hv, shard=split_rows(hv, what))
            self.in_proj_a = column_parallel_linear(hidden, hv, shard=split_rows(hv, what))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        set_shard(self.conv1d, "weight", conv_shard)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        set_shard(self, "dt_bias", split_rows(hv, what))
        set_shard(self, "A_log", split_rows(hv, what))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = row_parallel_linear(full_value, hidden, shard=split_rows(full_value, what))
        self.scale = self.head_k_dim**-0.5
        self.in_proj = None  # the input projections as one linear, after fuse_projections
        self._conv = kernel("causal_conv1d")
        self._conv_update = kernel("causal_conv1d_update")

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(
            conv_shape=(self.conv_dim, self.conv_width - 1),
            recurrent_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
            conv_dtype=dtype,
            recurrent_dtype=torch.float32,
        )

    # -- projections -------------------------------------------------------------------------

    def _projections(self) -> list[nn.Linear]:
        if self.layout == "split":
            return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        return [self.in_proj_qkvz, self.in_proj_ba]

    def fuse_projections(self) -> None:
        """All input projections as one matmul (called at load by ``pack_linears``)."""
        parts = self._projections()
        self.in_proj_sizes = [p.out_features for p in parts]
        self.in_proj = fuse_linears(parts)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"):
            self.__dict__.pop(name, None)
            self._modules.pop(name, None)

    def _project_all(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.in_proj is not None:
            return list(self.in_proj(x).split(self.in_proj_sizes, dim=-1))
        return [p(x) for p in self._projections()]

    def project(self, x: torch.Tensor):
        """``x [T, hidden]`` → ``mixed_qkv [T, conv_dim]`` (conv order), ``z [T, Hv, Dv]``, ``b, a [T, Hv]``."""
        T = x.shape[0]
        if self.layout == "split":
            qkv, z, b, a = self._project_all(x)
            return qkv, z.reshape(T, self.num_v_heads, self.head_v_dim), b, a
        # Grouped: per key head, [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and [b (r) | a (r)], r = Hv / Hk.
        r = self.num_v_heads // self.num_k_heads
        qkvz, ba = self._project_all(x)
        qkvz = qkvz.reshape(T, self.num_k_heads, 2 * self.head_k_dim + 2 * r * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        b, a = ba.reshape(T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, -1), a.reshape(T, -1)

    def gates(self, b: torch.Tensor, a: torch.Tensor):
        """``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32), each ``[T, Hv]``."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return b.float().sigmoid(), g

    def split_heads(self, mixed: torch.Tensor):
        """Post-conv ``[T, conv_dim]`` → ``q, k [T, Hv, Dk]`` (key heads repeated), ``v [T, Hv, Dv]``."""
        T = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q, k, v.reshape(T, self.num_v_heads, self.head_v_dim)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.conv_dim, self.conv_width)


class GatedDeltaNetDecoderLayer(SplitPrefillLayer):
    """Input norm → Gated DeltaNet → residual → post norm → MLP or MoE → residual."""

    layer_kind = GDN_KIND
    tensor_parallel = True

    def __init__(self, config, layer_index: int, *, layout: str, mlp: nn.Module):
        super().__init__(layer_index)
        self.linear_attn = GatedDeltaNet(config, layer_index, layout)
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return self.linear_attn.state_spec(dtype)

    def prefill_phase1(self, hidden, residual, ctx: ForwardContext):
        """``(recurrence, (residual, z))``."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attn = self.linear_attn
        mixed, z, b, a = attn.project(hidden)
        beta, g = attn.gates(b, a)
        q, k, v = attn.split_heads(self._conv(mixed, ctx))
        return Recurrence(self.layer_index, q, k, v, g, beta, attn.scale), (residual, z)

    def _conv(self, mixed: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Short conv of every sequence from its pool conv state; writes the new states (and captures)."""
        attn = self.linear_attn
        return conv_over_pool(self.layer_index, mixed, ctx, attn.conv_weight, attn._conv, attn._conv_update)

    def prefill_phase3(self, o: torch.Tensor, carry, ctx: ForwardContext):
        residual, z = carry
        attn = self.linear_attn
        o = attn.norm(o, z)
        hidden = parallel_state.all_reduce(attn.out_proj(o.reshape(o.shape[0], attn.value_dim)))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
