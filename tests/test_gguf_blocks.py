"""GGUF weights kept in their block formats (the default on CPU): which modules keep them, that they
hold exactly the file's values, that the model takes about the file's size, and that greedy tokens
follow transformers' (which dequantizes) up to ties within the activations' rounding."""

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from layerzoo import LLM, SamplingParams  # noqa: E402
from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.kernels.gguf_matmul import cpu as gguf_cpu  # noqa: E402
from layerzoo.layers.gguf_linear import GGUFEmbedding, GGUFLinear  # noqa: E402
from layerzoo.loading.gguf_loading import GGUFModel  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402
from layerzoo.testing.gguf_files import byte_level_bpe, write_gguf  # noqa: E402

if not gguf_cpu.available():
    pytest.skip("the C++ kernels are not built here: GGUF weights are dequantized at load", allow_module_level=True)

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, intermediate_size=96)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                              tie_word_embeddings=True),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CASES = [("qwen3", "Q8_0"), ("qwen3", "Q4_1"), ("llama", "Q4_0"), ("llama", "Q5_1"), ("qwen2", "Q5_0")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, qtype) -> (gguf path, transformers model loaded from it)."""
    root = tmp_path_factory.mktemp("gguf-blocks")
    tokenizer = byte_level_bpe(VOCAB)
    out = {}
    for arch, qtype in CASES:
        if arch == "llama":
            pytest.importorskip("layerzoo_llama", reason="the Llama plugin (examples/layerzoo-llama) is not installed")
        torch.manual_seed(len(out))
        model = getattr(transformers, HF_CLASSES[arch])(CONFIGS[arch]())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
        model.save_pretrained(root / f"{arch}-src")
        folder = root / f"{arch}-{qtype}"
        folder.mkdir()
        path = write_gguf(folder / "model.gguf", root / f"{arch}-src", qtype=qtype, tokenizer=tokenizer)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
        out[(arch, qtype)] = (path, hf.eval())
    return out


def ids(cases):
    return [f"{a}-{q}" for a, q in cases]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_block_weights_are_kept_and_hold_the_files_values(files, case):
    path, hf = files[case]
    model = load_model(path).model
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert linears and not any(type(m) is nn.Linear for m in model.modules())
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    embed = model.model.embed_tokens
    assert isinstance(embed, GGUFEmbedding)
    if hf.config.tie_word_embeddings:
        assert model.lm_head.weight is embed.weight  # one copy of the blocks
    theirs = hf.state_dict()
    checkpoint = GGUFModel.open(path).checkpoint()
    # every kept weight, dequantized, is transformers' tensor exactly (q/k row order undone for Llama)
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear) and not name.endswith(("qkv", "gate_up")):
            torch.testing.assert_close(module.dequantized_weight(), theirs[f"{name}.weight"], atol=0, rtol=0, msg=name)
    attn = model.layers[0].self_attn
    if attn.qkv is not None:  # q, k and v in one block type: fused by rows of blocks
        want = torch.cat([checkpoint.get(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
        torch.testing.assert_close(attn.qkv.dequantized_weight(), want, atol=0, rtol=0)
    rows = torch.tensor([5, 0, 5, VOCAB - 1])
    torch.testing.assert_close(embed(rows), theirs["model.embed_tokens.weight"][rows], atol=0, rtol=0)


def test_the_model_takes_about_the_files_size(files):
    path, _ = files[("qwen3", "Q4_1")]
    blocks = load_model(path).model
    dense = load_model(path, EngineArgs(dtype="float32")).model

    def nbytes(model):
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
                   if t.device.type == "cpu")

    # the rotary tables and norms are the only fp32 tensors besides the blocks
    assert nbytes(blocks) <= 1.1 * path.stat().st_size + 64 * 1024, (nbytes(blocks), path.stat().st_size)
    assert nbytes(dense) > 4 * nbytes(blocks)


def test_an_explicit_dtype_dequantizes(files):
    path, _ = files[("qwen3", "Q8_0")]
    model = load_model(path, EngineArgs(dtype="float32")).model
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_greedy_tokens_follow_transformers_up_to_near_ties(files, case):
    """Our greedy continuation equals transformers' until a step where transformers' own top two
    logits lie within the activations' rounding of each other (then both choices are right)."""
    path, hf = files[case]
    llm = LLM(str(path), max_num_batched_tokens=16)  # chunked prefill, then GEMV decode steps
    prompts = [llm.tokenizer.encode(t) for t in ("Hello world", "What is the capital of France?", "don't won't 1234")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        logits = hf_logits(hf, prompt + ours)
        for step, token in enumerate(ours):
            row = logits[len(prompt) + step - 1]
            best = int(row.argmax())
            if token != best:
                margin = float(row[best] - row[token])
                assert margin <= 0.02 * float(row.abs().max()), (case, step, token, best, margin)
                break


def _decode(llm, n=8):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=2)
    return [(list(r.outputs[0].token_ids), r.outputs[0].logprobs)
            for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _plans(llm):
    return [layer.__dict__.get("_decode_plan") for layer in llm.engine.runner.model.layers]


def test_decode_steps_of_block_weights_run_the_fused_layer_call_bitwise(files, monkeypatch):
    """GGUF linears answer `fused_part` with their blocks, so a plain layer's decode step is one C++
    call (on any CPU with the kernels, AVX2 included) making the same GEMV calls as the op-by-op
    path: the same tokens and logprobs, bitwise. A method that answers None keeps every layer op by op."""
    from layerzoo.layers import fused_decode

    path, _ = files[("qwen3", "Q4_1")]
    kwargs = dict(max_num_seqs=4, max_model_len=64)
    fused = LLM(str(path), **kwargs)
    got = _decode(fused)
    plans = _plans(fused)
    assert all(p is not None for p in plans) and all(p.runs[0] > 0 for p in plans)
    assert {t.dtype for p in plans for t in p.weights if t is not None} == {torch.uint8}

    monkeypatch.setenv(fused_decode.ENV, "0")
    python = LLM(str(path), **kwargs)
    assert _decode(python) == got
    assert all(p is None for p in _plans(python))

    monkeypatch.delenv(fused_decode.ENV)
    monkeypatch.setattr(GGUFLinear, "fused_part", lambda self: None)
    asked = LLM(str(path), **kwargs)
    assert _decode(asked) == got
    assert all(p is None for p in _plans(asked))


def test_projections_kept_apart_by_their_formats_fuse_in_the_layer_call(tmp_path, monkeypatch):
    """q/k in one type and v in another (as llama.cpp's Q4_K_M mixes do) stay three linears; the
    fused decode call runs them side by side and concatenates, bitwise the op-by-op path."""
    from layerzoo.layers import fused_decode

    torch.manual_seed(7)
    model = transformers.Qwen3ForCausalLM(CONFIGS["qwen3"]())
    model.save_pretrained(tmp_path / "src")
    path = write_gguf(tmp_path / "mixed.gguf", tmp_path / "src", qtype="Q4_1", tokenizer=byte_level_bpe(VOCAB),
                      qtypes={"attn_v": "Q8_0", "ffn_up": "Q4_0"})
    kwargs = dict(max_num_seqs=4, max_model_len=64)
    fused = LLM(str(path), **kwargs)
    attn, mlp = fused.engine.runner.model.layers[0].self_attn, fused.engine.runner.model.layers[0].mlp
    assert attn.qkv is None and mlp.gate_up is None  # kept apart
    got = _decode(fused)
    plans = _plans(fused)
    assert all(p is not None and p.runs[0] > 0 for p in plans)
    assert plans[0].linears[0] == 3 and len(plans[0].weights) == 7 * 3  # q, k, v | o | gate, up | down

    monkeypatch.setenv(fused_decode.ENV, "0")
    assert _decode(LLM(str(path), **kwargs)) == got


@pytest.mark.parametrize("qtype", [3, 12, 14], ids=["Q4_1", "Q4_K", "Q6_K"])
def test_a_linear_runs_the_gemv_for_few_rows_and_the_gemm_for_more(qtype):
    """Up to GEMV_ROWS rows the C++ GEMV, more (a prefill) the C++ GEMM, bitwise each op's answer
    (a [B, T, in] input included); both are the reference's math (int16 activations, int8 for Q4_K
    and Q6_K)."""
    from layerzoo.kernels.gguf_matmul import reference
    from layerzoo.layers import gguf_linear
    from layerzoo.testing.gguf_blocks import make_blocks

    k, n = 512, 70
    linear = GGUFLinear(k, n, qtype, bias=True)
    linear.weight = nn.Parameter(make_blocks(qtype, n, k, seed=qtype), requires_grad=False)
    linear.bias = nn.Parameter(torch.randn(n), requires_grad=False)
    gen = torch.Generator().manual_seed(qtype)
    for rows, op in ((1, gguf_cpu.gguf_gemv), (gguf_linear.GEMV_ROWS, gguf_cpu.gguf_gemv),
                     (gguf_linear.GEMV_ROWS + 1, gguf_cpu.gguf_gemm), (100, gguf_cpu.gguf_gemm)):
        x = torch.randn(rows, k, generator=gen)
        got = linear(x)
        assert torch.equal(got, op(x, linear.weight, qtype, k, linear.bias)), rows
        want = reference.gguf_matmul(x, linear.weight, qtype, k, linear.bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    x = torch.randn(3, 11, k, generator=gen)
    assert torch.equal(linear(x), gguf_cpu.gguf_gemm(x.reshape(33, k), linear.weight, qtype, k, linear.bias).view(3, 11, n))
