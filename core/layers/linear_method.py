"""What every linear method answers: one module class per weight format.

A model's projections are built as plain ``nn.Linear`` (the loader checks names and shapes against
them); at load each is replaced by the module of the format its weight is kept in, chosen once per
layer from the checkpoint (a GGUF tensor type, ``quantization_config``) or ``quantization=``. The
method owns its tensors and its forward, ``x [T, in] -> [T, out]``; the runtime asks it, never the
tensors, how to multiply: the fused CPU decode layer through `fused_part`, tests and
``dtype=`` conversions through `dequantized_weight`, tensor parallelism through `split` (the
format knows where its blocks allow a cut; `layerzoo.layers.parallel_linear.split_like` asks it
with the plain linear's shard). Plugins get every format through the core's linears without a
line of their own.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from layerzoo.distributed.sharding import Shard, set_shard
from layerzoo.errors import UserError


class SplitError(UserError):
    """A linear's weight format cannot cut this tensor-parallel piece (it would fall inside a block,
    a packed word or a scale group); names the layer and the boundary it needs."""


@attrs.frozen
class FusedPart:
    """One linear as the fused CPU decode call (``layerzoo_cpu::decode_layer``) takes it."""

    fields: tuple[int, int, int, int, int]  # w_ptr, N, K, w_bytes, block (see decode_layer_cpu.cpp)
    bias: torch.Tensor | None
    # The tensors a format passes by value (GGUF blocks; int4 nibbles, scale, zero * scale; FP8
    # bytes, scale), at most three; none for a weight reached by w_ptr.
    tensors: tuple[torch.Tensor, ...]
    rows: int  # the most rows its kernel takes
    dtype: torch.dtype  # of its activations


class LinearMethod(nn.Module):
    """Base of the per-format linear modules: ``in_features``, ``out_features``, ``bias`` (fp32 or
    the run dtype, or None) and the questions below."""

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

    def split(self, shard: Shard) -> None:
        """Keep only this rank's piece of the weight, as the plain linear built for ``shard`` would:
        ``shard.dim`` 0 keeps output rows (column-parallel; each of ``shard.sections``, a fused
        ``[q | k | v]``'s parts, splits alone), 1 keeps input columns (row-parallel). Called on the
        meta device, before the load: the format shrinks its tensors and ``in_features`` /
        ``out_features`` to this rank's and records, per tensor, the piece the loader reads
        (`set_shard`); a piece that does not fall on its blocks is a `SplitError`."""
        raise SplitError(f"{type(self).__name__} weights cannot be split across tensor-parallel ranks")

    def _keep_piece(self, attr: str, piece: Shard | None) -> None:
        """Shrink tensor ``attr`` to ``piece`` along its dim and record it for the loader (None:
        every rank loads the whole tensor)."""
        if piece is None:
            return
        old = getattr(self, attr)
        shape = list(old.shape)
        shape[piece.dim] = piece.local_size
        setattr(self, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False))
        set_shard(self, attr, piece)

    def _split_bias(self, shard: Shard) -> None:
        """The bias of a column split keeps this rank's outputs; that of a row split is whole on
        the first rank and zeros elsewhere (the all-reduce adds it once), as the plain linears'."""
        if self.bias is None:
            return
        if shard.dim == 0:
            self._keep_piece("bias", Shard(0, shard.sections, shard.index, shard.count))
        else:
            set_shard(self, "bias", Shard(0, (self.out_features,), 0, 1, zeros=shard.index != 0))

    def _split_features(self, shard: Shard) -> None:
        if shard.dim == 0:
            self.out_features = shard.local_size
        else:
            self.in_features = shard.local_size

    def weight_bytes(self) -> int:
        """Bytes the weight occupies in memory (what a decode step reads)."""
        return sum(t.numel() * t.element_size() for t in self.buffers()) + sum(
            p.numel() * p.element_size() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
