"""Tensor parallelism, the engine's side: the ranks, their start and end, and the step messages.

Rank 0 runs everything a single process runs (front end, scheduler, sampling, verification);
every other rank holds its shard of the model (`layerzoo.distributed.parallel_state` tells the
layers which) and only runs forward passes. Each step rank 0 broadcasts a `StepMessage` (the
step's plan as plain data, `StepPlan.for_workers`) and then runs its own forward; the workers run
the same passes (so every collective inside the model lines up), drop the logits, and keep their
KV and state pools identical to rank 0's, because every change to them comes from the plans.

Two ways to start, one code path (`LLM` calls `join`):

- ``tensor_parallel_size=N`` in one process: it spawns N-1 worker processes (``torch.multiprocessing``
  spawn context), each of which builds the same `LLM` and then serves plans;
- a ``torchrun`` launch (``RANK`` / ``WORLD_SIZE`` set): every process joins that group; rank 0
  goes on as the engine, the others serve plans until rank 0 shuts down, then exit.

Two process groups: the world group (gloo on CPU, NCCL on CUDA) for the layers' collectives, with
a collective timeout, and a gloo group on the CPU for the step messages, whose timeout is long:
a worker waits there for as long as the engine stays idle (a server without requests).

A rank that dies is noticed without waiting out a timeout: gloo fails a collective as soon as a
peer's sockets close, and rank 0 watches its spawned workers' process sentinels (a monitor thread),
ending the others when one dies so that no rank stays blocked. Rank 0 then raises `WorkerDied`
naming the rank (and its error, which a worker sends to rank 0 before it exits).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import attrs
import torch
import torch.distributed as dist

from layerzoo import settings
from layerzoo.distributed import parallel_state
from layerzoo.distributed.net import free_port
from layerzoo.errors import UserError, WorkerDied
from layerzoo.runtime.threads import usable_cpus

log = logging.getLogger(__name__)

# Seconds a collective of the layers may wait for a peer (a hung, not a dead, rank).
COLLECTIVE_TIMEOUT_ENV = "LAYERZOO_TP_TIMEOUT_S"
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next plan (an idle server)
STARTUP_TIMEOUT_S = 600  # spawned workers: import torch and layerzoo, then join
SHUTDOWN_GRACE_S = 15  # workers finish their queued steps and exit before being terminated


@attrs.frozen
class Launch:
    """How this process joins the group: its rank, the group's size and rendezvous, its threads."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port, or env:// under torchrun
    local_rank: int
    local_world_size: int
    spawned: bool  # a worker this package spawned (else rank 0 of a spawn, or a torchrun rank)


@attrs.frozen
class StepMessage:
    """One step for the workers: the plan to run (None: nothing to run). ``probe``: then every
    rank reports its `cache_digest`. With MTP drafting a second message follows each plan, after
    rank 0 sampled: ``mtp`` (`layerzoo.runtime.model_runner.MtpInputs`), the head's step to run."""

    plan: Any  # StepPlan.for_workers()
    probe: bool = False
    mtp: Any = None


def _tensor_digest(x: torch.Tensor) -> str:
    import hashlib

    x = x.detach()
    if x.is_mkldnn:  # a weight packed for oneDNN (layerzoo.layers.linear on CPU)
        x = x.to_dense()
    return hashlib.sha256(x.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def cache_digest(runner) -> dict:
    """What a rank holds, to compare ranks (tests, debugging): hashes of its weights and cache
    contents, and the written pattern of its caches (which KV rows, which state slots are not
    zero), which agrees across ranks even when each holds another shard of the heads."""
    weights = "".join(_tensor_digest(p) for p in runner.model.parameters())
    kv_values, kv_written = [], []
    for layer in sorted(runner.kv.rows):
        for name in sorted(runner.kv.rows[layer]):
            x = runner.kv.rows[layer][name]
            kv_values.append(_tensor_digest(x))
            kv_written.append((x.flatten(2) != 0).any(-1).nonzero().tolist())  # [(block, row)]
    state_values, state_written = [], []
    if runner.pool is not None:
        for layer in runner.pool.layers:
            for x in (runner.pool.conv[layer], runner.pool.recurrent[layer]):
                state_values.append(_tensor_digest(x))
                state_written.append((x.flatten(1) != 0).any(-1).nonzero().flatten().tolist())  # [slot]
    return {
        "weights": weights,
        "kv_values": kv_values, "kv_written": kv_written,
        "state_values": state_values, "state_written": state_written,
        "own_states": sorted(runner.own_states),
        "graph_slots": sorted(runner.slots.slot_of),
    }


class BlockTableMirror:
    """Block tables sent as changes: a sequence's table travels when its contents differ from the
    one last sent (a decode row's table changes once a block, not every step), and then only from
    the first block that differs, so a step's message stays small however long the contexts.
    Contents, not lengths: a verify's rejected drafts give their last block back, and the next
    plan's table may have the same length with another block there. Rank 0 and each worker hold
    one and drop the same sequences (those a message or a plan frees) before the plan's tables are
    compared or applied."""

    def __init__(self):
        self.tables: dict[int, tuple[int, ...]] = {}

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.tables.pop(seq_id, None)

    def changes(self, tables) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Rank 0: per table of the plan the workers do not hold yet, ``(kept, tail)``: the
        workers keep the first ``kept`` blocks of the table they hold and append ``tail``."""
        changed = {}
        for seq_id, table in tables.items():
            held = self.tables.get(seq_id, ())
            if held != table:
                kept = _common_prefix(held, table)
                changed[seq_id] = (kept, table[kept:])
                self.tables[seq_id] = table
        return changed

    def apply(self, changed) -> dict[int, tuple[int, ...]]:
        """A worker: every table it holds, with the message's changes."""
        for seq_id, (kept, tail) in changed.items():
            self.tables[seq_id] = self.tables.get(seq_id, ())[:kept] + tail
        return self.tables


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading blocks ``a`` and ``b`` share. Tables change at their end (growth, a
    rewind), so the whole common length is tried first; the scan runs only after a rewind."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


_control: dict = {"group": None, "torchrun_joined": False}  # the step-message group of this process, once joined


def control_group():
    """The gloo group step messages (and other small host-side agreements) travel on."""
    return _control["group"] if _control["group"] is not None else parallel_state.tp_group()


def agree_on_min(value: int) -> int:
    """The smallest ``value`` over the ranks (each rank sizes its KV pool from its own free memory;
    rank 0's scheduler must not address blocks a worker lacks). ``value`` in a single process."""
    if not parallel_state.is_parallel():
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
    return int(t.item())


# -- how this process joins ----------------------------------------------------------------------

_spawned_launch: dict = {"launch": None, "conn": None}  # set in a worker before it builds its LLM


def torchrun_world(env=None) -> tuple[int, int, int, int] | None:
    """``(rank, world_size, local_rank, local_world_size)`` under torchrun; None otherwise."""
    rank, world = settings.integer("RANK", env), settings.integer("WORLD_SIZE", env)
    if rank is None or world is None:
        return None
    local_rank, local_world = settings.integer("LOCAL_RANK", env), settings.integer("LOCAL_WORLD_SIZE", env)
    local_rank = rank if local_rank is None else local_rank
    local_world = world if local_world is None else local_world
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world, local_rank, local_world


def resolve_size(requested: int, env=None) -> tuple[int, tuple | None]:
    """The tensor-parallel size to run with, and the torchrun world when launched by torchrun.

    Under torchrun the group is the launch's: ``tensor_parallel_size`` left at 1 takes
    ``WORLD_SIZE``; another value must equal it.
    """
    world = torchrun_world(env)
    if world is None:
        return requested, None
    if requested not in (1, world[1]):
        raise UserError(
            f"tensor_parallel_size: {requested} does not match the torchrun launch's WORLD_SIZE={world[1]} "
            f"(leave it unset, or launch {requested} processes)"
        )
    return world[1], world


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=settings.seconds(COLLECTIVE_TIMEOUT_ENV))


def threads_per_rank(local_world_size: int) -> int:
    """The ranks on one machine share its CPUs: each gets its part (at least one)."""
    return max(1, usable_cpus() // local_world_size)


class TensorParallelGroup:
    """This process's membership of a tensor-parallel group (every rank has one).

    On rank 0 of a spawn it owns the worker processes. `shutdown` is idempotent and leaves no
    process behind; it also runs at interpreter exit (`LLM` registers it).
    """

    def __init__(self, launch: Launch, device: str):
        self.launch = launch
        self.rank, self.world_size = launch.rank, launch.world_size
        self.device = device
        self.procs: dict[int, Any] = {}  # rank -> process (rank 0 of a spawn)
        self.conns: dict[int, Any] = {}  # rank -> pipe end (a worker's error report)
        self.failure: WorkerDied | None = None
        self.broken_by: BaseException | None = None  # rank 0's own error that ended the group
        self.closed = False
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------------

    def spawn(self, build, llm_args: tuple, llm_kwargs: dict) -> None:
        """Rank 0: start ranks 1..N-1, each building ``build(*llm_args, **llm_kwargs)`` (the `LLM`
        class, passed by reference) as a worker."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            launch = attrs.evolve(self.launch, rank=rank, local_rank=rank, spawned=True)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main, args=(launch, child, build, llm_args, llm_kwargs), name=f"layerzoo-tp{rank}", daemon=True
            )
            proc.start()
            child.close()
            self.procs[rank], self.conns[rank] = proc, parent
        self._wait_for_joins()
        self._monitor = threading.Thread(target=self._watch, name="layerzoo-tp-monitor", daemon=True)
        self._monitor.start()

    def _wait_for_joins(self) -> None:
        """Each spawned worker says "joining" before it enters the rendezvous; one that dies
        first (an import error) is reported here instead of leaving rank 0 waiting in it."""
        waiting = dict(self.conns)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self.shutdown()
                raise WorkerDied(f"tensor-parallel ranks {sorted(waiting)} did not start within {STARTUP_TIMEOUT_S} s")
            sentinels = {self.procs[r].sentinel: r for r in waiting}
            ready = multiprocessing.connection.wait(list(waiting.values()) + list(sentinels), timeout=left)
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is None:
                    rank = next(r for r, c in waiting.items() if c is obj)
                    try:
                        message = obj.recv()
                    except EOFError:
                        message = None
                    if message == "joining":
                        waiting.pop(rank)
                        continue
                else:
                    message = self._error_of(rank)
                self._record_death(rank, message)
                failure = self.failure
                self.shutdown()
                raise WorkerDied(
                    f"{failure} while starting (it runs your main module first, as multiprocessing's spawn does: "
                    f"a script must create the LLM under `if __name__ == \"__main__\":`)"
                )

    def join(self) -> None:
        """Enter the process groups (blocks until every rank has)."""
        launch = self.launch
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)  # NCCL binds each rank's communicator to its device
        if not dist.is_initialized():
            dist.init_process_group(
                backend, init_method=launch.init_method, rank=launch.rank, world_size=launch.world_size,
                timeout=collective_timeout(),
            )
        _control["group"] = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        parallel_state.initialize(rank=launch.rank, world_size=launch.world_size)

    # -- liveness ------------------------------------------------------------------------------

    def _error_of(self, rank: int) -> str | None:
        conn = self.conns.get(rank)
        try:
            if conn is not None and conn.poll(0.5):
                return conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def _record_death(self, rank: int, error: str | None) -> None:
        proc = self.procs.get(rank)
        code = exit_code(proc) if proc is not None else None
        with self._lock:
            if self.failure is not None or self.closed:
                return
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            detail = f": {error.strip().splitlines()[-1]}" if error else ""
            self.failure = WorkerDied(f"tensor-parallel worker rank {rank} died ({how}){detail}")
            if error:
                log.error("tensor-parallel worker rank %d failed:\n%s", rank, error)

    def _watch(self) -> None:
        """Rank 0's monitor: the first worker to die ends the others, so no collective waits on it."""
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        while sentinels and not self.closed:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            for s in ready:
                rank = sentinels.pop(s)
                if self.closed:
                    return
                self._record_death(rank, self._error_of(rank))
            if ready and not self.closed:
                self._terminate_workers()
                return

    def check(self) -> None:
        """Raise the recorded failure (a dead worker) before rank 0 starts another step."""
        if self.failure is not None:
            raise WorkerDied(str(self.failure))
        if self.closed:
            after = f" after {self.broken_by!r}" if self.broken_by is not None else ""
            raise WorkerDied(f"the tensor-parallel group has ended{after}")

    def failed(self, exc: BaseException) -> WorkerDied | None:
        """After ``exc`` broke off a step (or the start) on this rank: end the group (ranks may be
        inside a collective this one left) and return the worker death behind ``exc``, if that is
        what it was (a dead peer's closed sockets fail gloo's collective with a RuntimeError)."""
        if isinstance(exc, RuntimeError):
            deadline = time.monotonic() + 5.0  # the sentinel fires a moment after the sockets close
            while self.failure is None and self.procs and time.monotonic() < deadline:
                for rank, proc in self.procs.items():
                    if not proc.is_alive():
                        self._record_death(rank, self._error_of(rank))
                time.sleep(0.05)
            if self.failure is None and not self.procs and "closed by peer" in str(exc):  # torchrun: no sentinels
                self.failure = WorkerDied(f"a tensor-parallel rank died: {exc}")
        self.broken_by = exc
        self.shutdown(graceful=False)
        return WorkerDied(str(self.failure)) if self.failure is not None else None

    def end_after(self, exc: BaseException) -> None:
        """The start failed with ``exc`` on this rank: end the group; a worker's death, when that
        is the cause, is raised instead of ``exc``. A user error (every rank makes the same) stays."""
        died = self.failed(exc)
        if died is not None and not isinstance(exc, UserError):
            raise died from exc

    # -- step messages -------------------------------------------------------------------------

    def send(self, message: StepMessage | None) -> None:
        """Rank 0: broadcast a step message (None: shut down)."""
        dist.broadcast_object_list([message], src=0, group=control_group())

    def receive(self) -> StepMessage | None:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control_group())
        return box[0]

    def serve(self, runner) -> None:
        """A worker rank: run rank 0's plans until it says stop."""
        assert self.rank != 0
        tables = BlockTableMirror()
        ran: dict[int, tuple[int, ...]] = {}  # the block tables of the last plan's chunks
        while (message := self.receive()) is not None:
            plan = message.plan
            if plan is not None:
                tables.drop(plan.freed)
                plan = attrs.evolve(plan, block_tables=tables.apply(plan.block_tables))
                ran = chunk_tables(plan)
                runner.execute_as_worker(plan)
                if runner.mtp is not None:  # the head's step follows once rank 0 sampled
                    after = self.receive()
                    if after is None:  # rank 0 ended the group instead
                        return
                    if after.mtp is not None:
                        runner.draft_as_worker(plan, after.mtp)
            if message.probe:
                dist.gather_object({**cache_digest(runner), "block_tables": ran}, None, dst=0, group=control_group())

    # -- end -----------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """End the group: rank 0 tells the workers to stop, waits for them (then ends any left),
        and every rank leaves the process groups. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            if graceful and self.rank == 0 and self.failure is None and dist.is_initialized():
                try:
                    self.send(None)
                except Exception as exc:  # a worker died meanwhile: the terminate below ends the rest
                    log.warning("tensor-parallel shutdown message failed: %r", exc)
            self._join_workers(SHUTDOWN_GRACE_S if graceful else 0)
        finally:
            leave_groups()

    def _join_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self._terminate_workers()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def _terminate_workers(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def chunk_tables(plan) -> dict[int, tuple[int, ...]]:
    """The block table each chunk of a plan ran with (``cache_digest``'s companion: the ranks
    must agree on these every step)."""
    return {c.seq_id: tuple(plan.block_tables[c.seq_id]) for c in plan.chunks}


def exit_code(proc, timeout_s: float = 5.0) -> int | None:
    """A dying process's exit code. Its sentinel closes a moment before it can be reaped, and when
    two threads join it the one that did not reap it sees None for a moment: wait for the code."""
    deadline = time.monotonic() + timeout_s
    while proc.exitcode is None and time.monotonic() < deadline:
        proc.join(0.05)
    return proc.exitcode


def leave_groups() -> None:
    _control["group"] = None
    parallel_state.destroy()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer
            log.debug("destroy_process_group: %r", exc)


def join(tensor_parallel_size: int, device: str, build, llm_args: tuple, llm_kwargs: dict) -> TensorParallelGroup | None:
    """Make this process a member of its tensor-parallel group, before the model is built.

    None: a single process (``tensor_parallel_size`` 1 and no torchrun launch). A spawned worker
    joins with the launch its parent gave it; a torchrun rank with the environment's; a process
    asking for ``tensor_parallel_size > 1`` becomes rank 0 and spawns the others, each of which
    calls ``build(*llm_args, **llm_kwargs)`` (the caller's `LLM` class) and so comes back here.
    """
    if parallel_state.is_parallel():  # layers read the group's size when built: it is this process's, one at a time
        raise UserError(
            "a tensor-parallel engine is running in this process: shut it down (LLM.shutdown()) before building "
            "another engine here"
        )
    spawned = _spawned_launch["launch"]
    if spawned is not None:
        group = TensorParallelGroup(spawned, device)
        _spawned_launch["conn"].send("joining")
        group.join()
        return group
    size, world = resolve_size(tensor_parallel_size)
    if size == 1:
        return None
    if device.startswith("cuda"):
        local = world[3] if world is not None else size
        if torch.cuda.device_count() < local:
            raise UserError(
                f"tensor_parallel_size: {local} ranks on this machine need as many CUDA devices, {torch.cuda.device_count()} visible"
            )
    if world is not None:
        if _control["torchrun_joined"]:
            raise UserError(
                "under torchrun a process builds one tensor-parallel engine: the other ranks left when the first "
                "one shut down (launch again for another)"
            )
        _control["torchrun_joined"] = True
        rank, size, local_rank, local_world = world
        group = TensorParallelGroup(Launch(rank, size, "env://", local_rank, local_world, spawned=False), device)
    else:
        launch = Launch(0, size, f"tcp://127.0.0.1:{free_port()}", 0, size, spawned=False)
        group = TensorParallelGroup(launch, device)
        group.spawn(build, llm_args, llm_kwargs)
    try:
        group.join()
    except BaseException as exc:
        group.end_after(exc)
        raise
    return group


def rank_device(device: str, local_rank: int) -> str:
    """Each rank on its own CUDA device (``cuda`` / ``cuda:N`` -> ``cuda:<local rank>``)."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def worker_main(launch: Launch, conn, build, llm_args: tuple, llm_kwargs: dict) -> None:
    """A spawned worker: build the same `LLM` (which joins the group and serves rank 0's plans
    until it shuts down), then end the process.

    Any error goes to rank 0 over ``conn`` (which names the rank) before the process exits, which
    closes its sockets and so fails rank 0's pending collective at once rather than at a timeout.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which ends the workers
    _spawned_launch.update(launch=launch, conn=conn)
    try:
        build(*llm_args, **llm_kwargs)
    except SystemExit as exc:
        if exc.code not in (0, None):
            _report(conn, f"SystemExit({exc.code})")
            os._exit(1)
    except BaseException:
        _report(conn, traceback.format_exc())
        os._exit(1)
    conn.close()
    exit_without_finalizing(0)  # the groups are left


def exit_without_finalizing(code: int) -> None:
    """End this process once its work is done and its groups are left, skipping interpreter
    finalization: gloo's worker threads can outlive the group, and tearing the interpreter down
    under them aborts the process now and then ("terminate called without an active exception",
    seen in CI)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(conn, text: str) -> None:
    try:
        conn.send(text)
        conn.close()
    except OSError:
        pass
    print(text, file=sys.stderr, flush=True)


class TensorParallelExecutor:
    """Rank 0's executor (`layerzoo.runtime.executor.Executor`): broadcasts each step's message,
    then runs the step on its own runner like a single process. The plans carry everything the
    workers need (frees, kept verify rows)."""

    def __init__(self, runner, group: TensorParallelGroup):
        self.runner, self.group = runner, group
        self._tables = BlockTableMirror()
        self._ran: dict[int, tuple[int, ...]] = {}  # the block tables of the last plan's chunks

    @torch.inference_mode()
    def execute(self, plan):
        if plan.empty and (self.group.failure is not None or self.group.closed):
            # A free-only plan after the group ended (an abort after a worker died): the ended ranks
            # hold nothing any more, rank 0 frees its own; the next step reports the death.
            return self.runner.execute(plan)
        self.group.check()
        message = self._message(plan)
        self._ran = chunk_tables(plan)
        try:
            self.group.send(message)
            chunks, logits = self.runner.forward(plan)
        except BaseException as exc:  # collectives left half-way: the group cannot go on
            self._failed(exc)
        if self.runner.mtp is None:
            return self.runner.sample(plan, chunks, logits)
        # With MTP the workers wait for the head's step, which needs the sampled tokens.
        try:
            result = self.runner.sample(plan, chunks, logits)
        except BaseException:
            with contextlib.suppress(Exception):  # (a group that cannot take it is ended by the next step)
                self.group.send(StepMessage(None))  # no head step after all: the workers go on
            raise
        inputs = self.runner.mtp_inputs(result)
        try:
            self.group.send(StepMessage(None, mtp=inputs))
            return self.runner.draft(plan, result, inputs)
        except BaseException as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException):
        """Re-raise ``exc`` (as `WorkerDied` when a worker died): the group cannot go on."""
        died = self.group.failed(exc)
        if died is not None:
            raise died from exc
        raise exc

    def _message(self, plan, probe: bool = False) -> StepMessage:
        if plan is not None:
            self._tables.drop(plan.freed)
            plan = attrs.evolve(plan.for_workers(), block_tables=self._tables.changes(plan.block_tables))
        return StepMessage(plan, probe)

    @torch.inference_mode()
    def digests(self) -> list[dict]:
        """Every rank's `cache_digest`, in rank order (between steps), with the block tables each
        rank ran the last plan's chunks with (``block_tables``)."""
        self.group.check()
        digests = [None] * self.group.world_size
        try:
            self.group.send(self._message(None, probe=True))
            dist.gather_object({**cache_digest(self.runner), "block_tables": self._ran}, digests, dst=0, group=control_group())
        except BaseException as exc:
            died = self.group.failed(exc)
            if died is not None:
                raise died from exc
            raise
        return digests

    def shutdown(self) -> None:
        self.group.shutdown()
