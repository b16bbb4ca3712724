"""Mamba2 (``Mamba2ForCausalLM``, HF model_type ``mamba2``) over the recurrent-state pool.

A stack of ``x + mixer(norm(x))`` blocks, a final norm and the LM head; no attention, no RoPE, no
MLP. The mixer, per token (``I = expand * hidden`` = ``H`` heads of ``P`` features, ``G`` groups
of ``N``-wide B and C)::

    [z (I) | xBC (I + 2 G N) | dt (H)] = in_proj(x)
    xBC = silu(conv1d(xBC))            # depthwise causal conv of width W, with bias
    [x | B | C] = xBC
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    h_t = exp(dt A) h_{t-1} + dt x ⊗ B;  y = h_t C + D x   # SSD scan (prefill) / one step (decode)
    out = out_proj(norm(y * silu(z)))  # RMSNorm over groups of I / G features

Per sequence the pool keeps the last ``W - 1`` raw xBC rows (model dtype) and ``h [H, P, N]``
(fp32). Decode rows run as one batch; prompt rows through the core's pool walker
(`layerzoo.layers.recurrent_pool.walk_prompts`): one varlen call (per round of pieces, when
captures cut sequences), so the rows from a capture row on are those of a pass starting there.

Numerics follow transformers' torch path: the residual stream is fp32 when ``residual_in_fp32``
(the block norm reads it rounded to the model dtype), dt and the scan run in fp32. Two deliberate
differences: dt is clamped to ``time_step_limit`` in decode too (transformers and mamba_ssm clamp
only the chunked scan; with the usual ``(0, inf)`` both are no-ops), and the scan output is in the
model dtype before the gated norm (transformers keeps it fp32; the same in fp32). The ``d_mlp``
part some original mamba_ssm checkpoints put in ``in_proj`` is not supported (transformers has no
such part either): such a checkpoint fails the strict load on the in_proj shape.

Tensor parallel: split by head and group (``H / N`` heads, ``G / N`` groups per rank; a head's
group stays on its rank): each section of ``in_proj`` (z, x, B, C, dt) and of the conv (x, B, C)
splits on its own, as do ``dt_bias``/``A_log``/``D`` and the gated norm's weight (its groups stay
whole); ``out_proj`` is row-parallel and all-reduced; the LM head's logits are gathered.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.config import DecoderConfig, hf
from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import set_shard
from layerzoo.layers.base import DecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import StateSpec
from layerzoo.layers.model import CausalLM
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.parallel_linear import column_parallel_linear, local_heads, row_parallel_linear, split_rows
from layerzoo.layers.recurrent_pool import walk_prompts
from layerzoo.layers.vocab_parallel import gather_logits
from layerzoo.plugins.ops import kernel
from layerzoo_ssm import MAMBA2_KIND


@attrs.frozen(kw_only=True)
class Mamba2Config(DecoderConfig):
    # diff with DecoderConfig: Mamba2's keys for the heads and the norm epsilon
    num_attention_heads: int = hf(key="num_heads", kind=int)
    head_dim: int = hf(64, kind=int)
    rms_norm_eps: float = hf(1e-5, key="layer_norm_epsilon", kind=float)
    state_size: int = hf(128, kind=int)
    expand: int = hf(2, kind=int)
    n_groups: int = hf(8, kind=int)
    conv_kernel: int = hf(4, kind=int)
    chunk_size: int = hf(256, kind=int)
    use_bias: bool = hf(False, kind=bool)
    use_conv_bias: bool = hf(True, kind=bool)
    residual_in_fp32: bool = hf(True, kind=bool)
    time_step_limit: tuple = hf((0.0, math.inf), kind=(list, tuple))

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        inner = self.expand * self.hidden_size
        object.__setattr__(self, "intermediate_size", inner)
        object.__setattr__(self, "time_step_limit", tuple(_json_float(v) for v in self.time_step_limit))
        if self.num_attention_heads * self.head_dim != inner:
            raise ValueError(
                f"num_heads * head_dim ({self.num_attention_heads} * {self.head_dim}) must equal "
                f"expand * hidden_size ({inner})"
            )
        if self.num_attention_heads % self.n_groups or inner % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide num_heads ({self.num_attention_heads})")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (expected 'silu')")
        if len(self.time_step_limit) != 2:
            raise ValueError(f"time_step_limit must be [min, max], got {list(self.time_step_limit)}")


def _json_float(value) -> float:
    """A number from config.json: transformers 5 writes infinity as ``{"__float__": "Infinity"}``,
    older files as the ``Infinity`` literal (or a string)."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"time_step_limit: expected numbers, got {value!r}")
    return float(value)


class MambaRMSNormGated(nn.Module):
    """``w * rms_norm(y * silu(z))``, normalised over groups of ``group_size`` features (fp32 inside)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        g = y.float() * F.silu(z.float())
        *lead, dim = g.shape
        g = g.view(*lead, dim // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, as transformers does.
        return self.weight * g.view(*lead, dim).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}"


class Mamba2Mixer(nn.Module):
    """The SSD token mixer; module names follow the checkpoint (``mixer.in_proj`` ...)."""

    def __init__(self, config: Mamba2Config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        what = f"the Mamba2 mixer of layer {layer_index}"
        H, G, I = config.num_attention_heads, config.n_groups, config.intermediate_size  # all ranks'
        gn = G * config.state_size
        split_rows((H, G), what)  # heads and groups must both split across the ranks
        self.num_heads, self.head_dim = local_heads(H), config.head_dim  # this rank's
        self.n_groups, self.state_size = local_heads(G), config.state_size
        self.intermediate_size = local_heads(I)
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size
        self.conv_width = config.conv_kernel
        self.chunk_size = config.chunk_size
        self.dt_limit = config.time_step_limit
        hidden = config.hidden_size
        self.in_proj = column_parallel_linear(
            hidden, I + I + 2 * gn + H, config.use_bias, shard=split_rows((I, I, gn, gn, H), what)
        )
        # [D, 1, W] as in the checkpoint; the ops take the [D, W] view.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=config.use_conv_bias
        )
        conv = split_rows((I, gn, gn), what)
        set_shard(self.conv1d, "weight", conv)
        if config.use_conv_bias:
            set_shard(self.conv1d, "bias", conv)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for name in ("dt_bias", "A_log", "D"):
            set_shard(self, name, split_rows(H, what))
        self.norm = MambaRMSNormGated(
            self.intermediate_size, self.intermediate_size // self.n_groups, config.rms_norm_eps
        )
        set_shard(self.norm, "weight", split_rows(I, what))
        self.out_proj = row_parallel_linear(I, hidden, config.use_bias, shard=split_rows(I, what))
        self._conv = kernel("causal_conv1d")
        self._conv_update = kernel("causal_conv1d_update")
        self._scan = kernel("mamba2_chunk_scan")
        self._step = kernel("mamba2_state_update")

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(
            conv_shape=(self.conv_dim, self.conv_width - 1),
            recurrent_shape=(self.num_heads, self.head_dim, self.state_size),
            conv_dtype=dtype,
            recurrent_dtype=torch.float32,
        )

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.conv_dim, self.conv_width)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        """``softplus(dt + dt_bias)`` clamped to ``time_step_limit``, fp32 ``[T, H]``."""
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != math.inf:
            dt = dt.clamp(min=lo, max=hi)
        return dt

    def _split(self, xbc: torch.Tensor):
        """Post-conv ``[T, conv_dim]`` → ``x [T, H, P]``, ``B, C [T, G, N]``."""
        T = xbc.shape[0]
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        return (
            x.reshape(T, self.num_heads, self.head_dim),
            B.reshape(T, self.n_groups, self.state_size),
            C.reshape(T, self.n_groups, self.state_size),
        )

    def _prompt(self, xbc, dt, A, conv, rec, cu_seqlens=None):
        """Conv then SSD scan of one piece (or a varlen batch) from ``conv [N, D, W-1]``, ``rec [N, H, P, N]``."""
        xbc, conv = self._conv(
            xbc, self.conv_weight, self.conv1d.bias, conv_state=conv, cu_seqlens=cu_seqlens, activation="silu"
        )
        x, B, C = self._split(xbc)
        y, rec = self._scan(
            x, dt, A, B, C, D=self.D, initial_state=rec, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size
        )
        return y, conv, rec

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.ssm is None:
            raise RuntimeError("Mamba2 runs over the recurrent-state pool: the step's context has no ssm view")
        T, layer, nd = hidden.shape[0], self.layer_index, ctx.num_decodes
        z, xbc, dt = self.in_proj(hidden).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        dt = self._dt(dt)
        A = -self.A_log.float().exp()
        pool = ctx.ssm.pool
        pools = (pool.conv[layer], pool.recurrent[layer])
        y = xbc.new_empty((T, self.num_heads, self.head_dim))
        if nd:  # one-token decodes, batched
            slots = ctx.ssm.slots_tensor[:nd]
            conv, rec = (p.index_select(0, slots) for p in pools)
            xc, conv = self._conv_update(xbc[:nd], conv, self.conv_weight, self.conv1d.bias, activation="silu")
            x, B, C = self._split(xc)
            y[:nd], rec = self._step(rec, x, dt[:nd], A, B, C, D=self.D)
            for p, new in zip(pools, (conv, rec)):
                p.index_copy_(0, slots, new.to(p.dtype))
        if nd < ctx.num_seqs:

            def run(rows, states, cu_seqlens, longest):
                out, conv, rec = self._prompt(xbc[rows], dt[rows], A, *states, cu_seqlens)
                return out, (conv, rec)

            walk_prompts(ctx, pools, run, y, varlen=True)
        out = self.norm(y.reshape(T, self.intermediate_size), z)
        return parallel_state.all_reduce(self.out_proj(out.to(hidden.dtype)))


class Mamba2Block(DecoderLayer):
    """``x + mixer(norm(x))``; the residual add is deferred to the next block (or the final norm)."""

    layer_kind = MAMBA2_KIND
    tensor_parallel = True  # the mixer splits by head and group

    def __init__(self, config: Mamba2Config, layer_index: int):
        super().__init__(layer_index)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = Mamba2Mixer(config, layer_index)
        self.residual_in_fp32 = config.residual_in_fp32

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return self.mixer.state_spec(dtype)

    def prefill(self, hidden, residual, ctx: ForwardContext):
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        elif residual.dtype == hidden.dtype == self.norm.weight.dtype:
            hidden, residual = self.norm(hidden, residual)
        else:
            # An fp32 residual stream under a lower-precision model: the norm reads the sum rounded
            # to the model dtype, as transformers does.
            residual = hidden + residual
            hidden = self.norm(residual.to(self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.float()
        return self.mixer(hidden, ctx), residual

    # Decode rows are handled by the same call (the context says which rows decode).
    decode = prefill


class _NoRotary(nn.Module):
    """Mamba2 has no positions to rotate: the step's ``cos_sin`` stays None."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return None


class Mamba2ForCausalLM(CausalLM):
    config_class = Mamba2Config

    def __init__(self, config: Mamba2Config, engine_config=None):
        super().__init__(config, engine_config)
        self.rotary = _NoRotary()

    def build_layer(self, layer_index: int) -> Mamba2Block:
        return Mamba2Block(self.config, layer_index)

    def reset_buffers(self) -> None:
        self.rotary = _NoRotary()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # With residual_in_fp32 the final norm's output is fp32; the head reads the model dtype.
        logits = self.lm_head(hidden.to(self.model.embed_tokens.weight.dtype)).float()
        return gather_logits(logits, self.config.vocab_size)


def name_map(config: Mamba2Config):
    """``backbone.*`` checkpoint names onto the core's ``model.*`` layout."""

    def map_name(key: str):
        if not key.startswith("backbone."):
            return key  # lm_head.weight
        rest = key[len("backbone."):]
        if rest in ("embeddings.weight", "embedding.weight"):  # the older name, as transformers' load hook
            return "model.embed_tokens.weight"
        if rest == "norm_f.weight":
            return "model.norm.weight"
        return "model." + rest  # layers.N.{norm, mixer.*}; anything else fails the strict load by name

    return map_name
