"""quantization="int8": every linear's weights in int8 blocks of 32 inputs with one scale each (ggml's
Q8_0, run by the GGUF block kernels), activations quantized per 32 inputs by the decode GEMV and
exact in prefill, so the model stays close to fp32; and compressed-tensors int8 checkpoints
(W8A8 / W8A16) loaded into the same path."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.layers import gguf_linear
from layerzoo.layers.gguf_linear import GGUFLinear, quantize_q8_0
from layerzoo.layers.linear import pack_linears
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits


def test_q8_0_blocks_are_ggmls_own():
    """The blocks equal what ggml's reference quantizer (the gguf package's) makes, bit for bit,
    and dequantize to within half a block's step of the weight."""
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different magnitude
    w[5, :32] = 0  # an all-zero block
    w[6, 3] = 1000.0  # an outlier: only its own block's scale grows
    blocks = quantize_q8_0(w)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), want)
    layer = GGUFLinear(96, 37, gguf_linear.Q8_0)
    layer.weight = nn.Parameter(blocks, requires_grad=False)
    step = w.reshape(37, 3, 32).abs().amax(-1, keepdim=True) / 127
    err = (layer.dequantized_weight().reshape(37, 3, 32) - w.reshape(37, 3, 32)).abs()
    assert bool((err <= step * 0.57 + 1e-7).all())  # half a step, and the fp16 rounding of the scale
    assert float(err[6, 1:].max()) < 0.05  # the outlier's neighbours in other blocks keep their precision


def test_every_linear_is_quantized_and_a_tied_weight_is_kept():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64, bias=False), nn.Linear(64, 96))
    m.head = nn.Linear(64, 40, bias=False)
    m.head.weight = m[0].weight
    shared = m[0].weight
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = m[2](m[1](m[0](x)))
        assert pack_linears(m, {id(shared)}, "int8") == 3  # m[1] has 40 inputs: not whole blocks, kept
        out = m[2](m[1](m[0](x)))
    assert isinstance(m[0], GGUFLinear) and isinstance(m[2], GGUFLinear) and isinstance(m.head, GGUFLinear)
    assert m[2].weight.dtype == torch.uint8 and m[2].weight.shape == (96, 2 * 34)
    assert type(m[1]) is nn.Linear
    assert shared.dtype == torch.float32  # a tied weight keeps its float copy for its other user
    assert float((out - ref).norm() / ref.norm()) < 0.02


def test_engine_args_refuse_an_unknown_method():
    with pytest.raises(UserError, match="quantization: expected None or one of 'int8'"):
        EngineArgs(quantization="int4")


def linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, GGUFLinear))]


def test_the_model_quantizes_every_linear_and_stays_close_to_fp32(tiny_qwen3_dir):
    fp32 = load_model(tiny_qwen3_dir).model
    int8 = load_model(tiny_qwen3_dir, EngineArgs(quantization="int8")).model
    found = linears(int8.model)  # the decoder: every projection (fused q/k/v, gate/up, o, down)
    assert len(found) == 2 * 4  # 2 layers x (qkv, o_proj, gate_up, down_proj)
    for name, module in found + [("lm_head", int8.lm_head)]:
        if module.in_features % 32:  # the MLP's 48 inputs do not fill blocks: kept as they are
            assert name.endswith("down_proj") and type(module) is nn.Linear, name
        else:
            assert isinstance(module, GGUFLinear) and module.qtype == gguf_linear.Q8_0, name
    ids = [3, 17, 42, 8, 8, 60, 1, 2, 33, 12, 5]
    ref = prefill_logits(fp32, ids, [4, 7])
    out = prefill_logits(int8, ids, [4, 7])
    assert float((out - ref).norm() / ref.norm()) < 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_greedy_on_the_embedded_model_agrees_with_fp32():
    from layerzoo import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def read_config(path):\n"
    fp32 = LLM(None, dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    int8_llm = LLM(None, dtype="float32", quantization="int8")
    assert all(isinstance(m, GGUFLinear) for _, m in linears(int8_llm.engine.model))
    int8 = int8_llm.generate([prompt], params)[0].outputs[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(fp32, int8)) if a != b), len(fp32))
    assert same >= 16, (same, fp32, int8)  # a trained model's greedy path survives int8 blocks


def test_few_rows_run_the_gemv_and_many_rows_the_gemm(monkeypatch):
    """Decode rows go through the block GEMV, prefill rows through the block GEMM; both round each
    row's activations to int16 on their own (per 32 inputs), so an outlier row beside ordinary ones
    coarsens none of them and a row does not depend on its batch."""
    from layerzoo.kernels.gguf_matmul import cpu

    if not cpu.available():
        pytest.skip("the C++ kernels are not built here")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(96, 50))
    pack_linears(m, set(), "int8")
    layer = m[0]
    calls = []
    for name in ("gguf_gemv", "gguf_gemm"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda x, *a, _real=real, _name=name, **k: calls.append((_name, x.shape[0])) or _real(x, *a, **k))
    layer._gemv = None  # look the kernel module up again, through the spies
    x = torch.randn(gguf_linear.GEMV_ROWS + 1, 96)
    x[1] *= 500  # an outlier row beside ordinary ones
    exact = x @ layer.dequantized_weight().t() + layer.bias
    with torch.no_grad():
        many = layer(x)
        few = layer(x[:2])
        alone = layer(x[:1])
    assert calls == [("gguf_gemm", gguf_linear.GEMV_ROWS + 1), ("gguf_gemv", 2), ("gguf_gemv", 1)]
    assert torch.equal(few[0], alone[0]) and torch.equal(many[0], cpu.gguf_gemm(x[:1], layer.weight, 8, 96, layer.bias)[0])
    for got in (many, few):
        assert float((got[0] - exact[0]).norm() / exact[0].norm()) < 1e-3


# -- compressed-tensors ----------------------------------------------------------------------------


def write_compressed(src, dst, fmt="int-quantized", activations=True, scale_dtype=torch.bfloat16):
    """Quantize every decoder linear of ``src`` (a transformers checkpoint) the way llm-compressor
    stores W8A8 (``activations``) or W8A16: int8 ``weight`` + ``weight_scale [N, 1]`` + zero point."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            # Scales the checkpoint's dtype can hold exactly, so the test knows the int8 values.
            scale = (t.abs().amax(1, keepdim=True) / 127).to(scale_dtype)
            out[name] = torch.round(t / scale.float()).clamp(-127, 127).to(torch.int8)
            out[name[: -len("weight")] + "weight_scale"] = scale
            out[name[: -len("weight")] + "weight_zero_point"] = torch.zeros(t.shape[0], 1, dtype=torch.int8)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True} if activations else None,
        }},
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (dst / extra).write_bytes((src / extra).read_bytes())
    return out


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
def test_a_compressed_tensors_int8_checkpoint_loads_its_int8_weights(tiny_qwen3_dir, tmp_path, scheme):
    stored = write_compressed(tiny_qwen3_dir, tmp_path / scheme, "int-quantized" if scheme == "w8a8" else "naive-quantized",
                              activations=scheme == "w8a8")
    loaded = load_model(tmp_path / scheme).model  # no quantization asked: the checkpoint says int8
    attn = loaded.layers[0].self_attn
    assert isinstance(attn.qkv, GGUFLinear) and isinstance(loaded.layers[1].mlp.gate_up, GGUFLinear)

    def stored_weight(name):
        return stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"].float()

    qkv = torch.cat([stored_weight(f"model.layers.0.self_attn.{p}_proj") for p in "qkv"])
    # re-blocked by 32 inputs: within half a block's step (never coarser than the channel's)
    step = qkv.abs().reshape(qkv.shape[0], -1, 32).amax(-1, keepdim=True) / 127
    err = (attn.qkv.dequantized_weight() - qkv).abs().reshape(qkv.shape[0], -1, 32)
    assert bool((err <= step * 0.57 + 1e-7).all())  # half a step, and the fp16 rounding of the scale
    # And it computes what the original checkpoint computes, within int8 error.
    ids = [3, 17, 42, 8, 8, 60, 1, 2, 33]
    ref = prefill_logits(load_model(tiny_qwen3_dir).model, ids, [9])
    out = prefill_logits(loaded, ids, [9])
    assert float((out - ref).norm() / ref.norm()) < 0.12


def test_a_packed_int8_compressed_tensors_layout_is_refused_naming_the_key(tiny_qwen3_dir, tmp_path):
    """``pack-quantized`` is read for 4-bit weights (`layerzoo.loading.hub_quantization`); 8-bit packed words are not."""
    write_compressed(tiny_qwen3_dir, tmp_path / "packed", "pack-quantized")
    with pytest.raises(UserError, match=r"quantization_config.config_groups.group_0.weights.num_bits: 8 is not supported"):
        load_model(tmp_path / "packed")


