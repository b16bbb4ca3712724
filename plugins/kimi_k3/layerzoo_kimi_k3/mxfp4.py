"""MXFP4 weights as compressed-tensors stores them (``mxfp4-pack-quantized``, groups of 32): the
checkpoint's ``quantization_config`` checked. The experts keep the codes and scales; the format's
definition and kernels are `layerzoo.kernels.mxfp4_matmul` (``reference.dequantize``).

A logical weight ``W [out, in]`` is stored as ``weight_packed [out, in / 2]`` (uint8, two E2M1
codes per byte, the even column in the LOW nibble) and ``weight_scale [out, in / 32]`` (uint8,
E8M0: one power-of-two exponent ``2^(s - 127)`` per 32 consecutive input columns), no global
scale, no zero point::

    W[n, j] = E2M1(code(n, j)) * 2^(scale[n, j // 32] - 127)
    E2M1(c) = (-1)^(c >> 3) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]
"""

from __future__ import annotations

from layerzoo.kernels.mxfp4_matmul.reference import GROUP


def check_quantization_config(config: dict) -> None:
    """Accept compressed-tensors MXFP4 (4-bit weights in groups of 32, no activation quantisation);
    raise ValueError naming anything else."""
    method, fmt = config.get("quant_method"), config.get("format")
    groups = config.get("config_groups") or {}
    formats = {g.get("format", fmt) for g in groups.values() if isinstance(g, dict)} or {fmt}
    if method != "compressed-tensors" or formats != {"mxfp4-pack-quantized"}:
        raise ValueError(
            f"quantization_config: {method} / {', '.join(map(str, sorted(formats, key=str)))} is not supported "
            f"(only compressed-tensors mxfp4-pack-quantized experts)"
        )
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits", 4) != 4 or weights.get("group_size", GROUP) != GROUP:
            raise ValueError(f"quantization_config.config_groups.{name}.weights: expected num_bits 4 and group_size {GROUP}")
        if (group or {}).get("input_activations"):
            raise ValueError(f"quantization_config.config_groups.{name}.input_activations: activation quantisation is not supported")

