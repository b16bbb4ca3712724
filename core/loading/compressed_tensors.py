"""Checkpoints quantized with compressed-tensors (llm-compressor's format) as int8: W8A8 and W8A16.

Such a checkpoint says so in ``config.json``::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head"]}

and stores each quantized linear as ``<name>.weight`` (int8 ``[N, K]``) and ``<name>.weight_scale``
(``[N, 1]`` per channel, or ``[1]`` per tensor), sometimes with an all-zero
``<name>.weight_zero_point``. The layouts read here are the unpacked ones (``int-quantized``,
``naive-quantized``) with 8-bit symmetric int weights; ``pack-quantized`` (4-bit) and
``float-quantized`` (FP8) are `layerzoo.loading.hub_quantization`'s; anything else (groups, asymmetric
int8) is refused with the key that says so.

Loading goes through the strict loader unchanged: `DequantizedCheckpoint` shows every int8 weight
as ``q * scale`` in fp32 and hides the scale tensors; the engine then runs ``quantization="int8"``,
which quantizes them again in blocks of 32 inputs with a scale each (Q8_0): a block's step is never
coarser than its channel's, so each weight comes back within half a step of the checkpoint's.
Activations are rounded to int16 per 32 inputs by the decode GEMV and the prefill GEMM, whatever
the checkpoint's ``input_activations`` say (W8A16 checkpoints included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from layerzoo.errors import UserError
from layerzoo.loading.loader import Checkpoint

# Tensors that only describe quantization; the dequantized weight replaces them.
SIDECARS = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point", "weight_g_idx")
UNPACKED_FORMATS = ("int-quantized", "naive-quantized")
HUB_FORMATS = ("pack-quantized", "float-quantized")  # 4-bit int and FP8 weights: `layerzoo.loading.hub_quantization`


def compressed_int8_scheme(hf_config: dict[str, Any], where: str | Path = "config.json") -> str | None:
    """``"int8"`` for a compressed-tensors int8 checkpoint this module reads, None when the config
    has no compressed-tensors ``quantization_config``; a `UserError` naming the key otherwise."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    key = f"{where}: quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{key}.config_groups: expected a non-empty object of quantization groups")
    for name, group in groups.items():
        fmt = (group or {}).get("format") or qc.get("format")
        if fmt in HUB_FORMATS:
            return None  # layerzoo.loading.hub_quantization reads them as linear methods
        if fmt not in UNPACKED_FORMATS:
            raise UserError(f"{key}.format: {fmt!r} is not supported; expected one of {', '.join(UNPACKED_FORMATS)} "
                            f"(int8 weights stored unpacked)")
        weights = (group or {}).get("weights") or {}
        checks = (("num_bits", 8), ("type", "int"), ("symmetric", True))
        for field, expected in checks:
            if weights.get(field) != expected:
                raise UserError(f"{key}.config_groups.{name}.weights.{field}: expected {expected!r}, got "
                                f"{weights.get(field)!r} (only symmetric 8-bit int weights are supported)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise UserError(f"{key}.config_groups.{name}.weights.strategy: expected 'channel' or 'tensor', got "
                            f"{weights.get('strategy')!r}")
    return "int8"


class DequantizedCheckpoint(Checkpoint):
    """A compressed-tensors checkpoint seen as a plain one: int8 weights with a ``weight_scale``
    read as fp32 ``q * scale``; the scale, zero-point and input-scale tensors are hidden."""

    @classmethod
    def wrap(cls, checkpoint: Checkpoint) -> DequantizedCheckpoint:
        tensors = dict(checkpoint._tensors)
        scaled = {}
        for name in list(tensors):
            prefix, _, leaf = name.rpartition(".")
            if leaf not in SIDECARS:
                continue
            del tensors[name]
            if leaf == "weight_scale":
                scaled[f"{prefix}.weight" if prefix else "weight"] = name
        view = cls(checkpoint.directory, tensors)
        view._source, view._scales = checkpoint, scaled
        for weight, scale in scaled.items():
            if weight not in tensors or checkpoint.dtype(weight) != torch.int8:
                raise UserError(f"{checkpoint.file(scale)}: {scale!r} has no int8 {weight!r} beside it")
            zero = weight + "_zero_point"
            if zero in checkpoint and bool(checkpoint.get(zero).any()):
                raise UserError(f"{checkpoint.file(zero)}: {zero!r} is not all zero (asymmetric int8 is not supported)")
        return view

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self._scales else self._source.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._source.get(name)
        scale_name = self._scales.get(name)
        if scale_name is None:
            return tensor
        scale = self._source.get(scale_name).float()
        rows = tensor.shape[0]
        if scale.numel() not in (1, rows):
            raise UserError(f"{self._source.file(scale_name)}: {scale_name!r} has shape {tuple(scale.shape)}, expected "
                            f"[{rows}, 1] (per channel) or [1] (per tensor) for {name!r} of shape {tuple(tensor.shape)}")
        return tensor.float() * scale.reshape(-1, *([1] * (tensor.dim() - 1)))

    def _handle(self, path: Path):
        return self._source._handle(path)
