"""GLM-5 (MLA + DSA indexer, MoE) split over 2 tensor-parallel ranks (CPU processes, gloo), without
the engine: MLA heads split with the latent and indexer-key cache replicated, the indexer
replicated, experts split; every rank gets the single-process logits over prefill chunks and
decode steps."""

import torch

from layerzoo.loading.model_loading import load_model
from layerzoo.testing.distributed import run_on_ranks, step_logits

PREFILL = "layerzoo.testing.distributed:prefill_on_rank"
DECODES = 3  # then one-row decode steps
CHUNKS = [17, 8]  # past index_topk (8): the selection decides


def test_glm5_on_two_ranks_matches_single_process(glm_tiny):
    path, hf = glm_tiny
    ids = torch.randint(0, hf.config.vocab_size, (sum(CHUNKS) + DECODES,), generator=torch.Generator().manual_seed(6)).tolist()
    single = load_model(path).model
    expected = step_logits(single, ids[: sum(CHUNKS)], CHUNKS, ids[sum(CHUNKS) :])
    results = run_on_ranks(PREFILL, str(path), ids[: sum(CHUNKS)], CHUNKS, False, ids[sum(CHUNKS) :], world_size=2)
    for rank, result in enumerate(results):
        # fp32; partial sums reduced in another order
        torch.testing.assert_close(result["logits"], expected, atol=5e-4, rtol=0, msg=f"rank {rank}")
        assert result["kv_specs"] == single.kv_cache_specs()  # latents and indexer keys: replicated
        shapes = result["shapes"]
        assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (2 * 24, 16)  # 2 of 4 heads
        assert shapes["model.layers.1.mlp.experts.down_proj"] == (3, 48, 24)  # 3 of 6 experts
        assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (12, 48)


def test_glm5_engine_on_two_ranks_gives_one_process_greedy_tokens(glm_tiny):
    """The whole engine with prompts past index_topk: batched, chunked, prefix hits over the replicated
    indexer-key rows, n-gram drafts verified."""
    from layerzoo.testing.parity import tensor_parallel_engine_parity

    path, hf = glm_tiny
    stats = tensor_parallel_engine_parity(
        path, hf.config.vocab_size, dtype="float32", max_model_len=128, max_num_batched_tokens=40, max_num_seqs=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False},
    )
    assert stats.prefix_cache_hits > 0 and stats.spec_draft_tokens > 0
