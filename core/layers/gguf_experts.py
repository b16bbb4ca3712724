"""Routed experts kept in their GGUF block formats (a Qwen3-MoE Q4_K_M file's ``ffn_*_exps``).

A GGUF file stacks each layer's experts in three 3-D tensors, ``blk.N.ffn_{gate,up,down}_exps``;
`GGUFStackedExperts` keeps them as the file stores them, ``gate_up_proj [E, 2I, row_bytes(H)]``
(each expert's gate rows over its up rows) and ``down_proj [E, H, row_bytes(I)]`` uint8, so the
experts take the file's bytes in memory instead of 4-8x that in fp32. A forward groups the routed
(token, slot) pairs by expert and runs only the experts that received tokens, each through the same
block matmul as a GGUF linear (`layerzoo.layers.gguf_linear.gguf_matmul`: the C++ GEMV for a few
rows, the C++ block GEMM for more). It is a `StackedExperts`, so expert parallelism
(this rank's ``E / N`` experts) and the decode-graph veto of experts run in torch apply unchanged.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.distributed.sharding import set_shard, shard_of
from layerzoo.layers.gguf_linear import _cpp_kernels, gguf_matmul, row_bytes, type_name
from layerzoo.layers.moe import StackedExperts
from layerzoo.loading.loader import Target

log = logging.getLogger(__name__)


class GGUFStackedExperts(StackedExperts):
    """SwiGLU experts whose weights are GGUF blocks: ``gate_up_proj`` in GGML type ``gate_up_qtype``,
    ``down_proj`` in ``down_qtype`` (a Q4_K_M file keeps some layers' down projections in Q6_K)."""

    counts_on_host = True  # the forward reads each expert's row count on the host: no captured decode step

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, gate_up_qtype: int, down_qtype: int):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_up_qtype, self.down_qtype = int(gate_up_qtype), int(down_qtype)
        shard = shard_of(self, "gate_up_proj")  # this rank's experts, as the float experts' split
        device = self.gate_up_proj.device
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, row_bytes(gate_up_qtype, hidden_size),
                                                     dtype=torch.uint8, device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden_size, row_bytes(down_qtype, intermediate_size),
                                                  dtype=torch.uint8, device=device), requires_grad=False)
        set_shard(self, "gate_up_proj", shard)
        set_shard(self, "down_proj", shard)
        self._kernels = None  # the C++ kernel module, looked up at the first call

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``weights, ids [T, k]`` (global expert ids) → ``[T, H]`` in ``x``'s dtype:
        this rank's experts' share of ``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])``."""
        top_k = ids.shape[1]
        local = (ids - self.first_expert).reshape(-1)  # pair p = (token p // k, slot p % k)
        pairs = ((local >= 0) & (local < self.num_local)).nonzero().squeeze(1)
        experts = local.index_select(0, pairs)
        order = torch.argsort(experts, stable=True)
        pairs = pairs.index_select(0, order)  # grouped by expert
        token_of = pairs // top_k
        counts = torch.bincount(experts, minlength=self.num_local).tolist()
        routed = x.index_select(0, token_of).float()
        out_rows = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                out_rows[start:start + count] = self.run_expert(expert, routed[start:start + count])
                start += count
        contributions = out_rows * weights.reshape(-1).index_select(0, pairs)[:, None].float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of, contributions)
        return out.to(x.dtype)

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert`` on ``rows [R, H]`` fp32 → ``[R, H]`` fp32: only its blocks are read."""
        if self._kernels is None:
            self._kernels = _cpp_kernels() or False
        kernels = self._kernels or None
        gate, up = gguf_matmul(rows, self.gate_up_proj[expert], self.gate_up_qtype, self.hidden_size,
                               kernels=kernels).chunk(2, dim=-1)
        return gguf_matmul(F.silu(gate) * up, self.down_proj[expert], self.down_qtype, self.intermediate_size,
                           kernels=kernels)

    def extra_repr(self) -> str:
        return (f"{self.num_local} of {self.num_experts} experts, hidden {self.hidden_size}, intermediate "
                f"{self.intermediate_size}, gate_up {type_name(self.gate_up_qtype)}, down {type_name(self.down_qtype)}")


def keep_expert_blocks(model: nn.Module, expert_types: dict[str, int], name_map, supported: frozenset[int]) -> frozenset[str]:
    """Replace each (meta-device) plain `StackedExperts` whose checkpoint experts are all in block
    types of ``supported`` by a `GGUFStackedExperts`; returns the checkpoint keys it takes as blocks.
    ``expert_types``: per-expert checkpoint key (``...experts.{e}.{gate,up,down}_proj.weight``) ->
    GGML type; ``name_map`` places them in ``gate_up_proj`` / ``down_proj`` grid cells. Experts whose
    gate and up differ in type (one stacked tensor holds both) stay dequantized, with a warning."""
    groups: dict[str, dict[str, dict[str, int]]] = {}  # module path -> parameter -> {key: type}
    for key, qtype in expert_types.items():
        target = name_map(key) if name_map is not None else None
        if not isinstance(target, Target) or not target.grid:
            continue
        path, _, attr = target.name.rpartition(".")
        if attr in ("gate_up_proj", "down_proj"):
            groups.setdefault(path, {}).setdefault(attr, {})[key] = qtype
    kept: set[str] = set()
    for path, params in groups.items():
        module = model.get_submodule(path)
        if type(module) is not StackedExperts or set(params) != {"gate_up_proj", "down_proj"}:
            continue  # a plugin's own experts (clamped, latent) read the dequantized weights
        gate_up, down = set(params["gate_up_proj"].values()), set(params["down_proj"].values())
        if len(gate_up) != 1 or len(down) != 1 or not (gate_up | down) <= supported:
            names = ", ".join(sorted(type_name(t) for t in gate_up | down))
            log.warning("%s: experts in %s are not kept in blocks (gate and up must share one supported type); "
                        "dequantized instead", path, names)
            continue
        hidden, intermediate = module.down_proj.shape[1:]  # [E, H, I]
        with torch.device("meta"):
            replacement = GGUFStackedExperts(module.num_experts, hidden, intermediate, gate_up.pop(), down.pop())
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, replacement)
        kept.update(params["gate_up_proj"], params["down_proj"])
    return frozenset(kept)
