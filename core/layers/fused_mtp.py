"""The MTP head's step as one C++ call (``layerzoo_cpu::mtp_head_step``, in decode_layer_cpu.cpp).

`CausalLM.mtp_step` runs `layerzoo.layers.mtp.MtpHead` op by op: the embedding, two norms, a cat,
``eh_proj``, the decoder block, the add and the shared norm, the LM head, and the drafter takes the
argmax: ~15 Python calls around one fused block call, ~0.25 ms a step of the embedded model
(2-core EPYC), as much as a quarter of the head's whole step. The C++ op makes the same calls in
the same order on the same arguments (so its carry and tokens are bitwise the Python path's) and
returns the drafted tokens. It also skips work the Python path does for nothing: only the rows
that draft need the block's output; the others (the rows before a verify's last, rows caught up
for a sequence that did not draft) run only the block's key/value part, which writes the same keys
and values (each row's norm, GEMV and rotation do not depend on the rows beside it).

Taken where the head is the core's `MtpHead` with `RMSNorm` norms, its block has a fused decode
plan (`layerzoo.layers.fused_decode`), ``eh_proj`` and the LM head have few-row kernels
(`LinearMethod.fused_part`), the embedding is a plain one-rank ``nn.Embedding`` and the step's
rows fit those kernels and the KV pool's one-call operands; elsewhere (GLM's MLA head, Qwen3-Next's
zero-centred norms, a long prompt chunk) the Python path runs.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from layerzoo.layers import fused_decode
from layerzoo.layers.base import PreNormDecoderLayer
from layerzoo.layers.linear_method import LinearMethod
from layerzoo.layers.mtp import MtpHead
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.rotary import RotaryEmbedding


@attrs.frozen
class MtpStepPlan:
    """What the head's one-call step takes besides the step's tensors."""

    block: fused_decode.DecodePlan
    embed: torch.Tensor  # [V, H]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    eps: float
    mask_position0: bool
    carry_normed: bool
    # eh_proj, then the LM head: each a count of linears and (w_ptr, N, K, w_bytes, block) a linear
    linears: tuple[int, ...]
    biases: tuple[torch.Tensor | None, ...]
    weights: tuple[torch.Tensor | None, ...]
    inv_freq: torch.Tensor  # the model's rotary (chained rows compute their cos and sin)
    rope_scaling: float
    max_rows: int
    # head steps, their rows, their draft rows, chain calls (a list: the plan is frozen)
    runs: list = attrs.field(factory=lambda: [0, 0, 0, 0])

    def run(self, token_ids: torch.Tensor, previous: torch.Tensor, ctx, rows: torch.Tensor):
        """``(carry [R, H], tokens [R])`` for the draft ``rows`` (indices into the step's ``T``
        rows, in order), or None when this step must take the Python path."""
        block = self.block
        if previous.dtype != block.dtype or not 0 < token_ids.shape[0] <= self.max_rows:
            return None
        if not all(op.native("cpu") for op in block.ops):
            return None
        operands = getattr(ctx.kv_cache, "decode_operands", None)
        operands = operands(block.layer_index, ctx) if operands is not None else None
        if operands is None or ctx.cos_sin is None or ctx.cos_sin[0].dtype != block.dtype:
            return None
        k_cache, v_cache, slots, tables, lens = operands
        cos, sin = ctx.cos_sin
        self.runs[0] += 1
        self.runs[1] += token_ids.shape[0]
        self.runs[2] += rows.shape[0]
        return _op()(
            token_ids, previous, self.embed, ctx.positions if self.mask_position0 else None, self.enorm, self.hnorm, self.norm,
            self.eps, self.carry_normed, self.linears, self.biases, self.weights, rows,
            block.input_norm, block.post_norm, block.q_norm, block.k_norm, block.eps, block.qk_eps, cos, sin,
            k_cache, v_cache, slots, tables, lens, block.scale, block.heads, block.linears, block.biases, block.weights)


    def chain(self, tokens: torch.Tensor, carry: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor,
              tables: torch.Tensor, kv):
        """The chained steps after a head step in one call: ``drafts [R, S]`` (-1 past a row's
        count), S = max(counts) - 1; row j drafts ``counts[j] - 1`` more tokens, decode rows at
        positions ``ends[j]``, ``ends[j] + 1``, ... on its block table ``tables[j]`` of the paged
        pool ``kv``. None: the Python loop runs."""
        block = self.block
        if carry.dtype != block.dtype or not 0 < tokens.shape[0] <= self.max_rows:
            return None
        if not all(op.native("cpu") for op in block.ops):
            return None
        caches = getattr(kv, "decode_caches", None)
        caches = caches(block.layer_index) if caches is not None else None
        if caches is None:
            return None
        k_cache, v_cache = caches
        self.runs[3] += 1
        return _chain_op()(
            tokens, carry, counts, ends, tables, kv.block_size, self.inv_freq, self.rope_scaling, self.embed,
            self.mask_position0, self.enorm, self.hnorm, self.norm, self.eps, self.carry_normed, self.linears, self.biases,
            self.weights, block.input_norm, block.post_norm, block.q_norm, block.k_norm, block.eps, block.qk_eps, k_cache, v_cache,
            block.scale, block.heads, block.linears, block.biases, block.weights)


def _op():
    return torch.ops.layerzoo_cpu.mtp_head_step.default


def _chain_op():
    return torch.ops.layerzoo_cpu.mtp_head_chain.default


def plan_for(model) -> MtpStepPlan | None:
    """The one-call plan of ``model``'s MTP head, or None where its step runs op by op (see the
    module docstring)."""
    head = model.mtp
    if type(head) is not MtpHead or model.lm_head is None:
        return None
    norms = (head.enorm, head.hnorm, head.norm)
    if any(type(n) is not RMSNorm for n in norms) or len({n.eps for n in norms}) != 1:
        return None
    embed = model.model.embed_tokens
    if type(embed) is not nn.Embedding or embed.weight.device.type != "cpu":
        return None
    layer = head.block
    # The block's step must be the one its fused plan stands for (a subclass may run another).
    if not isinstance(layer, PreNormDecoderLayer) or type(layer).prefill is not PreNormDecoderLayer.prefill:
        return None
    if "_decode_plan" not in layer.__dict__:  # one plan for both paths, as `PreNormDecoderLayer._fused` keeps it
        layer.__dict__["_decode_plan"] = layer._plan_decode()
    block = layer.__dict__["_decode_plan"]
    if block is None:
        return None
    linears = [head.eh_proj, model.lm_head]
    parts = [lin.fused_part() if isinstance(lin, LinearMethod) else None for lin in linears]
    if any(p is None or p.dtype != block.dtype for p in parts):
        return None
    if model.lm_head.out_features != model.config.vocab_size:  # a padded or split vocabulary
        return None
    tensors = [embed.weight, *(n.weight for n in norms)]
    if any(t.dtype != block.dtype for t in tensors):
        return None
    if type(model.rotary) is not RotaryEmbedding:  # the chain computes the plain rotary's cos and sin
        return None
    try:
        _op(), _chain_op()
    except (AttributeError, RuntimeError):  # a library built before the op existed
        return None
    return MtpStepPlan(
        block=block,
        embed=embed.weight.detach(),
        enorm=head.enorm.weight.detach(),
        hnorm=head.hnorm.weight.detach(),
        norm=head.norm.weight.detach(),
        eps=float(head.norm.eps),
        mask_position0=head.mask_position0,
        carry_normed=head.carry_normed,
        linears=tuple(f for p in parts for f in (1, *p.fields)),
        biases=tuple(p.bias for p in parts),
        weights=tuple(t for p in parts for t in (*p.tensors, None, None, None)[: fused_decode.TENSORS_PER_LINEAR]),
        inv_freq=model.rotary.inv_freq,
        rope_scaling=model.rotary.attention_scaling,
        max_rows=min(block.max_rows, *(p.rows for p in parts)),
    )
