"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer from one file.

A GGUF file carries what a checkpoint directory spreads over ``config.json``, ``tokenizer.json``
and safetensors shards. `GGUFModel.open` reads it with the ``gguf`` package (maintained with
llama.cpp) and answers:

* `GGUFModel.hf_config`: the architecture's metadata as the HF-style config dict that
  ``config_class.from_hf`` reads, so plugins need nothing GGUF-specific;
* `GGUFModel.checkpoint`: a `layerzoo.loading.loader.Checkpoint` whose keys are HF weight names and whose
  tensors are dequantised (``gguf.quants.dequantize``) on demand, in torch layout, with llama.cpp's
  q/k row interleave for RoPE undone for Llama, so the strict loader checks names, shapes and
  coverage exactly as for safetensors; the keys it is given as ``native`` come as the file's
  blocks instead (``[rows, row_bytes]`` uint8, rows in HF order), for the modules that keep them
  (`layerzoo.layers.gguf_linear`, chosen by `layerzoo.loading.model_loading.keep_gguf_blocks`), one
  expert's ``[rows, row_bytes]`` of a stacked expert tensor for `layerzoo.layers.gguf_experts`;
* the tokenizer, in `layerzoo.tokenization.gguf_tokenizer`.

Only the architectures in `ARCHITECTURES` are read; every other one, an unknown tensor or an
unsupported quantisation type is refused with an error naming it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from layerzoo.errors import CheckpointError, ConfigError
from layerzoo.loading.loader import Checkpoint, _TensorInfo

SUFFIX = ".gguf"

# GGUF ``general.architecture`` -> (HF architecture, HF model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# Architectures whose converter (llama.cpp's convert_hf_to_gguf.py) interleaves q/k rows per head.
PERMUTED_QK = {"llama"}

# ``{arch}.<key>`` metadata -> HF config key.
_HPARAMS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

# Quantisation types read (dequantised with gguf.quants); any other one is refused by name.
def _supported_types():
    from gguf import GGMLQuantizationType as Q

    return frozenset({
        Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    })


# GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the one ``*.gguf`` of a directory that has
    no ``config.json``; None for a safetensors checkpoint. Several GGUF files are an error."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path} holds several GGUF files ({names}): pass the one to load as --model")
    return files[0] if files else None


@attrs.frozen
class _Source:
    """Where an HF-named tensor comes from: a GGUF tensor, whole or one expert of a stacked one."""

    tensor: Any  # gguf ReaderTensor
    expert: int | None = None


class GGUFModel:
    """One opened GGUF file: its metadata, its config dict and its tensors under HF names."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.reader = reader
        self.gguf_architecture = self.string("general.architecture")
        if self.gguf_architecture not in ARCHITECTURES:
            raise ConfigError(
                f"{path}: general.architecture {self.gguf_architecture!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.tensors = {t.name: t for t in reader.tensors}
        self.hf_config = self._hf_config()

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """The file at `path`, parsed once: the model loader and the tokenizer share the parse
        while the file is unchanged (parsing a 49k-token vocabulary takes seconds)."""
        path = Path(path).resolve()
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        key = (path, stat.st_mtime_ns, stat.st_size)
        if _LAST_OPENED.get("key") != key:
            _LAST_OPENED.clear()
            _LAST_OPENED.update(key=key, model=cls(path, _read(path)))
        return _LAST_OPENED["model"]


    # ------------------------------------------------------------------ metadata

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key` (str, number, bool or list), or `default` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def string(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise ConfigError(f"{self.path}: metadata key {key!r} is missing or not a string")
        return value

    def _hf_config(self) -> dict[str, Any]:
        arch = self.gguf_architecture
        architecture, model_type = ARCHITECTURES[arch]
        config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
        for key, hf_key in _HPARAMS.items():
            value = self.value(f"{arch}.{key}")
            if value is not None:
                config[hf_key] = value
        for required in ("block_count", "embedding_length", "attention.head_count"):
            if f"{arch}.{required}" not in self.reader.fields:
                raise ConfigError(f"{self.path}: metadata key {arch + '.' + required!r} is missing")
        # head_dim: the key length when given, else the rotary width (Llama rotates whole heads).
        head_dim = self.value(f"{arch}.attention.key_length")
        if head_dim is None and arch == "llama":
            head_dim = self.value(f"{arch}.rope.dimension_count")
        if head_dim is not None:
            config["head_dim"] = head_dim
        vocab = self.value(f"{arch}.vocab_size")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        config["vocab_size"] = vocab if vocab is not None else (len(tokens.data) if tokens else None)
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        config["tie_word_embeddings"] = "output.weight" not in self.tensors
        config["bos_token_id"] = self.value("tokenizer.ggml.bos_token_id")
        config["eos_token_id"] = self.value("tokenizer.ggml.eos_token_id")
        if arch == "qwen3moe":
            # llama.cpp's qwen3moe graph always renormalises the top-k weights; every layer is sparse.
            config.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        config.update(self._rope_scaling())
        return config

    def _rope_scaling(self) -> dict[str, Any]:
        arch = self.gguf_architecture
        kind = self.value(f"{arch}.rope.scaling.type")
        if kind in (None, "none"):
            return {}
        factor = self.value(f"{arch}.rope.scaling.factor")
        if kind == "linear":
            return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
        if kind == "yarn":
            original = self.value(f"{arch}.rope.scaling.original_context_length")
            return {"rope_scaling": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}}
        raise ConfigError(f"{self.path}: {arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn)")

    # ------------------------------------------------------------------ tensors

    def sources(self) -> dict[str, _Source]:
        """HF weight name -> its GGUF source, for every tensor in the file (unknown ones refused)."""
        supported = _supported_types()
        experts = self.hf_config.get("num_experts")
        out: dict[str, _Source] = {}
        for name, tensor in self.tensors.items():
            if tensor.tensor_type not in supported:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has quantisation type {tensor.tensor_type.name}, "
                    f"which layerzoo does not read (supported: {', '.join(sorted(t.name for t in supported))})"
                )
            if name in GLOBAL_TENSORS:
                out[GLOBAL_TENSORS[name]] = _Source(tensor)
                continue
            match = _LAYER_NAME.match(name)
            if match and match.group(2) in LAYER_TENSORS:
                layer, kind, suffix = match.groups()
                out[f"model.layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}"] = _Source(tensor)
            elif match and match.group(2) in EXPERT_TENSORS and match.group(3) == "weight":
                layer, kind, _ = match.groups()
                if not experts:
                    raise ConfigError(
                        f"{self.path}: tensor {name!r} holds experts but metadata key "
                        f"'{self.gguf_architecture}.expert_count' is missing"
                    )
                for e in range(experts):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_TENSORS[kind]}.weight"] = _Source(tensor, e)
            else:
                what = " (llama3 RoPE frequency factors)" if name == "rope_freqs.weight" else ""
                raise CheckpointError(
                    f"{self.path}: tensor {name!r}{what} has no place in a {self.gguf_architecture} model"
                )
        return out

    def checkpoint(self, native: frozenset[str] = frozenset()) -> GGUFCheckpoint:
        return GGUFCheckpoint(self, native)

    def block_types(self) -> dict[str, int]:
        """HF weight name -> GGML type, for the whole (not per-expert) 2-D tensors in a block format."""
        from gguf import GGMLQuantizationType as Q

        dense = {Q.F32, Q.F16, Q.BF16}
        return {name: int(s.tensor.tensor_type) for name, s in self.sources().items()
                if s.expert is None and len(s.tensor.shape) == 2 and s.tensor.tensor_type not in dense}

    def expert_block_types(self) -> dict[str, int]:
        """HF per-expert weight name -> GGML type, for the experts stacked in a block format."""
        from gguf import GGMLQuantizationType as Q

        dense = {Q.F32, Q.F16, Q.BF16}
        return {name: int(s.tensor.tensor_type) for name, s in self.sources().items()
                if s.expert is not None and s.tensor.tensor_type not in dense}

    def blocks(self, source: _Source) -> torch.Tensor:
        """The blocks of `source` as the file stores them: ``[rows, row_bytes]`` uint8 (rows in HF
        order); of one expert of a stacked ``[E, rows, row_bytes]`` tensor where it names one."""
        tensor = source.tensor
        data = np.asarray(tensor.data, dtype=np.uint8)
        if source.expert is not None:
            data = data[source.expert]
        out = torch.from_numpy(np.array(data.reshape(data.shape[0], -1), order="C", copy=True))
        return self._hf_row_order(tensor, out)

    def _hf_row_order(self, tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` with llama.cpp's q/k row interleave undone where the converter made it."""
        match = _LAYER_NAME.match(tensor.name)
        kind = match.group(2) if match else None
        if self.gguf_architecture in PERMUTED_QK and kind in ("attn_q", "attn_k"):
            heads = self.hf_config["num_attention_heads"]
            if kind == "attn_k":
                heads = self.hf_config.get("num_key_value_heads") or heads
            out = unpermute_qk(out, heads)
        return out

    def dequantize(self, source: _Source) -> torch.Tensor:
        """The float32 tensor of `source` in torch layout (``[out, in]`` for a linear weight)."""
        from gguf.quants import dequantize

        tensor = source.tensor
        # ggml lists dimensions fastest first; numpy (and torch) slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if source.expert is not None:
            weights = weights[source.expert]
        out = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
        return self._hf_row_order(tensor, out)


_LAST_OPENED: dict[str, Any] = {}


def forget_opened() -> None:
    """Drop the cached parse of the last GGUF file (`GGUFModel.open`), and with it its memory map."""
    _LAST_OPENED.clear()


def _read(path: Path):
    """``gguf.GGUFReader`` over `path`, its errors turned into a CheckpointError naming the file."""
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        """The package's reader over a plain-ndarray view of its memory map: the parse makes a
        million small slices, and np.memmap's per-slice bookkeeping made it several times slower."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    try:
        return PlainArrayReader(path)
    except Exception as error:  # the reader raises ValueError/struct errors on a damaged file
        raise CheckpointError(f"{path}: not a readable GGUF file ({' '.join(str(error).split())})") from None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows ``[x0, y0, x1, y1, ...]`` (rotation pairs
    adjacent, for its interleaved RoPE) back to HF's ``[x0, x1, ..., y0, y1, ...]`` (rotate-half).

    ``weight [H * D, ...]`` (a projection's weight or bias) → same shape.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads of rotation pairs"
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint(Checkpoint):
    """The tensors of a GGUF file as a `Checkpoint` under HF names, dequantised when read, except
    the keys in ``native``: those are served as the file's blocks, ``[rows, row_bytes]`` uint8, for
    the modules that keep them (`layerzoo.layers.gguf_linear`).

    Shapes are known from the file's header, so the loader's plan check runs before any
    dequantisation. Experts stacked in one GGUF tensor are read once and served per expert.
    """

    def __init__(self, model: GGUFModel, native: frozenset[str] = frozenset()):
        self.model = model
        self.sources = model.sources()
        self.native = native
        infos = {}
        for name, source in self.sources.items():
            shape = tuple(int(d) for d in reversed(source.tensor.shape))
            if source.expert is not None:
                shape = shape[1:]
            offset = int(source.tensor.data_offset) + (source.expert or 0)  # keeps read order by file position
            dtype = torch.float32
            if name in native:
                assert len(shape) == 2, name
                blocks_shape = tuple(source.tensor.data.shape)  # [(E,) rows, row_bytes]
                dtype, shape = torch.uint8, blocks_shape[1:] if source.expert is not None else blocks_shape
            infos[name] = _TensorInfo(file=model.path, dtype=dtype, shape=shape, offset=offset)
        super().__init__(model.path, infos)
        self._stacked: tuple[str, torch.Tensor] | None = None  # the last stacked expert tensor read

    def get(self, name: str) -> torch.Tensor:
        source = self.sources.get(name)
        if source is None:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.directory}")
        if name in self.native:
            return self.model.blocks(source)
        if source.expert is None:
            return self.model.dequantize(source)
        if self._stacked is None or self._stacked[0] != source.tensor.name:
            self._stacked = (source.tensor.name, self.model.dequantize(_Source(source.tensor)))
        return self._stacked[1][source.expert]

    def close(self) -> None:
        self._stacked = None
