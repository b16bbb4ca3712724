"""GDN hybrids split over 2 tensor-parallel ranks (CPU processes, gloo), without the engine: Qwen3.5
(split projections) and Qwen3-Next (grouped projections, MoE with a shared expert) give the
single-process logits on every rank, with the recurrent state sharded by head; so does Mamba2
(heads and groups split)."""

import pytest
import torch

from layerzoo.loading.model_loading import load_model
from layerzoo.testing.distributed import run_on_ranks, step_logits

PREFILL = "layerzoo.testing.distributed:prefill_on_rank"
DECODES = 3  # then one-row decode steps
CHUNKS = [21, 9]  # past the plain-recurrence row limit: the chunked kernel runs, then a second chunk from state


def run_both(path, vocab, pack=True):
    ids = torch.randint(0, vocab, (sum(CHUNKS) + DECODES,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = step_logits(load_model(path).model, ids[: sum(CHUNKS)], CHUNKS, ids[sum(CHUNKS) :])
    results = run_on_ranks(PREFILL, str(path), ids[: sum(CHUNKS)], CHUNKS, pack, ids[sum(CHUNKS) :], world_size=2)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], expected, atol=5e-4, rtol=0, msg=f"rank {rank}")  # fp32, partial sums reduced in another order
    return results, load_model(path).model


def test_qwen3_5_heads_and_state_split(qwen3_5_tiny):
    path, hf = qwen3_5_tiny
    results, single = run_both(path, hf.config.vocab_size, pack=False)
    full = single.state_specs()[0]  # Hk=2, Hv=2, Dk=Dv=8: conv over [q|k|v] = 48 channels
    assert full.recurrent_shape == (2, 8, 8) and full.conv_shape == (48, 3)
    for result in results:
        spec = result["state_specs"][0]
        assert spec.recurrent_shape == (1, 8, 8) and spec.conv_shape == (24, 3)  # one head of each per rank
        shapes = result["shapes"]
        assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (24, 40)
        assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (24, 1, 4)
        assert shapes["model.layers.0.linear_attn.A_log"] == (1,)
        assert shapes["model.layers.0.linear_attn.out_proj.weight"] == (40, 8)
        assert result["kv_specs"][1].num_kv_heads == 1  # the attention layer's one KV head, replicated


def test_qwen3_next_grouped_layout_and_shared_expert(qwen3_next_tiny):
    path, hf = qwen3_next_tiny
    results, _ = run_both(path, hf.config.vocab_size)
    for result in results:
        assert result["state_specs"][0].recurrent_shape == (2, 8, 12)  # Hv 4 -> 2 per rank
        assert result["kv_specs"][1].num_kv_heads == 1  # 2 KV heads split


def test_mamba2_heads_and_groups_split(mamba2_tiny):
    path, hf = mamba2_tiny
    results, _ = run_both(path, hf.config.vocab_size, pack=False)
    for result in results:
        spec = result["state_specs"][0]  # H 8, P 12, N 8, G 2: 4 heads and 1 group per rank
        assert spec.recurrent_shape == (4, 12, 8) and spec.conv_shape == (48 + 2 * 8, 3)
        assert result["shapes"]["model.layers.0.mixer.in_proj.weight"] == (48 + 48 + 16 + 4, 48)  # z, x, B, C, dt
