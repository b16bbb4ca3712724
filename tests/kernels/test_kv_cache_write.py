"""``kv_cache_write``: the C++ kernel stores what the index_copy_ reference stores (fp32 and bf16,
strided value rows, shuffled slots), refuses slots outside the cache, and is what the KV pool writes
through on CPU (the same tokens with the reference)."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build
from layerzoo.kernels.kv_cache_write import cpp, reference

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _library_loaded():
    assert cpp_build.available(), cpp_build.why_unavailable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,hkv,d", [(1, 8, 128), (5, 2, 17), (13, 1, 64)])
def test_stores_what_the_reference_stores(dtype, t, hkv, d):
    g = torch.Generator().manual_seed(t * 31 + d)
    blocks, block_size = 6, 4
    qkv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)
    k = qkv[:, : hkv * d].view(t, hkv, d).contiguous()
    v = qkv[:, 2 * hkv * d :].view(t, hkv, d)  # a strided slice, as the fused projection leaves it
    slots = torch.randperm(blocks * block_size, generator=g)[:t]
    caches = [torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    reference.kv_cache_write(k, v, *expect, slots)
    cpp.kv_cache_write(k, v, *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, expect))
    flat = caches[1].view(-1, hkv, d)
    assert torch.equal(flat[slots], v)


def test_refusals():
    cache = torch.zeros(2, 4, 1, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache's 8"):
        torch.ops.layerzoo_cpu.kv_cache_write(k, k, cache, cache.clone(), torch.tensor([8]))
    with pytest.raises(KernelUnsupported):  # a cast: the reference does it
        cpp.kv_cache_write(k.bfloat16(), k.bfloat16(), cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="of the cache's dtype"):
        torch.ops.layerzoo_cpu.kv_cache_write(k.double(), k, cache, cache.clone(), torch.tensor([0]))


def test_the_kv_pool_writes_through_it_and_generates_the_same_with_the_reference(tiny_qwen3_dir, monkeypatch):
    from layerzoo import LLM, SamplingParams
    from layerzoo.plugins.kernel_registry import KernelOp
    from layerzoo.testing import generate_counting_ops

    llm = LLM(tiny_qwen3_dir, max_num_seqs=2, max_model_len=64)
    layers = llm.engine.runner.model.config.num_hidden_layers
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5]}, {"prompt_token_ids": [9, 2, 6]}]

    def run():
        return generate_counting_ops(llm, prompts, params, "layerzoo_cpu::kv_cache_write", "aten::index_copy_")

    with_kernel, writes, copies = run()
    assert writes >= 5 * layers and copies == 0
    monkeypatch.setattr(llm.engine.runner.kv, "_write", KernelOp("kv_cache_write", {"torch": reference.kv_cache_write}))
    without, writes, copies = run()
    assert writes == 0 and copies >= 2 * 5 * layers
    assert without == with_kernel
