"""Kimi Delta Attention (Kimi Linear, Kimi K3, GLM-5.3-Flash) over the recurrent-state pool.

Per token: ``q, k, v = q_proj x, k_proj x, v_proj x`` (``H`` heads of ``D``); one depthwise causal
conv (width 4, SiLU) over ``[q | k | v]`` (checkpoints store ``q_conv1d``, ``k_conv1d``,
``v_conv1d`` apart: `conv_weight` concatenates them); ``beta = sigmoid(b_proj x)``; a decay per
key channel ``g [H, D]`` from ``f = f_b_proj(f_a_proj x)``:

- unbounded (Kimi Linear): ``g = -exp(A_log[h]) * softplus(f + dt_bias)``;
- lower-bounded (K3, GLM-5.3-Flash): ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``
  (a multiply, not a clamp);

then the KDA recurrence (fp32 state ``[H, D, D]``, q and k L2-normalised, ``q * D^-0.5``) and
``o_proj(RMSNorm(o) * sigmoid(gate))`` with the gate low-rank (``g_b_proj(g_a_proj x)``) or full
rank (``g_proj x``).

The mixer splits its step in the three phases of `layerzoo.layers.split_prefill`: `phase1`
(projections, conv, gates; returns the `Recurrence`), the core's recurrence of every sequence from
its pool state (with captures), and `output` (gated norm, output projection); a decoder layer wraps
them with its norms and MLP.

Tensor parallel: split by head. Each rank keeps ``H / N`` heads: its rows of q/k/v, of their convs,
of ``f_b_proj``/``dt_bias``/``A_log``/``b_proj`` and of the output gate's last projection
(``f_a_proj``/``g_a_proj`` are low-rank and replicated); ``o_proj`` is row-parallel and `output`
all-reduces. ``num_heads`` is this rank's, so the state spec is per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import Shard, set_shard
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import StateSpec
from layerzoo.layers.parallel_linear import column_parallel_linear, local_heads, row_parallel_linear, split_heads
from layerzoo.layers.recurrent_pool import Recurrence, conv_over_pool
from layerzoo.layers.split_prefill import recurrence_over_pool
from layerzoo.plugins.ops import kernel

# Pieces of at most this many rows run the plain recurrence; longer ones the chunked form.


class SigmoidGatedRMSNorm(nn.Module):
    """``w * rmsnorm(o) * sigmoid(gate)`` over the head dim, in fp32 (KDA's ``o_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x * torch.sigmoid(gate.float())).to(o.dtype)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer; checkpoint names as Kimi Linear's ``self_attn``."""

    def __init__(
        self,
        *,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_width: int = 4,
        norm_eps: float = 1e-5,
        gate_lower_bound: float | None = None,
        full_rank_output_gate: bool = False,
        a_log_shape: tuple[int, ...] | None = None,
        keep_fp32: bool = False,
    ):
        super().__init__()
        self.layer_index = layer_index
        what = f"the KDA of layer {layer_index}"
        heads = split_heads(num_heads, head_dim, what)  # rows of a [H * D, ...] weight
        full_dim = num_heads * head_dim
        self.num_heads, self.head_dim = local_heads(num_heads), head_dim  # this rank's heads
        self.dim = self.num_heads * head_dim
        self.conv_dim = 3 * self.dim
        self.conv_width = conv_width
        self.gate_lower_bound = gate_lower_bound
        # GLM-5.3-Flash: the conv weights, A_log and dt_bias stay fp32 whatever the model dtype (as
        # transformers keeps them), so a bf16 model's conv runs on fp32 weights
        self.keep_fp32 = keep_fp32
        self.q_proj = column_parallel_linear(hidden_size, full_dim, shard=heads)
        self.k_proj = column_parallel_linear(hidden_size, full_dim, shard=heads)
        self.v_proj = column_parallel_linear(hidden_size, full_dim, shard=heads)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, nn.Conv1d(self.dim, self.dim, conv_width, groups=self.dim, bias=False))
            set_shard(getattr(self, name), "weight", heads)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = column_parallel_linear(head_dim, full_dim, shard=heads)
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        set_shard(self, "dt_bias", heads)
        # One per head, stored as the checkpoint stores it (Kimi Linear: [1, 1, H, 1]); K3 stores
        # more entries than heads and the first H are read.
        self.A_log = nn.Parameter(torch.zeros(self._local_a_log_shape(a_log_shape or (num_heads,), num_heads)))
        set_shard(self, "A_log", self._a_log_shard(a_log_shape or (num_heads,), num_heads))
        self.b_proj = column_parallel_linear(hidden_size, num_heads, shard=split_heads(num_heads, 1, what))
        if full_rank_output_gate:
            self.g_proj = column_parallel_linear(hidden_size, full_dim, shard=heads)
        else:
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = column_parallel_linear(head_dim, full_dim, shard=heads)
        self.full_rank_output_gate = full_rank_output_gate
        self.o_norm = SigmoidGatedRMSNorm(head_dim, norm_eps)
        self.o_proj = row_parallel_linear(full_dim, hidden_size, shard=heads)
        self.scale = head_dim**-0.5
        self._conv = kernel("causal_conv1d")
        self._conv_update = kernel("causal_conv1d_update")

    @staticmethod
    def _a_log_shard(shape: tuple[int, ...], num_heads: int) -> Shard | None:
        """``A_log``'s split: along its one dim longer than 1 (the heads, then any extra entries,
        each section split), so that this rank's first ``H / N`` entries are its heads' rates."""
        n = parallel_state.tp_size()
        if n == 1:
            return None
        dim = next(d for d, size in enumerate(shape) if size > 1 or d == len(shape) - 1)
        extra = shape[dim] - num_heads
        return Shard(dim, (num_heads, extra) if extra else (num_heads,), parallel_state.tp_rank(), n)

    @classmethod
    def _local_a_log_shape(cls, shape: tuple[int, ...], num_heads: int) -> tuple[int, ...]:
        shard = cls._a_log_shard(shape, num_heads)
        if shard is None:
            return shape
        return tuple(shard.local_size if d == shard.dim else size for d, size in enumerate(shape))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.keep_fp32:
            for p in (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.A_log, self.dt_bias):
                if p.dtype != torch.float32:
                    p.data = p.data.float()
        return self

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(
            conv_shape=(self.conv_dim, self.conv_width - 1),
            recurrent_shape=(self.num_heads, self.head_dim, self.head_dim),
            conv_dtype=dtype,
            recurrent_dtype=torch.float32,
        )

    @property
    def conv_weight(self) -> torch.Tensor:
        """``[3 H D, W]``: the q, k and v convs as one depthwise conv over ``[q | k | v]``."""
        parts = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        return torch.cat([w.view(self.dim, self.conv_width) for w in parts])

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` → ``g [T, H, D]`` (fp32 log decay), ``beta [T, H]`` (fp32)."""
        T = x.shape[0]
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(T, self.num_heads, self.head_dim)
        rate = self.A_log.float().reshape(-1)[: self.num_heads].exp()[:, None]  # [H, 1]
        if self.gate_lower_bound is None:
            g = -rate * F.softplus(f)
        else:
            g = self.gate_lower_bound * torch.sigmoid(rate * f)
        return g, torch.sigmoid(self.b_proj(x).float())

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.g_proj(x) if self.full_rank_output_gate else self.g_b_proj(self.g_a_proj(x))
        return gate.view(x.shape[0], self.num_heads, self.head_dim)

    # -- the three phases ------------------------------------------------------------------------

    def phase1(self, x: torch.Tensor, ctx: ForwardContext) -> Recurrence:
        """The normed input ``x [T, hidden]`` → the recurrence's inputs (conv states written)."""
        T = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = conv_over_pool(self.layer_index, mixed, ctx, self.conv_weight, self._conv, self._conv_update)
        q, k, v = (t.reshape(T, self.num_heads, self.head_dim) for t in mixed.split(self.dim, dim=-1))
        g, beta = self.gates(x)
        return Recurrence(self.layer_index, q, k, v, g, beta, self.scale)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The recurrence's ``o [T, H, D]`` and the mixer's input ``x`` (for the gate) → ``[T, hidden]``."""
        o = self.o_norm(o, self.output_gate(x))
        return parallel_state.all_reduce(self.o_proj(o.reshape(o.shape[0], self.dim)))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, varlen: bool = False) -> torch.Tensor:
        """The three phases in a row (``varlen``: the prompt sequences in one recurrence call)."""
        return self.output(recurrence_over_pool(self.phase1(x, ctx), ctx, varlen), x)
