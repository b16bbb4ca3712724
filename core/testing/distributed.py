"""Run a function on N tensor-parallel ranks (CPU processes over gloo), for tests of sharded models
without the engine.

`run_on_ranks` spawns one process per rank; each joins the group through
`layerzoo.distributed.parallel_state.initialize` (a ``file://`` rendezvous in a temporary
directory), calls ``"module:function"(*args)`` and sends back what it returns. Every process is
joined, or killed when one fails or the deadline passes (a rank left alone blocks in its next
collective), so a failing test leaves no process behind. A failure names the rank and carries its
traceback.

`prefill_on_rank` is the usual target: load a checkpoint through the loader on this rank, prefill
token ids in chunks, decode a few more one step each (`step_logits`) and return the logits with
what each rank holds.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch


class RankFailed(RuntimeError):
    """A rank raised, died or did not finish in time; the message names it."""


def run_on_ranks(target: str, *args, world_size: int = 2, timeout: float = 300.0) -> list:
    """``[target(*args) on rank 0, on rank 1, ...]``, each run in its own process of one group.

    ``target`` is ``"module:function"`` (imported in the child, so it needs no pickling); ``args``
    and the results must pickle (tensors do).
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="layerzoo-tp-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, init, target, args, tmp), name=f"layerzoo-rank{rank}")
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            _wait(procs, tmp, timeout)
            return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=30)


def _wait(procs, tmp: str, timeout: float) -> None:
    """Return once every rank exited cleanly; raise `RankFailed` on the first that did not."""
    deadline = time.monotonic() + timeout
    while True:
        for rank, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                error = Path(tmp) / f"rank{rank}.err"
                detail = error.read_text() if error.exists() else f"exit code {p.exitcode}"
                raise RankFailed(f"rank {rank} failed:\n{detail}")
        if all(p.exitcode == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            late = [r for r, p in enumerate(procs) if p.exitcode is None]
            raise RankFailed(f"ranks {late} did not finish within {timeout:.0f} s")
        time.sleep(0.05)


def _rank_main(rank: int, world_size: int, init: str, target: str, args: tuple, tmp: str) -> None:
    from layerzoo.distributed import parallel_state
    from layerzoo.runtime.tensor_parallel import exit_without_finalizing

    torch.set_num_threads(1)
    try:
        parallel_state.initialize(rank=rank, world_size=world_size, init_method=init, backend="gloo")
        module, _, name = target.partition(":")
        result = getattr(importlib.import_module(module), name)(*args)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")
        # No rank tears its group down while a peer is still inside a collective.
        torch.distributed.barrier(group=parallel_state.tp_group())
        parallel_state.destroy()
    except BaseException:
        (Path(tmp) / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # skip atexit: the group may be stuck waiting for a peer
    exit_without_finalizing(0)


@contextlib.contextmanager
def pretend_rank(rank: int, world_size: int):
    """Build and load models in this process as rank ``rank`` of ``world_size`` would, with no
    process group: for checking one rank's shard. Collectives are not available inside."""
    from layerzoo.distributed import parallel_state

    saved = dict(parallel_state._state)
    parallel_state._state.update(rank=rank, size=world_size, group=None, owns_process_group=False)
    try:
        yield
    finally:
        parallel_state._state.clear()
        parallel_state._state.update(saved)


def step_logits(model, prompt: list[int], chunks: list[int], decode_ids: list[int] = (), block_size: int = 16):
    """Logits ``[len(prompt) + len(decode_ids), vocab]``: the prompt prefilled in ``chunks``, then
    each of ``decode_ids`` fed as a one-row decode step (teacher-forced, so that two runs compare
    without near-tie argmax choices in between), over a paged KV pool and a state pool as the
    engine runs them."""
    from layerzoo.layers.context import ForwardContext
    from layerzoo.runtime.kv_pool import PagedKVCache
    from layerzoo.runtime.state_pool import SsmStep, StatePool

    assert sum(chunks) == len(prompt)
    ids = torch.as_tensor([*prompt, *decode_ids], dtype=torch.long)
    num_blocks = -(-len(ids) // block_size)
    kv = PagedKVCache(model.kv_cache_specs(), num_blocks, block_size)
    specs = model.state_specs()
    pool = StatePool(specs, 1) if specs else None
    steps = [(n, 0) for n in chunks] + [(1, 1)] * len(decode_ids)  # (rows, decode rows)
    hidden, done = [], 0
    with torch.inference_mode():
        for n, decodes in steps:
            ctx = ForwardContext.for_paged(
                seq_ids=[0], query_lens=[n], context_lens=[done + n], block_tables=[list(range(num_blocks))],
                block_size=block_size, num_decodes=decodes, kv_cache=kv,
            )
            if pool is not None:
                ctx.ssm = SsmStep(pool=pool, slots=(0,))
            hidden.append(model(ids[done : done + n], ctx))
            done += n
        return model.compute_logits(torch.cat(hidden))


def prefill_on_rank(model_dir: str, token_ids: list[int], chunks: list[int], pack: bool = True, decode_ids: list[int] = ()) -> dict:
    """Load ``model_dir`` on this rank (fp32), prefill ``token_ids`` in ``chunks`` and decode
    ``decode_ids`` one step each (`step_logits`).

    Returns ``logits [T, vocab]``, ``shapes`` (parameter name -> this rank's shape; ask with
    ``pack=False``: packing fuses and re-lays weights) and the per-rank cache declarations
    ``kv_specs`` / ``state_specs`` (layer index -> spec).
    """
    from layerzoo.engine_args import EngineArgs
    from layerzoo.layers.linear import ENV
    from layerzoo.loading.model_loading import load_model

    if not pack:
        os.environ[ENV] = "0"
    model = load_model(Path(model_dir), EngineArgs(dtype="float32")).model
    return {
        "logits": step_logits(model, token_ids, chunks, decode_ids),
        "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()},
        "kv_specs": model.kv_cache_specs(),
        "state_specs": model.state_specs(),
    }
