"""Decode graphs: when a decode step may replay a captured graph, which one, and when it goes stale.

`DecodeGraphRunner` owns the bookkeeping and never touches a device itself: capturing and replaying
are injected (``capture_fn(bucket, slots) -> handle``, ``replay_fn(handle, live_rows) -> output``),
so the same rules hold on every device and are tested with fakes. The model runner injects
`layerzoo.runtime.decode_capture.DecodeCapture`: CUDA graphs on CUDA (built on `cuda_capture_fn` /
`cuda_replay_fn`, bottom of file), a ``torch.compile``'d decode step on CPU.

The rules, each from a capability answer (`layerzoo.plugins.capabilities`):

* ``decode_graph_unsupported`` on any layer is a veto computed once here, at build: always eager,
  the reason naming the layer (from ``capabilities.disabled()``).
* ``fp8_calibration_frozen`` changes at run time, so ``poll_fp8()`` is asked on EVERY step; graphs
  wait until `ModelCapabilities.graphs_ready_after_fp8_calibration` says no layer is calibrating.
* A batch of ``n`` decodes pads to the smallest bucket ``>= n`` with `PAD_ID` rows; only the
  first ``n`` output rows are ever returned.
* ``graph_stale_on_new_sequence``: a graph bakes in its sequences' buffers, so graphs are keyed
  ``(bucket, padded slots)`` and freeing a sequence drops exactly the graphs whose key holds its
  slot (never wholesale). When no layer says so, a graph holds nothing of its sequences and one graph per bucket serves every batch
  (key ``(bucket, ())``).
* A capture that raises turns graphs off for the run (logged once, reason in the stats): the step
  and every later one run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from layerzoo.plugins.capabilities import ModelCapabilities

log = logging.getLogger(__name__)

# The id of a padded decode row wherever an id is asked: its graph slot and its sequence id (own-state
# layers allocate it a throwaway state). Never a sequence's: it writes only the pools' padding rows
# (`PagedKVCache.pad_block`, `StatePool.pad_slot`), never indexes a pool itself.
PAD_ID = -1

GraphKey = tuple[int, tuple[int, ...]]

REASON_DISABLED = "graphs disabled by config"
REASON_NO_BUCKET = "batch above the largest graph bucket"


class CaptureFailed(Exception):
    """A capture raised (its cause is the original error). Raised by `DecodeGraphRunner` for a
    ``capture_fn`` that raised, and by a ``replay_fn`` that had to capture more (e.g. a new table
    width) and failed before running anything live: the step runs eagerly and graphs stop."""


class StaleReplay(Exception):
    """Raised by a ``replay_fn`` whose replay ran (``output`` is right) but showed that the captured
    step is not static after all (e.g. a compiled step had to recompile): graphs stop for the run."""

    def __init__(self, reason: str, output: Any):
        super().__init__(reason)
        self.reason, self.output = reason, output


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _sorted_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(buckets)))
    if not out or out[0] < 1:
        raise ValueError(f"batch_buckets must be non-empty positive sizes, got {buckets!r}")
    return out


@attrs.frozen(kw_only=True)
class GraphConfig:
    batch_buckets: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16, 32, 64), converter=_sorted_buckets)
    enabled: bool = True  # the user's switch (enforce_eager turns it off)
    compile_on_cpu: bool = False  # on CPU the captured step is a compiled one: only when asked (compile_decode)
    off_reason: str | None = None  # why ``enabled`` is False, for the stats (default: REASON_DISABLED)

    def captures_on(self, device_type: str) -> bool:
        """Whether decode steps on ``device_type`` are captured (CUDA unless off; CPU only when asked)."""
        return self.enabled and (device_type != "cpu" or self.compile_on_cpu)


class DecodeGraphRunner:
    def __init__(
        self,
        capabilities: ModelCapabilities | None,
        config: GraphConfig,
        *,
        device: str | torch.device,
        poll_fp8: Callable[[], Sequence[bool | None]] | None = None,
        capture_fn: Callable[[int, tuple[int, ...]], Any] | None = None,
        replay_fn: Callable[[Any, int], Any] | None = None,
    ):
        self.capabilities = capabilities
        self.config = config
        self.device = torch.device(device)  # a "cuda" string does not initialise CUDA
        self.capture_fn, self.replay_fn = capture_fn, replay_fn
        if config.enabled and (capture_fn is None or replay_fn is None):
            raise ValueError(f"DecodeGraphRunner on {self.device.type} needs capture_fn and replay_fn")
        self.abandoned: str | None = None  # why graphs stopped for the run (a capture raised, a replay was stale)
        # Without a poller, the answers given at build stand (a calibrating layer keeps us eager).
        self.poll_fp8 = poll_fp8 or self._build_time_fp8_states
        self.veto_reason = self._veto_reason(capabilities)  # once, at build
        self.stale_on_new_sequence = capabilities is not None and capabilities.graph_stale_on_new_sequence
        self.graphs: dict[GraphKey, Any] = {}
        self.stats: dict[str, int] = {"captures": 0, "replays": 0, "eager": 0, "dropped": 0}
        self.eager_reasons: dict[str, int] = {}

    def _build_time_fp8_states(self) -> list[bool | None]:
        return [lc.fp8_calibration_frozen for lc in self.capabilities.layers] if self.capabilities else []

    @staticmethod
    def _veto_reason(caps: ModelCapabilities | None) -> str | None:
        if caps is None or not caps.decode_graph_veto:
            return None
        cause = next(c for c in caps.disabled() if c.query == "decode_graph_unsupported")
        log.info("%s: decoding eagerly", cause.describe())
        return cause.describe()

    # -- predicates ----------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows; None when it is above the largest."""
        assert batch >= 1, f"a decode batch has at least one row, got {batch}"
        return next((b for b in self.config.batch_buckets if b >= batch), None)

    def can_use_graphs(self) -> tuple[bool, str | None]:
        """``(allowed, reason)``; the FP8 states are polled anew on every call."""
        if not self.config.enabled:
            return False, self.config.off_reason or REASON_DISABLED
        if self.veto_reason is not None:
            return False, self.veto_reason
        if self.abandoned is not None:
            return False, self.abandoned
        states = list(self.poll_fp8())
        if not ModelCapabilities.graphs_ready_after_fp8_calibration(states):
            layer = next(i for i, s in enumerate(states) if s is not None and not s)
            return False, f"fp8 calibration not frozen (layer {layer})"
        return True, None

    # -- the step ------------------------------------------------------------------------------

    def key_for(self, slots: Sequence[int], bucket: int) -> GraphKey:
        """``(bucket, slots padded with PAD_ID to bucket rows)`` when graphs go stale with their
        sequences; ``(bucket, ())`` when they hold nothing of them."""
        if not self.stale_on_new_sequence:
            return bucket, ()
        return bucket, (*slots, *[PAD_ID] * (bucket - len(slots)))

    def replay(self, slots: Sequence[int]) -> Any | None:
        """One decode step over the sequences in ``slots`` (row order) by a captured graph: its
        output rows, or None when this step must run eagerly (the reason is counted)."""
        slots = tuple(slots)
        assert PAD_ID not in slots, f"slot {PAD_ID} is the padding slot, not a sequence's"
        assert len(set(slots)) == len(slots), f"a slot appears twice in one decode batch: {slots}"
        allowed, reason = self.can_use_graphs()
        bucket = self.bucket_for(len(slots))
        if allowed and bucket is None:
            reason = f"{REASON_NO_BUCKET} ({self.config.batch_buckets[-1]})"
        if not allowed or bucket is None:
            return self._eager(reason)
        try:
            handle = self._graph(self.key_for(slots, bucket))
            out = self.replay_fn(handle, len(slots))
        except StaleReplay as exc:
            self.abandon(exc.reason)
            out = exc.output
        except CaptureFailed as exc:
            self.abandon(f"decode graph capture failed ({_first_line(exc.__cause__ or exc)})", exc)
            return self._eager(self.abandoned)
        self.stats["replays"] += 1
        return out[: len(slots)]  # padded rows never leave

    def eager_while_off(self) -> None:
        """A pure decode pass of a run with graphs off: counted eager, with the reason they are off."""
        assert not self.config.enabled
        return self._eager(self.config.off_reason or REASON_DISABLED)

    def _eager(self, reason: str) -> None:
        self.stats["eager"] += 1
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        return None

    def abandon(self, reason: str, exc: BaseException | None = None) -> None:
        """Stop capturing and replaying for the rest of the run (logged once): decode eagerly."""
        self.abandoned = reason
        self.graphs.clear()
        log.warning("%s; decoding eagerly from now on", reason, exc_info=exc if exc is not None and log.isEnabledFor(logging.DEBUG) else None)

    def _graph(self, key: GraphKey) -> Any:
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture_fn(*key)
            except CaptureFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - any capture failure routes to the eager path
                raise CaptureFailed(str(exc)) from exc
            self.stats["captures"] += 1
        return self.graphs[key]

    def warmup(self, slot_sets: Iterable[Sequence[int]]) -> int:
        """Capture graphs ahead of use, largest bucket first (one shared pool reuses its memory)."""
        if not self.can_use_graphs()[0]:
            return 0
        keys = {self.key_for(tuple(s), b) for s in slot_sets if (b := self.bucket_for(len(s))) is not None}
        before = self.stats["captures"]
        for key in sorted(keys, key=lambda k: -k[0]):
            self._graph(key)
        return self.stats["captures"] - before

    # -- staleness -----------------------------------------------------------------------------

    def free_sequence(self, slot: int) -> None:
        """A sequence left ``slot``: drop the graphs that baked it in, when a layer says they go stale."""
        assert slot != PAD_ID, "the padding slot belongs to no sequence"
        if not self.stale_on_new_sequence:
            return
        stale = [key for key in self.graphs if slot in key[1]]
        for key in stale:
            del self.graphs[key]
        self.stats["dropped"] += len(stale)

    def summary(self) -> dict[str, Any]:
        """For the engine's stats."""
        return {**self.stats, "graphs": len(self.graphs), "eager_reasons": dict(self.eager_reasons)}


# -- CUDA capture and replay (used only when torch.cuda.is_available()) ------------------------


@attrs.define
class CudaGraph:
    """A captured graph and its static output; the captured step reads static buffers that its
    owner writes before each replay (`layerzoo.runtime.decode_capture.DecodeCapture`)."""

    graph: Any  # torch.cuda.CUDAGraph
    output: torch.Tensor


def new_graph_pool() -> Any:
    """One memory pool for every capture (pass it to each `cuda_capture_fn`)."""
    return torch.cuda.graph_pool_handle()


def cuda_capture_fn(fn: Callable[[], torch.Tensor], *, pool: Any = None, warmup: int = 1) -> CudaGraph:
    """Capture ``fn()`` after ``warmup`` runs on a side stream (capture needs one)."""
    assert torch.cuda.is_available(), "cuda_capture_fn needs CUDA"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return CudaGraph(graph, output)


def cuda_replay_fn(handle: CudaGraph, rows: int) -> torch.Tensor:
    """Replay; the output's first ``rows`` rows, cloned: a static output in a shared pool is
    overwritten by the next replay."""
    handle.graph.replay()
    return handle.output[:rows].clone()
