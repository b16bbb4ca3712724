"""Tensor parallelism on CPU (gloo, 2 ranks): the same greedy tokens as one process, the ranks'
caches kept in step, a dead worker named, no process left behind, and a torchrun launch.

Each engine here spawns a process that imports torch, so the tests share one engine where they can.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.runtime.tensor_parallel import WorkerDied, exit_code, resolve_size
from layerzoo.testing.checkpoints import add_mtp_head, copy_checkpoint
from layerzoo.testing.mtp import mtp_config
from layerzoo.testing.parity import assert_same_greedy, engine_paths_workload, greedy_tokens

# Tight on purpose: 12 blocks of 16 tokens (256 bytes a token) make a batch of six preempt.
ENGINE = dict(
    dtype="float32", max_model_len=128, kv_cache_memory=12 * 16 * 256, max_num_batched_tokens=40, max_num_seqs=8,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False},
)
# The cache budget is per rank and each rank holds half the KV heads (and half the state heads):
# half the bytes give each rank the single process's block count, so the TP run preempts too.
TP_ENGINE = {**ENGINE, "kv_cache_memory": ENGINE["kv_cache_memory"] // 2}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def child_pids() -> list[int]:
    """This process's live children (zombies aside, and multiprocessing's resource tracker, which
    the first spawn starts for the interpreter's lifetime), from /proc."""
    me, pids = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            if b"resource_tracker" not in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def runs(tiny_qwen3_dir):
    """The workload on one process and on two ranks (the same engine settings), and the ranks' digests."""
    first, second = engine_paths_workload(64)
    single = LLM(tiny_qwen3_dir, **ENGINE)
    expected = greedy_tokens(single, first) + greedy_tokens(single, second)
    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, **TP_ENGINE) as tp:
        got = greedy_tokens(tp, first) + greedy_tokens(tp, second)
        digests = tp.engine.executor.digests()
        stats = tp.stats
        children = multiprocessing.active_children()
    yield dict(single=single, prompts=first + second, expected=expected, got=got, digests=digests, stats=stats,
               children=children, single_stats=single.stats)


def test_two_ranks_give_one_process_greedy_tokens(runs):
    stats = runs["stats"]
    # The workload took every path the plan drives: chunked prompts, preemption, prefix hits, drafts.
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # rejected drafts too (kept rows < run)
    assert (stats.preemptions, stats.prefix_cache_hits) == (runs["single_stats"].preemptions, runs["single_stats"].prefix_cache_hits)
    assert_same_greedy(runs["single"].engine.model, runs["prompts"], runs["expected"], runs["got"])


def test_worker_caches_mirror_rank_0(runs):
    """Every pool change on a worker comes from the plans: it wrote the same KV rows and the same
    state slots as rank 0, and where the ranks hold the same weights, the same values."""
    rank0, rank1 = runs["digests"]
    assert rank0["kv_written"] == rank1["kv_written"] and any(rank0["kv_written"])
    assert rank0["own_states"] == rank1["own_states"] == []
    if rank0["weights"] == rank1["weights"]:  # replicated layers
        assert rank0["kv_values"] == rank1["kv_values"]


def test_shutdown_leaves_no_process(runs):
    assert len(runs["children"]) == 1  # the worker, while the engine ran
    assert multiprocessing.active_children() == [] and child_pids() == []


def test_tensor_parallel_size_is_validated(tiny_qwen3_dir):
    with pytest.raises(UserError, match="tensor_parallel_size: expected an int >= 1, got 0"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(UserError, match="tensor_parallel_size"):
        LLM(tiny_qwen3_dir, tensor_parallel_size="2")
    with pytest.raises(UserError, match="WORLD_SIZE=2"):
        resolve_size(3, {"RANK": "0", "WORLD_SIZE": "2"})
    assert resolve_size(1, {"RANK": "1", "WORLD_SIZE": "2"}) == (2, (1, 2, 1, 2))
    assert resolve_size(4, {}) == (4, None)


def test_cli_flag_reaches_the_engine():
    from layerzoo.entrypoints.cli import _parser, engine_kwargs

    args = _parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2


def test_killed_worker_ends_the_engine_naming_its_rank(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, tensor_parallel_size=2, **TP_ENGINE)
    (worker,) = llm.engine.executor.group.procs.values()
    first, _ = engine_paths_workload(64, seed=1)
    for i, prompt in enumerate(first):
        llm.engine.add_request(str(i), prompt, greedy(30))
    for _ in range(3):
        llm.engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"rank 1 died \(killed by signal 9\)"):
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert time.monotonic() - start < 60
    with pytest.raises(WorkerDied, match="rank 1"):  # and it stays dead
        llm.engine.step()
    llm.shutdown()
    assert multiprocessing.active_children() == [] and not alive(worker.pid)


def test_interpreter_exit_ends_the_workers(tiny_qwen3_dir, tmp_path):
    """A script that never calls shutdown: its worker ends with it."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from layerzoo import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(tiny_qwen3_dir)!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64)
            print(*[p.pid for p in llm.engine.executor.group.procs.values()], flush=True)
            out = llm.generate("t1 t2 t3", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            print(out[0].outputs[0].token_ids, flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)


def test_a_worker_that_cannot_start_is_named(tiny_qwen3_dir, tmp_path):
    """A script without the main-module guard: the spawned rank re-runs it and fails while
    bootstrapping; rank 0 says so (and what to write) instead of waiting at the rendezvous."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"from layerzoo import LLM\nLLM({str(tiny_qwen3_dir)!r}, tensor_parallel_size=2, dtype='float32', max_model_len=64)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "WorkerDied: tensor-parallel worker rank 1 died (exit code 1)" in last and '__name__ == "__main__"' in last


def test_block_tables_travel_as_changes():
    """Rank 0 sends a table only when it changed; the worker's copy always equals the plan's,
    through growth, frees (a preempted sequence coming back with other blocks) and reuse."""
    from layerzoo.runtime.tensor_parallel import BlockTableMirror

    rng = random.Random(0)
    rank0, worker = BlockTableMirror(), BlockTableMirror()
    live: dict[int, list[int]] = {}
    sent = total = 0
    for step in range(400):
        freed = [s for s in list(live) if rng.random() < 0.03]
        for s in freed:
            del live[s]
        for s in range(step % 7, 40, 7):
            if s not in live and rng.random() < 0.2:
                live[s] = [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
        for blocks in live.values():
            if rng.random() < 0.1:
                blocks.append(rng.randrange(100))
        tables = {s: tuple(b) for s, b in live.items()}
        rank0.drop(freed)
        changes = rank0.changes(tables)
        worker.drop(freed)
        held = worker.apply(changes)
        assert all(held[s] == t for s, t in tables.items())
        sent, total = sent + len(changes), total + len(tables)
    assert sent < total / 3


def test_a_table_changed_at_its_length_travels_and_only_its_tail():
    """A verify's rejected drafts give a block back and the next plan's table has the same length
    with another block there: that change travels. Growth sends the new blocks only."""
    from layerzoo.runtime.tensor_parallel import BlockTableMirror

    rank0, worker = BlockTableMirror(), BlockTableMirror()
    assert worker.apply(rank0.changes({1: (0, 1, 2, 3)})) == {1: (0, 1, 2, 3)}
    assert rank0.changes({1: (0, 1, 2, 3)}) == {}
    changed = rank0.changes({1: (0, 1, 2, 5)})
    assert changed == {1: (3, (5,))} and worker.apply(changed) == {1: (0, 1, 2, 5)}
    changed = rank0.changes({1: (0, 1, 2, 5, 6, 7)})
    assert changed == {1: (4, (6, 7))} and worker.apply(changed) == {1: (0, 1, 2, 5, 6, 7)}
    changed = rank0.changes({1: (0, 9, 2, 5)})  # not a tail change (no such plan today): still exact
    assert changed == {1: (1, (9, 2, 5))} and worker.apply(changed) == {1: (0, 9, 2, 5)}


def test_worker_block_tables_follow_speculation_rewinds(tiny_qwen3_dir):
    """Blocks of 4 tokens and several sequences speculating (3 drafts each): a verify that rejects
    drafts gives its last block back, and the sequence's next plan may take another block at the
    same place, its table's length unchanged. After every step the worker ran each chunk with the
    block table rank 0 ran it with (a worker on a stale table writes KV into another block)."""
    engine = dict(ENGINE, block_size=4, kv_cache_memory=96 * 4 * 256 // 2, max_num_batched_tokens=32)
    prompts = [[7, 3, 9, 7, 3, 9, 7, 3], [1, 2, 3, 4, 5, 1, 2, 3, 4], [11, 12, 11, 12, 11], [40, 41, 42, 43, 40, 41]]
    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, **engine) as tp:
        for i, prompt in enumerate(prompts):
            tp.engine.add_request(str(i), prompt, greedy(24))
        held: dict[int, tuple[int, ...]] = {}
        same_length_changes = steps = 0
        while tp.engine.has_unfinished():
            tp.engine.step()
            rank0, rank1 = tp.engine.executor.digests()
            assert rank1["block_tables"] == rank0["block_tables"], f"step {steps}"
            for seq_id, table in rank0["block_tables"].items():
                old = held.get(seq_id)
                same_length_changes += old is not None and len(old) == len(table) and old != table
                held[seq_id] = table
            steps += 1
        stats = tp.stats
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens and stats.preemptions == 0
    assert same_length_changes > 0


def test_mtp_drafting_on_two_ranks(tiny_qwen3_dir, tmp_path):
    """The MTP head's block is split over the ranks like the model's, so every rank runs its step:
    after sampling, rank 0 sends the workers the head's rows (`HeadRows`) and its schedule's asks.
    Greedy tokens equal one process's plain decoding through chunked prompts, preemption and
    prefix hits, drafts are verified, and the ranks wrote the same KV rows (the head's included)."""
    path = copy_checkpoint(tiny_qwen3_dir, tmp_path / "mtp", lambda tensors: None)
    add_mtp_head(path, "qwen", source_layer=1)
    first, second = engine_paths_workload(64)
    plain = LLM(path, **{**ENGINE, "speculative_config": None})
    expected = greedy_tokens(plain, first) + greedy_tokens(plain, second)
    with LLM(path, tensor_parallel_size=2, **{**TP_ENGINE, "speculative_config": mtp_config(2)}) as tp:
        got = greedy_tokens(tp, first) + greedy_tokens(tp, second)
        rank0, rank1 = tp.engine.executor.digests()
        stats = tp.stats
    assert stats.spec_draft_tokens > 0 and stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert_same_greedy(plain.engine.model, first + second, expected, got)
    assert rank0["kv_written"] == rank1["kv_written"] and any(rank0["kv_written"])


def test_mtp_second_tokens_on_two_ranks(tiny_qwen3_dir, tmp_path):
    """A second token (`MtpProposer.ask_second`: the head's row before the last through its whole
    block) runs on every rank: rank 0 sends the asks with the head's rows, or the block's
    collectives would not line up. Here rank 0 asks one with every ask of the adaptive policy
    (whose guesses run a sequence's waiting rows with its new one); greedy tokens stay plain
    decoding's and second tokens were made."""
    path = copy_checkpoint(tiny_qwen3_dir, tmp_path / "mtp", lambda tensors: None)
    add_mtp_head(path, "qwen", source_layer=1)
    first, _ = engine_paths_workload(64)
    plain = LLM(path, **{**ENGINE, "speculative_config": None})
    expected = greedy_tokens(plain, first)
    with LLM(path, tensor_parallel_size=2, **{**TP_ENGINE, "speculative_config": mtp_config(2, adaptive=True)}) as tp:
        proposer = tp.engine.runner.mtp.proposer
        ask, made = proposer.propose_for, []

        def asked_with_second(seq_id, token_ids, k):
            proposer.ask_second(seq_id)
            return ask(seq_id, token_ids, k)

        proposer.propose_for = asked_with_second
        store_second = proposer.store_second
        proposer.store_second = lambda seq_id, length, token: (made.append(length), store_second(seq_id, length, token))
        got = greedy_tokens(tp, first)
        rank0, rank1 = tp.engine.executor.digests()
    assert made
    assert_same_greedy(plain.engine.model, first, expected, got)
    assert rank0["kv_written"] == rank1["kv_written"] and any(rank0["kv_written"])


def test_ranks_split_the_cpus(monkeypatch):
    from layerzoo.runtime import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "usable_cpus", lambda: 2)
    assert [tensor_parallel.threads_per_rank(n) for n in (1, 2, 3)] == [2, 1, 1]


def test_torchrun_generate_matches_one_process(tiny_qwen3_dir):
    """``torchrun --nproc-per-node 2 -m layerzoo.entrypoints.cli generate``: rank 0 prints what one process
    prints; rank 1 serves the steps and exits cleanly."""
    flags = ["generate", "--model", str(tiny_qwen3_dir), "--prompt", "t5 t9 t2 t5 t9", "--max-tokens", "12",
             "--max-model-len", "64", "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "layerzoo.entrypoints.cli", *flags], capture_output=True, text=True, timeout=600, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    launched = subprocess.run(
        # `python -m torch.distributed.run` is the `torchrun` command
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "layerzoo.entrypoints.cli", *flags],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout == single.stdout and single.stdout.count("t") > 12


def test_async_engine_on_two_ranks_and_a_worker_that_raises(tiny_qwen3_dir):
    """`AsyncLLM` (the server's engine) on two ranks; a worker that fails on a step sends its
    error to rank 0 and exits, and the engine ends naming the rank and the error."""
    import asyncio

    from layerzoo.entrypoints.async_llm import AsyncLLM
    from layerzoo.runtime.plan import ChunkRows, StepPlan
    from layerzoo.runtime.tensor_parallel import StepMessage

    prompt = [3, 1, 4, 1, 5]
    single = LLM(tiny_qwen3_dir, dtype="float32", max_model_len=64)
    expected = greedy_tokens(single, [prompt], 6)
    engine = AsyncLLM(tiny_qwen3_dir, tensor_parallel_size=2, dtype="float32", max_model_len=64)
    group = engine.engine.executor.group
    (worker,) = group.procs.values()

    async def complete(prompt):
        async for out in engine.generate({"prompt_token_ids": prompt}, greedy(6)):
            last = out
        return last.outputs[0].token_ids

    try:
        got = asyncio.run(complete(prompt))
        with pytest.raises(UserError, match="a tensor-parallel engine is running in this process"):
            LLM(tiny_qwen3_dir, dtype="float32", max_model_len=64)  # its layers would see the group
        # A decode of a sequence the worker holds no block table for: its runner raises KeyError.
        # (The broadcast itself may already see the worker's sockets close.)
        bad = StepPlan(decodes=(ChunkRows(10**9, 0, 1, (1,)),), prefills=())
        with contextlib.suppress(RuntimeError):
            asyncio.run(engine.call(lambda e: e.executor.group.send(StepMessage(bad))))
        assert exit_code(worker, 60) == 1
        # The step fails every live request with the error; the engine stays up to say so again.
        for _ in range(2):
            with pytest.raises(WorkerDied, match=r"rank 1 died \(exit code 1\): KeyError: 1000000000"):
                asyncio.run(complete([2, 7, 1, 8]))
    finally:
        engine.shutdown()
    assert multiprocessing.active_children() == [] and child_pids() == []
    assert_same_greedy(single.engine.model, [prompt], expected, [got])
