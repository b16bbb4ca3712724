"""What every linear method answers: one module class per weight format.

A model's projections are built as plain ``nn.Linear`` (the loader checks names and shapes against
them); at load each is replaced by the module of the format its weight is kept in, chosen once per
layer from the checkpoint (a GGUF tensor type, ``quantization_config``) or ``quantization=``. The
method owns its tensors and its forward, ``x [T, in] -> [T, out]``; the runtime asks it, never the
tensors, how to multiply: the fused CPU decode layer through `fused_part`, tests and
``dtype=`` conversions through `dequantized_weight`. Plugins get every format through the core's
linears without a line of their own.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn


@attrs.frozen
class FusedPart:
    """One linear as the fused CPU decode call (``layerzoo_cpu::decode_layer``) takes it."""

    fields: tuple[int, int, int, int, int]  # w_ptr, N, K, w_bytes, block (see decode_layer_cpu.cpp)
    bias: torch.Tensor | None
    weight: torch.Tensor | None  # the tensor a format passes by value (GGUF blocks); None when reached by w_ptr
    rows: int  # the most rows its kernel takes
    dtype: torch.dtype  # of its activations


class LinearMethod(nn.Module):
    """Base of the per-format linear modules: ``in_features``, ``out_features``, ``bias`` (fp32 or
    the run dtype, or None) and the three questions below."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        """Called once after the strict load: repack the loaded tensors into the kernels' layout."""

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as a float ``[out, in]`` tensor (a copy for a quantized format)."""
        raise NotImplementedError

    def fused_part(self) -> FusedPart | None:
        """How the fused CPU decode layer (`layerzoo.layers.fused_decode`) runs this linear, or None
        where it cannot (the layer then decodes op by op)."""
        return None

    def weight_bytes(self) -> int:
        """Bytes the weight occupies in memory (what a decode step reads)."""
        return sum(t.numel() * t.element_size() for t in self.buffers()) + sum(
            p.numel() * p.element_size() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
