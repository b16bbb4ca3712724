"""MoE routers as Triton kernels: one program per token row, the whole row of experts on chip.

The top-k is k rounds of argmax over the row (k is small: 1-16). Ties: among exactly-equal
selection scores the lowest expert id wins here, while ``torch.topk`` leaves the order of ties
unspecified, so the ids may differ from the reference's only among exactly-equal scores (the
weights are then equal too). ``softmax_topk`` selects on the logits, which order the experts as
the probabilities do but cannot collide through rounding or underflow.

Rows of more than ``MAX_EXPERTS`` experts raise `KernelUnsupported` (the op then runs its torch
reference); impossible configurations (``top_k`` above the experts of the kept groups) raise
`ValueError`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported

# The whole row sits in one block; past this the row should be split (no model routes over more).
MAX_EXPERTS = 1024


@triton.jit
def _pick_topk(b_sel, b_val, o_flat, m_valid, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``TOP_K`` rounds of argmax over ``b_sel`` where ``m_valid``.

    Returns ``(b_val at the picks, their flat ids)``, ``[BLOCK_K]`` each, in the order picked.
    """
    o_k = tl.arange(0, BLOCK_K)
    b_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    m_free = m_valid
    for j in tl.static_range(TOP_K):
        b_cand = tl.where(m_free, b_sel, float("-inf"))
        b_best = tl.max(b_cand, axis=0)
        # the lowest id among the free entries at the maximum (-inf ones included, so k <= E always picks)
        i_best = tl.min(tl.where(m_free & (b_cand == b_best), o_flat, 2147483647), axis=0)
        w = tl.sum(tl.where(o_flat == i_best, b_val, 0.0), axis=0)
        b_w = tl.where(o_k == j, w, b_w)
        b_i = tl.where(o_k == j, i_best.to(tl.int64), b_i)
        m_free = m_free & (o_flat != i_best)
    return b_w, b_i


@triton.jit
def softmax_topk_kernel(
    logits,
    weights,
    ids,
    stride_t,
    E,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    # [BLOCK_E]
    b_x = tl.load(logits + i_t * stride_t + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    b_p = tl.where(m_e, tl.exp(b_x - tl.max(b_x, axis=0)), 0.0)
    b_p = b_p / tl.sum(b_p, axis=0)

    b_w, b_i = _pick_topk(b_x, b_p, o_e, m_e, TOP_K, BLOCK_K)
    if RENORMALIZE:
        b_w = b_w / tl.sum(b_w, axis=0)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < TOP_K
    tl.store(weights + i_t * TOP_K + o_k, b_w, mask=m_k)
    tl.store(ids + i_t * TOP_K + o_k, b_i, mask=m_k)


@triton.jit
def sigmoid_grouped_topk_kernel(
    logits,
    bias,
    weights,
    ids,
    stride_t,
    scaling,
    TOP_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_t = tl.program_id(0)
    # the row as a [group, expert-in-group] tile
    o_g = tl.arange(0, BLOCK_G)
    o_s = tl.arange(0, BLOCK_S)
    m_ge = (o_g[:, None] < N_GROUP) & (o_s[None, :] < GROUP_SIZE)
    o_ge = o_g[:, None] * GROUP_SIZE + o_s[None, :]
    # [BLOCK_G, BLOCK_S]
    b_x = tl.load(logits + i_t * stride_t + o_ge, mask=m_ge, other=0.0).to(tl.float32)
    b_bias = tl.load(bias + o_ge, mask=m_ge, other=0.0).to(tl.float32)
    b_score = tl.sigmoid(b_x)
    b_choice = tl.where(m_ge, b_score + b_bias, float("-inf"))

    if N_GROUP > 1:
        # group score: the sum of its two best biased scores, [BLOCK_G]
        b_top1 = tl.max(b_choice, axis=1)
        i_top1 = tl.min(tl.where(b_choice == b_top1[:, None], o_s[None, :], BLOCK_S), axis=1)
        b_group = b_top1
        if GROUP_SIZE > 1:
            b_group += tl.max(tl.where(o_s[None, :] == i_top1[:, None], float("-inf"), b_choice), axis=1)
        # keep the TOPK_GROUP best groups
        m_free = o_g < N_GROUP
        m_keep = o_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            b_cand = tl.where(m_free, b_group, float("-inf"))
            b_best = tl.max(b_cand, axis=0)
            i_best = tl.min(tl.where(m_free & (b_cand == b_best), o_g, BLOCK_G), axis=0)
            m_keep = m_keep | (o_g == i_best)
            m_free = m_free & (o_g != i_best)
        m_ge = m_ge & m_keep[:, None]

    BLOCK: tl.constexpr = BLOCK_G * BLOCK_S
    o_flat = tl.where(m_ge, o_ge, 2147483647)
    b_w, b_i = _pick_topk(
        tl.reshape(b_choice, [BLOCK]),
        tl.reshape(b_score, [BLOCK]),
        tl.reshape(o_flat, [BLOCK]),
        tl.reshape(m_ge, [BLOCK]),
        TOP_K,
        BLOCK_K,
    )
    if RENORMALIZE:
        b_w = b_w / (tl.sum(b_w, axis=0) + 1e-20)
    b_w = b_w * scaling
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < TOP_K
    tl.store(weights + i_t * TOP_K + o_k, b_w, mask=m_k)
    tl.store(ids + i_t * TOP_K + o_k, b_i, mask=m_k)


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    if num_experts > MAX_EXPERTS:
        raise KernelUnsupported(f"the triton router holds a row of at most {MAX_EXPERTS} experts, got {num_experts}")
    if logits.device.type != "cuda" and not settings.switch("TRITON_INTERPRET"):
        raise KernelUnsupported(f"{logits.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    return weights, ids


def _num_warps(block: int) -> int:
    return 1 if block <= 128 else 4


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the k most probable, optionally renormalised over those k.

    Args:
        logits: ``[T, E]`` router logits, any float dtype, ``E <= 1024``.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the k chosen probabilities by their sum (``norm_topk_prob``).
    Returns:
        ``(weights [T, k] fp32, ids [T, k] int64)``, by descending probability.
    """
    weights, ids = _outputs(logits, top_k)
    if logits.shape[0] == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(logits.shape[1])
    softmax_topk_kernel[(logits.shape[0],)](
        logits,
        weights,
        ids,
        logits.stride(0),
        logits.shape[1],
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=_num_warps(block_e),
    )
    return weights, ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 router: sigmoid scores, biased grouped selection, unbiased weights.

    Args:
        logits: ``[T, E]`` router logits, any float dtype, ``E <= 1024``.
        bias: ``[E]`` selection bias (``e_score_correction_bias``), used only to choose.
        top_k: experts per token, at most ``topk_group * E / n_group``.
        n_group: number of expert groups, dividing ``E`` (1: no grouping).
        topk_group: groups kept per token (by the sum of each group's two best biased scores).
        renormalize: divide the chosen sigmoid scores by their sum (+1e-20).
        routed_scaling_factor: multiplies the weights last.
    Returns:
        ``(weights [T, k] fp32, ids [T, k] int64)``, by descending biased score.
    """
    num_experts = logits.shape[1]
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must divide the number of experts ({num_experts}), got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    group_size = num_experts // n_group
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_group * group_size} experts of the {topk_group} kept groups; "
            "raise topk_group or lower top_k"
        )
    if bias.shape != (num_experts,):
        raise ValueError(f"bias must have shape [{num_experts}], got {tuple(bias.shape)}")
    weights, ids = _outputs(logits, top_k)
    if logits.shape[0] == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    sigmoid_grouped_topk_kernel[(logits.shape[0],)](
        logits,
        bias.contiguous(),
        weights,
        ids,
        logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        GROUP_SIZE=group_size,
        RENORMALIZE=renormalize,
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=_num_warps(block_g * block_s),
    )
    return weights, ids
