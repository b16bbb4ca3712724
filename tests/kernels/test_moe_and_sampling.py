"""MoE routing (softmax top-k, DeepSeek-V3 grouped sigmoid top-k), the grouped expert GEMM and
top-k/top-p filtering: Triton kernels against their torch references on odd shapes, fp32 and bf16
storage; the references against the core layers and sampler they serve.

Inputs are tie-free (distinct logits per row): where scores tie, the kernels may pick a different
one of the equal entries than the sort-based references (see each kernel's docstring).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import backends_of
from layerzoo.kernels.moe_grouped_matmul import reference as mm_ref
from layerzoo.kernels.moe_routing import reference as route_ref
from layerzoo.kernels.sampling import reference as sample_ref
from layerzoo.layers.moe import SoftmaxTopKRouter, StackedExperts
from layerzoo.plugins.manager import PluginRegistry, resolve_object
from layerzoo.runtime.sampler import apply_top_k_top_p
from layerzoo.testing import assert_close, kernel_test_device

route_tri = pytest.importorskip("layerzoo.kernels.moe_routing.triton")
mm_tri = pytest.importorskip("layerzoo.kernels.moe_grouped_matmul.triton")
sample_tri = pytest.importorskip("layerzoo.kernels.sampling.triton")

# LAYERZOO_TEST_DEVICE=cuda runs the same tests compiled on a GPU (with TRITON_INTERPRET=0).
DEVICE = torch.device(os.environ.get("LAYERZOO_TEST_DEVICE", "cpu"))
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Every bf16 value in ±[4.9e-4, 8): 3584 distinct values to draw tie-free rows from.
_BF16_POOL = torch.arange(0x3A00, 0x4100, dtype=torch.int16).view(torch.bfloat16).float()
_BF16_POOL = torch.cat([_BF16_POOL, -_BF16_POOL])


def distinct_rows(rows: int, cols: int, dtype: torch.dtype, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    """``[rows, cols]`` logits, distinct within each row, exactly representable in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def row() -> torch.Tensor:
        if dtype == torch.float32:
            return torch.randn(cols, generator=gen) * scale
        return _BF16_POOL[torch.randperm(len(_BF16_POOL), generator=gen)[:cols]]

    out = []
    while len(out) < rows:
        candidate = row()
        if len(candidate.unique()) == cols:  # a rare fp32 collision: draw the row again
            out.append(candidate)
    return torch.stack(out).to(device=DEVICE, dtype=dtype)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


# -- routing ------------------------------------------------------------------------------------

SOFTMAX_CASES = [
    pytest.param(T, E, k, id=f"T{T}-E{E}-k{k}") for T, E, k in [(1, 3, 1), (7, 8, 2), (33, 64, 6), (3, 512, 8)]
]


@pytest.mark.parametrize("T, E, k", SOFTMAX_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_topk(T, E, k, dtype, nan_empty):
    logits = distinct_rows(T, E, dtype, seed=E)
    renormalize = dtype == torch.float32  # each case once with and once without
    ref_w, ref_ids = route_ref.softmax_topk(logits, k, renormalize)
    tri_w, tri_ids = route_tri.softmax_topk(logits, k, renormalize)
    assert tri_ids.dtype == torch.int64 and tri_w.dtype == torch.float32
    assert torch.equal(tri_ids, ref_ids)
    assert_close("weights", ref_w, tri_w, 1e-6)


# (T, E, k, n_group, topk_group): one group, groups of one, a non-power-of-2 group size, DeepSeek-V3's 256/8/4
GROUPED_CASES = [
    pytest.param(*case, id="T{}-E{}-k{}-g{}-kg{}".format(*case))
    for case in [
        (1, 3, 1, 1, 1), (7, 3, 2, 3, 2), (7, 8, 2, 4, 2), (33, 64, 2, 8, 3),
        (7, 64, 6, 8, 3), (7, 48, 6, 4, 2), (3, 256, 8, 8, 4), (1, 512, 8, 1, 1),
    ]  # fmt: skip
]


@pytest.mark.parametrize("T, E, k, n_group, topk_group", GROUPED_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_grouped_topk(T, E, k, n_group, topk_group, dtype, nan_empty):
    logits = distinct_rows(T, E, dtype, seed=E)
    bias = randn(E, seed=1, scale=0.3)  # fp32, as checkpoints keep e_score_correction_bias
    renormalize, scaling = (True, 2.5) if dtype == torch.float32 else (False, 1.0)
    args = (logits, bias, k, n_group, topk_group, renormalize, scaling)
    ref_w, ref_ids = route_ref.sigmoid_grouped_topk(*args)
    tri_w, tri_ids = route_tri.sigmoid_grouped_topk(*args)
    assert torch.equal(tri_ids, ref_ids)
    assert_close("weights", ref_w, tri_w, 1e-6)


def test_sigmoid_grouped_topk_selects_by_bias_but_weighs_without_it():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=DEVICE)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=DEVICE)
    for op in (route_ref.sigmoid_grouped_topk, route_tri.sigmoid_grouped_topk):
        weights, ids = op(logits, bias, 2, 2, 1, False, 1.0)
        # group {0, 1} wins on 10.5 + 0.73; its experts are chosen, weighed by sigmoid alone
        assert ids.tolist() == [[0, 1]]
        assert_close("weights", torch.sigmoid(logits[:, :2]), weights, 1e-6)


def test_grouped_topk_rejects_impossible_configs():
    logits, bias = torch.zeros(2, 8, device=DEVICE), torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="n_group must divide"):
        route_tri.sigmoid_grouped_topk(logits, bias, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="exceeds the 2 experts of the 1 kept groups"):
        route_tri.sigmoid_grouped_topk(logits, bias, 3, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k must be in"):
        route_tri.softmax_topk(logits, 9, True)


def test_calls_the_kernels_do_not_serve_fall_back_to_torch():
    with pytest.raises(KernelUnsupported, match="at most 1024 experts"):
        route_tri.softmax_topk(torch.zeros(1, 1025, device=DEVICE), 2, True)
    args = expert_inputs(1, 3, 1, 24, 40, torch.float32)
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        mm_tri.fused_experts(args[0], args[1].double(), *args[2:])
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        sample_tri.top_k_top_p_filter(torch.zeros(1, 5, dtype=torch.float64, device=DEVICE), *sampling_params(1, 5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_topk_reference_is_the_core_router(dtype):
    router = SoftmaxTopKRouter(hidden_size=24, num_experts=8, top_k=2, norm_topk_prob=True).to(DEVICE)
    with torch.no_grad():
        router.weight.copy_(randn(8, 24, seed=1))
    router = router.to(dtype)
    x = randn(7, 24, dtype=dtype)
    for norm in (True, False):
        router.norm_topk_prob = norm
        weights, ids = router(x)
        ref_w, ref_ids = route_ref.softmax_topk(F.linear(x, router.weight), 2, norm)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w.to(dtype))


# -- grouped expert GEMM ------------------------------------------------------------------------

# (T, E, k, H, I); T*k/E sets the row block: 16 (few rows per expert, spare blocks), 32 or 64
EXPERT_CASES = [
    pytest.param(*case, id="T{}-E{}-k{}-H{}-I{}".format(*case))
    for case in [(1, 3, 1, 24, 40), (7, 8, 2, 40, 72), (7, 64, 6, 72, 24), (33, 8, 6, 24, 72), (33, 3, 3, 40, 24)]
]


def expert_inputs(T, E, k, H, I, dtype):
    x = randn(T, H, dtype=dtype)
    w13 = randn(E, 2 * I, H, dtype=dtype, seed=1, scale=H**-0.5)
    w2 = randn(E, H, I, dtype=dtype, seed=2, scale=I**-0.5)
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, k, generator=gen).to(DEVICE)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("T, E, k, H, I", EXPERT_CASES)
@pytest.mark.parametrize(
    "dtype, ratio", [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 1e-2, id="bf16")]
)
def test_fused_experts(T, E, k, H, I, dtype, ratio, nan_empty):
    args = expert_inputs(T, E, k, H, I, dtype)
    out = mm_tri.fused_experts(*args)
    assert out.dtype == dtype
    assert_close("out", mm_ref.fused_experts(*args), out, ratio)


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 1], [2, 1]], device=DEVICE)  # pairs per expert: 2, 3, 3, 0
    pair_of_row, expert_of_block = mm_tri.align_by_expert(ids, num_experts=4, block_m=2)
    # experts 0, 1, 2 fill 1 + 2 + 2 blocks (padding rows hold T*k = 8); the bound leaves a spare block
    assert expert_of_block.tolist() == [0, 1, 1, 2, 2, -1]
    assert pair_of_row.view(-1, 2).tolist() == [[1, 4], [3, 5], [7, 8], [0, 2], [6, 8], [8, 8]]


def test_fused_experts_reference_is_the_core_stacked_experts():
    T, E, k, H, I = 7, 8, 2, 24, 40
    x, w13, w2, weights, ids = expert_inputs(T, E, k, H, I, torch.float32)
    experts = StackedExperts(E, H, I).to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        core = experts(x, weights, ids)
    assert_close("out", core, mm_ref.fused_experts(x, w13, w2, weights, ids), 1e-6)


# -- top-k / top-p ------------------------------------------------------------------------------

SAMPLING_CASES = [pytest.param(B, V, id=f"B{B}-V{V}") for B, V in [(1, 5), (6, 1000), (4, 3001)]]


def sampling_params(B, V, seed=0):
    """Per-row switches: off, on, both, k = 1, k >= V, tiny and large p."""
    gen = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, V, (B,), generator=gen)
    top_p = torch.rand(B, generator=gen) * 0.9 + 0.05
    for row, (k, p) in enumerate([(0, 1.0), (0, None), (None, 1.0), (1, 0.5), (V, 0.3), (None, 1e-3)][:B]):
        if k is not None:
            top_k[row] = k
        if p is not None:
            top_p[row] = p
    return top_k.to(DEVICE), top_p.to(DEVICE)


@pytest.mark.parametrize("B, V", SAMPLING_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_top_p(B, V, dtype, nan_empty):
    logits = distinct_rows(B, V, dtype, seed=V)
    if V > 5:
        logits[-1, ::3] = float("-inf")  # a row already cut by min-p or min_tokens
    top_k, top_p = sampling_params(B, V)
    ref = sample_ref.top_k_top_p_filter(logits, top_k, top_p)
    out = sample_tri.top_k_top_p_filter(logits, top_k, top_p)
    assert out.dtype == dtype
    kept = out.isfinite()
    assert torch.equal(kept, ref.isfinite()), f"kept {kept.sum(-1).tolist()}, want {ref.isfinite().sum(-1).tolist()}"
    assert torch.equal(out[kept], logits[kept])


@pytest.mark.parametrize("B, V", SAMPLING_CASES)
def test_top_k_top_p_reference_is_the_core_sampler_filter(B, V):
    logits = distinct_rows(B, V, torch.float32, seed=V)
    top_k, top_p = sampling_params(B, V, seed=1)
    core_k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # the sampler's "off" is V
    assert torch.equal(sample_ref.top_k_top_p_filter(logits, top_k, top_p), apply_top_k_top_p(logits, core_k, top_p))


# -- registry -----------------------------------------------------------------------------------


def test_registry_lists_torch_and_triton_backends():
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    for op in ("moe_softmax_topk", "moe_sigmoid_grouped_topk", "moe_grouped_matmul", "top_k_top_p"):
        assert set(backends_of(op)) == {"torch", "triton"}
        for backend in ("torch", "triton"):
            reg = registry.kernels.entries[(op, backend)]
            assert reg.plugin == "layerzoo.kernels" and callable(resolve_object(reg.target))


# -- the clamped SwiGLU (limit) of GLM-5.3-Flash's experts ----------------------------------------


def clamped_inputs(T, H, I, E, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.5, torch.randn(E, H, I, generator=g) * 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


# (T, H, I, E, k): one token, odd widths, an intermediate past one 64-column block, unused experts
@pytest.mark.parametrize("T,H,I,E,k", [(1, 20, 12, 3, 1), (5, 33, 70, 4, 2), (9, 16, 8, 6, 3)])
def test_clamped_experts_triton_matches_the_reference(T, H, I, E, k):
    """The grouped matmul's limit (GLM-5.3-Flash's clamped SwiGLU) in Triton against the reference."""
    x, w13, w2, weights, ids = clamped_inputs(T, H, I, E, k, kernel_test_device())
    ref = mm_ref.fused_experts(x, w13, w2, weights, ids, limit=1.5)
    torch.testing.assert_close(mm_tri.fused_experts(x, w13, w2, weights, ids, limit=1.5), ref, atol=1e-4, rtol=1e-4)
    unclamped = mm_ref.fused_experts(x, w13, w2, weights, ids)
    assert (unclamped - ref).abs().max() > 1e-2  # the clamp is active at 1.5 on these inputs
    torch.testing.assert_close(mm_ref.fused_experts(x, w13, w2, weights, ids, limit=1e9), unclamped)


def test_clamped_experts_reference_is_transformers_experts():
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts

    config = transformers.Glm5NextTextConfig(hidden_size=20, moe_intermediate_size=12, n_routed_experts=4, swiglu_limit=1.5, q_lora_rank=8)
    experts = Glm5NextTextExperts(config)
    x, w13, w2, weights, ids = clamped_inputs(6, 20, 12, 4, 2, "cpu", seed=2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        expected = experts(x, ids, weights)
    torch.testing.assert_close(mm_ref.fused_experts(x, w13, w2, weights, ids, limit=1.5), expected, atol=1e-5, rtol=1e-5)
    core = StackedExperts(4, 20, 12, limit=1.5)
    with torch.no_grad():
        core.gate_up_proj.copy_(w13)
        core.down_proj.copy_(w2)
        torch.testing.assert_close(core(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
