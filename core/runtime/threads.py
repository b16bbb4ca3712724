"""CPU thread defaults that degrade gracefully when the machine is shared.

Two things made the CLI 5-50x slower on a 2-core machine while another process kept one core
busy: torch sized its pool from all the machine's cores, and OpenMP (libgomp) worker threads
spin at every barrier, so a thread that shares its core with the busy process holds back each
op while the others burn the remaining core spinning. What is done about each:

- the intra-op pool has one thread per CPU this process may run on (``os.sched_getaffinity``:
  a taskset or container CPU set counts, not the machine's total);
- the spinning stays: a sleeping thread's wake-up costs more than a small op (on a 2-core VM,
  single-stream decode of a 0.1B model ran at 24 tok/s with ``OMP_WAIT_POLICY=PASSIVE`` and 29
  with libgomp's default spin; the embedded model's batched generation 420 against 690 tok/s).
  Instead the engine watches for contention and runs on one thread while it lasts
  (`layerzoo.runtime.cpu_contention`), which a spinning team cannot slow down.

Each is only a default: ``OMP_NUM_THREADS``/``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` set by the user,
or ``EngineArgs.num_threads`` (``--num-threads``), win. ``bench/threads.py`` measures the effect.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from layerzoo import settings


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_num_threads(env: MutableMapping[str, str] | None = None) -> int | None:
    """Threads for torch's intra-op pool: None when the user set ``OMP_NUM_THREADS`` (torch obeys it)."""
    if settings.text("OMP_NUM_THREADS", env):
        return None
    return usable_cpus()


def apply_thread_defaults(num_threads: int | None = None) -> int:
    """Size torch's intra-op pool; returns the size.

    ``num_threads`` given: exactly that. Otherwise the pool is only ever lowered, to
    `default_num_threads`: a smaller count the caller chose (``torch.set_num_threads(1)``) stays.
    """
    import torch

    current = torch.get_num_threads()
    if num_threads is not None:
        wanted = num_threads
    else:
        limit = default_num_threads()
        wanted = min(current, limit) if limit is not None else current
    if wanted != current:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()
