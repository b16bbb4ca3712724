"""`EngineArgs`: every setting of a running engine, in one frozen record.

The `LLM` constructor's keyword arguments, the CLI's engine flags and the capability queries'
``engine_config`` argument are all this record. It holds plain values only (no torch objects
are built here), so that it can travel to other processes and be printed.
"""

from __future__ import annotations

from typing import Any

import attrs

from layerzoo.errors import UserError
from layerzoo.kv_cache import parse_kv_cache_dtype
from layerzoo.speculative.config import SpeculativeConfig


def check_kv_cache_dtype(_instance, _attribute, value) -> None:
    """attrs validator for ``kv_cache_dtype``."""
    parse_kv_cache_dtype(value)


def check_calibration_tokens(_instance, _attribute, value) -> None:
    """attrs validator for ``fp8_calibration_tokens`` (0: no calibration, scale 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"fp8_calibration_tokens: expected an int >= 0, got {value!r}")


QUANTIZATION_METHODS = ("int8",)


def check_quantization(_instance, _attribute, value) -> None:
    """attrs validator for ``quantization``."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise UserError(f"quantization: expected None or one of {', '.join(map(repr, QUANTIZATION_METHODS))}, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """How the engine loads and runs a model (the `LLM` constructor's keyword arguments)."""

    dtype: Any = "auto"  # "auto" (the checkpoint's dtype; fp32 on CPU), "float32", "bfloat16", ...
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: float | int = 0.25  # a fraction of available memory, or bytes
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    loop_watchdog: bool = False  # re-steer every request out of repetition loops (per request: SamplingParams)
    enforce_eager: bool = False  # never capture decode graphs
    # KV storage: "auto" (the model's dtype) or "fp8_e4m3" (alias "fp8"; per-layer K and V scales)
    kv_cache_dtype: str = attrs.field(default="auto", validator=check_kv_cache_dtype)
    # FP8 KV without checkpoint scales: calibrate online over the first N tokens (0: fixed scale 1.0)
    fp8_calibration_tokens: int = attrs.field(default=512, validator=check_calibration_tokens)
    # Models with recurrent state (Gated DeltaNet, Mamba2): prefix-cache state snapshots kept, and
    # rollback-ring snapshots per sequence for the loop watchdog's re-steer.
    ssm_snapshot_slots: int = attrs.field(default=16, validator=attrs.validators.ge(0))
    ssm_ring_depth: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    # Also snapshot recurrent state every N blocks inside prompts, so that a prefix shared only in
    # part (a system prompt) resumes too; 0: only at each prompt's end and at chunk ends.
    ssm_snapshot_interval: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # Speculative decoding, written the way vLLM users write it:
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None, converter=attrs.converters.optional(SpeculativeConfig.parse)
    )
    # Weight quantization of every linear layer: None (the compute dtype) or "int8" (per-output-
    # channel scales, an int8 GEMM; layerzoo.layers.linear). Checkpoints already quantized as
    # compressed-tensors int8 load as "int8" whatever this says.
    quantization: str | None = attrs.field(default=None, validator=check_quantization)
    # When a layer cannot drop rejected drafts: run without speculation (and log why) instead of
    # refusing to start.
    speculative_fallback: bool = False

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in attrs.fields(cls))
