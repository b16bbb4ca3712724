"""FP8 (e4m3) weights from hub checkpoints (compressed-tensors ``float-quantized``, ``quant_method:
"fp8"``), kept one byte a weight: one linear method.

The weight loads as stored (``weight`` float8_e4m3fn ``[N, K]``) with its scale (``weight_scale``
``[N, 1]`` per channel or ``[1]`` per tensor; ``weight_scale_inv`` or ``weight_scale``
``[ceil(N/bn), ceil(K/bk)]`` per block of ``weight_block_size``); `process_weights_after_loading`
expands the scale to fp32 ``[N, K/group]`` rows (`layerzoo.kernels.fp8_matmul`). Activations stay in
the run dtype (the weights are exact; no activation quantization).

Under tensor parallelism (`FP8Linear.split`) the weight splits by rows or columns as a plain one; a
per-channel scale follows the output rows (whole under a row split), a per-tensor one is whole,
a block scale splits with its blocks: a piece must hold whole blocks.

Few rows on CPU run the C++ GEMV (e4m3 → fp32 in registers); more rows dequantize into the shared
fp32 scratch matrix and multiply there; CUDA runs the Triton kernel; elsewhere the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo import settings
from layerzoo.distributed.sharding import Shard
from layerzoo.errors import UserError
from layerzoo.layers.int4_linear import KeepDtypes, scratch
from layerzoo.layers.linear_method import FusedPart, LinearMethod, SplitError

# Up to this many rows a CPU FP8 linear runs the C++ GEMV; from here on dequantize + GEMM.
GEMV_ROWS = settings.integer("LAYERZOO_FP8_GEMV_ROWS")
FUSED_FP8_BLOCK = -4  # the block field that tells decode_layer_cpu.cpp "FP8 bytes, group in w_bytes"


class FP8Linear(KeepDtypes, LinearMethod):
    """``x [T, in] -> [T, out]`` by an e4m3 weight with per-channel, per-tensor or block scales.
    ``tensors``: leaf name -> (shape, dtype) as the checkpoint stores them (``weight`` and one scale)."""

    def __init__(self, in_features: int, out_features: int, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 bias: bool = False, dtype: torch.dtype = torch.float32, *, block: tuple[int, int] | None = None,
                 name: str = ""):
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        scales = [leaf for leaf in tensors if leaf != "weight"]
        if "weight" not in tensors or len(scales) != 1:
            raise UserError(f"{name}: an FP8 weight needs 'weight' and one scale tensor, got {', '.join(tensors)}")
        self.scale_name = scales[0]
        self.weight = nn.Parameter(torch.empty(tensors["weight"][0], dtype=tensors["weight"][1]), requires_grad=False)
        shape, sdtype = tensors[self.scale_name]
        setattr(self, self.scale_name, nn.Parameter(torch.empty(shape, dtype=sdtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.block = self._block(tuple(shape), block)
        self.register_buffer("scale", None, persistent=False)
        self.group = in_features
        self._gemv = None

    def _block(self, shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, int] | None:
        """The weight block one scale covers: the config's, else from the scale's shape (None: per
        channel or tensor)."""
        n, k = self.out_features, self.in_features
        if block is not None and len(shape) == 2 and (-(-n // block[0]), -(-k // block[1])) == tuple(shape):
            return int(block[0]), int(block[1])
        if len(shape) <= 1 or (len(shape) == 2 and shape[1] == 1 and shape[0] in (1, n)):
            if int(torch.Size(shape).numel()) not in (1, n):
                raise UserError(f"{self.name}.{self.scale_name}: shape {shape} is neither per tensor, per channel nor per block")
            return None
        rows, cols = shape
        bn, bk = -(-n // rows), -(-k // cols)
        # the hub's block size is a power of two ([128, 128]); rounding up to one recovers it from the grid
        bn, bk = 1 << (bn - 1).bit_length(), 1 << (bk - 1).bit_length()
        if (-(-n // bn), -(-k // bk)) != (rows, cols):
            raise UserError(f"{self.name}.{self.scale_name}: shape {shape} does not tile a [{n}, {k}] weight in blocks")
        return bn, bk

    def split(self, shard: Shard) -> None:
        """The e4m3 weight splits as a plain one; a per-channel scale keeps this rank's output rows
        (whole under a row split), a per-tensor one stays whole, a block scale keeps the rows or
        columns of blocks of this rank's piece: a `SplitError` unless the piece holds whole blocks."""
        raw = getattr(self, self.scale_name)
        if self.block is not None:
            unit = self.block[shard.dim]
            piece = shard.in_units(unit)
            if piece is None:
                sections = " + ".join(map(str, shard.sections))
                what = "output rows" if shard.dim == 0 else "input columns"
                raise SplitError(f"{self.name or 'an FP8 linear'}: {self.scale_name} scales blocks of {list(self.block)}; "
                                 f"its {sections} {what} do not split into {shard.count} pieces of whole blocks of {unit}")
            scale_piece = piece
        elif shard.dim == 0 and raw.numel() > 1:  # per channel: [N, 1] or [N]
            scale_piece = shard
        else:
            scale_piece = None  # per tensor, or per channel under a row split
        self._keep_piece("weight", shard)
        self._keep_piece(self.scale_name, scale_piece)
        self._split_features(shard)
        self._split_bias(shard)

    def process_weights_after_loading(self) -> None:
        if self.scale is not None:
            return
        from layerzoo.kernels.fp8_matmul import reference

        raw = getattr(self, self.scale_name)
        scale, group = reference.expand_scale(raw.detach().cpu(), self.out_features, self.in_features, self.block)
        delattr(self, self.scale_name)
        self.scale, self.group = scale.to(self.weight.device), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = self._matmul(flat).to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if x.device.type == "cuda":
            from layerzoo.kernels.fp8_matmul import triton as fp8_triton

            return fp8_triton.matmul(x, self.weight, self.scale, self.group, self.bias)
        if x.device.type == "cpu" and self.group % 32 == 0 and self.in_features % self.group == 0:
            if self._gemv is None:
                from layerzoo.kernels.fp8_matmul import cpu

                self._gemv = cpu if cpu.available() else False
            if self._gemv:
                xf = x.float().contiguous()
                if 0 < x.shape[0] <= GEMV_ROWS:
                    return self._gemv.fp8_gemv(xf, self.weight, self.scale, self.group, bias)
                w = self._gemv.dequantize(self.weight, self.scale, self.group, scratch(self.out_features * self.in_features))
                return F.linear(xf, w, bias)
        from layerzoo.kernels.fp8_matmul import reference

        return reference.matmul(x, self.weight, self.scale, self.group, bias)

    def dequantized_weight(self) -> torch.Tensor:
        from layerzoo.kernels.fp8_matmul import reference

        return reference.dequantize(self.weight.cpu(), self.scale.cpu(), self.group)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + (0 if self.scale is None else self.scale.numel() * 4)

    def fused_part(self) -> FusedPart | None:
        """The FP8 bytes and fp32 scale by value: the fused call makes `_matmul`'s ``fp8_gemv`` call
        for up to `GEMV_ROWS` fp32 rows."""
        if self.weight.device.type != "cpu" or self.group % 32 or self.in_features % self.group:
            return None
        from layerzoo.kernels.fp8_matmul import cpu

        if not cpu.available():
            return None
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        fields = (0, self.out_features, self.in_features, self.group, FUSED_FP8_BLOCK)
        return FusedPart(fields, bias, (self.weight.detach(), self.scale), GEMV_ROWS, torch.float32)

    def extra_repr(self) -> str:
        kind = f"block={list(self.block)}" if self.block else "per channel"
        return f"{super().extra_repr()}, e4m3, {kind}"
