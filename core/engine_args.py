"""`EngineArgs`: every setting of a running engine, in one frozen record.

The `LLM` constructor's keyword arguments, the CLI's engine flags and the capability queries'
``engine_config`` argument are all this record. It holds plain values only (no torch objects
are built here), so that it can travel to other processes and be printed.
"""

from __future__ import annotations

from typing import Any

import attrs

from layerzoo import settings
from layerzoo.errors import UserError
from layerzoo.layers.kv_cache import parse_kv_cache_dtype
from layerzoo.speculative.config import SpeculativeConfig


def check_kv_cache_dtype(_instance, _attribute, value) -> None:
    """attrs validator for ``kv_cache_dtype``."""
    parse_kv_cache_dtype(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(_instance, attribute, value) -> None:
    """attrs validator: an int >= 1 (bools and floats are refused, not truncated)."""
    if not _is_int(value) or value < 1:
        raise UserError(f"{attribute.name}: expected an int >= 1, got {value!r}")


def non_negative_int(_instance, attribute, value) -> None:
    """attrs validator: an int >= 0 (bools and floats are refused, not truncated)."""
    if not _is_int(value) or value < 0:
        raise UserError(f"{attribute.name}: expected an int >= 0, got {value!r}")


def optional_positive_int(_instance, attribute, value) -> None:
    """attrs validator: None (unset) or an int >= 1; 0 is refused rather than read as "unset"."""
    if value is not None:
        positive_int(_instance, attribute, value)


def strict_bool(_instance, attribute, value) -> None:
    """attrs validator: True or False only (``'no'`` is truthy, so strings are refused)."""
    if not isinstance(value, bool):
        raise UserError(f"{attribute.name}: expected True or False, got {value!r}")


def check_kv_cache_memory(_instance, attribute, value) -> None:
    """attrs validator: bytes (an int > 0) or a fraction of available memory in (0, 1]."""
    ok = (_is_int(value) and value > 0) or (isinstance(value, float) and 0 < value <= 1)
    if not ok:
        raise UserError(f"{attribute.name}: expected bytes (an int > 0) or a fraction in (0, 1], got {value!r}")


def dtype_name(value: Any) -> Any:
    """attrs converter: a torch dtype object becomes its name (``torch.float32`` → ``"float32"``)."""
    module = type(value).__module__
    if module == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    return value


def check_dtype(_instance, attribute, value) -> None:
    """attrs validator for ``dtype``: "auto" or a dtype name layerzoo runs."""
    from layerzoo.config import DTYPES

    if not isinstance(value, str) or (value != "auto" and value.lower() not in DTYPES):
        names = ", ".join(sorted(set(DTYPES.values())))
        raise UserError(f"{attribute.name}: expected 'auto' or one of {names} (or a torch dtype), got {value!r}")


def check_device(_instance, attribute, value) -> None:
    """attrs validator for ``device``: a torch device string that exists on this machine."""
    import torch

    if not isinstance(value, str):
        raise UserError(f"{attribute.name}: expected a device string such as 'cpu' or 'cuda', got {value!r}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise UserError(f"{attribute.name}: {value!r} is not a torch device (expected 'cpu', 'cuda' or 'cuda:N')") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{attribute.name}: {value!r} asked for, but CUDA is not available here (use device='cpu')")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{attribute.name}: {value!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif device.type != "cpu":
        raise UserError(f"{attribute.name}: device type {device.type!r} is not supported (expected 'cpu' or 'cuda')")


def check_calibration_tokens(_instance, _attribute, value) -> None:
    """attrs validator for ``fp8_calibration_tokens`` (0: no calibration, scale 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"fp8_calibration_tokens: expected an int >= 0, got {value!r}")


def an_int(_instance, attribute, value) -> None:
    """attrs validator: any int (not a bool)."""
    if not _is_int(value):
        raise UserError(f"{attribute.name}: expected an int, got {value!r}")


def check_mla_prefill(_instance, _attribute, value) -> None:
    """attrs validator for ``mla_prefill`` (see `layerzoo.layers.mla`)."""
    if value not in ("paged", "local"):
        raise UserError(f"mla_prefill: expected 'paged' or 'local', got {value!r}")


QUANTIZATION_METHODS = ("int8",)


def check_quantization(_instance, _attribute, value) -> None:
    """attrs validator for ``quantization``."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise UserError(f"quantization: expected None or one of {', '.join(map(repr, QUANTIZATION_METHODS))}, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """How the engine loads and runs a model (the `LLM` constructor's keyword arguments)."""

    # "auto" (the checkpoint's dtype; fp32 on CPU), "float32", "bfloat16", ... (a torch dtype is named)
    dtype: Any = attrs.field(default="auto", converter=dtype_name, validator=check_dtype)
    device: str = attrs.field(default="cpu", validator=check_device)
    seed: int = attrs.field(default=0, validator=an_int)
    max_num_seqs: int = attrs.field(default=64, validator=positive_int)
    # Tokens one step may run. None: 512 on CPU, 2048 elsewhere (`default_step_budget`).
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=optional_positive_int)
    # a fraction of available memory, or bytes
    kv_cache_memory: float | int = attrs.field(default=0.25, validator=check_kv_cache_memory)
    block_size: int = attrs.field(default=16, validator=positive_int)
    enable_prefix_caching: bool = attrs.field(default=True, validator=strict_bool)
    # None: the model's max_position_embeddings; more than that is refused at start, not clamped
    max_model_len: int | None = attrs.field(default=None, validator=optional_positive_int)
    enable_chunked_prefill: bool = attrs.field(default=True, validator=strict_bool)
    # re-steer every request out of repetition loops (per request: SamplingParams)
    loop_watchdog: bool = attrs.field(default=False, validator=strict_bool)
    enforce_eager: bool = attrs.field(default=False, validator=strict_bool)  # never capture decode graphs
    # On CPU, run decode steps as torch.compile'd steps, one per batch bucket and block-table width.
    # Opt-in: steps get 1.2-1.7x faster but each compile takes minutes, paid back only after
    # thousands of steps (bench/decode_graphs.py). CUDA captures CUDA graphs unless enforce_eager.
    compile_decode: bool = attrs.field(default=False, validator=strict_bool)
    # KV storage: "auto" (the model's dtype) or "fp8_e4m3" (alias "fp8"; per-layer K and V scales)
    kv_cache_dtype: str = attrs.field(default="auto", validator=check_kv_cache_dtype)
    # FP8 KV without checkpoint scales: calibrate online over the first N tokens (0: fixed scale 1.0)
    fp8_calibration_tokens: int = attrs.field(default=512, validator=check_calibration_tokens)
    # Models with recurrent state (Gated DeltaNet, Mamba2): prefix-cache state snapshots kept, and
    # rollback-ring snapshots per sequence for the loop watchdog's re-steer.
    ssm_snapshot_slots: int = attrs.field(default=16, validator=non_negative_int)
    ssm_ring_depth: int = attrs.field(default=2, validator=non_negative_int)
    # Also snapshot recurrent state every N blocks inside prompts, so that a prefix shared only in
    # part (a system prompt) resumes too; 0: only at each prompt's end and at chunk ends.
    ssm_snapshot_interval: int = attrs.field(default=0, validator=non_negative_int)
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
    speculative_fallback: bool = attrs.field(default=False, validator=strict_bool)
    # torch's intra-op threads; None: OMP_NUM_THREADS if set, else the CPUs this process may use
    num_threads: int | None = attrs.field(default=None, validator=optional_positive_int)
    # MLA prefill: "paged" expands the cached latents of the whole context; "local" only the
    # chunk's own (no prefix matching, chunking, forked tails or verifies past position 0).
    mla_prefill: str = attrs.field(default="paged", validator=check_mla_prefill)
    # Ranks the model is split over (tensor parallelism): the engine spawns N-1 worker processes,
    # or joins the torchrun group when RANK / WORLD_SIZE are set (layerzoo.runtime.tensor_parallel).
    tensor_parallel_size: int = attrs.field(default=1, validator=positive_int)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in attrs.fields(cls))


# -- checks that need the model ------------------------------------------------------------------


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    """The context length to run with: the model's own unless asked for less; more is refused."""
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise UserError(
            f"max_model_len: {requested} is beyond the model's limit (max_position_embeddings = {model_limit}); "
            f"use max_model_len <= {model_limit} or leave it unset"
        )
    return requested


def check_kv_cache_fits(num_blocks: int, block_size: int, max_model_len: int, kv_cache_memory: float | int) -> None:
    """Refuse to start when the KV cache cannot hold one sequence of ``max_model_len`` tokens.

    Otherwise long requests would be cut short with ``length`` without a word (vLLM refuses too).
    """
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return
    fits = num_blocks * block_size
    raise UserError(
        f"kv_cache_memory: the KV cache holds {num_blocks} blocks of {block_size} tokens ({fits} tokens), but one "
        f"sequence of max_model_len={max_model_len} tokens needs {needed} blocks; raise kv_cache_memory "
        f"(now {kv_cache_memory!r}) or lower max_model_len to at most {fits}"
    )


def check_kernel_backend(device: str, env: dict[str, str] | None = None) -> None:
    """Refuse a ``LAYERZOO_KERNEL_BACKEND`` that cannot run here, before any model step.

    An unknown name would otherwise be ignored without a word, and ``triton`` on CPU fails deep
    inside the first kernel launch.
    """
    from layerzoo.plugins.kernel_registry import BACKEND_ENV, kernel_ops
    from layerzoo.plugins.manager import get_registry

    value = settings.text(BACKEND_ENV, env)
    if value is None:
        return
    known = {backend for regs in kernel_ops(get_registry()).values() for backend in regs}
    if value not in known:
        raise UserError(f"{BACKEND_ENV}: unknown kernel backend {value!r} (expected one of: {', '.join(sorted(known))})")
    interpreted = settings.switch("TRITON_INTERPRET", env)
    if value == "triton" and not device.startswith("cuda") and not interpreted:
        raise UserError(
            f"{BACKEND_ENV}=triton: Triton kernels need a CUDA device (device={device!r}); unset it, or set "
            f"TRITON_INTERPRET=1 to interpret them on CPU (slow, for kernel tests)"
        )


# On CPU a prefill GEMM is about as efficient at 512 rows as at 1000+ (fp32 oneDNN on 2 AVX2 cores:
# within noise from 256 rows up), so a smaller step costs little throughput and lets requests that
# arrive together finish their prompts one after another instead of all at the end of one long
# step. bench/throughput.py --size 0.6b, 8 requests x ~128 tokens arriving at once: budget 512 gave
# 5.7-6.2 s mean time to first token against 8.0-8.7 s at 2048, at the same or higher output tok/s.
CPU_STEP_BUDGET = 512
DEVICE_STEP_BUDGET = 2048


def default_step_budget(args: EngineArgs) -> int:
    """``args.max_num_batched_tokens``, or the device's default when it is None."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return CPU_STEP_BUDGET if str(args.device).startswith("cpu") else DEVICE_STEP_BUDGET
