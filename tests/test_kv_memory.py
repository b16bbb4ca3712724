"""The KV pool takes memory as its blocks are written, not all at load (issue 34): a pool sized
for the longest workload (a quarter of RAM by default) must not grow the process by that much
before the first token."""

import os

from layerzoo import LLM, SamplingParams
from layerzoo.runtime import kv_pool


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_big_kv_pool_costs_what_its_sequences_write():
    before = rss_mib()
    llm = LLM(kv_cache_memory=1 << 30, max_num_seqs=256)  # the embedded model; 1 GiB of blocks
    pool = llm.engine.runner.kv
    assert pool.nbytes >= 1000 << 20
    assert rss_mib() - before < 512, "the KV pool's pages were all touched at load"
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    assert rss_mib() - before < 512


def test_lazily_taken_zeros_are_zeros_of_the_asked_dtype():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = kv_pool.zeros_as_written((3, 16, 2, 8), dtype, "cpu")
        assert t.shape == (3, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
        assert not t.float().any()
        t[1, 3] = 1  # writable, and writes land where they should
        assert t.float().sum() == 16
