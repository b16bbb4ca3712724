"""Embeddings (`LLM.embed`): pooled final hidden states equal transformers' ``last_hidden_state``
pooled the same way, for a Qwen3ForCausalLM checkpoint and a bare ``Qwen3Model`` one (Qwen3-Embedding's
layout), last and mean pooling, prompts of several lengths in one call, one longer than a step's
token budget (chunked prefill)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.errors import UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.testing import write_word_tokenizer  # noqa: E402

VOCAB = 97
BUDGET = 16  # max_num_batched_tokens: the 40-token prompt runs in three chunks
LENGTHS = (1, 5, 13, 40)


def tiny_config():
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.25,
    )


def save(path, cls):
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "eager"
    cls(config).eval().save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    return {
        "causal": save(root / "causal", transformers.Qwen3ForCausalLM),
        "bare": save(root / "bare", transformers.Qwen3Model),
    }


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def reference(model_dir, ids: list[int], method: str, normalize: bool = True) -> torch.Tensor:
    """transformers: ``AutoModel(dir)(ids).last_hidden_state`` pooled, L2-normalised."""
    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[-1] if method == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def llms(checkpoints):
    out = {name: LLM(str(path), max_num_batched_tokens=BUDGET, block_size=8) for name, path in checkpoints.items()}
    yield out
    for llm in out.values():
        llm.shutdown()


@pytest.mark.parametrize("name", ["causal", "bare"])
@pytest.mark.parametrize("method", ["last", "mean"])
def test_embeddings_equal_transformers(llms, checkpoints, prompts, name, method):
    llm = llms[name]
    outs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], pooling=method)
    assert [o.prompt_token_ids for o in outs] == prompts
    for ids, out in zip(prompts, outs):
        got = torch.tensor(out.outputs.embedding)
        want = reference(checkpoints[name], ids, method)
        assert got.shape == (32,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert abs(got.norm().item() - 1) < 1e-5
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.engine.blocks.num_free_blocks() == llm.engine.blocks.num_blocks  # every block given back


def test_unnormalized_and_text(llms, checkpoints):
    llm = llms["causal"]
    (out,) = llm.embed("t3 t9 t27 t4", pooling="mean", normalize=False)
    want = reference(checkpoints["causal"], [3, 9, 27, 4], "mean", normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, rtol=1e-5, atol=1e-5)
    assert out.prompt == "t3 t9 t27 t4" and out.finished


def test_long_prompt_is_chunked(llms, prompts):
    """The 40-token prompt runs in several steps of at most BUDGET tokens (and still matches above)."""
    llm = llms["causal"]
    steps = llm.engine.stats.steps
    llm.embed({"prompt_token_ids": prompts[-1]}, pooling="mean")
    assert llm.engine.stats.steps - steps >= -(-len(prompts[-1]) // BUDGET)


def test_embedding_beside_generation(llms, checkpoints, prompts):
    """A pooling request shares steps with a generating one; neither disturbs the other."""
    from layerzoo.sampling import SamplingParams

    llm = llms["causal"]
    engine = llm.engine
    engine.add_request("gen", prompts[2], SamplingParams(max_tokens=6, ignore_eos=True))
    (seq,) = engine.add_pooling_request("emb", prompts[3], engine.default_pooling())
    engine.run_until_done()
    torch.testing.assert_close(torch.tensor(seq.pooled.embedding()), reference(checkpoints["causal"], prompts[3], "last"),
                               rtol=1e-5, atol=1e-5)
    assert len(engine.release("gen")[0].output_token_ids) == 6
    engine.release("emb")


def test_default_pooling_is_the_models(llms):
    assert llms["bare"].engine.default_pooling().method == "last"
    assert llms["bare"].loaded.architecture == "Qwen3Model"


def test_embedding_model_refuses_to_generate(llms):
    with pytest.raises(UserError, match="prompt 0: Qwen3Model is an embedding model .*cannot generate; use LLM.embed"):
        llms["bare"].generate("t1 t2")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"pooling": "cls"}, "pooling: expected one of 'last', 'mean', got 'cls'"),
     ({"normalize": 1}, "normalize: expected True or False")],
)
def test_bad_pooling_arguments(llms, kwargs, match):
    with pytest.raises(UserError, match=match):
        llms["causal"].embed("t1", **kwargs)


def test_empty_prompt_is_named(llms):
    with pytest.raises(UserError, match="prompt 1: the prompt has no tokens"):
        llms["causal"].embed([{"prompt_token_ids": [1]}, {"prompt_token_ids": []}])
    assert not llms["causal"].engine.requests


def test_mean_pooling_through_preemption(checkpoints, prompts):
    """A decode that needs a block preempts a pooling request mid-prompt (the KV cache holds 6
    blocks of 8 tokens); its recompute adds no row twice, so the mean still equals transformers'."""
    from layerzoo.runtime.pooling import PoolingParams
    from layerzoo.sampling import SamplingParams

    llm = LLM(str(checkpoints["causal"]), max_num_batched_tokens=BUDGET, block_size=8, max_model_len=40,
              kv_cache_memory=6 * 8 * 256, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.blocks.num_blocks == 6
    engine.add_request("gen", prompts[-1][:15], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()  # decoding now
    pooled = prompts[-1][:30]
    (seq,) = engine.add_pooling_request("emb", pooled, PoolingParams("mean"))
    engine.run_until_done()
    assert seq.num_preemptions > 0 and len(engine.release("gen")[0].output_token_ids) == 20
    torch.testing.assert_close(torch.tensor(seq.pooled.embedding()), reference(checkpoints["causal"], pooled, "mean"),
                               rtol=1e-5, atol=1e-5)


def test_qwen3_embedding_layout(tmp_path, checkpoints):
    """Qwen3-Embedding's own layout: config.json names Qwen3ForCausalLM over a bare-decoder checkpoint
    (keys without ``model.``, no lm_head), and its tokenizer appends an end-of-text token to every
    text. It loads as the Qwen3Model embedder; text keeps the appended token, which last pooling reads."""
    import json
    import shutil

    from tokenizers import Tokenizer, processors

    path = tmp_path / "qwen3-embedding"
    shutil.copytree(checkpoints["bare"], path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = VOCAB - 1  # stands for <|endoftext|>
    tok.post_processor = processors.TemplateProcessing(single=f"$A t{eos}", special_tokens=[(f"t{eos}", eos)])
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(str(path))
    assert llm.loaded.architecture == "Qwen3Model"
    (out,) = llm.embed("t3 t9 t27")
    assert out.prompt_token_ids == [3, 9, 27, eos]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(checkpoints["bare"], [3, 9, 27, eos], "last"),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="embedding model"):
        llm.generate("t1")


def test_async_encode(checkpoints):
    """AsyncLLM.encode (vLLM's name): one finished output, the embedding, and nothing before it."""
    import asyncio

    from layerzoo.entrypoints.async_llm import AsyncLLM

    llm = LLM(str(checkpoints["bare"]))
    engine = AsyncLLM.from_engine(llm.engine, llm.tokenizer)

    async def run():
        return [out async for out in engine.encode({"prompt_token_ids": [5, 6, 7, 8]})]

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(outs) == 1 and outs[0].finished and not llm.engine.requests
    torch.testing.assert_close(torch.tensor(outs[0].outputs.embedding), reference(checkpoints["bare"], [5, 6, 7, 8], "last"),
                               rtol=1e-5, atol=1e-5)


def test_prefix_cache_serves_last_but_not_mean(llms, checkpoints, prompts):
    """Last pooling reads one row: a repeated prompt reuses its cached blocks and runs only its tail.
    Mean pooling needs every row: it matches no cached prefix."""
    llm = llms["causal"]
    ids = prompts[-1][::-1]
    llm.embed({"prompt_token_ids": ids}, pooling="last")
    hits = llm.engine.blocks.prefix_hits
    (again,) = llm.embed({"prompt_token_ids": ids}, pooling="last")
    assert llm.engine.blocks.prefix_hits > hits
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), reference(checkpoints["causal"], ids, "last"),
                               rtol=1e-5, atol=1e-5)
    hits = llm.engine.blocks.prefix_hits
    (mean,) = llm.embed({"prompt_token_ids": ids}, pooling="mean")
    assert llm.engine.blocks.prefix_hits == hits
    torch.testing.assert_close(torch.tensor(mean.outputs.embedding), reference(checkpoints["causal"], ids, "mean"),
                               rtol=1e-5, atol=1e-5)
