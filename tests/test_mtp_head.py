"""The MTP head (`layerzoo.layers.mtp.MtpHead`) against a plain-torch reference written from the
public model code (vLLM's ``DeepSeekMultiTokenPredictorLayer`` / ``Glm4MoeMultiTokenPredictorLayer``
and ``Qwen3NextMultiTokenPredictor``), on odd shapes, two sequences of different lengths through
the paged pool, then one chained row per sequence that attends over the rows written before."""

import pytest
import torch

from layerzoo.config import RopeConfig
from layerzoo.layers.attention import Attention
from layerzoo.layers.base import PreNormDecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.mtp import MtpHead
from layerzoo.layers.rotary import RotaryEmbedding
from layerzoo.runtime.kv_pool import PagedKVCache

H, HEADS, KV_HEADS, D, INTER, EPS, THETA = 40, 5, 1, 8, 24, 1e-5, 10000.0
BLOCK = 4


def rms(x, w, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos):
    """Neox-style rotary (halves), as the Llama / Qwen families use it: ``x [T, heads, D]``."""
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_block(p, x, pos, seq_of):
    """A pre-norm decoder block: causal GQA attention within each sequence, SwiGLU MLP."""
    r = x
    h = rms(x, p["input_layernorm.weight"])
    q = (h @ p["self_attn.q_proj.weight"].T).view(-1, HEADS, D)
    k = (h @ p["self_attn.k_proj.weight"].T).view(-1, KV_HEADS, D)
    v = (h @ p["self_attn.v_proj.weight"].T).view(-1, KV_HEADS, D)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * D**-0.5
    allowed = (seq_of[:, None] == seq_of[None, :]) & (pos[None, :] <= pos[:, None])
    att = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    h = att.reshape(-1, HEADS * D) @ p["self_attn.o_proj.weight"].T
    r = r + h
    h = rms(r, p["post_attention_layernorm.weight"])
    h = (torch.nn.functional.silu(h @ p["mlp.gate_proj.weight"].T) * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
    return r + h


def ref_mtp(p, embeds, previous, pos, seq_of, *, mask_position0):
    """vLLM's MTP layer: mask position 0 (DeepSeek / GLM), enorm / hnorm, eh_proj over the concat,
    the block, then the shared head's norm of ``hidden + residual``."""
    if mask_position0:
        embeds = torch.where((pos == 0)[:, None], torch.zeros_like(embeds), embeds)
    x = torch.cat([rms(embeds, p["enorm.weight"]), rms(previous, p["hnorm.weight"])], -1) @ p["eh_proj.weight"].T
    summed = ref_block({k[len("block."):]: v for k, v in p.items() if k.startswith("block.")}, x, pos, seq_of)
    return summed, rms(summed, p["norm.weight"])


def build_head(mask_position0, carry_normed):
    rotary = RotaryEmbedding(RopeConfig(theta=THETA), D, 256)
    attn = Attention(layer_index=3, hidden_size=H, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, rotary=rotary)
    block = PreNormDecoderLayer(3, self_attn=attn, mlp=GatedMLP(H, INTER), hidden_size=H, eps=EPS)
    head = MtpHead(H, EPS, block, mask_position0=mask_position0, carry_normed=carry_normed)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    return head.eval(), rotary


def context(kv, tables, query_lens, context_lens, rotary):
    ctx = ForwardContext.for_paged(
        seq_ids=list(range(len(tables))), query_lens=query_lens, context_lens=context_lens,
        block_tables=tables, block_size=BLOCK, num_decodes=0, kv_cache=kv,
    )
    ctx.cos_sin = rotary.cos_sin(ctx.positions, torch.float32)
    return ctx


@pytest.mark.parametrize("mask_position0,carry_normed", [(True, True), (False, True), (True, False)])
@torch.inference_mode()
def test_mtp_head_matches_the_reference_over_paged_rows_and_a_chained_step(mask_position0, carry_normed):
    head, rotary = build_head(mask_position0, carry_normed)
    params = {k: v.detach().clone() for k, v in head.named_parameters()}
    kv = PagedKVCache({3: head.block.kv_cache_spec(torch.float32)}, 8, BLOCK)
    tables, lens = [[5, 1, 6], [2, 7]], [9, 6]  # odd lengths across block edges, tables out of order
    torch.manual_seed(2)
    embeds, previous = torch.randn(sum(lens), H), torch.randn(sum(lens), H)
    carry, normed = head(embeds, previous, context(kv, tables, lens, lens, rotary))
    pos = torch.cat([torch.arange(n) for n in lens])
    seq_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    want_sum, want_normed = ref_mtp(params, embeds, previous, pos, seq_of, mask_position0=mask_position0)
    torch.testing.assert_close(normed, want_normed, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(carry, want_normed if carry_normed else want_sum, atol=2e-5, rtol=2e-5)
    # A chained step: one more row per sequence, fed the carried hidden of each one's last row;
    # it attends over the paged rows the first call wrote.
    last = torch.tensor([lens[0] - 1, sum(lens) - 1])
    next_embeds = torch.randn(2, H)
    _, chained = head(next_embeds, carry[last], context(kv, tables, [1, 1], [n + 1 for n in lens], rotary))
    all_embeds = torch.cat([embeds[: lens[0]], next_embeds[:1], embeds[lens[0]:], next_embeds[1:]])
    all_previous = torch.cat([previous[: lens[0]], carry[last[:1]], previous[lens[0]:], carry[last[1:]]])
    pos2 = torch.cat([torch.arange(n + 1) for n in lens])
    seq2 = torch.cat([torch.full((n + 1,), i) for i, n in enumerate(lens)])
    _, want_all = ref_mtp(params, all_embeds, all_previous, pos2, seq2, mask_position0=mask_position0)
    torch.testing.assert_close(chained, want_all[torch.tensor([lens[0], sum(lens) + 1])], atol=2e-5, rtol=2e-5)


def test_position_zero_masking_changes_the_first_row_only():
    """The DeepSeek/GLM mask is live: with it the first row ignores its embedding."""
    head, rotary = build_head(True, True)
    kv = PagedKVCache({3: head.block.kv_cache_spec(torch.float32)}, 4, BLOCK)
    torch.manual_seed(3)
    embeds, previous = torch.randn(3, H), torch.randn(3, H)
    with torch.inference_mode():
        a, _ = head(embeds, previous, context(kv, [[0]], [3], [3], rotary))
        b, _ = head(embeds + torch.cat([torch.randn(1, H), torch.zeros(2, H)]), previous, context(kv, [[0]], [3], [3], rotary))
    torch.testing.assert_close(a, b)


def test_waiting_rows_stay_contiguous_through_rewinds_gaps_and_the_cap():
    """The rows the head has not run for a sequence (`MtpDrafter`): the last ``limit`` whole steps,
    a rewind drops those at or past the new rows, a gap drops them all."""
    from layerzoo.speculative.mtp_drafter import _Rows, _stacked, _Waiting

    hidden = torch.arange(40.0).view(20, 2)

    def rows(start, n):
        return _Rows(7, start, list(range(start + 1, start + n + 1)), [(hidden, start, start + n)], True)

    waiting = _Waiting(limit=3)
    for start in range(10, 15):  # five decode steps: the last three wait
        waiting.add(rows(start, 1))
    joined = waiting.before(rows(15, 2))
    assert (joined.start, joined.next_ids) == (12, [13, 14, 15, 16, 17])
    assert torch.equal(_stacked([joined]), hidden[12:17])
    waiting = _Waiting(limit=4)
    waiting.add(rows(10, 1))
    waiting.add(rows(11, 3))  # a verify's three kept rows
    rewound = waiting.before(rows(12, 1))  # rewound to 12: rows 12, 13 of the verify go
    assert (rewound.start, rewound.next_ids) == (10, [11, 12, 13])
    assert torch.equal(_stacked([rewound]), hidden[10:13])
    waiting = _Waiting(limit=3)
    waiting.add(rows(10, 1))
    assert waiting.before(rows(12, 1)).start == 12  # a gap at 11: none lead up to 12
