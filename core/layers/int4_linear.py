"""Weight-only 4-bit linears from hub checkpoints (compressed-tensors W4A16, AWQ, GPTQ): one method.

Each format's tensors load as they are stored (parameters named and shaped like the checkpoint's:
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``/``weight_g_idx``,
``qweight``/``qzeros``/``scales``/``g_idx``), then `process_weights_after_loading` converts them,
exactly, into one layout (`layerzoo.kernels.int4_matmul`): 4-bit values ``q [N, K/2]`` uint8 and,
per row and group of ``group`` input columns, fp32 ``scale`` and ``zs = zero * scale``, so that
``w = q * scale - zs`` (``(q - zero) * scale`` with fp16/bf16 scales: both products are exact in
fp32, so is their difference). GPTQ's act-order (``desc_act``: the group of input column ``k`` is
``g_idx[k]``) becomes a permutation of the input columns sorting them by group, applied to the
weight at load and gathered from the activations in forward.

Under tensor parallelism (`Int4Linear.split`) a column split keeps rows of packed values and their
scales/zeros (rows packed 8 a word in whole words); a row split keeps whole scale groups of input
columns. GPTQ/compressed-tensors with ``g_idx`` split the input columns anywhere: each rank loads
the whole (small) scales and zeros and its slice of ``g_idx``, and lays its columns out by group;
with act-order a group's columns are scattered over the ranks, so a rank's piece of a group is
padded to the group's size with columns of zero activations (exact; that rank then holds up to
the whole input width, as act-order leaves no split on group boundaries).

Few rows (decode, verifies) on CPU run the C++ GEMV, which unpacks the nibbles in registers; more
rows dequantize into a shared fp32 scratch matrix and multiply there; CUDA runs the Triton kernel
(dequantization inside the GEMM); elsewhere the plain-torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo import settings
from layerzoo.distributed.sharding import Shard
from layerzoo.errors import UserError
from layerzoo.layers.linear_method import FusedPart, LinearMethod, SplitError

# Up to this many rows a CPU 4-bit linear runs the C++ GEMV; from here on dequantize + GEMM.
GEMV_ROWS = settings.integer("LAYERZOO_INT4_GEMV_ROWS")
FUSED_INT4_BLOCK = -3  # the block field that tells decode_layer_cpu.cpp "4-bit groups, group in w_bytes"

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i of a word holds column 8 * word + AWQ_ORDER[i]
FORMATS = ("compressed", "awq", "gptq")


class KeepDtypes:
    """A module whose checkpoint tensors keep their dtype through ``model.to(dtype)`` (scales stay
    fp16/fp32, FP8 weights stay FP8); only the bias follows the run dtype. Device moves apply."""

    def _apply(self, fn, recurse=True):
        bias = self._parameters.get("bias")

        def keeping(t):
            if t is bias:
                return fn(t)
            try:  # what fn does to an empty tensor of this dtype (no data converted in vain)
                probe = fn(torch.empty(0, dtype=t.dtype, device="meta"))
            except Exception:
                probe = None
            if probe is not None and probe.dtype != t.dtype:
                device = t.device if probe.device.type == "meta" else probe.device
                return t if device == t.device else t.to(device=device)
            out = fn(t)
            if out.dtype == t.dtype:
                return out
            return t.to(device=out.device) if t.device != out.device else t

        return super()._apply(keeping, recurse)


def unpack_int32_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., W]`` → uint8 ``[..., 8 W]``: nibble ``j`` (bits ``4j..4j+3``) of each word."""
    b = words.contiguous().view(torch.uint8)  # little-endian: byte i holds nibbles 2i, 2i+1
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*words.shape[:-1], words.shape[-1] * 8)


def group_permutation(g_idx: torch.Tensor, group: int, k: int, what: str) -> torch.Tensor | None:
    """The input-column order that makes the groups of ``g_idx`` contiguous (None when they already
    are: ``g_idx[k] == k // group``); a `UserError` when a group does not hold ``group`` columns."""
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // group):
        return None
    counts = torch.bincount(g_idx, minlength=k // group)
    if g_idx.min() < 0 or counts.numel() != k // group or not bool((counts == group).all()):
        raise UserError(f"{what}: g_idx does not put {group} input columns in each of {k // group} groups")
    return torch.argsort(g_idx, stable=True)


def group_slots(g_idx: torch.Tensor, group: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-parallel piece's input columns laid out by group: ``g_idx [K]`` (the global group of
    each local column) → ``(slots [S], groups [S / group])``: slot ``s`` takes local column
    ``slots[s]`` (``K``: a padding slot, fed a zero activation), each run of ``group`` slots the
    columns of global group ``groups[j]`` in their order. No padding where every group present is
    whole on this rank."""
    g = g_idx.long()
    groups, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
    if bool((counts > group).any()) or g.min() < 0:
        raise UserError(f"{what}: g_idx puts more than {group} input columns in one group")
    order = torch.argsort(g, stable=True)
    if bool((counts == group).all()):
        return order, groups
    sorted_group = inverse[order]
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.full((groups.numel() * group,), g.numel(), dtype=torch.long)
    slots[sorted_group * group + torch.arange(g.numel()) - starts[sorted_group]] = order
    return slots, groups


def canonical_compressed(t: dict[str, torch.Tensor], n: int, k: int):
    """compressed-tensors ``pack-quantized`` 4-bit: ``weight_packed`` int32 ``[N, K/8]`` (8 values
    a word, low bits first, stored + 8), ``weight_scale [N, K/group]``, ``weight_zero_point``
    int32 ``[ceil(N/8), K/group]`` (packed along the rows, + 8) when asymmetric. ``n, k``: the
    rows and columns this module holds (a tensor-parallel piece of ``weight_shape``)."""
    values = unpack_int32_nibbles(t["weight_packed"])[:, :k]
    scale = t["weight_scale"].float()
    if "weight_zero_point" in t:
        zero = unpack_int32_nibbles(t["weight_zero_point"].t())[:, :n].t().float()  # [N, G], + 8 like q
    else:
        zero = torch.full_like(scale, 8.0)
    g_idx = t.get("weight_g_idx")
    return values, scale, zero * scale, g_idx


def canonical_awq(t: dict[str, torch.Tensor], group: int):
    """AWQ GEMM: ``qweight [K, N/8]``, ``qzeros [K/group, N/8]`` int32 in AWQ's nibble order,
    ``scales [K/group, N]``; ``w = (q - z) * s``."""
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # column c of a word is nibble inverse[c]

    def columns(words: torch.Tensor) -> torch.Tensor:
        nib = unpack_int32_nibbles(words).reshape(words.shape[0], words.shape[1], 8)
        return nib[:, :, inverse].reshape(words.shape[0], words.shape[1] * 8)

    values = columns(t["qweight"]).t().contiguous()  # [N, K]
    zero = columns(t["qzeros"]).t().float()  # [N, G]
    scale = t["scales"].t().float()
    return values, scale, zero * scale, None


def canonical_gptq(t: dict[str, torch.Tensor], group: int, zero_offset: int):
    """GPTQ: ``qweight [K/8, N]`` (8 input rows a word, low bits first), ``qzeros [K/group, N/8]``
    (stored zero + ``zero_offset`` is the zero: 1 in the classic ``gptq`` format),
    ``scales [K/group, N]``, ``g_idx [K]``; ``w = (q - z) * s[g_idx[k]]``."""
    qw = t["qweight"]
    values = unpack_int32_nibbles(qw.t()).contiguous()  # [N, K]: word i of column n holds k = 8i..8i+7
    zero = (unpack_int32_nibbles(t["qzeros"]).float() + zero_offset).t()  # [N, G]
    scale = t["scales"].t().float()
    return values, scale, zero * scale, t.get("g_idx")


# How each checkpoint tensor splits, per format: (dim, logical rows per entry) along the outputs
# (a column split) and along the inputs (a row split); None: every rank loads it whole. "group":
# one entry per scale group of inputs.
SPLITS = {
    "compressed": {"weight_packed": ((0, 1), (1, 8)), "weight_scale": ((0, 1), (1, "group")),
                   "weight_zero_point": ((0, 8), (1, "group")), "weight_shape": (None, None),
                   "weight_g_idx": (None, (0, 1))},
    "awq": {"qweight": ((1, 8), (0, 1)), "qzeros": ((1, 8), (0, "group")), "scales": ((1, 1), (0, "group"))},
    "gptq": {"qweight": ((1, 1), (0, 8)), "qzeros": ((1, 8), (0, "group")), "scales": ((1, 1), (0, "group")),
             "g_idx": (None, (0, 1))},
}
G_IDX = ("weight_g_idx", "g_idx")


class Int4Linear(KeepDtypes, LinearMethod):
    """``x [T, in] -> [T, out]`` by a 4-bit weight loaded in format ``fmt`` (`FORMATS`) with
    ``tensors``: leaf name -> (shape, dtype) as the checkpoint stores them."""

    def __init__(self, in_features: int, out_features: int, fmt: str, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 group: int, bias: bool = False, dtype: torch.dtype = torch.float32, *, symmetric: bool = True,
                 zero_offset: int = 0, name: str = ""):
        super().__init__()
        assert fmt in FORMATS, fmt
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.whole_shape = (out_features, in_features)  # the checkpoint's weight, of which a rank may hold a piece
        self.group = in_features if group in (-1, 0, None) else int(group)
        self.scale_groups = in_features // self.group  # groups the loaded scales hold
        self.columns_split = False  # a row-parallel piece: g_idx is this rank's slice, the scales whole
        self.symmetric, self.zero_offset, self.name = symmetric, zero_offset, name
        self.loaded = list(tensors)
        for leaf, (shape, tdtype) in tensors.items():
            setattr(self, leaf, nn.Parameter(torch.empty(shape, dtype=tdtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("qweight_nibbles", None, persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.register_buffer("zs", None, persistent=False)
        self.register_buffer("perm", None, persistent=False)
        self.padded = False  # perm has padding slots (index in_features: a zero activation)
        self._gemv = None

    # -- tensor parallelism ---------------------------------------------------------------------

    def split(self, shard: Shard) -> None:
        """Output rows: rows of values and of their scales/zeros (8 a word where packed along the
        rows); input columns: whole scale groups, or anywhere with ``g_idx`` (`group_slots`)."""
        along_inputs = shard.dim == 1
        per_channel = self.group == self.in_features
        has_g_idx = any(leaf in G_IDX for leaf in self.loaded)
        pieces: dict[str, Shard] = {}
        if along_inputs and per_channel and shard.in_units(32) is None:  # the kernels' layout packs runs of 32
            sections = " + ".join(map(str, shard.sections))
            raise SplitError(f"{self.name or 'a 4-bit linear'}: its {sections} input columns do not split into "
                             f"{shard.count} pieces of whole runs of 32")
        for leaf in self.loaded:
            rule = SPLITS[self.fmt][leaf][along_inputs]
            if rule is None:
                continue
            dim, unit = rule
            if unit == "group":
                if per_channel or has_g_idx:
                    continue  # one scale for the row, or the local columns pick their groups after the load
                unit = self.group
            piece = shard.in_units(unit, dim)
            if piece is None:
                sections = " + ".join(map(str, shard.sections))
                what = "input columns" if along_inputs else "output rows"
                raise SplitError(f"{self.name or 'a 4-bit linear'}: {self.fmt} {leaf} holds one entry per {unit} "
                                 f"{what}; its {sections} {what} do not split into {shard.count} pieces of whole ones")
            pieces[leaf] = piece
        for leaf, piece in pieces.items():
            self._keep_piece(leaf, piece)
        self._split_features(shard)
        if along_inputs:
            self.columns_split = True
            if per_channel:
                self.group = self.in_features
            self.scale_groups = self.whole_shape[1] // self.group if has_g_idx and not per_channel else self.in_features // self.group
        self._split_bias(shard)

    # -- loading --------------------------------------------------------------------------------

    def process_weights_after_loading(self) -> None:
        if self.qweight_nibbles is not None:
            return
        device = next(iter(self.parameters())).device
        tensors = {leaf: getattr(self, leaf).detach().cpu() for leaf in self.loaded}
        n, k = self.out_features, self.in_features
        if self.fmt == "compressed":
            stored = tuple(int(v) for v in tensors["weight_shape"].tolist())
            if stored != self.whole_shape:
                raise UserError(f"{self.name}.weight_shape: {list(stored)}, expected {list(self.whole_shape)}")
            values, scale, zs, g_idx = canonical_compressed(tensors, n, k)
        elif self.fmt == "awq":
            values, scale, zs, g_idx = canonical_awq(tensors, self.group)
        else:
            values, scale, zs, g_idx = canonical_gptq(tensors, self.group, self.zero_offset)
        if tuple(values.shape) != (n, k) or tuple(scale.shape) != (n, self.scale_groups):
            raise UserError(f"{self.name}: {self.fmt} 4-bit tensors unpack to {tuple(values.shape)} with scales "
                            f"{tuple(scale.shape)}, expected ({n}, {k}) and ({n}, {self.scale_groups})")
        perm = None
        if g_idx is not None and self.columns_split:
            perm, groups = group_slots(g_idx, self.group, self.name)
            scale, zs = scale[:, groups], zs[:, groups]
            self.padded = perm.numel() > k
            values = torch.cat([values, values.new_zeros(n, 1)], 1)[:, perm] if self.padded else values[:, perm]
            if not self.padded and torch.equal(perm, torch.arange(k)):
                perm = None
        elif g_idx is not None:
            perm = group_permutation(g_idx, self.group, k, self.name)
            if perm is not None:
                values = values[:, perm]
        from layerzoo.kernels.int4_matmul import reference

        for leaf in self.loaded:
            delattr(self, leaf)
        self.qweight_nibbles = reference.pack(values).to(device)
        self.scale = scale.contiguous().to(device)
        self.zs = zs.contiguous().to(device)
        self.perm = None if perm is None else perm.to(device)
        self.loaded = []

    # -- compute --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.padded:  # slot in_features: the zero activation of a padding column
            flat = torch.cat([flat, flat.new_zeros(flat.shape[0], 1)], 1)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        out = self._matmul(flat)
        out = out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if x.device.type == "cuda":
            from layerzoo.kernels.int4_matmul import triton as int4_triton

            return int4_triton.matmul(x, self.qweight_nibbles, self.scale, self.zs, self.group, self.bias)
        if x.device.type == "cpu" and self.group % 32 == 0:
            if self._gemv is None:
                from layerzoo.kernels.int4_matmul import cpu

                self._gemv = cpu if cpu.available() else False
            if self._gemv:
                xf = x.float().contiguous()
                if 0 < x.shape[0] <= GEMV_ROWS:
                    return self._gemv.int4_gemv(xf, self.qweight_nibbles, self.scale, self.zs, self.group, bias)
                w = self._gemv.dequantize(self.qweight_nibbles, self.scale, self.zs, self.group,
                                          scratch(self.qweight_nibbles.numel() * 2))
                return F.linear(xf, w, bias)
        from layerzoo.kernels.int4_matmul import reference

        return reference.matmul(x, self.qweight_nibbles, self.scale, self.zs, self.group, bias)

    def dequantized_weight(self) -> torch.Tensor:
        from layerzoo.kernels.int4_matmul import reference

        w = reference.dequantize(self.qweight_nibbles.cpu(), self.scale.cpu(), self.zs.cpu(), self.group)
        if self.perm is not None:  # back to the input columns' order (padding slots land past the end)
            out = w.new_zeros(w.shape[0], self.in_features + 1)
            out[:, self.perm.cpu()] = w
            w = out[:, : self.in_features].contiguous()
        return w

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight_nibbles, self.scale, self.zs) if t is not None)

    def fused_part(self) -> FusedPart | None:
        """Nibbles, scale and zero * scale by value: the fused call makes `_matmul`'s ``int4_gemv``
        call for up to `GEMV_ROWS` fp32 rows (not with an act-order permutation, which `forward`
        applies to the activations first)."""
        if self.perm is not None or self.qweight_nibbles.device.type != "cpu" or self.group % 32:
            return None
        from layerzoo.kernels.int4_matmul import cpu

        if not cpu.available():
            return None
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        fields = (0, self.out_features, self.in_features, self.group, FUSED_INT4_BLOCK)
        return FusedPart(fields, bias, (self.qweight_nibbles, self.scale, self.zs), GEMV_ROWS, torch.float32)

    def extra_repr(self) -> str:
        order = (", padded groups" if self.padded else ", act-order") if self.perm is not None else ""
        return f"{super().extra_repr()}, {self.fmt}, group={self.group}" + order


_scratch: dict[torch.device, torch.Tensor] = {}


def scratch(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A shared fp32 buffer of at least ``numel`` elements (the dequantized weight of one linear at a
    time: the model runs its linears one after another)."""
    device = torch.device(device)
    buf = _scratch.get(device)
    if buf is None or buf.numel() < numel:
        buf = _scratch[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]
