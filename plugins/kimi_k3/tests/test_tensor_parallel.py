"""Kimi Linear split over 2 tensor-parallel ranks (CPU processes, gloo), without the engine: KDA
heads and their recurrent state split, MLA heads split with the latent cache replicated, experts
split with the shared expert's partial sum in the same all-reduce; every rank gets the
single-process logits."""

import torch

from layerzoo.model_loading import load_model
from layerzoo.testing.distributed import run_on_ranks, step_logits

PREFILL = "layerzoo.testing.distributed:prefill_on_rank"
DECODES = 3  # then one-row decode steps
CHUNKS = [19, 7]


def test_kimi_linear_on_two_ranks_matches_single_process(kimi_tiny):
    path, hf = kimi_tiny
    ids = torch.randint(0, hf.config.vocab_size, (sum(CHUNKS) + DECODES,), generator=torch.Generator().manual_seed(5)).tolist()
    single = load_model(path).model
    expected = step_logits(single, ids[: sum(CHUNKS)], CHUNKS, ids[sum(CHUNKS) :])
    results = run_on_ranks(PREFILL, str(path), ids[: sum(CHUNKS)], CHUNKS, False, ids[sum(CHUNKS) :], world_size=2)
    full_kv, full_state = single.kv_cache_specs()[2], single.state_specs()[0]
    for rank, result in enumerate(results):
        # fp32; partial sums reduced in another order
        torch.testing.assert_close(result["logits"], expected, atol=5e-4, rtol=0, msg=f"rank {rank}")
        assert result["kv_specs"][2] == full_kv  # MLA: one latent row per token on every rank
        state = result["state_specs"][0]
        assert full_state.recurrent_shape == (2, 16, 16) and state.recurrent_shape == (1, 16, 16)
        assert state.conv_shape == (48, 3)  # [q | k | v] of one head
        shapes = result["shapes"]
        assert shapes["model.layers.0.self_attn.A_log"] == (1, 1, 1, 1)
        assert shapes["model.layers.2.self_attn.kv_b_proj.weight"] == (2 * (16 + 12), 24)  # 2 of 4 heads
        assert shapes["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] == (24 + 8, 48)  # replicated
        assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (3, 48, 48)  # 3 of 6 experts

