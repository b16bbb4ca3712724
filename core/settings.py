"""Every environment variable layerzoo reads: one table, and typed accessors over it.

Each variable is declared once in `SETTINGS` (name, type, default, meaning, the files that read
it); code reads it through the accessor of its type (`flag`, `integer`, `seconds`, `text`,
`names`, `pairs`, `path`, `switch`, `is_set`), which looks at the environment at call time (so a
test's ``monkeypatch.setenv`` counts) or at the ``env`` mapping a caller passes instead. A bad
value is a `UserError` naming the variable and what it takes. Reading an undeclared variable, or
one through the wrong accessor, is a `LookupError` (a bug, caught by the first test that runs it).

The README's table of variables is `markdown_table` (``python -m layerzoo.settings`` prints it);
``tests/test_settings.py`` checks that it matches and that every ``LAYERZOO_*`` name in the source
is declared here. This module imports nothing heavy (no torch): ``layerzoo plugins`` reads it.

Most variables are read when the thing they steer happens (a registry built, a model loaded, a
step planned). The ``*_GEMV_ROWS`` tuning knobs are read when their module is imported, since the
decode path compares against them on every linear call, and ``TRITON_INTERPRET`` where the kernels
are decorated, since ``triton.jit`` fixes interpreted or compiled at that moment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from layerzoo.errors import UserError

Env = Mapping[str, str]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: how it is typed, what it does, and who reads it.

    ``kind`` names the accessor that parses it; ``default`` is what an unset (or, except for
    ``names``, empty) variable means; ``read_by`` lists the files (paths from the repository root)
    that read it; ``owner`` is who defines it where that is not layerzoo (torchrun, glibc, ...)."""

    name: str
    kind: str
    default: object
    meaning: str
    read_by: tuple[str, ...]
    owner: str = "layerzoo"


def _s(name, kind, default, meaning, *read_by, owner="layerzoo") -> Setting:
    return Setting(name, kind, default, meaning, tuple(read_by), owner)


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # plugins
    _s("LAYERZOO_PLUGINS", "names", None, "load only these plugin entry points (empty: none); built-ins always load",
       "core/plugins/manager.py"),
    _s("LAYERZOO_DISABLE_PLUGINS", "names", None, "never load these plugin entry points", "core/plugins/manager.py"),
    _s("LAYERZOO_PREFER", "pairs", None, "which plugin serves a name (an architecture, a speculative method) that several plugins register",
       "core/plugins/manager.py"),
    # kernels
    _s("LAYERZOO_KERNEL_BACKEND", "text", None, "run every kernel op on this backend (torch, triton, cpp) instead of the device's choice",
       "core/plugins/kernel_registry.py", "core/engine_args.py"),
    _s("LAYERZOO_CPP_KERNELS", "flag", True, "0: never build or load the C++ CPU kernels (torch ops instead)", "kernels/cpp_build.py"),
    _s("LAYERZOO_CPU_MARCH", "text", "native", "the -march the C++ kernels are built for (e.g. haswell: an AVX2 build on an AVX-512 host, "
       "with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 for torch's own ops; read at import)", "kernels/cpp_build.py"),
    _s("LAYERZOO_KERNEL_CACHE", "path", None, "where built C++ kernels are cached (default: layerzoo/cpp-kernels under $XDG_CACHE_HOME or ~/.cache)",
       "kernels/cpp_build.py"),
    _s("LAYERZOO_FUSED_DECODE", "flag", True, "0: run CPU decode layers op by op instead of one fused C++ call per layer",
       "core/layers/fused_decode.py"),
    _s("LAYERZOO_CPU_PACKED_LINEAR", "flag", True, "0: keep CPU linear weights as they are instead of packing them for oneDNN at load",
       "core/layers/linear.py"),
    _s("LAYERZOO_FP32_GEMV_ROWS", "int", 32, "up to this many rows (at most 32) a packed fp32/bf16 linear runs the C++ GEMV (read at import)",
       "core/layers/linear.py"),
    _s("LAYERZOO_AMX_BF16_GEMV_ROWS", "int", 4, "the same limit for bf16 linears in oneDNN's AMX layout (read at import)",
       "core/layers/linear.py"),
    _s("LAYERZOO_GGUF_GEMV_ROWS", "int", 8, "up to this many rows a GGUF-block linear runs the C++ GEMV (read at import)",
       "core/layers/gguf_linear.py"),
    _s("LAYERZOO_FP8_GEMV_ROWS", "int", 4, "up to this many rows a CPU FP8 linear runs the C++ GEMV (read at import)",
       "core/layers/fp8_linear.py"),
    _s("LAYERZOO_INT4_GEMV_ROWS", "int", 4, "up to this many rows a CPU 4-bit linear runs the C++ GEMV (read at import)",
       "core/layers/int4_linear.py"),
    _s("LAYERZOO_MXFP4_GEMV_ROWS", "int", 32, "up to this many rows an MXFP4 expert runs the C++ GEMV (read at import)",
       "kernels/mxfp4_matmul/cpu.py"),
    # engine
    _s("LAYERZOO_MLA_PREFIX_SKIP", "flag", False, "1: keep prefix caching on with local-MLA prefill (accepts its approximation)",
       "core/plugins/capabilities.py"),
    _s("LAYERZOO_THREAD_GOVERNOR", "flag", True, "0: never drop to one CPU thread while other processes hold the cores",
       "core/runtime/cpu_contention.py"),
    _s("LAYERZOO_TP_TIMEOUT_S", "seconds", 1800.0, "seconds a tensor-parallel collective waits for a peer before failing",
       "core/runtime/tensor_parallel.py"),
    _s("LAYERZOO_MALLOC_TUNING", "flag", True, "0: leave glibc malloc's mmap and trim thresholds as they are", "core/runtime/malloc.py"),
    _s("LAYERZOO_PROGRESS", "flag", None, "1 or 0: show or hide progress bars (default: shown on a terminal)", "core/entrypoints/progress.py"),
    _s("LAYERZOO_API_KEY", "text", None, "the key `layerzoo serve` requires when --api-key is not given", "core/entrypoints/cli.py"),
    # tests and benchmarks
    _s("LAYERZOO_TEST_DEVICE", "text", "cpu", "device the kernel tests run on (e.g. cuda)",
       "core/testing/__init__.py", "tests/kernels/conftest.py", owner="tests"),
    _s("LAYERZOO_HYPOTHESIS_EXAMPLES", "int", 60, "examples the scheduler's stateful property test runs", "tests/test_scheduler.py",
       owner="tests"),
    _s("LAYERZOO_GPU_CHECK_GRAPHS", "flag", True, "0: bench/gpu_check.sh skips its decode-graph part", "bench/gpu_check.sh", owner="tests"),
    # defined by others, read by layerzoo
    _s("OMP_NUM_THREADS", "text", None, "set: torch's thread count is the user's (no default sizing, no thread governor)",
       "core/runtime/threads.py", "core/llm.py", owner="OpenMP"),
    _s("MALLOC_MMAP_THRESHOLD_", "present", None, "set: glibc's own setting wins over LAYERZOO_MALLOC_TUNING", "core/runtime/malloc.py",
       owner="glibc"),
    _s("MALLOC_TRIM_THRESHOLD_", "present", None, "set: glibc's own setting wins over LAYERZOO_MALLOC_TUNING", "core/runtime/malloc.py",
       owner="glibc"),
    _s("TRITON_INTERPRET", "switch", False, "1/true/on: Triton kernels run in its interpreter (CPU tensors, for tests)",
       "core/engine_args.py", "kernels/triton_common.py", "kernels/paged_attention/triton.py", "kernels/mxfp4_matmul/triton.py",
       "kernels/moe_routing/triton.py", "kernels/moe_grouped_matmul/triton.py", "kernels/sampling/triton.py",
       owner="Triton"),
    _s("HF_HUB_OFFLINE", "text", None, "1/on/yes/true: never ask the hub, use the local cache", "core/loading/hub.py", owner="huggingface_hub"),
    _s("TRANSFORMERS_OFFLINE", "text", None, "read as HF_HUB_OFFLINE when that is unset", "core/loading/hub.py", owner="huggingface_hub"),
    _s("RANK", "int", None, "this process's rank under torchrun", "core/runtime/tensor_parallel.py", owner="torchrun"),
    _s("WORLD_SIZE", "int", None, "the number of ranks under torchrun", "core/runtime/tensor_parallel.py", owner="torchrun"),
    _s("LOCAL_RANK", "int", None, "the rank on this machine (default RANK)", "core/runtime/tensor_parallel.py", owner="torchrun"),
    _s("LOCAL_WORLD_SIZE", "int", None, "the ranks on this machine (default WORLD_SIZE)", "core/runtime/tensor_parallel.py",
       owner="torchrun"),
    _s("XDG_CACHE_HOME", "path", None, "the cache folder LAYERZOO_KERNEL_CACHE defaults under (else ~/.cache)", "kernels/cpp_build.py",
       owner="XDG"),
    _s("CXX", "text", "c++", "the C++ compiler the C++ kernels are built with", "kernels/cpp_build.py", owner="torch cpp_extension"),
)}

WHAT_IT_TAKES = {
    "flag": "0 or 1 (or false/true, no/yes, off/on)",
    "int": "a whole number >= 0",
    "seconds": "a number of seconds > 0",
    "text": "a string",
    "names": "comma-separated names",
    "pairs": "comma-separated Name=plugin pairs",
    "path": "a folder",
    "switch": "1/true/on, else off",
    "present": "any value",
}


def _declared(name: str, kind: str) -> Setting:
    setting = SETTINGS.get(name)
    if setting is None:
        raise LookupError(f"{name} is not declared in layerzoo.settings.SETTINGS")
    if setting.kind != kind:
        raise LookupError(f"{name} is a {setting.kind!r} setting, read as {kind!r}")
    return setting


def _raw(name: str, env: Env | None) -> str | None:
    return (os.environ if env is None else env).get(name)


def _bad(setting: Setting, raw: str) -> UserError:
    return UserError(f"{setting.name}: expected {WHAT_IT_TAKES[setting.kind]}, got {raw!r}")


def flag(name: str, env: Env | None = None) -> bool | None:
    """A yes/no variable: True or False, or its default (None for a tri-state one) when unset or empty."""
    setting = _declared(name, "flag")
    raw = _raw(name, env)
    if not raw:
        return setting.default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise _bad(setting, raw)


def integer(name: str, env: Env | None = None) -> int | None:
    """A count (>= 0), or the default when unset or empty."""
    setting = _declared(name, "int")
    raw = _raw(name, env)
    if not raw:
        return setting.default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(setting, raw) from None
    if value < 0:
        raise _bad(setting, raw)
    return value


def seconds(name: str, env: Env | None = None) -> float:
    """A duration (> 0 s), or the default when unset or empty."""
    setting = _declared(name, "seconds")
    raw = _raw(name, env)
    if not raw:
        return setting.default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(setting, raw) from None
    if not value > 0:
        raise _bad(setting, raw)
    return value


def text(name: str, env: Env | None = None) -> str | None:
    """The value as given, or the default when unset or empty."""
    return _raw(name, env) or _declared(name, "text").default


def names(name: str, env: Env | None = None) -> list[str] | None:
    """A comma-separated list; None when unset, and an empty list when set to nothing."""
    _declared(name, "names")
    raw = _raw(name, env)
    if raw is None:
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


def pairs(name: str, env: Env | None = None) -> dict[str, str]:
    """``Key=value,...`` as a dict (empty when unset); an item without ``=`` is a `UserError`."""
    setting = _declared(name, "pairs")
    raw = _raw(name, env) or ""
    out = {}
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise _bad(setting, raw)
        out[key.strip()] = value.strip()
    return out


def path(name: str, env: Env | None = None) -> Path | None:
    """A folder (``~`` expanded), or the default when unset or empty."""
    setting = _declared(name, "path")
    raw = _raw(name, env)
    return Path(raw).expanduser() if raw else setting.default


def switch(name: str, env: Env | None = None) -> bool:
    """Another tool's on/off variable, read as that tool reads it (never an error): 1/true/on."""
    _declared(name, "switch")
    return (_raw(name, env) or "").strip().lower() in ("1", "true", "on")


def is_set(name: str, env: Env | None = None) -> bool:
    """Whether a variable whose mere presence counts is in the environment."""
    _declared(name, "present")
    return name in (os.environ if env is None else env)


SHORT = {"flag": "0/1", "int": "count", "seconds": "seconds", "text": "string", "names": "a,b,...", "pairs": "Name=plugin,...",
         "path": "folder", "switch": "0/1", "present": "any"}


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(int(default))
    return f"{default:g}" if isinstance(default, float) else str(default)


def markdown_table() -> str:
    """The README's table: every variable layerzoo itself defines, what it takes and does."""
    rows = ["| variable | takes | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        if s.owner != "layerzoo":
            continue
        rows.append(f"| `{s.name}` | {SHORT[s.kind]} | {_shown(s.default)} | {s.meaning} |")
    others = ", ".join(f"`{s.name}` ({s.owner})" for s in SETTINGS.values() if s.owner not in ("layerzoo", "tests"))
    tests = ", ".join(f"`{s.name}`" for s in SETTINGS.values() if s.owner == "tests")
    return "\n".join(rows) + f"\n\nFor tests and benchmarks: {tests}. Also read, as their owners define them: {others}.\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
