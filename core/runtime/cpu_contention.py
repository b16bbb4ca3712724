"""Fewer CPU threads while other processes hold our cores, back to all of them once they leave.

OpenMP threads spin at each barrier for a while before they sleep (libgomp's default), which
saves a sleeping thread's wake-up at every op of a step: on a 2-core VM, single-stream decode of
a 0.1B model ran at 29 tok/s against 24 with ``OMP_WAIT_POLICY=PASSIVE``. The price comes when
another process is busy on one of our cores: the thread that shares it spins against that process
and loses most of its slices, and every barrier waits for it (bench/threads.py measured 0.06-0.2x
of the idle rate). One thread per free core is then the fastest choice, and it has no barriers.

`ThreadGovernor.after_step` is called by the runner after each step. Every ``window_s`` it reads
how long this process's threads were runnable but not running (the run-queue delay the kernel
keeps in ``/proc/self/task/*/schedstat``, in ns). Delay above ``threshold`` of the window's wall
time per thread means the cores are contended: the pool drops to one thread. Every ``probe_s``
after that it goes back to the full count for one window and keeps it if the delay stays low.

Only in charge when the pool size is layerzoo's own default: a user's ``num_threads`` or
``OMP_NUM_THREADS`` stays as given, and ``LAYERZOO_THREAD_GOVERNOR=0`` turns it off. Off with
``compile_decode``: compiled steps are specialised to the thread count.
"""

from __future__ import annotations

import glob
import logging
import time
from collections.abc import Callable

import torch

from layerzoo import settings
from layerzoo.runtime.threads import default_num_threads

log = logging.getLogger(__name__)

ENV = "LAYERZOO_THREAD_GOVERNOR"


def run_queue_delay_ns() -> int | None:
    """Total ns this process's threads have waited on a run queue since they started (the second
    field of each ``/proc/self/task/<tid>/schedstat``); None where the kernel does not say."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
            found = True
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return total if found else None


class ThreadGovernor:
    """Chooses torch's intra-op thread count between ``full`` and 1 from measured contention.

    ``read_delay`` and ``clock`` are the kernel's counter and a monotonic clock; ``set_threads``
    resizes the pool (``torch.set_num_threads``).
    """

    def __init__(
        self,
        full: int,
        *,
        window_s: float = 0.5,
        probe_s: float = 5.0,
        threshold: float = 0.15,
        read_delay: Callable[[], int | None] = run_queue_delay_ns,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ):
        assert full > 1
        self.full, self.threads = full, full
        self.window_s, self.probe_s, self.threshold = window_s, probe_s, threshold
        self.read_delay, self.clock, self.set_threads = read_delay, clock, set_threads
        self._start = clock()
        self._delay = read_delay()
        self._reduced_at: float | None = None
        self.changes = 0  # how many times the pool was resized (for logs and tests)

    @classmethod
    def for_engine(cls, device_type: str, num_threads: int | None, compiled_decode: bool = False) -> ThreadGovernor | None:
        """The engine's governor: on CPU, with more than one thread, when nobody chose the count.

        None with ``compiled_decode``: a compiled step is specialised to the thread count (dynamo
        guards it), so a resize would make every captured step recompile and fall back to eager.
        """
        user_chose = num_threads is not None or default_num_threads() is None  # num_threads, OMP_NUM_THREADS
        if device_type != "cpu" or user_chose or compiled_decode:
            return None
        if not settings.flag(ENV) or torch.get_num_threads() < 2 or run_queue_delay_ns() is None:
            return None
        return cls(torch.get_num_threads())

    def after_step(self) -> None:
        now = self.clock()
        elapsed = now - self._start
        if elapsed < self.window_s:
            return
        delay = self.read_delay()
        if delay is None or self._delay is None:
            self._restart(now, delay)
            return
        waited = (delay - self._delay) / 1e9 / (elapsed * self.threads)
        if self.threads == self.full and waited > self.threshold:
            self._resize(1, f"threads waited {waited:.0%} of the last {elapsed:.1f} s for a CPU")
            self._reduced_at = now
        elif self.threads == 1 and now - self._reduced_at >= self.probe_s:
            self._resize(self.full, "probing whether the cores are free again")
        self._restart(now, delay)

    def _restart(self, now: float, delay: int | None) -> None:
        self._start, self._delay = now, delay

    def _resize(self, threads: int, why: str) -> None:
        log.info("CPU threads %d -> %d: %s", self.threads, threads, why)
        self.set_threads(threads)
        self.threads = threads
        self.changes += 1
