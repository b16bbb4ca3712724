"""FP8 hub checkpoints (compressed-tensors ``float-quantized`` per channel / per tensor, and
``quant_method: "fp8"`` with block scales, as Qwen3-*-FP8 stores them) load as `FP8Linear`, one byte
a weight, with exactly the stored weights: compared with the same model saved with the dequantized
weights in fp32."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerzoo import LLM, SamplingParams
from layerzoo.errors import UserError
from layerzoo.layers import fp8_linear
from layerzoo.layers.fp8_linear import FP8Linear
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits, write_word_tokenizer

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj")
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3-fp8")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.25, eos_token_id=None, bos_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path


def quantize(w: torch.Tensor, kind: str, block=(32, 64)):
    """The checkpoint tensors of ``w [N, K]`` and their exact dequantization."""
    n, k = w.shape
    if kind == "channel":
        scale = (w.abs().amax(1, keepdim=True) / 448).bfloat16()  # compressed-tensors keeps the model's dtype
        q = (w / scale.float()).clamp(-448, 448).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    if kind == "tensor":
        scale = (w.abs().amax() / 448).reshape(1).float()
        q = (w / scale).clamp(-448, 448).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / 448
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(FP8)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def quant_config(kind: str, block) -> dict:
    if kind == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": kind, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]}


def write_pair(base, dst, kind, block=(32, 64), static_input_scale=False):
    state = load_file(base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    quant, ref, want = {}, {}, {}
    for key, tensor in state.items():
        prefix = key.rpartition(".")[0]
        if key.endswith(".weight") and prefix.split("layers.")[-1].split(".", 1)[-1] in LINEARS:
            packed, deq = quantize(tensor.float(), kind, block)
            quant.update({f"{prefix}.{leaf}": v for leaf, v in packed.items()})
            if static_input_scale:
                quant[f"{prefix}.input_scale"] = torch.tensor([0.01])
            ref[key] = want[prefix] = deq
        else:
            quant[key] = ref[key] = tensor
    for name, tensors, qc in (("quant", quant, quant_config(kind, block)), ("ref", ref, None)):
        (dst / name).mkdir(parents=True)
        save_file(tensors, dst / name / "model.safetensors")
        (dst / name / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        write_word_tokenizer(dst / name, config["vocab_size"])
    return want


def greedy(path, prompts, n=10):
    llm = LLM(str(path), max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_same_greedy(quant_dir, ref_dir):
    """Same greedy tokens as the dequantized fp32 model, but for a near tie in the reference's logits."""
    prompts = [[3, 17, 42, 8], [5, 9, 60, 1, 2, 33, 12, 40, 7, 7, 21, 50, 3, 3, 11, 19, 23, 2]]
    ours, theirs = greedy(quant_dir, prompts), greedy(ref_dir, prompts)
    ref_model = load_model(ref_dir).model
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        ids = prompt + b[:step + 1]
        row = prefill_logits(ref_model, ids, [len(ids)])[len(prompt) + step - 1]
        assert float(row[b[step]] - row[a[step]]) <= 1e-4 * float(row.abs().max()), (prompt, a, b, step)


CASES = [("channel", None), ("tensor", None), ("block", (32, 64)), ("block", (128, 128)), ("block", (48, 64))]


@pytest.mark.parametrize("kind,block", CASES, ids=[f"{k}{'-' + 'x'.join(map(str, b)) if b else ''}" for k, b in CASES])
def test_an_fp8_checkpoint_loads_its_exact_weights_and_decodes_like_them(base_dir, tmp_path, kind, block):
    want = write_pair(base_dir, tmp_path, kind, block, static_input_scale=kind == "tensor")
    model = load_model(tmp_path / "quant").model
    found = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert sorted(found) == sorted(want)  # lm_head stays plain
    for name, module in found.items():
        assert module.weight.dtype == FP8  # one byte a weight, as stored
        assert torch.equal(module.dequantized_weight(), want[name]), name
    packed = sum(m.weight_bytes() for m in found.values())
    weights = sum(w.numel() for w in want.values())
    assert packed <= weights * (1 + 4 / 32)  # the bytes and an fp32 scale per row and block at most
    assert_same_greedy(tmp_path / "quant", tmp_path / "ref")


def test_forward_rows_do_not_depend_on_their_batch(base_dir, tmp_path):
    write_pair(base_dir, tmp_path, "block", (32, 64))
    layer = load_model(tmp_path / "quant").model.layers[1].mlp.down_proj
    x = torch.randn(9, layer.in_features)
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T, rtol=1e-5, atol=1e-5)
    for rows in range(1, fp8_linear.GEMV_ROWS + 1):
        assert torch.equal(layer(x[:rows]), torch.cat([layer(x[i:i + 1]) for i in range(rows)]))


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size: [128]"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int"}}}},
     "quantization_config.config_groups.g.input_activations"),
    ({"quant_method": "mxfp4"}, "quantization_config.quant_method: 'mxfp4'"),
])
def test_an_unsupported_fp8_variant_is_one_line_naming_the_key(base_dir, tmp_path, qc, message):
    config = json.loads((base_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (tmp_path / "model.safetensors").write_bytes((base_dir / "model.safetensors").read_bytes())
    with pytest.raises(UserError) as info:
        load_model(tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_stacked_moe_experts_load_dequantized_beside_fp8_attention(tmp_path):
    """Qwen3-MoE-FP8 style: attention linears become `FP8Linear`; the per-expert FP8 tensors load,
    exactly dequantized, into the stacked experts (the router stays plain, as the hub keeps it)."""
    transformers = pytest.importorskip("transformers")
    base = tmp_path / "base"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
        initializer_range=0.25, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(base)
    state = load_file(base / "model.safetensors")
    base_config = json.loads((base / "config.json").read_text())
    quant, ref = {}, {}
    for key, tensor in state.items():
        if key.endswith("_proj.weight") and key.startswith("model.layers."):
            packed, deq = quantize(tensor.float(), "block", (32, 32))
            quant.update({f"{key[:-len('.weight')]}.{leaf}": v for leaf, v in packed.items()})
            ref[key] = deq
        else:
            quant[key] = ref[key] = tensor
    for name, tensors, qc in (("quant", quant, quant_config("block", (32, 32))), ("ref", ref, None)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps({**base_config, **({"quantization_config": qc} if qc else {})}))
        write_word_tokenizer(tmp_path / name, config.vocab_size)
    model = load_model(tmp_path / "quant").model
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, FP8Linear) and torch.equal(attn.q_proj.dequantized_weight(),
                                                             ref["model.layers.0.self_attn.q_proj.weight"])
    experts = load_model(tmp_path / "ref").model.layers[1].mlp.experts
    for name, param in model.layers[1].mlp.experts.named_parameters():
        assert torch.equal(param, experts.get_parameter(name)), name
    assert_same_greedy(tmp_path / "quant", tmp_path / "ref")


@pytest.mark.parametrize("kind,block", [("channel", None), ("block", (32, 64))])
def test_the_fused_decode_layer_takes_fp8_linears(base_dir, tmp_path, monkeypatch, kind, block):
    """Decode steps of an FP8 checkpoint run as one C++ call per layer (`fp8_gemv` inside it), with
    the logprobs of the op-by-op path, bit for bit."""
    from layerzoo.layers import fused_decode
    from layerzoo.testing.fused_decode import fused_decode_run

    write_pair(base_dir, tmp_path, kind, block)
    prompt = [3, 17, 42, 8]
    tokens, logprobs, plans = fused_decode_run(tmp_path / "quant", prompt)
    assert all(p is not None and p.runs[0] >= 7 for p in plans)
    assert {field for p in plans for field in p.block_fields} == {fp8_linear.FUSED_FP8_BLOCK}
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert fused_decode_run(tmp_path / "quant", prompt)[:2] == (tokens, logprobs)

