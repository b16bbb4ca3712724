"""The tensor-parallel group this process belongs to, and the collectives layers use on it.

A process that is not part of a group (the common case: one device) sees rank 0 of a group of
size 1, and every collective is the identity, so a layer written for tensor parallelism runs
unchanged in a single process. The engine calls :func:`initialize` before it builds the model:
layers read :func:`tp_rank` / :func:`tp_size` at construction to size their shards, and the loader
reads them to cut each weight's slice.

Built on ``torch.distributed`` (gloo on CPU, NCCL on CUDA); the group is the default (world)
group, so a ``torchrun`` launch and engine-spawned workers look the same from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_state: dict = {"rank": 0, "size": 1, "group": None, "owns_process_group": False}


def initialize(*, rank: int, world_size: int, init_method: str | None = None, backend: str | None = None) -> None:
    """Join (or create) the process group and make it this process's tensor-parallel group.

    ``init_method`` is a ``torch.distributed`` URL (``tcp://host:port`` or ``file://...``); None
    reads ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment, as under ``torchrun``.
    ``backend`` None picks NCCL when CUDA is available, else gloo.
    """
    assert 0 <= rank < world_size, (rank, world_size)
    owns = False
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)
        owns = True
    if world_size > 1:
        assert dist.get_world_size() == world_size and dist.get_rank() == rank, "process group disagrees"
    _state.update(rank=rank, size=world_size, group=dist.group.WORLD if world_size > 1 else None, owns_process_group=owns)


def destroy() -> None:
    """Leave the group (destroying the process group if :func:`initialize` created it)."""
    if _state["owns_process_group"] and dist.is_initialized():
        dist.destroy_process_group()
    _state.update(rank=0, size=1, group=None, owns_process_group=False)


def tp_rank() -> int:
    return _state["rank"]


def tp_size() -> int:
    return _state["size"]


def tp_group():
    """The ``torch.distributed`` group of the tensor-parallel ranks; None in a single process."""
    return _state["group"]


def is_parallel() -> bool:
    return _state["size"] > 1


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` for a quantity that must split evenly across ranks."""
    assert numerator % denominator == 0, f"{numerator} does not split evenly into {denominator} shards"
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``. Identity in a single process."""
    if is_parallel():
        dist.all_reduce(x, group=tp_group())
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` side by side along ``dim`` (rank order). Identity in a single process."""
    if not is_parallel():
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=tp_group())
    return torch.cat(parts, dim=dim)


