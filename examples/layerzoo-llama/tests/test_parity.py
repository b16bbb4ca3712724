"""Llama and Mistral through layerzoo-llama against transformers: logits, batched greedy decoding,
chunked prefill and prefix-cache hits on tiny random checkpoints."""

import ast
import random
from pathlib import Path

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.errors import ConfigError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits

NAMES = ["llama", "llama-bias-tied", "llama3-rope", "mistral"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_architectures_served_by_the_plugin(tiny_models):
    assert load_model(tiny_models["llama"][0]).plugin == "llama"
    assert load_model(tiny_models["mistral"][0]).architecture == "MistralForCausalLM"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length,chunks", [(1, [1]), (40, [16, 16, 8]), (70, [33, 37])])
def test_logits_match_transformers(tiny_models, name, length, chunks):
    path, hf_model = tiny_models[name]
    model = load_model(path).model
    ids = torch.randint(0, hf_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks), expected, atol=1e-4, rtol=0)


def workload(vocab, seed=0):
    """6 requests of different lengths; half share a 24-token prefix, the last repeats one."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(24)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for i in range(5)]
    return prompts + [list(prompts[1])]


@pytest.fixture(scope="module")
def expected(tiny_models):
    """name -> (prompts, transformers' greedy continuation of each)."""
    out = {}
    for name in NAMES:
        hf_model = tiny_models[name][1]
        prompts = workload(hf_model.config.vocab_size)
        out[name] = (prompts, [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts])
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 13, "max_num_seqs": 3, "block_size": 8}], ids=["batched", "chunked-prefix"])
def test_greedy_matches_transformers(tiny_models, expected, name, engine_args):
    path = tiny_models[name][0]
    prompts, tokens = expected[name]
    llm = LLM(path, dtype="float32", **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    if engine_args:
        assert llm.stats.prefix_cache_hits > 0  # later requests reused the shared prefix


def test_tied_embeddings_share_storage(tiny_models):
    model = load_model(tiny_models["llama-bias-tied"][0]).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.layers[0].self_attn.o_proj.bias is not None


def test_mistral_sliding_window_refused_by_name(tmp_path, llama_tiny):
    llama_tiny.save_tiny(tmp_path, llama_tiny.mistral_config(sliding_window=64))
    with pytest.raises(ConfigError, match="sliding_window=64"):
        load_model(tmp_path)


def test_mistral_window_covering_the_context_is_full_attention(tmp_path, llama_tiny):
    hf_model = llama_tiny.save_tiny(tmp_path, llama_tiny.mistral_config(sliding_window=512), seed=3)
    prompt = list(range(3, 30))
    out = LLM(tmp_path, dtype="float32").generate({"prompt_token_ids": prompt}, GREEDY)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


def test_mlp_bias_refused_by_name(tmp_path, llama_tiny):
    llama_tiny.save_tiny(tmp_path, llama_tiny.llama_config(mlp_bias=True))
    with pytest.raises(ConfigError, match="mlp_bias"):
        load_model(tmp_path)


def test_plugin_imports_only_public_core_names():
    """A third party's view of layerzoo: no underscore module or name, nothing of layerzoo.runtime."""
    package = Path(__file__).parents[1] / "layerzoo_llama"
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layerzoo."):
                parts = node.module.split(".")
                assert not any(p.startswith("_") for p in parts), f"{source.name}: {node.module}"
                assert parts[1] != "runtime", f"{source.name}: {node.module}"
                assert not any(a.name.startswith("_") for a in node.names), f"{source.name}: {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not any(p.startswith("_") for p in alias.name.split(".")), f"{source.name}: {alias.name}"
