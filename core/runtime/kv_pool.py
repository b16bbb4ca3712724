"""The paged KV pool: per-layer per-token rows in fixed-size blocks, and attention over them.

Every cache layer owns one tensor ``[num_blocks, block_size, Hkv, D]`` per row name its
`KVCacheSpec` declares: ``k`` and ``v`` for GQA attention (`attend`), one ``latent`` row for MLA
(`write_latent` / `latents`, the attention itself is the MLA layer's). A token at position ``p`` of
a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; the step's
``slot_mapping [T]`` holds ``block * block_size + offset`` for each new token. Block ids come from
the device-free `BlockManager`; this module only stores and reads.

FP8 cache (``kv_cache_dtype="fp8_e4m3"``): a layer whose spec's ``storage_dtype`` is
``float8_e4m3fn`` stores ``K / k_scale`` and ``V / v_scale`` as e4m3, with one 0-d fp32 scale per
layer for K and one for V (`Fp8KvScales`: from the checkpoint, or calibrated online on the first
tokens). Attention gathers the step's blocks and dequantises them to the compute dtype first.
An MLA latent row is scaled by the layer's K scale (its V scale calibrates to the same value and
goes unused).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import attrs
import numpy as np
import torch

from layerzoo.kernels import cpp_build
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import FP8_KV_DTYPE, LATENT_ROWS, KVCacheSpec, parse_kv_cache_dtype
from layerzoo.plugins.ops import kernel
from layerzoo.runtime.fp8_calibration import HEADROOM, Fp8KvScales

log = logging.getLogger(__name__)

# A step whose chunks are all this short (decodes, speculative verifies, short continuations)
# attends in one decode call with every row a query of its own (`ForwardContext.row_queries`):
# exact, since a row sees the keys up to its own position, and one call per layer instead of a
# decode call beside a prefill call (whose per-layer index work cost a verify step ~0.3 of a plain
# step on a small model).
ROW_QUERY_CHUNK = 16
# Where the C++ decode kernel serves (CPU, fp32 or bf16 cache), prompts and chunks of up to this many rows
# attend that way too: a row query costs about what a row of the causal flash call does, without
# the flash kernel's per-block overhead on short sequences. Measured (Zen 5, 2 threads, Hq 16 / Hkv 8
# / D 128): 4 prompts of 121 tokens 2.4 vs 5.3 ms per layer, 2 of 256 5.4 vs 8.0 ms, one of 512
# 14.1 vs 14.3 ms (equal: longer chunks keep the prefill op).
ROW_QUERY_CHUNK_CPP = 256

def zeros_as_written(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor whose CPU memory is taken page by page as it is written (``calloc``: the
    kernel maps untouched pages to its zero page), so a pool sized for the longest workload costs
    what the sequences actually fill (blocks are handed out lowest id first). ``torch.zeros``
    writes every byte at once: the demo model's quarter-of-RAM pool made the process 6.7 GB
    bigger before its first token."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))  # numpy's zeros: calloc
    return raw.view(dtype).view(shape)


def with_kv_cache_dtype(specs: Mapping[int, KVCacheSpec], kv_cache_dtype: str) -> dict[int, KVCacheSpec]:
    """``specs`` with the storage dtype ``kv_cache_dtype`` asks for (``"auto"``: unchanged)."""
    storage = parse_kv_cache_dtype(kv_cache_dtype)
    if storage is None:
        return dict(specs)
    return {i: attrs.evolve(spec, storage_dtype=storage) for i, spec in specs.items()}


def num_blocks_for_budget(specs: Mapping[int, KVCacheSpec], block_size: int, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes`` given every layer's per-token footprint."""
    per_block = block_size * sum(spec.bytes_per_token for spec in specs.values())
    return max(0, budget_bytes // per_block) if per_block else 0


class PagedKVCache:
    """The paged rows of every cache layer: ``attend`` writes a GQA layer's K/V and attends over
    them; ``write_latent`` / ``latents`` store and read an MLA layer's latent rows.

    ``fp8`` maps each FP8 layer to its `Fp8KvScales`; ``fp8_calibration_tokens`` is the online
    calibration window of those layers (0: fixed scale 1.0), unless `bind` finds checkpoint scales.
    """

    def __init__(
        self,
        specs: Mapping[int, KVCacheSpec],
        num_blocks: int,
        block_size: int,
        device="cpu",
        *,
        fp8_calibration_tokens: int = 512,
        fp8_headroom: float = HEADROOM,
        pad_block: bool = False,
    ):
        assert num_blocks > 0 and block_size > 0
        self.specs = dict(specs)
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        # With decode graphs: one block more than the block manager hands out, which padded rows of
        # a captured decode step write and read (never a sequence's block).
        self.pad_block = num_blocks if pad_block else None
        num_rows = num_blocks + 1 if pad_block else num_blocks
        # layer -> row name -> [num_rows, block_size, Hkv, D]
        self.rows = {
            i: {
                name: zeros_as_written((num_rows, block_size, s.num_kv_heads, s.head_dim), s.cache_dtype, device)
                for name in s.rows
            }
            for i, s in self.specs.items()
        }
        for i, s in self.specs.items():
            for name, width in s.extra_rows:
                self.rows[i][name] = zeros_as_written((num_rows, block_size, 1, width), s.dtype, device)
            s.check_block_size(block_size, i)
            for name, width, k in s.pooled_rows:
                self.rows[i][name] = zeros_as_written((num_rows, block_size // k, 1, width), s.dtype, device)
        log.info("KV cache: %d blocks of %d tokens (%d tokens), %.0f MiB reserved on %s%s", num_blocks, block_size,
                 num_blocks * block_size, self.nbytes / 2**20, self.device,
                 ", taken as blocks are written" if self.device.type == "cpu" else "")
        self.k = {i: rows["k"] for i, rows in self.rows.items() if "k" in rows}
        self.v = {i: rows["v"] for i, rows in self.rows.items() if "v" in rows}
        self.fp8 = {
            i: Fp8KvScales(self.device, fp8_calibration_tokens, headroom=fp8_headroom)
            for i, s in self.specs.items()
            if s.cache_dtype == FP8_KV_DTYPE
        }
        for i, s in self.specs.items():
            assert s.cache_dtype in (s.dtype, FP8_KV_DTYPE), f"layer {i}: KV storage dtype {s.cache_dtype} is not supported"
        self._write = kernel("kv_cache_write")
        self._decode_op = kernel("paged_decode_attention")
        self._static_decode_op = kernel("paged_decode_attention_static")
        self._prefill_op = kernel("paged_prefill_attention")
        self.cpp_decode = self._cpp_decode()
        self.row_query_rows = ROW_QUERY_CHUNK_CPP if self.cpp_decode else ROW_QUERY_CHUNK
        if self.fp8:
            self._quantize = kernel("fp8_quantize")
            self._dequantize = kernel("fp8_dequantize")

    def _cpp_decode(self) -> bool:
        """Whether fp32 and bf16 decode queries on this pool's device run the C++ kernel (built here)."""
        return self.device.type == "cpu" and self._decode_op.choose("cpu")[0] == "cpp" and cpp_build.available()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for rows in self.rows.values() for t in rows.values())

    def bind(self, model) -> None:
        """Hand each attention module of ``model`` its layer's FP8 scales (or None).

        An attention module answers ``fp8_calibration_frozen`` from them; one that loaded
        ``k_scale``/``v_scale`` buffers from the checkpoint makes its layer use those scales.
        """
        for i in self.specs:
            scales = self.fp8.get(i)
            layer = model.cache_layer(i) if hasattr(model, "cache_layer") else model.layers[i]  # (an MTP head's block too)
            for module in layer.modules():
                if getattr(module, "layer_index", None) != i or not hasattr(module, "fp8_kv"):
                    continue
                loaded = [getattr(module, name, None) for name in ("k_scale", "v_scale")]
                if scales is not None and all(isinstance(t, torch.Tensor) for t in loaded):
                    scales.use_checkpoint_scales(*loaded)
                module.fp8_kv = scales

    def attend(self, layer: int, q, k, v, scaling: float, ctx: ForwardContext) -> torch.Tensor:
        """Write the step's K/V of ``layer`` into its slots, then attend causally.

        Args:
            q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (rotated), rows ordered as ``ctx``:
               the ``ctx.num_decodes`` one-token decode rows first, then prefill chunks.
        Returns:
            ``[T, Hq, D]``.
        """
        assert not self.specs[layer].is_latent, f"layer {layer} keeps MLA latents: it writes them with write_latent"
        if layer in self.fp8:
            k_cache, v_cache, block_tables = self._write_fp8(layer, k, v, ctx, q.dtype)
        else:
            k_cache, v_cache, block_tables = self.k[layer], self.v[layer], ctx.block_tables
            self._write(k, v, k_cache, v_cache, ctx.slot_mapping)
        queries = self._one_call_queries(ctx, k_cache.dtype, block_tables)
        if queries is not None:
            decode = self._static_decode_op if ctx.shape_static else self._decode_op
            return decode(q, k_cache, v_cache, *queries, scaling)
        nd = ctx.num_decodes
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_op(q[:nd], k_cache, v_cache, block_tables[:nd], ctx.context_lens_tensor[:nd], scaling)
        out[nd:] = self._prefill_op(
            q[nd:], k_cache, v_cache, block_tables[nd:], ctx.query_start_tensor(nd), ctx.context_lens_tensor[nd:], scaling
        )
        return out

    def _one_call_queries(self, ctx: ForwardContext, dtype: torch.dtype, block_tables: torch.Tensor):
        """``(block_tables, context_lens)`` of one decode call over every row of the step: a decode
        step (a row a sequence), or only short chunks (verifies, short continuations, short prompts
        with the C++ kernel) with every row a query of its own; None where prompt chunks take the
        prefill op."""
        if ctx.num_decodes == ctx.num_seqs:
            return block_tables, ctx.context_lens_tensor
        limit = self.row_query_rows if dtype in cpp_build.DTYPES else ROW_QUERY_CHUNK
        if ctx.shape_static or ctx.token_seqs is None or max(ctx.query_lens) > limit:
            return None
        return ctx.row_queries() if block_tables is ctx.block_tables else (block_tables[ctx.token_seqs], ctx.positions + 1)

    def decode_operands(self, layer: int, ctx: ForwardContext):
        """``(k_cache, v_cache, slot_mapping, block_tables, context_lens)`` for a fused decode
        layer (`layerzoo.layers.fused_decode`) that writes and attends in one decode call as
        `attend` would: a decode step (one row a sequence), or a step of short chunks (verifies,
        short prompts) as row queries (`ForwardContext.row_queries`: a table and a length a row).
        None where `attend` must do it: a longer chunk, a compiled step, FP8 or latent rows, or a
        cache the C++ decode kernel does not read."""
        caches = None if ctx.shape_static else self.decode_caches(layer)
        if caches is None:
            return None
        queries = self._one_call_queries(ctx, caches[0].dtype, ctx.block_tables)
        return None if queries is None else (*caches, ctx.slot_mapping, *queries)

    def decode_caches(self, layer: int):
        """``(k_cache, v_cache)`` of ``layer`` where a fused call may write and attend its decode
        rows itself (`decode_operands` for a step of one row a sequence); None where `attend` must."""
        if layer in self.fp8 or self.specs[layer].is_latent:
            return None
        k_cache = self.k[layer]
        if k_cache.dtype not in cpp_build.DTYPES or not self.cpp_decode:
            return None
        if not (self._write.native(self.device.type) and self._decode_op.native(self.device.type)):
            return None  # as `attend` would not call them either
        return k_cache, self.v[layer]

    # -- FP8 ---------------------------------------------------------------------------------

    def _store_fp8(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise and store a write; for a latent layer ``k`` is the latent row (``v`` the same)."""
        scales = self.fp8[layer]
        if self.specs[layer].is_latent:
            pairs = ((self.rows[layer]["latent"], k, scales.k_scale),)
        else:
            pairs = ((self.k[layer], k, scales.k_scale), (self.v[layer], v, scales.v_scale))
        for cache, x, scale in pairs:
            # Through uint8 views: index_copy_ has no float8 kernel on every device.
            flat = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
            flat.index_copy_(0, slots, self._quantize(x, scale).view(torch.uint8))

    @staticmethod
    def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)

    def _write_fp8(self, layer: int, k, v, ctx: ForwardContext, dtype: torch.dtype):
        """Quantise and write the step's K/V (calibrating if the layer still does); returns the
        step's blocks dequantised to ``dtype`` as a compact cache, and block tables into it."""
        scales = self.fp8[layer]
        if scales.calibrating and scales.calibrator.observe(ctx.slot_mapping, k, v):
            # The window ended with this write: redo every staged write at the frozen scales.
            for slots, staged_k, staged_v in scales.calibrator.drain():
                self._store_fp8(layer, slots, staged_k, staged_v)
        else:
            self._store_fp8(layer, ctx.slot_mapping, k, v)
        if ctx.shape_static:  # the Python lengths are the capture's: take the whole fixed width
            tables = ctx.block_tables
        else:
            tables = ctx.block_tables[:, : -(-max(ctx.context_lens) // self.block_size)]
        used = tables.reshape(-1)
        k_cache = self._dequantize(self._gather(self.k[layer], used), scales.k_scale, dtype)
        v_cache = self._dequantize(self._gather(self.v[layer], used), scales.v_scale, dtype)
        compact = torch.arange(used.numel(), device=used.device).view(tables.shape)
        return k_cache, v_cache, compact

    # -- MLA latents ---------------------------------------------------------------------------

    def write_latent(self, layer: int, latent: torch.Tensor, ctx: ForwardContext) -> None:
        """Store the step's latent rows ``[T, 1, D]`` (``D = kv_lora_rank + rope_dim``) of an MLA
        layer at ``ctx.slot_mapping`` (quantised, and calibrating, for an FP8 cache)."""
        assert self.specs[layer].rows == LATENT_ROWS, f"layer {layer} keeps no latent rows"
        if layer not in self.fp8:
            cache = self.rows[layer]["latent"]
            cache.view(-1, *cache.shape[2:]).index_copy_(0, ctx.slot_mapping, latent.to(cache.dtype))
            return
        scales = self.fp8[layer]
        if scales.calibrating and scales.calibrator.observe(ctx.slot_mapping, latent, latent):
            for slots, staged, _ in scales.calibrator.drain():
                self._store_fp8(layer, slots, staged, staged)
        else:
            self._store_fp8(layer, ctx.slot_mapping, latent, latent)

    def latents(self, layer: int, ctx: ForwardContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent cache of ``layer`` readable in ``dtype`` and the block tables into it.

        Returns ``(cache [N, block_size, 1, D], block_tables [B, W])``: the pool's own tensor and
        ``ctx.block_tables``, or for an FP8 cache the step's blocks dequantised as a compact cache
        with tables into it.
        """
        cache = self.rows[layer]["latent"]
        if layer not in self.fp8:
            return cache, ctx.block_tables
        width = -(-max(ctx.context_lens) // self.block_size)
        tables = ctx.block_tables[:, :width]
        used = tables.reshape(-1)
        compact = self._dequantize(self._gather(cache, used), self.fp8[layer].k_scale, dtype)
        return compact, torch.arange(used.numel(), device=used.device).view(tables.shape)

    # -- extra rows (KVCacheSpec.extra_rows) ---------------------------------------------------

    def write_row(self, layer: int, name: str, x: torch.Tensor, ctx: ForwardContext) -> None:
        """Store the step's ``x [T, 1, width]`` in ``layer``'s extra row ``name`` at ``ctx.slot_mapping``."""
        assert name in dict(self.specs[layer].extra_rows), f"layer {layer} declares no extra row {name!r}"
        cache = self.rows[layer][name]
        cache.view(-1, *cache.shape[2:]).index_copy_(0, ctx.slot_mapping, x.to(cache.dtype))

    def row(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s extra row ``name`` as the pool keeps it: ``[num_blocks, block_size, 1, width]``
        under the step's ``ctx.block_tables``."""
        assert name in dict(self.specs[layer].extra_rows), f"layer {layer} declares no extra row {name!r}"
        return self.rows[layer][name]

    # -- pooled rows (KVCacheSpec.pooled_rows): one row per k tokens -----------------------------

    def pooled_row(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s pooled row ``name``: ``[num_blocks, block_size // k, 1, width]``, row ``j`` of a
        sequence at block ``block_table[j // (block_size // k)]``, offset ``j % (block_size // k)``."""
        assert name in {n for n, _, _ in self.specs[layer].pooled_rows}, f"layer {layer} declares no pooled row {name!r}"
        return self.rows[layer][name]

    def write_pooled_row(self, layer: int, name: str, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``x [n, 1, width]`` in ``layer``'s pooled row ``name`` at the flat row indices
        ``slots [n]`` (``block * (block_size // k) + offset``)."""
        cache = self.pooled_row(layer, name)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
