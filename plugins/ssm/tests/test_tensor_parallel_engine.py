"""Tensor parallelism on a Gated DeltaNet hybrid (Qwen3.5 text), CPU, gloo, 2 ranks: the same
greedy tokens as one process through chunked prompts, preemption, state-snapshot prefix hits and
n-gram speculation (per-draft states, the accepted one kept), and worker state pools that stay
identical to rank 0's. One engine of each kind, shared by the tests."""

from __future__ import annotations

import multiprocessing

import pytest

from layerzoo import LLM
from layerzoo.testing.parity import assert_same_greedy, engine_paths_workload, greedy_tokens

# 12 KV blocks of 16 tokens (128 bytes a token) after the state pool's 238272 bytes: a batch of
# six preempts.
ENGINE = dict(
    dtype="float32", max_model_len=128, kv_cache_memory=238272 + 12 * 16 * 128, max_num_batched_tokens=40,
    max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False},
)
# The cache budget is per rank. A rank holds half the state (119136 bytes) but, with one KV head
# replicated on both ranks, the whole 128 bytes a token of KV: this budget leaves each rank the
# single process's 12 blocks, so both runs preempt and hit snapshots alike.
TP_ENGINE = {**ENGINE, "kv_cache_memory": 238272 // 2 + 12 * 16 * 128}


@pytest.fixture(scope="module")
def runs(qwen3_5_tiny):
    path, hf_model = qwen3_5_tiny
    first, second = engine_paths_workload(hf_model.config.vocab_size)
    single = LLM(path, **ENGINE)
    expected = greedy_tokens(single, first) + greedy_tokens(single, second)
    with LLM(path, tensor_parallel_size=2, **TP_ENGINE) as tp:
        got = greedy_tokens(tp, first) + greedy_tokens(tp, second)
        digests = tp.engine.executor.digests()
        stats = tp.stats
    return dict(single=single, prompts=first + second, expected=expected, got=got, digests=digests, stats=stats)


def test_two_ranks_give_one_process_greedy_tokens(runs):
    stats, single = runs["stats"], runs["single"].stats
    assert stats.preemptions > 0 and stats.state_snapshot_hits > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # rejected drafts: a per-draft state kept
    assert (stats.preemptions, stats.state_snapshot_hits) == (single.preemptions, single.state_snapshot_hits)
    assert_same_greedy(runs["single"].engine.model, runs["prompts"], runs["expected"], runs["got"])
    assert multiprocessing.active_children() == []


def test_worker_state_pool_mirrors_rank_0(runs):
    """Snapshots, restores, per-draft captures and kept drafts all come from the plans (and the
    kept rows from the next message): the worker's state slots hold what rank 0's do."""
    rank0, rank1 = runs["digests"]
    assert rank0["state_written"] == rank1["state_written"] and any(rank0["state_written"])
    assert rank0["kv_written"] == rank1["kv_written"]
    if rank0["weights"] == rank1["weights"]:  # replicated layers: the values too
        assert rank0["state_values"] == rank1["state_values"]
        assert rank0["kv_values"] == rank1["kv_values"]
