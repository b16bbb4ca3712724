"""What a layer keeps: per token in the paged cache (`KVCacheSpec`), per sequence in the state pool (`StateSpec`).

This is the public module plugins import their cache declarations from; the runtime that sizes
and holds the caches (`layerzoo.runtime`) is never imported by a plugin.

A layer kind declares its per-token shape and dtype through `KVCacheSpec`; the runtime's paged
pool (`layerzoo.runtime.kv_pool`) sizes its blocks from these declarations, so layouts other
than GQA K/V (MLA latents, FP8) fit by declaring another spec. ``dtype`` is what attention
computes in; ``storage_dtype`` (when set) is what the pool keeps, e.g. ``float8_e4m3fn`` for an
FP8 cache that attention dequantises on read.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from layerzoo.errors import UserError

FP8_KV_DTYPE = torch.float8_e4m3fn
# kv_cache_dtype -> storage dtype (None: the model's compute dtype).
KV_CACHE_DTYPES: Mapping[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8_KV_DTYPE, "fp8": FP8_KV_DTYPE}


def parse_kv_cache_dtype(name) -> torch.dtype | None:
    """The storage dtype ``kv_cache_dtype`` names; a UserError naming the argument otherwise."""
    if not isinstance(name, str) or name.lower() not in KV_CACHE_DTYPES:
        raise UserError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name.lower()]


# The named per-token tensors of the two layouts the core knows.
GQA_ROWS = ("k", "v")  # grouped-query attention: a key and a value row per KV head
LATENT_ROWS = ("latent",)  # MLA: one row [c_kv | k_pe] shared by every query head


@attrs.frozen
class KVCacheSpec:
    """What one layer stores per token: the named tensors ``rows``, each ``num_kv_heads x head_dim``.

    GQA keeps K and V (``rows = ("k", "v")``); MLA keeps one latent row of ``kv_lora_rank +
    rope_dim`` as a single "head" (`KVCacheSpec.latent`). The pool keeps one paged tensor
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` per name, all under the same block tables.
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the compute dtype
    storage_dtype: torch.dtype | None = None  # what the pool stores; None: the compute dtype
    rows: tuple[str, ...] = GQA_ROWS
    # More per-token rows of other widths beside ``rows``: ``(name, width)`` pairs, one head each,
    # kept in the compute dtype (never FP8), e.g. a DSA indexer's key next to an MLA latent.
    extra_rows: tuple[tuple[str, int], ...] = ()
    # Rows kept once per ``k`` consecutive tokens: ``(name, width, k)`` triples, one head each, in
    # the compute dtype, e.g. a k-pool indexer's pooled key. Row ``j`` of a sequence covers its
    # positions ``j*k .. j*k+k-1`` and lives in the block of those positions, at offset
    # ``(j*k % block_size) // k`` (the block size must be a multiple of ``k``).
    pooled_rows: tuple[tuple[str, int, int], ...] = ()

    def __attrs_post_init__(self):
        names = (*self.rows, *(name for name, _ in self.extra_rows), *(name for name, _, _ in self.pooled_rows))
        assert self.rows and len(set(names)) == len(names), names
        assert all(width > 0 for _, width in self.extra_rows), self.extra_rows
        assert all(width > 0 and k > 0 for _, width, k in self.pooled_rows), self.pooled_rows

    @classmethod
    def latent(cls, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> KVCacheSpec:
        """An MLA layer's cache: one ``[c_kv (kv_lora_rank) | k_pe (rope_dim)]`` row per token."""
        return cls(1, kv_lora_rank + rope_dim, dtype, rows=LATENT_ROWS)

    @property
    def is_latent(self) -> bool:
        return self.rows == LATENT_ROWS

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.storage_dtype or self.dtype

    @property
    def bytes_per_token(self) -> int:
        extra = sum(width for _, width in self.extra_rows) * self.dtype.itemsize
        # a pooled row's bytes spread over its k tokens, rounded up (the budget errs on the safe side)
        pooled = sum(-(-width * self.dtype.itemsize // k) for _, width, k in self.pooled_rows)
        return len(self.rows) * self.num_kv_heads * self.head_dim * self.cache_dtype.itemsize + extra + pooled

    def check_block_size(self, block_size: int, layer: int | str = "?") -> None:
        """A UserError naming ``block_size`` when a pooled row's ``k`` does not divide it."""
        for name, _, k in self.pooled_rows:
            if block_size % k:
                raise UserError(
                    f"block_size: layer {layer} keeps one {name!r} row per {k} tokens, so block_size must be "
                    f"a multiple of {k}; got {block_size}"
                )


@attrs.frozen
class StateSpec:
    """What one pool layer keeps per sequence.

    ``conv_shape`` is the short-conv window (``[conv_dim, W - 1]``, the last raw inputs, oldest
    first) in the model dtype; ``recurrent_shape`` the recurrent state (``[H, K, V]`` for a gated
    delta rule, ``[H, P, N]`` for Mamba2) in fp32.
    """

    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]
    conv_dtype: torch.dtype = torch.float32
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_slot(self) -> int:
        def size(shape, dtype):
            n = 1
            for d in shape:
                n *= d
            return n * torch.empty((), dtype=dtype).element_size()

        return size(self.conv_shape, self.conv_dtype) + size(self.recurrent_shape, self.recurrent_dtype)
