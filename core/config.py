"""Typed configs: the HF ``config.json`` read into attrs records, and the engine's own settings.

A model config is an attrs class whose fields carry the HF key they come from
(``hf(...)``); `from_hf` reads them with type checks, so a wrong or missing value is one error
naming the file and the key. Architectures add fields by subclassing `DecoderConfig`.
Multimodal wrappers keep the text model under ``text_config``: `read_hf_config` descends into it
and carries the top-level fields the text tower needs (``architectures``, tied embeddings).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from layerzoo.errors import ConfigError

_MISSING = object()


def hf(default: Any = _MISSING, *, key: str | None = None, aliases: tuple[str, ...] = (), kind: Any = None):
    """An attrs field read from config.json key ``key`` (the field's own name by default)."""
    metadata = {"hf_key": key, "aliases": aliases, "kind": kind}
    if default is _MISSING:
        return attrs.field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return attrs.field(factory=lambda: type(default)(default), metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def _check_kind(value: Any, kind: Any, where: str) -> Any:
    if kind is None or value is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: expected {expected}, got {type(value).__name__} {value!r}")
    return value


def from_hf(cls, data: Mapping[str, Any], source: str = "config.json"):
    """Build the attrs config ``cls`` from a config.json dict; errors name ``source`` and the key."""
    kwargs = {}
    for field in attrs.fields(cls):
        meta = field.metadata
        if "hf_key" not in meta:
            continue
        keys = (meta["hf_key"] or field.name, *meta["aliases"])
        key = next((k for k in keys if k in data and data[k] is not None), None)
        if key is None:
            if field.default is attrs.NOTHING:
                raise ConfigError(f"{source}: required key {keys[0]!r} is missing")
            continue
        kwargs[field.name] = _check_kind(data[key], meta["kind"], f"{source}: key {key!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing or broken file is a ConfigError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# Top-level fields of a multimodal wrapper that the text tower inherits when it lacks them.
_CARRIED_FROM_WRAPPER = (
    "architectures", "tie_word_embeddings", "eos_token_id", "bos_token_id",
    # a multimodal wrapper's placeholder ids, so that its text model can refuse them in prompts
    "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "media_placeholder_token_id",  # Kimi K3
)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of ``model_dir`` flattened for the text model (``text_config`` descended into)."""
    path = Path(model_dir) / "config.json"
    data = read_json(path)
    text = data.get("text_config")
    if text is None:
        return data
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: key 'text_config' must be an object")
    merged = dict(text)
    for key in _CARRIED_FROM_WRAPPER:
        if key in data and key not in merged:
            merged[key] = data[key]
    merged["architectures"] = data.get("architectures", merged.get("architectures"))
    merged["_wrapper_model_type"] = data.get("model_type")
    return merged


def architecture_of(config: Mapping[str, Any], source: str = "config.json") -> str:
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ConfigError(f"{source}: key 'architectures' must be a non-empty list of class names")
    return archs[0]


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@attrs.frozen
class RopeConfig:
    """Rotary embedding parameters, from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` keys."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, data: Mapping[str, Any], source: str = "config.json") -> RopeConfig:
        params = data.get("rope_parameters") or data.get("rope_scaling") or {}
        key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: key {key!r} must be an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{source}: {key}.rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
        fields = {f.name for f in attrs.fields(cls)} - {"rope_type", "theta", "partial_rotary_factor"}
        extra = {name: params[name] for name in fields if params.get(name) is not None}
        if "original_max_position_embeddings" not in extra and rope_type in ("llama3", "yarn"):
            extra["original_max_position_embeddings"] = data.get("max_position_embeddings")
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
        for name in needed.get(rope_type, ()):
            if name not in extra:
                raise ConfigError(f"{source}: {key}.{name} is required for rope_type {rope_type!r}")
        try:
            return cls(rope_type=rope_type, theta=float(theta), partial_rotary_factor=float(partial), **extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from exc


def check_eos_token_ids(value: Any, vocab_size: int) -> None:
    """Raises ValueError naming ``eos_token_id`` when an id of `value` (an int or a list of ints)
    is not a token of the model's vocabulary: the model never samples it, so generation would
    run on to max_tokens without a word."""
    if value is None:
        return
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"key 'eos_token_id': expected an int or a list of ints, got {value!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"key 'eos_token_id': {outside[0]} is outside the vocabulary (vocab_size {vocab_size}: "
            f"ids 0..{vocab_size - 1})"
        )


def check_generation_config(model_dir: Path, vocab_size: int) -> None:
    """Refuses an ``eos_token_id`` of ``generation_config.json`` (read before config.json's by the
    tokenizer) outside the model's vocabulary, naming the file, the key, the id and the size."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return
    value = read_json(path).get("eos_token_id")
    try:
        check_eos_token_ids(value, vocab_size)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# The common decoder config
# ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DecoderConfig:
    """Fields every decoder-only transformer in the zoo has; architectures subclass it."""

    architectures: list = hf(kind=list)
    model_type: str = hf("", kind=str)
    vocab_size: int = hf(kind=int)
    hidden_size: int = hf(kind=int)
    num_hidden_layers: int = hf(kind=int)
    num_attention_heads: int = hf(kind=int)
    num_key_value_heads: int | None = hf(None, kind=int)
    head_dim: int | None = hf(None, kind=int)
    intermediate_size: int = hf(0, kind=int)
    hidden_act: str = hf("silu", kind=str)
    rms_norm_eps: float = hf(1e-6, kind=float)
    max_position_embeddings: int = hf(32768, kind=int)
    tie_word_embeddings: bool = hf(False, kind=bool)
    attention_bias: bool = hf(False, kind=bool)
    bos_token_id: Any = hf(None, kind=(int, list))
    eos_token_id: Any = hf(None, kind=(int, list))
    rope: RopeConfig = attrs.field(factory=RopeConfig)

    def __attrs_post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and value < 1:  # a 0 would surface as a ZeroDivisionError or empty tensors
                raise ValueError(f"key {name!r}: expected an int > 0, got {value!r}")
        check_eos_token_ids(self.eos_token_id, self.vocab_size)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf(cls, data: Mapping[str, Any], source: str = "config.json"):
        config = from_hf(cls, data, source)
        return attrs.evolve(config, rope=RopeConfig.from_hf(data, source))


# ---------------------------------------------------------------------------------------------
# Engine settings
# ---------------------------------------------------------------------------------------------

DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str | Any, checkpoint_dtype: str | None = None):
    """A torch dtype from a user's ``dtype`` argument (``"auto"`` follows the checkpoint)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        name = checkpoint_dtype or "float32"
    canonical = DTYPES.get(str(name).lower())
    if canonical is None:
        raise ConfigError(f"dtype {name!r} is not supported (use one of: auto, {', '.join(sorted(set(DTYPES.values())))})")
    return getattr(torch, canonical)
