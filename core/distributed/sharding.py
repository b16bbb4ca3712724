"""How a parameter of this rank relates to the full checkpoint tensor: the per-parameter shard
description the tensor-parallel layers set and the loader reads.

A layer that splits a weight across the tensor-parallel ranks records, for that parameter, a
`Shard`: the dimension it splits, the full lengths of the sections along it that split separately
(a fused ``[q | k | v]`` projection splits each of q, k, v by head, not the whole by rows), and
which of ``count`` pieces this rank holds. The loader (`layerzoo.loading.loader.load_weights`) checks the
checkpoint tensor against the full shape and reads only this rank's piece through a safetensors
slice. A parameter with no description is replicated: every rank loads the whole tensor.

Descriptions live on the owning module (``module._tp_shards``: attribute name -> `Shard`), not on
the parameter objects, because building on the meta device and moving to the real device
replaces the parameter objects.
"""

from __future__ import annotations

import attrs
from torch import nn

SHARDS_ATTR = "_tp_shards"


@attrs.frozen
class Shard:
    """This rank's piece of a parameter along ``dim``.

    Each section (full length ``s``) is cut into ``count`` pieces of ``ceil(s / count)`` rows; this
    rank holds piece ``index`` of every section, side by side. The last piece of a section that
    does not split evenly (a vocabulary) is short: the parameter's tail rows past it are zeros.
    ``zeros`` marks a parameter that this rank holds as zeros and never reads (the bias of a
    row-parallel linear: added once, on rank 0, before the all-reduce).
    """

    dim: int
    sections: tuple[int, ...] = attrs.field(converter=tuple)
    index: int = 0
    count: int = 1
    zeros: bool = False

    def __attrs_post_init__(self):
        assert self.sections and all(s > 0 for s in self.sections), self.sections
        assert 0 <= self.index < self.count, (self.index, self.count)

    @property
    def full_size(self) -> int:
        return sum(self.sections)

    @property
    def local_size(self) -> int:
        """Rows this rank's parameter has along ``dim`` (padding of an uneven split included)."""
        return sum(-(-s // self.count) for s in self.sections)

    def ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` of this rank's rows of the full tensor, one per section (may be empty)."""
        out, offset = [], 0
        for s in self.sections:
            piece = -(-s // self.count)
            start = min(offset + self.index * piece, offset + s)
            out.append((start, min(start + piece, offset + s)))
            offset += s
        return out

    def in_units(self, unit: int, dim: int | None = None) -> Shard | None:
        """The same split of a tensor holding one entry per ``unit`` rows of this one (a word of 8
        packed values, a scale per group or block of inputs), along ``dim`` (this one's by default);
        None where a section or a piece does not fall on a whole unit (or the split is uneven)."""
        if any(s % (unit * self.count) for s in self.sections):
            return None
        return Shard(self.dim if dim is None else dim, tuple(s // unit for s in self.sections), self.index, self.count)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint's shape of a parameter whose local shape is ``local_shape``."""
        assert local_shape[self.dim] == self.local_size, (local_shape, self)
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def set_shard(module: nn.Module, attr: str, shard: Shard | None) -> None:
    """Record how ``module.<attr>`` is split across the ranks (None: replicated, nothing recorded)."""
    if shard is None:
        return
    shards = module.__dict__.setdefault(SHARDS_ATTR, {})
    shards[attr] = shard


def shard_of(module: nn.Module, attr: str) -> Shard | None:
    return module.__dict__.get(SHARDS_ATTR, {}).get(attr)


def parameter_shards(model: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter or buffer of ``model``, by its state-dict name."""
    out = {}
    for prefix, module in model.named_modules():
        for attr, shard in module.__dict__.get(SHARDS_ATTR, {}).items():
            out[f"{prefix}.{attr}" if prefix else attr] = shard
    return out


def check_shardable(model: nn.Module, layer_kind_of) -> None:
    """Refuse, naming it, a decoder layer that cannot split across the tensor-parallel ranks.

    Asked after the model is built (on the meta device) and before any weight is read, when
    ``tp_size() > 1``. ``layer_kind_of(layer)`` names the layer's registered kind.
    """
    from layerzoo.distributed import parallel_state
    from layerzoo.errors import UserError

    n = parallel_state.tp_size()
    if n == 1:
        return
    for index, layer in enumerate(model.layers):
        if vars(type(layer)).get("tensor_parallel") is not True:  # declared by the class itself
            raise UserError(
                f"tensor_parallel_size={n}: layer {index} of kind {layer_kind_of(layer)!r} "
                f"({type(layer).__name__}) cannot be sharded across tensor-parallel ranks "
                "(its plugin does not split it); run this model with tensor_parallel_size=1"
            )
