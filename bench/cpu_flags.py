"""What every benchmark prints first: the CPU torch dispatches for, and the instructions the fast
paths rely on (fp32 GEMM: AVX2/FMA or AVX-512; int8 GEMM: AVX2 ``vpmaddubsw`` or VNNI; bf16:
AVX-512 BF16 or AMX). Figures from machines that differ here are not comparable."""

from __future__ import annotations

import os

# Flags from /proc/cpuinfo that decide which GEMM kernels oneDNN / fbgemm pick.
RELEVANT = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cpu_summary() -> str:
    """One line: model, torch's CPU capability, and which relevant flags are present or missing."""
    import torch

    flags = cpu_flags()
    have = [f for f in RELEVANT if f in flags]
    missing = [f for f in RELEVANT if f not in flags]
    return (f"cpu: {cpu_model()} ({os.cpu_count()} cores) | torch.backends.cpu.get_cpu_capability()="
            f"{torch.backends.cpu.get_cpu_capability()} | flags: {' '.join(have) or '-'} | missing: {' '.join(missing) or '-'}")
