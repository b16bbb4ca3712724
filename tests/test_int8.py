"""quantization="int8": per-channel int8 weights in every linear, fbgemm's int8 GEMM, close to fp32;
and compressed-tensors int8 checkpoints (W8A8 / W8A16) loaded into the same path."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.layers.linear import (int8_available, int8_linear, int8_weight_rows, pack_linears, prepack_int8,
                                    quantize_per_channel_int8)
from layerzoo.model_loading import load_model
from layerzoo.testing import prefill_logits

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch built without the fbgemm quantized engine")


def test_per_channel_quantization_bounds_each_row_by_half_its_scale():
    torch.manual_seed(0)
    w = torch.randn(37, 53) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different magnitude
    w[5] = 0  # an all-zero channel
    q, scale = quantize_per_channel_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and int(q.abs().max()) == 127
    assert bool((q[5] == 0).all()) and scale[5] == 1
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_to_fp32(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(67, 45, bias=bias)
    x = torch.randn(rows, 67)
    layer.requires_grad_(False)
    q, scale = quantize_per_channel_int8(layer.weight)
    out = int8_linear(x, prepack_int8(q, scale, layer.bias))
    ref = x @ (q.float() * scale[:, None]).t() + (layer.bias if bias else 0)  # the dequantized weights
    assert out.shape == (rows, 45) and out.dtype == torch.float32
    # Activations are quantized per call (7 bits): the error is a small fraction of the output.
    assert float((out - ref).norm() / ref.norm()) < 0.03
    # Leading dims and other float dtypes: reshaped, and cast back.
    out3 = int8_linear(x.to(torch.bfloat16)[None], prepack_int8(q, scale, layer.bias))
    assert out3.shape == (1, rows, 45) and out3.dtype == torch.bfloat16


def test_every_linear_is_quantized_and_a_tied_weight_is_kept():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24, bias=False))
    m.head = nn.Linear(24, 40, bias=False)
    m.head.weight = m[0].weight
    shared = m[0].weight
    x = torch.randn(3, 24)
    with torch.no_grad():
        ref = m[1](m[0](x))
        assert pack_linears(m, {id(shared)}, "int8") == 3
        out = m[1](m[0](x))
    assert m[1].weight.dtype == torch.int8 and m[1].weight_scale.shape == (24,)
    assert m[0].weight is shared and shared.dtype == torch.float32  # tied: kept for its other user
    assert all(hasattr(mod, "int8_packed") for mod in m.modules() if isinstance(mod, nn.Linear))
    assert float((out - ref).norm() / ref.norm()) < 0.05


def test_engine_args_refuse_an_unknown_method():
    with pytest.raises(UserError, match="quantization: expected None or one of 'int8'"):
        EngineArgs(quantization="int4")


def linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_the_model_quantizes_every_linear_and_stays_close_to_fp32(tiny_qwen3_dir):
    fp32 = load_model(tiny_qwen3_dir).model
    int8 = load_model(tiny_qwen3_dir, EngineArgs(quantization="int8")).model
    found = linears(int8.model)  # the decoder: every projection (fused q/k/v, gate/up, o, down)
    assert len(found) == 2 * 4  # 2 layers x (qkv, o_proj, gate_up, down_proj)
    for name, module in found + [("lm_head", int8.lm_head)]:
        assert hasattr(module, "int8_packed"), name
    assert all(m.weight.dtype == torch.int8 for _, m in found)
    ids = [3, 17, 42, 8, 8, 60, 1, 2, 33, 12, 5]
    ref = prefill_logits(fp32, ids, [4, 7])
    out = prefill_logits(int8, ids, [4, 7])
    # hidden 32: few products per dot, so 7-bit activation rounding averages out less than in a real model
    assert float((out - ref).norm() / ref.norm()) < 0.12
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75  # vocab 64, random: near ties


def test_greedy_on_the_embedded_model_agrees_with_fp32():
    from layerzoo import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def read_config(path):\n"
    fp32 = LLM(None, dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    int8_llm = LLM(None, dtype="float32", quantization="int8")
    assert all(hasattr(m, "int8_packed") for _, m in linears(int8_llm.engine.model))
    int8 = int8_llm.generate([prompt], params)[0].outputs[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(fp32, int8)) if a != b), len(fp32))
    assert same >= 12, (same, fp32, int8)  # a trained model's greedy path survives int8 for a while


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
    attn, mlp = loaded.layers[0].self_attn, loaded.layers[0].mlp
    qkv = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(int8_weight_rows(attn.qkv), qkv)  # fused, the checkpoint's int8 values exactly
    assert torch.equal(int8_weight_rows(loaded.layers[1].mlp.down_proj), stored["model.layers.1.mlp.down_proj.weight"])
    scale = stored["model.layers.0.mlp.gate_proj.weight_scale"].float().flatten()
    torch.testing.assert_close(mlp.gate_up.weight_scale[: scale.numel()], scale)
    # And it computes what the original checkpoint computes, within int8 error.
    ids = [3, 17, 42, 8, 8, 60, 1, 2, 33]
    ref = prefill_logits(load_model(tiny_qwen3_dir).model, ids, [9])
    out = prefill_logits(loaded, ids, [9])
    assert float((out - ref).norm() / ref.norm()) < 0.12


def test_a_packed_compressed_tensors_layout_is_refused_naming_the_key(tiny_qwen3_dir, tmp_path):
    write_compressed(tiny_qwen3_dir, tmp_path / "packed", "pack-quantized")
    with pytest.raises(UserError, match=r"config.json: quantization_config.format: 'pack-quantized' is not supported"):
        load_model(tmp_path / "packed")


# -- decode rows through the C++ GEMV --------------------------------------------------------------

gemv_built = pytest.mark.skipif(not __import__("layerzoo.layers.linear", fromlist=["x"]).int8_gemv_available(),
                                reason="the C++ decode GEMV is not built here (no compiler)")


@gemv_built
def test_few_rows_run_the_gemv_with_per_row_activation_scales():
    """Up to ``INT8_GEMV_ROWS`` rows an int8 linear computes exactly what the GEMV's reference does:
    each row quantized with its own scale, so one row's outlier does not cost another row (fbgemm,
    used from more rows on, quantizes all rows of a call with one scale)."""
    from layerzoo.kernels.cpu_gemv import reference
    from layerzoo.layers import linear

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(96, 50))
    pack_linears(m, set(), "int8")
    layer = m[0]
    x = torch.randn(2, 96)
    x[1] *= 500  # an outlier row beside an ordinary one
    with torch.no_grad():
        out = layer(x)
        alone = layer(x[:1])
    ref = reference.int8_gemv(x, int8_weight_rows(layer), layer.weight_scale, layer.bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], alone[0])
    assert linear.INT8_GEMV_ROWS >= 2
    # The same rows through fbgemm (one scale for the call): row 0 loses precision to row 1.
    fbgemm = int8_linear(x, layer.int8_packed)
    exact = x @ (int8_weight_rows(layer).float() * layer.weight_scale[:, None]).t() + layer.bias
    assert (out[0] - exact[0]).norm() < 0.1 * (fbgemm[0] - exact[0]).norm()


@gemv_built
def test_the_engine_decodes_through_the_gemv(monkeypatch):
    from layerzoo import LLM, SamplingParams
    from layerzoo.layers import linear

    rows = []
    real = linear._int8_gemv

    def spy(layer, x):
        rows.append(x.numel() // x.shape[-1])
        return real(layer, x)

    monkeypatch.setattr(linear, "_int8_gemv", spy)
    # the linear's own routing (the fused decode layer calls the kernel from C++: test_fused_decode)
    monkeypatch.setenv("LAYERZOO_FUSED_DECODE", "0")
    llm = LLM(None, dtype="float32", quantization="int8")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(["def read_config(path):\n"], params)[0].outputs[0].token_ids
    per_step = len(linears(llm.engine.model)) + 1 - 1  # every linear of the decoder, and the head
    decode_rows = rows.count(1)  # a short prompt's rows may take it too (up to the layer's limit)
    assert decode_rows >= 5 * per_step // 2 and max(rows) <= linears(llm.engine.model)[0][1].int8_gemv_rows, (rows, per_step)
    monkeypatch.setattr(linear, "INT8_GEMV_ROWS", 0)  # fbgemm only: close, not always the same bits
    assert LLM(None, dtype="float32", quantization="int8").generate(["def read_config(path):\n"], params)[0].outputs[0].token_ids[:3] == out[:3]


@gemv_built
def test_layers_keep_their_weights_blocked_for_the_vnni_gemv():
    """With AVX-512 VNNI the int8 weights are stored once, blocked for the GEMV (fbgemm keeps its
    own packing for many rows); the blocked and row-major kernels give the same bits."""
    from layerzoo.layers import linear

    if not linear.int8_blocked_available():
        pytest.skip("the blocked int8 GEMV needs AVX-512 VNNI")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(96, 50))
    pack_linears(m, set(), "int8")
    layer = m[0]
    assert layer.weight.shape == (1, 24, 64, 4) and layer.weight.data_ptr() == layer.int8_weight.data_ptr()
    assert layer.int8_gemv_rows == linear.INT8_BLOCKED_GEMV_ROWS
    x = torch.randn(linear.INT8_BLOCKED_GEMV_ROWS, 96)
    with torch.no_grad():
        blocked = layer(x)
        layer.int8_weight, layer.int8_colsum = int8_weight_rows(layer).contiguous(), None
        assert torch.equal(layer(x), blocked)
