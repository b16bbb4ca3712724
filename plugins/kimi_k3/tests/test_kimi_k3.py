"""The Kimi K3 text model against the plain-torch reference in ``k3_reference.py``: logits over
chunked prefills, greedy tokens batched and chunked with prefix hits and speculation, MXFP4
experts quantised here and kept packed (the dequantised checkpoint's greedy tokens), and the
refusals (image inputs, other quantisations)."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerzoo import LLM, SamplingParams
from layerzoo.errors import ConfigError, UserError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits, write_word_tokenizer

_spec = importlib.util.spec_from_file_location("k3_reference", Path(__file__).with_name("k3_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

MEDIA = 96
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def write_k3(path: Path, text: dict, seed=0, **top) -> dict:
    weights = ref.random_checkpoint(text, seed)
    weights["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)  # skipped: the text model is served
    save_file(weights, str(path / "model.safetensors"))
    config = dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3", text_config=text,
                  vision_config={}, media_placeholder_token_id=MEDIA, tie_word_embeddings=False, **top)
    (path / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(path, text["vocab_size"])
    return weights


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3")
    text = ref.text_config()
    return path, ref.K3Reference(text, write_k3(path, text))


@pytest.mark.parametrize("length,chunks", [(1, [1]), (11, [11]), (40, [17, 1, 22])])
def test_logits_match_the_reference(k3, length, chunks):
    path, model = k3
    ids = [random.Random(length).randrange(MEDIA) for _ in range(length)]
    with torch.no_grad():
        expected = model.logits(ids)
    torch.testing.assert_close(prefill_logits(load_model(path).model, torch.tensor(ids), chunks), expected, atol=2e-4, rtol=0)


def test_greedy_matches_the_reference(k3):
    path, model = k3
    rng = random.Random(3)
    shared = [rng.randrange(MEDIA) for _ in range(40)]
    prompts = [shared + [1, 2, 3, 1, 2, 3], [rng.randrange(MEDIA) for _ in range(5)], shared + [7, 7, 7]]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=19, block_size=8, ssm_snapshot_interval=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "adaptive": False})
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)]
    outs += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)]
    assert outs == [model.greedy(p, GREEDY.max_tokens) for p in prompts]
    assert llm.stats.prefix_cache_hits > 0


def test_a_log_is_read_per_head_from_its_first_entries(k3):
    path, _ = k3
    model = load_model(path).model
    kda = model.layers[0].self_attn
    assert kda.A_log.shape == (8,) and kda.num_heads == 3  # stored padded to head_dim
    x = torch.randn(2, 32)
    with torch.no_grad():
        before = kda.gates(x)[0]
        kda.A_log[3:] += 5.0  # the padding is never read
        assert torch.equal(kda.gates(x)[0], before)
        kda.A_log[1] += 1.0  # a head's own entry is
        changed = kda.gates(x)[0]
    assert before.shape == (2, 3, 8)
    assert torch.equal(changed[:, 0], before[:, 0]) and not torch.equal(changed[:, 1], before[:, 1])
    assert (before > -5).all() and (before < 0).all()  # the lower-bounded gate lies in (-5, 0)


def test_image_inputs_are_refused(k3):
    path, _ = k3
    llm = LLM(path, dtype="float32")
    with pytest.raises(UserError, match="image inputs"):
        llm.generate([{"prompt_token_ids": [1, 2, MEDIA, 3]}], GREEDY)


# -- MXFP4 experts --------------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                       "weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
         "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*"]}


def quantize_mxfp4(w: torch.Tensor):
    """``w [out, in]`` → ``(packed [out, in/2], scale [out, in/32], dequantised w)``: per 32 input
    columns the smallest power of two that puts the group's absmax within 6, codes to nearest."""
    out, cols = w.shape
    groups = w.view(out, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / exponent.exp2()[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    code = code.view(out, cols).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    deq = (E2M1[code.long() & 7] * (1 - 2 * (code.long() >> 3))).view(out, cols // 32, 32) * exponent.exp2()[..., None]
    return packed, (exponent + 127).to(torch.uint8), deq.view(out, cols)


def write_k3_weights(path: Path, text: dict, tensors: dict) -> None:
    """A K3 checkpoint of ``tensors`` (as stored) at ``path``."""
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3", text_config=text,
                  media_placeholder_token_id=MEDIA, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(path, text["vocab_size"])


def write_mxfp4_k3(path: Path, text: dict, seed: int) -> dict:
    """An MXFP4 K3 checkpoint (experts quantised here) at ``path``; returns the dequantised weights."""
    weights = ref.random_checkpoint(text, seed=seed)
    stored = {}
    for name, w in weights.items():
        if ".experts." in name:
            packed, scale, weights[name] = quantize_mxfp4(w)
            stored[name.replace(".weight", ".weight_packed")] = packed
            stored[name.replace(".weight", ".weight_scale")] = scale
        else:
            stored[name] = w
    write_k3_weights(path, text, stored)
    return weights


MXFP4_TEXT = dict(routed_expert_hidden_size=32, moe_intermediate_size=32, quantization_config=MXFP4)


def test_mxfp4_experts_stay_packed(tmp_path):
    """The experts keep the checkpoint's uint8 codes and scales: 0.53 bytes a weight, 17/64 of
    bf16's (9,792 bytes a layer here against 36,864 in bf16, 73,728 in fp32), and the model
    computes the dequantised weights' logits."""
    text = ref.text_config(**MXFP4_TEXT)
    weights = write_mxfp4_k3(tmp_path, text, seed=5)
    model = load_model(tmp_path).model
    experts = model.layers[1].mlp.experts
    assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
    tensors = dict(experts.named_parameters())
    assert sorted(tensors) == ["down_packed", "down_scale", "gate_up_packed", "gate_up_scale"]
    assert all(t.dtype == torch.uint8 for t in tensors.values())
    E, L, I = text["num_experts"], text["routed_expert_hidden_size"], text["moe_intermediate_size"]
    stored_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert stored_bytes == 9792 and stored_bytes * 64 == 17 * (E * 3 * I * L * 2)  # bf16: 2 bytes a weight
    w1 = weights["language_model.model.layers.1.block_sparse_moe.experts.4.w1.weight"]
    from layerzoo.kernels.mxfp4_matmul.reference import dequantize

    assert torch.equal(dequantize(experts.gate_up_packed[4, 0], experts.gate_up_scale[4, 0]), w1)  # the codes as stored
    reference = ref.K3Reference(text, weights)  # the reference runs the dequantised weights
    ids = [random.Random(9).randrange(MEDIA) for _ in range(23)]
    with torch.no_grad():
        torch.testing.assert_close(prefill_logits(model, torch.tensor(ids), [23]), reference.logits(ids), atol=2e-4, rtol=0)


def test_mxfp4_greedy_tokens_equal_the_dequantised_checkpoints(tmp_path, monkeypatch):
    """Greedy tokens of the packed experts (C++ GEMV at decode, dequantize + GEMM for experts with
    more than 4 prefill rows here) equal those of the same weights stored dequantised in fp32 (the
    old load path), batched and chunked."""
    from layerzoo.kernels.mxfp4_matmul import cpu

    monkeypatch.setattr(cpu, "GEMV_ROWS", 4)
    text = ref.text_config(**MXFP4_TEXT, num_experts=8, num_experts_per_token=3)
    packed_dir, plain_dir = tmp_path / "mxfp4", tmp_path / "fp32"
    packed_dir.mkdir(), plain_dir.mkdir()
    weights = write_mxfp4_k3(packed_dir, text, seed=11)
    write_k3_weights(plain_dir, {k: v for k, v in text.items() if k != "quantization_config"}, weights)
    rng = random.Random(4)
    prompts = [[rng.randrange(MEDIA) for _ in range(n)] for n in (1, 6, 29)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def greedy(path):
        llm = LLM(path, dtype="float32", max_num_batched_tokens=16, block_size=8)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    assert greedy(packed_dir) == greedy(plain_dir)
    from layerzoo.kernels import cpp_build
    from layerzoo.plugins.ops import kernel

    op = kernel("mxfp4_expert_matmul")
    if cpp_build.available():  # the C++ kernels ran, none fell back to torch
        assert op.native("cpu") and not op.fallbacks


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "fp8 / None is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "compressed-tensors / nvfp4-pack-quantized"),
    ({**MXFP4, "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 16}}}}, "group_size 32"),
])
def test_other_quantisations_are_refused_by_name(tmp_path, quantization, message):
    write_k3(tmp_path, ref.text_config(quantization_config=quantization))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path)


@pytest.mark.parametrize("overrides, engine", [
    (dict(attn_res_block_size=1, first_k_dense_replace=2), dict(mla_prefill="local")),
    (dict(attn_res_block_size=4, num_hidden_layers=5, linear_attn_config=dict(
        num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        kda_layers=[2, 3, 5], full_attn_layers=[1, 4]), q_lora_rank=None), dict(max_num_batched_tokens=9)),
])
def test_other_shapes_match_the_reference(tmp_path, overrides, engine):
    """Other AttnRes block sizes, layer layouts (MLA first), a plain q_proj, chunk-local MLA prefill."""
    text = ref.text_config(**overrides)
    model = ref.K3Reference(text, write_k3(tmp_path, text, seed=2))
    prompts = [[(i * 5 + 1) % MEDIA for i in range(30)], [3, 1, 4, 1, 5]]
    llm = LLM(tmp_path, dtype="float32", **engine)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert outs == [model.greedy(p, GREEDY.max_tokens) for p in prompts]
