"""Grouped-query self-attention with optional per-head QK-norm, over the step's KV cache."""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.linear import fuse_linears
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.parallel_linear import column_parallel_linear, kv_heads_shard, local_heads, row_parallel_linear, split_heads
from layerzoo.plugins.ops import kernel


class Attention(nn.Module):
    """q/k/v projections, optional QK RMSNorm over ``head_dim`` (before RoPE), RoPE, GQA attention.

    ``forward(x [T, hidden], ctx) -> [T, hidden]``. The cache write and the attention itself go
    through ``ctx.kv_cache.attend`` so that the cache layout stays the runtime's business.

    With an FP8 KV cache the pool hands the layer its scales (``fp8_kv``, see
    `layerzoo.runtime.kv_pool.PagedKVCache.bind`); the layer answers ``fp8_calibration_frozen``
    from them. ``k_scale``/``v_scale`` buffers exist only when `register_kv_scales` was called for
    a checkpoint that carries them.

    Tensor parallel: each rank computes ``num_heads / N`` query heads and their KV heads (split, or
    one replicated KV head when there are fewer KV heads than ranks); ``o_proj`` is row-parallel and
    the output is all-reduced. ``num_heads``/``num_kv_heads`` are this rank's, so the KV cache spec
    is per rank.
    """

    def __init__(
        self,
        *,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary,
        qk_norm_eps: float | None = None,
        bias: bool = False,
        output_bias: bool | None = None,
    ):
        """``bias`` adds biases to q, k and v (and to o unless ``output_bias`` says otherwise:
        Qwen2 biases q/k/v but not o)."""
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.layer_index = layer_index
        heads = split_heads(num_heads, head_dim, f"attention of layer {layer_index}")
        local_kv, kv_shard = kv_heads_shard(num_kv_heads, head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = local_heads(num_heads), local_kv, head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = column_parallel_linear(hidden_size, num_heads * head_dim, bias, shard=heads)
        self.k_proj = column_parallel_linear(hidden_size, num_kv_heads * head_dim, bias, shard=kv_shard)
        self.v_proj = column_parallel_linear(hidden_size, num_kv_heads * head_dim, bias, shard=kv_shard)
        self.o_proj = row_parallel_linear(num_heads * head_dim, hidden_size, bias if output_bias is None else output_bias, shard=heads)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        # QK-norm and RoPE as one op where it has a kernel for the device (the C++ one on CPU);
        # elsewhere the separate ops, whose own kernels (Triton on CUDA) the fused reference lacks
        self._qk_norm_rotary = kernel("qk_norm_rotary")
        # Shared with the model, not owned: keeps it out of this module's state_dict.
        self.__dict__["rotary"] = rotary
        self.qkv = None  # q_proj, k_proj and v_proj as one matmul, after fuse_projections
        self.fp8_kv = None  # this layer's FP8 KV scales (layerzoo.runtime.fp8_calibration.Fp8KvScales), set by the pool

    @property
    def fp8_calibration_frozen(self) -> bool | None:
        """None: no online FP8 KV calibration; False: calibrating; True: the scales froze."""
        return None if self.fp8_kv is None else self.fp8_kv.calibration_frozen

    def register_kv_scales(self) -> None:
        """Add ``k_scale``/``v_scale`` buffers ``[]`` for FP8 KV scales the checkpoint carries."""
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.ones((), dtype=torch.float32, device=self.k_proj.weight.device))

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(self.num_kv_heads, self.head_dim, dtype)

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one linear over all three (one bigger matmul)."""
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor):
        if self.qkv is not None:
            return self.qkv(x).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """QK-norm (when the layer has it) then RoPE: ``q [T, Hq, D]``, ``k [T, Hkv, D]`` → both."""
        if self._qk_norm_rotary.native(q.device.type):
            if not self.qk_norm:
                return self._qk_norm_rotary(q, k, None, None, 0.0, cos, sin)
            if type(self.q_norm) is RMSNorm and type(self.k_norm) is RMSNorm:  # not a subclass's own norm
                return self._qk_norm_rotary(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.project_qkv(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.norm_and_rotate(q, k, *ctx.cos_sin)
        out = ctx.kv_cache.attend(self.layer_index, q, k, v, self.scaling, ctx)
        return parallel_state.all_reduce(self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)))
