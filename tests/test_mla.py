"""MLA in the core (`layerzoo.layers.mla`) against a dense, plain-torch MLA written from the
formulas: the latent cache, the absorbed decode, paged and chunk-local prefill, mixed steps, the
q_lora path, interleaved RoPE with yarn's mscale, the output gate, and an FP8 latent cache."""

import pytest
import torch

from layerzoo.config import RopeConfig
from layerzoo.kernels.rotary.reference import apply_rotary
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.mla import MLAAttention, mla_softmax_scale, yarn_mscale
from layerzoo.layers.rotary import RotaryEmbedding
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype

H, HIDDEN, KVR, DN, DR, DV = 3, 20, 12, 8, 4, 6
BLOCK = 4
YARN = RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0)


def build(*, q_lora=None, rope=None, interleaved=False, gate=False, prefill="paged", seed=0):
    torch.manual_seed(seed)
    rotary = RotaryEmbedding(rope, DR, 256) if rope is not None else None
    m = MLAAttention(
        layer_index=0, hidden_size=HIDDEN, num_heads=H, q_lora_rank=q_lora, kv_lora_rank=KVR,
        qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV, rotary=rotary, interleaved_rope=interleaved,
        output_gate=gate, softmax_scale=mla_softmax_scale(DN + DR, rope), prefill=prefill,
    )
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return m.eval()


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def dense_mla(m: MLAAttention, x: torch.Tensor) -> torch.Tensor:
    """The whole sequence ``x [T, hidden]`` at positions 0..T-1, causal, expanded K/V."""
    T = x.shape[0]
    if m.q_lora_rank is None:
        q = x @ m.q_proj.weight.T
    else:
        q = rms(x @ m.q_a_proj.weight.T, m.q_a_layernorm.weight) @ m.q_b_proj.weight.T
    q = q.view(T, H, DN + DR)
    ckv = x @ m.kv_a_proj_with_mqa.weight.T
    c, k_pe = rms(ckv[:, :KVR], m.kv_a_layernorm.weight), ckv[:, None, KVR:]
    q_nope, q_pe = q[..., :DN], q[..., DN:]
    if m.rotary is not None:
        cos, sin = m.rotary.cos_sin(torch.arange(T), x.dtype)
        q_pe = apply_rotary(q_pe, cos, sin, interleaved=m.interleaved_rope)
        k_pe = apply_rotary(k_pe, cos, sin, interleaved=m.interleaved_rope)
    kv = (c @ m.kv_b_proj.weight.T).view(T, H, DN + DV)
    k = torch.cat([kv[..., :DN], k_pe.expand(T, H, DR)], -1)
    scores = torch.einsum("ihd,jhd->hij", torch.cat([q_nope, q_pe], -1), k) * m.scaling
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., DN:])
    if m.output_gate:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T).view(T, H, DV)
    return o.reshape(T, H * DV) @ m.o_proj.weight.T


def ctx_for(kv, rotary, query_lens, context_lens, num_decodes, tables):
    ctx = ForwardContext.for_paged(
        seq_ids=list(range(len(query_lens))), query_lens=query_lens, context_lens=context_lens,
        block_tables=tables, block_size=BLOCK, num_decodes=num_decodes, kv_cache=kv,
    )
    if rotary is not None:
        ctx.cos_sin = rotary.cos_sin(ctx.positions, torch.float32)
    return ctx


def run_in_steps(m, x, steps, kv_cache_dtype="auto"):
    """Feed one sequence ``x`` in the given step sizes (size 1 after the first step: a decode row)."""
    specs = with_kv_cache_dtype({0: m.kv_cache_spec(torch.float32)}, kv_cache_dtype)
    kv = PagedKVCache(specs, 16, BLOCK, fp8_calibration_tokens=0)
    table = [list(range(15, -1, -1))]  # blocks in a scrambled order
    out, done = [], 0
    with torch.no_grad():
        for n in steps:
            decode = int(n == 1 and done > 0)
            out.append(m(x[done : done + n], ctx_for(kv, m.rotary, [n], [done + n], decode, table)))
            done += n
    return torch.cat(out)


CASES = {
    "nope": dict(),
    "q_lora": dict(q_lora=10),
    "rope": dict(rope=RopeConfig()),
    "interleaved_yarn_gate": dict(q_lora=10, rope=YARN, interleaved=True, gate=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("steps", [[13], [5, 8], [6, 3, 1, 1, 1]])
def test_paged_prefill_and_absorbed_decode_match_dense(case, steps):
    m = build(**CASES[case])
    x = torch.randn(sum(steps), HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(run_in_steps(m, x, steps), dense_mla(m, x), atol=1e-5, rtol=1e-5)


def test_local_prefill_matches_paged_on_a_whole_prompt():
    for case in CASES.values():
        paged, local = build(**case), build(**case, prefill="local")
        x = torch.randn(12, HIDDEN)
        torch.testing.assert_close(run_in_steps(local, x, [11, 1]), run_in_steps(paged, x, [11, 1]), atol=1e-6, rtol=0)


def test_local_prefill_refuses_a_chunk_past_position_0():
    m = build(prefill="local")
    with pytest.raises(AssertionError, match="starts at position 5, not 0"):
        run_in_steps(m, torch.randn(9, HIDDEN), [5, 4])


def test_mixed_step_decodes_and_prefills_several_sequences():
    """One step with two decode rows and two prefill chunks (one continuing) == each alone."""
    m = build(**CASES["interleaved_yarn_gate"])
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in (7, 4, 9, 6)]
    expected = [dense_mla(m, x) for x in xs]
    kv = PagedKVCache({0: m.kv_cache_spec(torch.float32)}, 16, BLOCK)
    tables = [[0, 1], [2, 3], [4, 5, 6], [7, 8]]
    with torch.no_grad():
        # step 1: prefill all but the last row of seqs 0-1, the first 5 rows of seq 2, nothing of 3
        m(torch.cat([xs[0][:6], xs[1][:3], xs[2][:5]]), ctx_for(kv, m.rotary, [6, 3, 5], [6, 3, 5], 0, tables[:3]))
        # step 2: decode seqs 0-1, continue seq 2, start seq 3
        out = m(torch.cat([xs[0][6:], xs[1][3:], xs[2][5:], xs[3]]), ctx_for(kv, m.rotary, [1, 1, 4, 6], [7, 4, 9, 6], 2, tables))
    got = out.split([1, 1, 4, 6])
    for g, e, rows in zip(got, expected, (slice(6, 7), slice(3, 4), slice(5, 9), slice(0, 6))):
        torch.testing.assert_close(g, e[rows], atol=1e-5, rtol=1e-5)


def test_fp8_latent_cache_stays_close():
    m = build(**CASES["rope"])
    x = torch.randn(12, HIDDEN)
    exact = dense_mla(m, x)
    fp8 = run_in_steps(m, x, [8, 1, 1, 1, 1], kv_cache_dtype="fp8")
    err = (fp8 - exact).norm() / exact.norm()
    assert 0 < err < 0.05, err


def test_latent_spec_sizes_the_pool():
    spec = KVCacheSpec.latent(KVR, DR, torch.bfloat16)
    assert spec.is_latent and spec.rows == ("latent",) and spec.num_kv_heads == 1
    assert spec.bytes_per_token == (KVR + DR) * 2
    gqa = KVCacheSpec(2, 8, torch.bfloat16)
    assert gqa.bytes_per_token == 2 * 2 * 8 * 2 and not gqa.is_latent
    specs = with_kv_cache_dtype({0: spec, 1: gqa}, "fp8")
    assert specs[0].bytes_per_token == KVR + DR and specs[0].rows == ("latent",)
    per_block = BLOCK * ((KVR + DR) + 2 * 2 * 8)
    assert num_blocks_for_budget(specs, BLOCK, 10 * per_block) == 10
    pool = PagedKVCache(specs, 10, BLOCK)
    assert set(pool.rows[0]) == {"latent"} and set(pool.rows[1]) == {"k", "v"}
    assert 0 not in pool.k and pool.rows[0]["latent"].shape == (10, BLOCK, 1, KVR + DR)
    assert pool.nbytes == 10 * per_block


def test_yarn_mscale_goes_into_the_softmax_scale():
    assert mla_softmax_scale(192) == 192**-0.5
    m = yarn_mscale(40.0, 1.0)
    assert m > 1 and mla_softmax_scale(192, RopeConfig(rope_type="yarn", factor=40.0, mscale_all_dim=1.0)) == pytest.approx(192**-0.5 * m * m)
