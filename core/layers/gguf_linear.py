"""GGUF weights kept in llama.cpp's block formats (Q4_0 ... Q6_K): a linear method and an embedding.

The weight is the file's blocks as they are, ``[out, row_bytes]`` uint8 (row n: the blocks of weight
row n), so a model takes about the file's size in memory. Few rows (decode steps, verifies) run the
C++ GEMV of `layerzoo.kernels.gguf_matmul`, which streams the blocks once and multiplies them in
integers with each activation row rounded to int16 per group (Q4_K and Q6_K: int8 per 256, as
llama.cpp does). In a plain decoder layer the fused CPU decode call makes those GEMV calls itself
(`fused_part`). More rows (prefill, batched decode) run the C++ GEMM, the same math with each tile of
weight rows decoded once a call and multiplied with every row: 1.5-3x dequantizing into a scratch fp32 matrix for an fp32
GEMM, which it replaced. Elsewhere (no C++ kernels, CUDA) the plain-torch dequantization of the op
folder's ``reference.py`` serves.

The embedding dequantizes only the rows it looks up. Under tensor parallelism a linear keeps its
rank's rows of blocks, or its columns where they fall on block boundaries (`GGUFLinear.split`), and
the embedding its rank's vocabulary rows (`GGUFVocabParallelEmbedding`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo import settings
from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import Shard, set_shard, shard_of
from layerzoo.layers.linear_method import FusedPart, LinearMethod, SplitError
from layerzoo.layers.parallel_linear import split_like, whole_features
from layerzoo.layers.vocab_parallel import VocabParallelEmbedding

log = logging.getLogger(__name__)

# Up to this many rows a GGUF linear runs the C++ GEMV; from here on the C++ GEMM. Measured with
# the weights streamed from memory (kernels/gguf_matmul/README.md): the GEMV is faster below about
# 6 rows (Q4_1) to 16 (the K-quants, Q8_0); 8 keeps batched decode of 8 on the fused layer call.
GEMV_ROWS = settings.integer("LAYERZOO_GGUF_GEMV_ROWS")
FUSED_GGUF_BLOCK = -2  # the block field that tells decode_layer_cpu.cpp "GGUF blocks, type in w_bytes"


def block_size(qtype: int) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of GGML type ``qtype``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of ``k`` elements in GGML type ``qtype``."""
    elements, size = block_size(qtype)
    assert k % elements == 0, f"{k} elements do not fill whole blocks of {elements}"
    return k // elements * size


def type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def _cpp_kernels():
    """The C++ backend module where it is built, else None."""
    from layerzoo.kernels.gguf_matmul import cpu

    return cpu if cpu.available() else None


def dequantize_blocks(blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks [N, row_bytes]`` → fp32 ``[N, k]`` (or only ``rows``: ``[R, k]``)."""
    cpu = _cpp_kernels() if blocks.device.type == "cpu" else None
    if cpu is not None:
        return cpu.dequantize(blocks, qtype, k, rows)
    from layerzoo.kernels.gguf_matmul import reference

    return reference.dequantize(blocks if rows is None else blocks[rows], qtype, k)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int, bias: torch.Tensor | None = None,
                kernels=None) -> torch.Tensor:
    """``x [..., k] @ W.T + bias`` -> ``[..., N]`` in ``x``'s dtype, ``W`` read from ``blocks [N, row_bytes]``:
    up to `GEMV_ROWS` rows by the C++ GEMV, more by the C++ GEMM (``kernels``: the module of
    `_cpp_kernels`, None where not built: then ``W`` dequantized and ``F.linear``). What a GGUF
    linear and each routed expert kept in blocks (`layerzoo.layers.gguf_experts`) run."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if kernels is not None and rows > 0 and blocks.device.type == "cpu":
        product = kernels.gguf_gemv if rows <= GEMV_ROWS else kernels.gguf_gemm
        out = product(flat.float().contiguous(), blocks, qtype, k, None if bias is None else bias.float())
        out = out.to(x.dtype)
        return out if flat is x else out.reshape(*x.shape[:-1], blocks.shape[0])
    weight = dequantize_blocks(blocks, qtype, k).to(x.dtype)
    return F.linear(x, weight, bias)


Q8_0 = 8  # GGMLQuantizationType.Q8_0: 32 int8 values and one fp16 scale per block (34 bytes)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (K a multiple of 32) → its Q8_0 blocks ``[N, K / 32 * 34]`` uint8, as
    ggml's reference quantizer makes them: per block ``d = max|w| / 127``, ``q = round(w / d)``
    (halves away from zero), ``d`` stored as fp16."""
    n, k = weight.shape
    assert k % 32 == 0, f"Q8_0 needs whole blocks of 32 inputs, got {k}"
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    packed = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [N, K/32, 34]
    return packed.reshape(n, k // 32 * 34).contiguous()


def quantize_linears_q8_0(model: nn.Module) -> int:
    """``quantization="int8"``: every plain ``nn.Linear`` whose inputs fill blocks of 32 becomes a
    Q8_0 `GGUFLinear` (int8 weights with one scale per 32 inputs; activations rounded to int16 per 32
    by the GEMV and the GEMM), in place; returns how many. A weight another module shares (a tied
    embedding) keeps its float copy for that module."""
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module.in_features % 32:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = module.weight
        linear = GGUFLinear(module.in_features, module.out_features, Q8_0, module.bias is not None,
                            module.bias.dtype if module.bias is not None else weight.dtype)
        linear.weight = nn.Parameter(quantize_q8_0(weight).to(weight.device), requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        setattr(parent, attr, linear)
        count += 1
    return count


class GGUFLinear(LinearMethod):
    """``x [T, in] -> [T, out]`` by a weight kept in GGML block type ``qtype``."""

    def __init__(self, in_features: int, out_features: int, qtype: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, *, name: str = ""):
        super().__init__()
        self.in_features, self.out_features, self.qtype, self.name = in_features, out_features, int(qtype), name
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._gemv = None  # the C++ kernel module, looked up at the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is None:
            self._gemv = _cpp_kernels() or False
        return gguf_matmul(x, self.weight, self.qtype, self.in_features, self.bias, self._gemv or None)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.qtype, self.in_features)

    def split(self, shard: Shard) -> None:
        """Output rows split as whole rows of blocks; input columns only at block boundaries
        (32 inputs, 256 for the K-quants): the byte columns of each section's piece."""
        if shard.dim == 0:
            self._keep_piece("weight", shard)
        else:
            elements, size = block_size(self.qtype)
            blocks = shard.in_units(elements)
            if blocks is None:
                sections = " + ".join(map(str, shard.sections))
                raise SplitError(f"{self.name or 'a GGUF linear'}: {type_name(self.qtype)} blocks hold {elements} inputs "
                                 f"each; its {sections} input columns do not split into {shard.count} pieces of whole blocks")
            self._keep_piece("weight", Shard(1, tuple(b * size for b in blocks.sections), shard.index, shard.count))
        self._split_features(shard)
        self._split_bias(shard)

    def fused_part(self) -> FusedPart | None:
        """The blocks by value, the GGML type in the ``w_bytes`` field: the fused call makes the same
        ``gguf_gemv`` call as `forward` for up to `GEMV_ROWS` fp32 rows."""
        if self.weight.device.type != "cpu" or not _cpp_kernels():
            return None
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        fields = (0, self.out_features, self.in_features, self.qtype, FUSED_GGUF_BLOCK)
        return FusedPart(fields, bias, (self.weight.detach(),), GEMV_ROWS, torch.float32)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {type_name(self.qtype)}"


class GGUFEmbedding(nn.Module):
    """``ids [T]`` → ``[T, H]`` in ``dtype``, each looked-up row dequantized from its blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype, self.dtype = num_embeddings, embedding_dim, int(qtype), dtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(qtype, embedding_dim), dtype=torch.uint8),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = dequantize_blocks(self.weight, self.qtype, self.embedding_dim, flat).to(self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {type_name(self.qtype)}"


class GGUFVocabParallelEmbedding(GGUFEmbedding):
    """This rank's vocabulary rows of a GGUF embedding, as `VocabParallelEmbedding`: ids outside
    them look up zeros, and the ranks' rows are summed (all-reduce)."""

    def __init__(self, vocab_size: int, embedding_dim: int, qtype: int, dtype: torch.dtype, shard: Shard):
        super().__init__(shard.local_size, embedding_dim, qtype, dtype)
        (self.start, self.end), = shard.ranges()
        self.vocab_size = vocab_size
        set_shard(self, "weight", shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = super().forward(torch.where(outside, 0, ids - self.start)).masked_fill_(outside.unsqueeze(-1), 0)
        return parallel_state.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.end}) of {self.vocab_size}, {self.embedding_dim}, {type_name(self.qtype)}"


def fuse_gguf_linears(parts: list[GGUFLinear]) -> GGUFLinear | None:
    """One GGUF linear whose output is the parts' side by side (blocks concatenated by rows), or
    None when the parts differ in block type (a Q4_K_M file keeps some projections in Q6_K)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
        return None
    assert all(p.bias is None for p in parts) or all(p.bias is not None for p in parts)
    fused = GGUFLinear(first.in_features, sum(p.out_features for p in parts), first.qtype, first.bias is not None,
                       first.bias.dtype if first.bias is not None else torch.float32)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def keep_blocks(model: nn.Module, block_types: dict[str, int], name_map, tied: dict[str, str],
                dtype: torch.dtype, supported: frozenset[int]) -> frozenset[str]:
    """Replace the (meta-device) ``nn.Linear`` and ``nn.Embedding`` modules whose checkpoint weight
    is in a block type of ``supported`` by their GGUF modules; returns the checkpoint keys they take
    as blocks. ``block_types``: checkpoint key -> GGML type; ``name_map`` as the loader's. A tied
    weight the checkpoint lacks (an LM head sharing the embedding) follows its source."""
    from layerzoo.loading.loader import Target

    targets: dict[str, tuple[str, int]] = {}  # parameter name -> (checkpoint key, type)
    for key, qtype in block_types.items():
        target = name_map(key) if name_map is not None else key
        if isinstance(target, Target):
            if target.grid:
                continue  # one cell of a stacked parameter (experts, a fused projection): dequantized
            target = target.name
        if qtype in supported and isinstance(target, str) and target.endswith(".weight"):
            targets[target] = (key, qtype)
    kept = {name: key for name, (key, qtype) in targets.items() if _replace(model, name, qtype, dtype)}
    for target, source in tied.items():
        if source in kept and target not in targets:  # the checkpoint lacks it: it shares the source's blocks
            _replace(model, target, targets[source][1], dtype)
    return frozenset(kept.values())


def _replace(model: nn.Module, name: str, qtype: int, dtype: torch.dtype) -> bool:
    """Put the GGUF module in place of the plain one whose weight is ``name``; False where that is
    a module of another kind (a plugin's own, which reads the dequantized weight)."""
    path = name.rpartition(".")[0]
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    module = getattr(parent, attr, None)
    with torch.device("meta"):
        if type(module) is nn.Linear:
            in_features, out_features = whole_features(module)
            replacement = GGUFLinear(in_features, out_features, qtype, module.bias is not None, dtype, name=path)
            try:
                split_like(replacement, module)
            except SplitError as error:  # this one layer reads the file dequantized, split as a plain linear
                log.warning("%s; it is dequantized to %s instead", error, dtype)
                return False
        elif type(module) is nn.Embedding:
            replacement = GGUFEmbedding(module.num_embeddings, module.embedding_dim, qtype, dtype)
        elif type(module) is VocabParallelEmbedding:
            replacement = GGUFVocabParallelEmbedding(module.vocab_size, module.weight.shape[1], qtype, dtype,
                                                     shard_of(module, "weight"))
        else:
            return False
    setattr(parent, attr, replacement)
    return True
