"""Test helpers: GGUF files written with the ``gguf`` package from tiny safetensors checkpoints.

`write_gguf` does what llama.cpp's converter does for the architectures layerzoo reads: the
config as ``{arch}.*`` metadata, the tensors renamed (per-expert tensors stacked), Llama's q/k rows
interleaved for llama.cpp's RoPE, 2-D weights quantised with ``gguf.quants.quantize``, and a
byte-level BPE tokenizer (`byte_level_bpe`) stored as ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from layerzoo.config import read_hf_config
from layerzoo.loading.gguf_loading import ARCHITECTURES, EXPERT_TENSORS, GLOBAL_TENSORS, LAYER_TENSORS, PERMUTED_QK
from layerzoo.loading.loader import Checkpoint

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital. "
    "Numbers like 12345 and 2026, emoji \u00e9t\u00e9 caf\u00e9, tabs\tand\nnew lines; don't won't it's we'll. "
) * 4


def byte_level_bpe(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids, trained on a sentence
    list; ids 0..2 are the `SPECIALS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 8, trainer)
    assert tok.get_vocab_size() == vocab_size, f"trained {tok.get_vocab_size()} ids, wanted {vocab_size}"
    return tok


_GGUF_NAMES = {hf: gguf for gguf, hf in GLOBAL_TENSORS.items()}
_GGUF_LAYER = {hf: gguf for gguf, hf in LAYER_TENSORS.items()}
_GGUF_EXPERT = {hf: gguf for gguf, hf in EXPERT_TENSORS.items()}


def gguf_name(hf_name: str) -> tuple[str, int | None]:
    """``(GGUF tensor name, expert index or None)`` of HF weight `hf_name`."""
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name], None
    parts = hf_name.split(".")
    assert parts[:2] == ["model", "layers"], hf_name
    layer, rest, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    if rest.startswith("mlp.experts."):
        _, _, expert, proj = rest.split(".")
        return f"blk.{layer}.{_GGUF_EXPERT[proj]}.{suffix}", int(expert)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{suffix}", None


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter order for q/k rows (the inverse of `layerzoo.loading.gguf_loading.unpermute_qk`)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_gguf(
    gguf_path: str | Path,
    model_dir: str | Path,
    *,
    qtype: str = "F32",
    tokenizer=None,
    chat_template: str | None = CHAT_TEMPLATE,
    add_bos: bool = False,
    eos_token_id: int = 2,
    skip: tuple[str, ...] = (),
    extra: dict[str, np.ndarray | tuple[np.ndarray, str]] | None = None,
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Convert the safetensors checkpoint in `model_dir` to a GGUF file at `gguf_path`.

    `qtype` (``F32``, ``F16``, ``Q8_0``, ``Q4_0``, ``Q4_1``, ...) applies to 2-D weights whose rows
    split into whole quantisation blocks; norms and biases stay F32, as llama.cpp keeps them.
    `skip` leaves GGUF tensors out and `extra` adds raw ones (for tests of strict loading), a
    ``(uint8 blocks [..., rows, row_bytes], "Q4_K")`` pair as blocks of that type (the types the
    ``gguf`` package cannot quantize: a test makes their bytes itself).
    `qtypes` gives some tensor kinds a type of their own, as llama.cpp's mixes do (``{"attn_v":
    "Q6_K"}``: every layer's ``blk.N.attn_v.weight``).
    """
    import gguf

    config = read_hf_config(Path(model_dir))
    arch = next(k for k, (hf_arch, _) in ARCHITECTURES.items() if hf_arch == config["architectures"][0])
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer, arch, chat_template, add_bos, eos_token_id)

    for name, array in _gguf_tensors(Path(model_dir), config, arch, heads, kv_heads, skip).items():
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        _add_tensor(writer, name, array, (qtypes or {}).get(kind, qtype))
    for name, array in (extra or {}).items():
        if isinstance(array, tuple):
            blocks, raw = array
            writer.add_tensor(name, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType[raw])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(gguf_path)


def random_kquant_blocks(qtype: str, shape: tuple[int, ...], k: int, rng: np.random.Generator) -> np.ndarray:
    """``[*shape, row_bytes]`` uint8 blocks of K-quant ``qtype`` (Q4_K or Q6_K) for rows of ``k``
    weights: random quants and sub-block scales, small fp16 super-block scales (weights of a few
    tenths). A valid tensor of a type the ``gguf`` package cannot quantize; pass it to `write_gguf`'s
    ``extra`` as ``(blocks, qtype)``."""
    import gguf

    elements, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, (*shape, k // elements, size), dtype=np.uint8)
    offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]  # Q4_K: d, dmin first; Q6_K: d last
    for offset in offsets:
        d = rng.uniform(1e-4, 4e-4, (*shape, k // elements)).astype(np.float16)
        data[..., offset:offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return data.reshape(*shape, -1)


def _gguf_tensors(model_dir: Path, config: dict, arch: str, heads: int, kv_heads: int, skip) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array (numpy order), experts stacked ``[E, ...]``."""
    checkpoint = Checkpoint.open(model_dir)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for key in checkpoint.keys():
        name, expert = gguf_name(key)
        tensor = checkpoint.get(key).float()
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if arch in PERMUTED_QK and kind in ("attn_q", "attn_k"):
            tensor = permute_qk(tensor, heads if kind == "attn_q" else kv_heads)
        if expert is None:
            out[name] = tensor.numpy()
        else:
            stacks.setdefault(name, {})[expert] = tensor.numpy()
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return {name: array for name, array in sorted(out.items()) if name not in skip}


def _add_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if array.ndim < 2 or kind == gguf.GGMLQuantizationType.F32 or array.shape[-1] % block:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), kind), raw_dtype=kind)


def _add_tokenizer(writer, tokenizer, arch: str, chat_template, add_bos: bool, eos_token_id: int) -> None:
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_token_id)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    if chat_template:
        writer.add_chat_template(chat_template)
