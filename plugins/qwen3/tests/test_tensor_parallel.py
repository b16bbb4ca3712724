"""Qwen3, Qwen3-MoE and Qwen2 split over 2 tensor-parallel ranks (CPU processes, gloo), without the
engine: each rank loads its shard through the loader, prefills the same tokens in two chunks and decodes
three more one step each; the logits every
rank gets equal the single-process model's, and each rank holds only its share of the weights."""

import pytest
import torch

from layerzoo.loading.model_loading import load_model
from layerzoo.testing import write_word_tokenizer
from layerzoo.testing.distributed import run_on_ranks, step_logits

transformers = pytest.importorskip("transformers")

PREFILL = "layerzoo.testing.distributed:prefill_on_rank"
DECODES = 3  # then one-row decode steps
CHUNKS = [13, 8]  # two chunks: the second attends over the first's cached KV


def tokens(vocab):
    return torch.randint(0, vocab, (sum(CHUNKS) + DECODES,), generator=torch.Generator().manual_seed(3)).tolist()


def check_ranks_match_single_process(path, vocab, *, pack=True):
    """The 2-rank logits on both ranks against one process's; returns the ranks' results."""
    ids = tokens(vocab)
    expected = step_logits(load_model(path).model, ids[: sum(CHUNKS)], CHUNKS, ids[sum(CHUNKS) :])
    results = run_on_ranks(PREFILL, str(path), ids[: sum(CHUNKS)], CHUNKS, pack, ids[sum(CHUNKS) :], world_size=2)
    for rank, result in enumerate(results):
        assert result["logits"].shape == (sum(CHUNKS) + DECODES, vocab), rank
        torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
    return results


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory, qwen3_tiny):
    root = tmp_path_factory.mktemp("qwen3-tp")
    configs = {
        # 4 query and 2 KV heads: both split
        "dense": qwen3_tiny.dense_config(num_hidden_layers=2),
        # one KV head for 2 ranks (replicated), tied embeddings, a vocabulary that does not split evenly
        "kv1-tied": qwen3_tiny.dense_config(
            num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=97
        ),
        # 6 experts, 3 per rank, a dense layer in between
        "moe": qwen3_tiny.moe_config(num_hidden_layers=3, mlp_only_layers=[1]),
    }
    for name, config in configs.items():
        qwen3_tiny.save_tiny(root / name, config, seed=7)
    return {name: root / name for name in configs}


def test_dense_split_heads_match_single_process(qwen3_models):
    check_ranks_match_single_process(qwen3_models["dense"], 131)


def test_replicated_kv_head_tied_uneven_vocab_shards(qwen3_models):
    """Each rank holds half the query heads, the one KV head, half (rounded up) the vocabulary."""
    results = check_ranks_match_single_process(qwen3_models["kv1-tied"], 97, pack=False)
    for rank, result in enumerate(results):
        shapes = result["shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2 * 24, 48)  # 2 of 4 heads, head_dim 24
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (24, 48)  # the one KV head
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (48, 2 * 24)
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (36, 48)  # 72 / 2
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (48, 36)
        assert shapes["model.embed_tokens.weight"] == (49, 48)  # ceil(97 / 2), the tied head shares it
        assert "lm_head.weight" not in shapes
        assert shapes["model.norm.weight"] == (48,)  # replicated
        assert result["kv_specs"][0].num_kv_heads == 1 and result["kv_specs"][0].head_dim == 24


def test_moe_experts_split_across_ranks(qwen3_models):
    results = check_ranks_match_single_process(qwen3_models["moe"], 113, pack=False)
    for result in results:
        shapes = result["shapes"]
        assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (3, 40, 40)  # 3 of 6 experts, [2I, H]
        assert shapes["model.layers.0.mlp.experts.down_proj"] == (3, 40, 20)
        assert shapes["model.layers.0.mlp.gate.weight"] == (6, 40)  # the router sees every expert
        assert shapes["model.layers.1.mlp.gate_proj.weight"] == (32, 40)  # the dense layer splits
        # Qwen3-MoE's single KV head: one per rank, replicated
        assert result["kv_specs"][0].num_kv_heads == 1


def test_qwen2_qkv_biases_split(tmp_path):
    torch.manual_seed(5)
    config = transformers.Qwen2Config(
        vocab_size=101, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, config.vocab_size)
    check_ranks_match_single_process(tmp_path, 101)


def test_moe_engine_on_two_ranks_gives_one_process_greedy_tokens(qwen3_models):
    """The whole engine over the expert-split model: batched, chunked, prefix hits, n-gram drafts."""
    from layerzoo.testing.parity import tensor_parallel_engine_parity

    stats = tensor_parallel_engine_parity(
        qwen3_models["moe"], 113, dtype="float32", max_model_len=128, max_num_batched_tokens=40, max_num_seqs=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False},
    )
    assert stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
