"""Mixture-of-experts MLP: softmax top-k routing over experts stored stacked.

Experts are stored as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (the layout
transformers 5 uses in memory); checkpoints with one tensor per expert are stacked at load time
by the architecture's weight mapping.

Expert parallel (with tensor parallelism): each rank holds ``E / N`` consecutive experts. The
router is replicated, so every rank routes every token alike; each rank runs only the (token,
expert) pairs of its own experts and the owning block all-reduces the partial sums — the simplest
exchange that is right (an all-to-all of the routed tokens would move less data).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import set_shard
from layerzoo.layers.parallel_linear import split_rows
from layerzoo.loading.loader import Target
from layerzoo.plugins.ops import kernel


class SoftmaxTopKRouter(nn.Module):
    """``softmax(x Wᵀ)`` in fp32 → top-k → optional renormalisation over the chosen k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self._topk = kernel("moe_softmax_topk")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` → ``(weights [T, k] in x's dtype, expert ids [T, k])``."""
        logits = F.linear(x, self.weight)
        weights, ids = self._topk(logits, self.top_k, self.norm_topk_prob)
        return weights.to(logits.dtype), ids


class SigmoidGroupedTopKRouter(nn.Module):
    """DeepSeek-V3's ``noaux_tc`` router (Kimi, GLM-5): sigmoid scores in fp32, a per-expert
    correction bias for the choice only, group top-k, optional renormalisation, routed scaling."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, num_groups: int, topk_groups: int,
                 renormalize: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self._topk = kernel("moe_sigmoid_grouped_topk")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` → ``(weights [T, k] fp32, expert ids [T, k])``."""
        logits = F.linear(x.float(), self.weight.float())
        return self._topk(
            logits, self.e_score_correction_bias, self.top_k, self.num_groups, self.topk_groups,
            self.renormalize, self.routed_scaling_factor,
        )


class StackedExperts(nn.Module):
    """SwiGLU experts; each token runs through its k experts and the outputs are weight-summed.

    With tensor parallelism this rank holds experts ``[first_expert, first_expert + num_local)``
    and `forward` returns only their share of the sum (the owner all-reduces it). ``limit``
    clamps the SwiGLU (GLM-5.3-Flash: ``silu(min(gate, limit)) · clamp(up, -limit, limit)``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, limit: float | None = None):
        super().__init__()
        self.limit = limit
        shard = split_rows(num_experts, "the MoE's routed experts")
        self.num_experts = num_experts
        self.num_local = num_experts if shard is None else shard.local_size
        self.first_expert = 0 if shard is None else shard.ranges()[0][0]
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size))
        set_shard(self, "gate_up_proj", shard)
        set_shard(self, "down_proj", shard)
        self._experts = kernel("moe_grouped_matmul")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``weights, ids [T, k]`` (global expert ids) → ``[T, H]``."""
        if self.num_local == self.num_experts:
            return self._experts(x, self.gate_up_proj, self.down_proj, weights, ids, **self._options())
        return self._local_experts(x, weights, ids)

    def _options(self) -> dict:
        # only when set: the op's other backends (CPU packed, GGUF, MXFP4 experts) take no limit
        return {} if self.limit is None else {"limit": self.limit}

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share: each (token, slot) pair routed here runs as a row of its own."""
        local = ids - self.first_expert
        tokens, slots = ((local >= 0) & (local < self.num_local)).nonzero(as_tuple=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if tokens.numel():
            rows = self._experts(
                x.index_select(0, tokens), self.gate_up_proj, self.down_proj,
                weights[tokens, slots].unsqueeze(1), local[tokens, slots].unsqueeze(1), **self._options(),
            )
            out.index_add_(0, tokens, rows.float())
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Router + experts: the MoE replacement of a layer's MLP."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = SoftmaxTopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_state.all_reduce(self.partial_forward(x))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (all of it with one rank), before the all-reduce."""
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


def is_sparse_layer(layer_index: int, *, num_experts: int, decoder_sparse_step: int, mlp_only_layers) -> bool:
    """Whether a layer of a Qwen-style MoE config uses the MoE block rather than a dense MLP (the
    rule of the HF references: experts exist, the layer is on the sparse step, not MLP-only)."""
    return layer_index not in mlp_only_layers and num_experts > 0 and (layer_index + 1) % decoder_sparse_step == 0


_EXPERT = re.compile(r"^((?:model\.layers\.\d+|mtp\.block)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")  # mtp.block: an MTP head's block


def stacked_expert_target(key: str, num_experts: int) -> Target | None:
    """Where a per-expert checkpoint tensor goes in `StackedExperts`, or None for any other key.

    ``...experts.{e}.{gate,up,down}_proj.weight`` lands in ``gate_up_proj [E, 2I, H]`` (gate rows
    first) or ``down_proj [E, H, I]``: the name map of an architecture with such checkpoints.
    """
    match = _EXPERT.match(key)
    if match is None:
        return None
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    if proj == "down_proj":
        return Target(f"{prefix}.down_proj", (expert,), (num_experts,))
    return Target(f"{prefix}.gate_up_proj", (expert, 0 if proj == "gate_proj" else 1), (num_experts, 2))
