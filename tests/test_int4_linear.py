"""4-bit hub checkpoints (compressed-tensors W4A16, AWQ, GPTQ with act-order) load as `Int4Linear`:
each packed with a packer written here from the format's definition, loaded by the engine, and
compared with the same model saved with the exactly dequantized weights in fp32."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.layers import int4_linear
from layerzoo.layers.int4_linear import Int4Linear
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits, write_word_tokenizer

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Qwen3 whose linears have multiples of 32 inputs."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3-k32")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.25, eos_token_id=None, bos_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path


def words(values: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., 8 W]`` nibbles → int32 ``[..., W]``, nibble j in bits 4j.. (two's complement)."""
    v = values.long().reshape(*values.shape[:-1], -1, 8)
    packed = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize(w: torch.Tensor, group: int, symmetric: bool, g_idx: torch.Tensor | None = None):
    """``w [N, K]`` → (q [N, K] 0..15, zero [N, G] 0..15, scale fp16 [N, G]) with group of column k
    ``g_idx[k]`` (``k // group`` by default)."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    G = k // group
    cols = [w[:, g_idx == g] for g in range(G)]
    lo = torch.stack([c.min(1).values for c in cols], 1)
    hi = torch.stack([c.max(1).values for c in cols], 1)
    if symmetric:
        scale = (torch.maximum(lo.abs(), hi.abs()) / 7.5).half()
        zero = torch.full_like(scale, 8, dtype=torch.long)
    else:
        scale = ((hi - lo) / 15).half()
        zero = torch.round(-lo / scale.float()).clamp(1, 15).long()  # >= 1: GPTQ's classic format stores zero - 1
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = torch.round(w / s + z).clamp(0, 15).long()
    return q, zero, scale


def dequant(q, zero, scale, g_idx):
    return (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]


def pack(fmt: str, w: torch.Tensor, group: int, act_order: bool):
    """The format's tensors for weight ``w [N, K]`` and the exact dequantized weight."""
    n, k = w.shape
    group = k if group == -1 else group  # per channel: one group of the whole row
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k) // group).to(torch.int32)  # groups of scattered columns
    gi = (torch.arange(k) // group) if g_idx is None else g_idx.long()
    if fmt in ("ct_sym", "ct_asym"):
        symmetric = fmt == "ct_sym"
        q, zero, scale = quantize(w, group, symmetric, gi)
        t = {"weight_packed": words(q), "weight_scale": scale, "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not symmetric:
            t["weight_zero_point"] = words(zero.t()).t().contiguous()  # packed along the rows
        if g_idx is not None:
            t["weight_g_idx"] = g_idx
        return t, dequant(q, zero, scale, gi)
    if fmt == "awq":
        q, zero, scale = quantize(w, group, False)
        reorder = lambda v: v.reshape(v.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(v.shape)  # noqa: E731
        t = {"qweight": words(reorder(q.t())), "qzeros": words(reorder(zero.t())), "scales": scale.t().contiguous()}
        return t, dequant(q, zero, scale, gi)
    assert fmt.startswith("gptq")
    q, zero, scale = quantize(w, group, fmt == "gptq_sym", gi)
    t = {"qweight": words(q).t().contiguous(),  # [K/8, N]: word i of column n holds k = 8i..8i+7
         "qzeros": words((zero - 1).t()),  # classic format: zero - 1
         "scales": scale.t().contiguous(), "g_idx": gi.to(torch.int32)}
    return t, dequant(q, zero, scale, gi)


def quant_config(fmt: str, group: int, act_order: bool) -> dict:
    if fmt.startswith("ct"):
        strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                    "num_bits": 4, "type": "int", "symmetric": fmt == "ct_sym", **strategy,
                    "actorder": "group" if act_order else None, "dynamic": False}}},
                "ignore": ["lm_head"]}
    if fmt == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True,
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": fmt == "gptq_sym",
            "checkpoint_format": "gptq"}


def write_pair(base, dst, fmt, group=32, act_order=False):
    """``dst/quant`` in the format and ``dst/ref`` with its dequantized weights; returns the
    dequantized weights by module name."""
    torch.manual_seed(1)
    state = load_file(base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    quant, ref, want = {}, {}, {}
    for key, tensor in state.items():
        prefix = key.rpartition(".")[0]
        if key.endswith(".weight") and prefix.split("layers.")[-1].split(".", 1)[-1] in LINEARS:
            packed, deq = pack(fmt, tensor.float(), group, act_order)
            quant.update({f"{prefix}.{leaf}": v for leaf, v in packed.items()})
            ref[key] = deq
            want[prefix] = deq
        else:
            quant[key] = ref[key] = tensor
    for name, tensors, qc in (("quant", quant, quant_config(fmt, group, act_order)), ("ref", ref, None)):
        (dst / name).mkdir(parents=True)
        save_file(tensors, dst / name / "model.safetensors")
        (dst / name / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        write_word_tokenizer(dst / name, config["vocab_size"])
    return want


def greedy(path, prompts, n=10):
    llm = LLM(str(path), max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_same_greedy(quant_dir, ref_dir):
    """Same greedy tokens as the dequantized fp32 model, but for a near tie in the reference's logits."""
    prompts = [[3, 17, 42, 8], [5, 9, 60, 1, 2, 33, 12, 40, 7, 7, 21, 50, 3, 3, 11, 19, 23, 2]]  # the long one: chunked prefill
    ours, theirs = greedy(quant_dir, prompts), greedy(ref_dir, prompts)
    ref_model = load_model(ref_dir).model
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        ids = prompt + b[:step + 1]
        row = prefill_logits(ref_model, ids, [len(ids)])[len(prompt) + step - 1]
        margin = float(row[b[step]] - row[a[step]])
        assert margin <= 1e-4 * float(row.abs().max()), (prompt, a, b, step, margin)


CASES = [("ct_sym", 32, False), ("ct_asym", 32, False), ("ct_sym", 32, True), ("ct_asym", -1, False), ("awq", 32, False),
         ("gptq", 32, False), ("gptq", 32, True), ("gptq_sym", 64, True), ("gptq", -1, False)]


@pytest.mark.parametrize("fmt,group,act_order", CASES, ids=[f"{f}-g{g}{'-actorder' if a else ''}" for f, g, a in CASES])
def test_a_4bit_checkpoint_loads_its_exact_weights_and_decodes_like_them(base_dir, tmp_path, fmt, group, act_order):
    want = write_pair(base_dir, tmp_path, fmt, group, act_order)
    model = load_model(tmp_path / "quant").model
    found = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert sorted(found) == sorted(want)  # every quantized linear, and only those (lm_head stays plain)
    for name, module in found.items():
        assert torch.equal(module.dequantized_weight(), want[name]), name
        assert (module.perm is not None) == (act_order and module.in_features > group > 0)  # one group: no order
    # memory: the packed size (nibbles + fp32 scale and zero*scale per group), not fp32 weights
    packed = sum(m.weight_bytes() for m in found.values())
    fp32 = sum(w.numel() * 4 for w in want.values())
    assert packed <= fp32 * (0.5 + 8 / (group if group > 0 else 64)) / 4 + 1
    assert_same_greedy(tmp_path / "quant", tmp_path / "ref")


def test_a_bf16_run_keeps_the_scales_exact(base_dir, tmp_path):
    """``dtype=bfloat16``: only the bias follows the run dtype; fp16 scales stay fp16 until the
    conversion, so the weights are still exactly the checkpoint's."""
    want = write_pair(base_dir, tmp_path, "awq", 32, False)
    model = load_model(tmp_path / "quant", EngineArgs(dtype="bfloat16")).model
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int4Linear) and torch.equal(layer.dequantized_weight(), want["model.layers.0.self_attn.q_proj"])
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_an_ignored_module_keeps_its_plain_linear(base_dir, tmp_path, monkeypatch):
    """A module the ignore list names is not replaced; packed tensors of it load dequantized."""
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")  # the plain weight stays readable
    want = write_pair(base_dir, tmp_path, "ct_asym", 32, False)
    config_path = tmp_path / "quant" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] += ["re:.*layers\\.1\\.mlp\\.down_proj$"]
    config_path.write_text(json.dumps(config))
    model = load_model(tmp_path / "quant").model
    down = model.layers[1].mlp.down_proj
    assert type(down) is torch.nn.Linear and torch.equal(down.weight, want["model.layers.1.mlp.down_proj"])
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)


def test_forward_matches_the_dequantized_weight_for_any_rows(base_dir, tmp_path):
    write_pair(base_dir, tmp_path, "gptq", 32, True)
    model = load_model(tmp_path / "quant").model
    layer = model.layers[0].mlp.down_proj
    w = layer.dequantized_weight()
    x = torch.randn(17, layer.in_features)
    full = layer(x)
    torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-5)
    for rows in range(1, int4_linear.GEMV_ROWS + 1):  # the GEMV's rows do not depend on their batch
        assert torch.equal(layer(x[:rows]), torch.cat([layer(x[i:i + 1]) for i in range(rows)]))


BAD = [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits: 8 is not supported"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "quantization_config.version: 'gemv'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method: 'bitsandbytes'"),
    ({"quant_method": "hqq"}, "quantization_config.quant_method: 'hqq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "sparsity_config": {"format": "sparse-24-bitmask"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "quantization_config.sparsity_config.format: 'sparse-24-bitmask'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}}}},
     "quantization_config.config_groups.g.weights.num_bits: 2"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
     "quantization_config.format: 'mxfp4-pack-quantized'"),
]


@pytest.mark.parametrize("qc,message", BAD, ids=[b[0]["quant_method"] + str(i) for i, b in enumerate(BAD)])
def test_an_unsupported_format_is_one_line_naming_the_key(base_dir, tmp_path, qc, message):
    config = json.loads((base_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (tmp_path / "model.safetensors").write_bytes((base_dir / "model.safetensors").read_bytes())
    with pytest.raises(UserError) as info:
        load_model(tmp_path, EngineArgs())
    assert message in str(info.value) and "\n" not in str(info.value) and "config.json" in str(info.value)


def test_the_fused_decode_layer_takes_4bit_linears(base_dir, tmp_path, monkeypatch):
    """Decode steps of a 4-bit checkpoint run as one C++ call per layer (`int4_gemv` inside it), with
    the logprobs of the op-by-op path, bit for bit; an act-order permutation keeps the Python path."""
    from layerzoo.layers import fused_decode
    from layerzoo.testing.fused_decode import fused_decode_run

    write_pair(base_dir, tmp_path, "ct_asym", 32)
    prompt = [3, 17, 42, 8]
    tokens, logprobs, plans = fused_decode_run(tmp_path / "quant", prompt)
    assert all(p is not None and p.runs[0] >= 7 for p in plans)
    assert {field for p in plans for field in p.block_fields} == {int4_linear.FUSED_INT4_BLOCK}
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert fused_decode_run(tmp_path / "quant", prompt)[:2] == (tokens, logprobs)
    monkeypatch.delenv(fused_decode.ENV)
    write_pair(base_dir, tmp_path / "act-order", "gptq", 32, act_order=True)
    assert all(p is None for p in fused_decode_run(tmp_path / "act-order" / "quant", prompt)[2])

