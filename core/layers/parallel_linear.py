"""Column- and row-parallel linears: the tensor-parallel split of a projection pair.

A column-parallel linear ``[out, in]`` keeps ``out / N`` output rows on each rank (its output stays
split: this rank's heads, this rank's slice of the MLP's intermediate); a row-parallel linear keeps
``in / N`` input columns and its partial products are summed over the ranks by an all-reduce
(`parallel_state.all_reduce`, which the owning block calls once after it, so that an MoE's routed
and shared experts share one reduction). Both are plain ``nn.Linear`` of the local shape, so the
CPU packing, the q/k/v and gate/up fusion and int8 quantization (`layerzoo.layers.linear`) work on
the shard unchanged: sharding is decided at construction, packing after the load.

The split is recorded per parameter (`layerzoo.distributed.sharding.Shard`) for the loader, which
reads only this rank's slice of the checkpoint tensor. A linear whose checkpoint weight is in a
quantized format is replaced at load by its method's module, built for the whole weight and cut
like the plain linear (`split_like`): the method knows where its blocks allow the cut. With one
rank these functions return exactly the ``nn.Linear`` the layers built before tensor
parallelism, with no description.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import Shard, set_shard, shard_of
from layerzoo.errors import ConfigError


def split_rows(sections: int | Sequence[int], what: str = "a projection") -> Shard | None:
    """This rank's even share of each section along dim 0 (None with one rank).

    A section that does not split evenly is a config the layer cannot shard: a `ConfigError`
    naming ``what``.
    """
    sections = (sections,) if isinstance(sections, int) else tuple(sections)
    n = parallel_state.tp_size()
    if n == 1:
        return None
    uneven = [s for s in sections if s % n]
    if uneven:
        sizes = " + ".join(str(s) for s in sections)
        raise ConfigError(f"tensor_parallel_size={n}: {what} ({sizes}) does not split into {n} equal shards")
    return Shard(0, sections, parallel_state.tp_rank(), n)


def split_heads(num_heads: int, head_dim: int, what: str) -> Shard | None:
    """This rank's heads of a per-head projection ``[num_heads * head_dim, ...]`` (None with one rank)."""
    n = parallel_state.tp_size()
    if n > 1 and num_heads % n:
        raise ConfigError(f"tensor_parallel_size={n}: {what} has {num_heads} heads, which do not split into {n} ranks")
    return split_rows(num_heads * head_dim, what)


def local_heads(num_heads: int) -> int:
    """Heads one rank computes when ``num_heads`` split across the ranks."""
    return parallel_state.divide(num_heads, parallel_state.tp_size())


def kv_heads_shard(num_kv_heads: int, head_dim: int) -> tuple[int, Shard | None]:
    """``(KV heads on this rank, the shard of a k or v projection)``.

    With at least as many KV heads as ranks they split; with fewer, each rank keeps one KV head,
    replicated over the ``N / num_kv_heads`` ranks whose query heads share it (rank ``r`` holds KV
    head ``r // (N / num_kv_heads)``, the one its query heads group onto).
    """
    n, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    if n == 1:
        return num_kv_heads, None
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ConfigError(f"tensor_parallel_size={n}: {num_kv_heads} KV heads do not split into {n} ranks")
        return num_kv_heads // n, Shard(0, (num_kv_heads * head_dim,), rank, n)
    if n % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={n}: {num_kv_heads} KV heads cannot be replicated evenly over {n} ranks")
    return 1, Shard(0, (num_kv_heads * head_dim,), rank // (n // num_kv_heads), num_kv_heads)


def column_parallel_linear(in_features: int, out_features: int, bias: bool = False, *, shard: Shard | None) -> nn.Linear:
    """``nn.Linear(in_features, local out)`` holding this rank's output rows ``shard`` (None: all)."""
    local = out_features if shard is None else shard.local_size
    assert shard is None or shard.full_size == out_features, (shard, out_features)
    linear = nn.Linear(in_features, local, bias=bias)
    set_shard(linear, "weight", shard)
    if bias:
        set_shard(linear, "bias", shard)
    return linear


def row_parallel_linear(in_features: int, out_features: int, bias: bool = False, *, shard: Shard | None) -> nn.Linear:
    """``nn.Linear(local in, out_features)`` holding this rank's input columns ``shard`` (dim 0 of
    ``shard`` read as the weight's dim 1); the caller all-reduces its output.

    A bias is loaded on rank 0 only (zeros elsewhere), so that the all-reduce adds it once.
    """
    if shard is None:
        return nn.Linear(in_features, out_features, bias=bias)
    assert shard.full_size == in_features, (shard, in_features)
    linear = nn.Linear(shard.local_size, out_features, bias=bias)
    set_shard(linear, "weight", Shard(1, shard.sections, shard.index, shard.count))
    if bias:
        set_shard(linear, "bias", Shard(0, (out_features,), 0, 1, zeros=parallel_state.tp_rank() != 0))
    return linear


def whole_features(linear: nn.Linear) -> tuple[int, int]:
    """``(in_features, out_features)`` of the whole weight of which ``linear`` (a plain column- or
    row-parallel linear) holds this rank's piece."""
    shard = shard_of(linear, "weight")
    if shard is None:
        return linear.in_features, linear.out_features
    if shard.dim == 0:
        return linear.in_features, shard.full_size
    return shard.full_size, linear.out_features


def split_like(method, linear: nn.Linear):
    """``method`` (a `LinearMethod` built for the whole weight of ``linear``) cut to the piece the
    plain linear it replaces holds: the method splits its own tensors (`LinearMethod.split`),
    raising a `SplitError` where its format cannot. Returns ``method``."""
    shard = shard_of(linear, "weight")
    if shard is not None:
        method.split(shard)
    return method
