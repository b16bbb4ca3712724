"""The CPU thread governor: one thread while other processes hold our cores, all of them again
once the cores are free; driven by the kernel's run-queue delay of this process's threads."""

import os
import subprocess
import sys

import pytest
import torch

from layerzoo.runtime.cpu_contention import ThreadGovernor, run_queue_delay_ns


class Machine:
    """A clock and a run-queue delay counter that the test advances."""

    def __init__(self):
        self.now, self.delay_ns, self.threads = 0.0, 0, []

    def run(self, seconds: float, waiting_fraction: float, threads: int):
        self.now += seconds
        self.delay_ns += int(seconds * waiting_fraction * threads * 1e9)


def governor(machine, full=2):
    return ThreadGovernor(full, window_s=0.5, probe_s=5.0, threshold=0.15, read_delay=lambda: machine.delay_ns,
                          clock=lambda: machine.now, set_threads=machine.threads.append)


def steps(machine, gov, seconds, waiting_fraction, step_s=0.05):
    for _ in range(round(seconds / step_s)):
        machine.run(step_s, waiting_fraction, gov.threads)
        gov.after_step()


def test_idle_cores_keep_every_thread():
    machine = Machine()
    gov = governor(machine)
    steps(machine, gov, 10.0, waiting_fraction=0.02)
    assert gov.threads == 2 and machine.threads == []


def test_contention_drops_to_one_thread_then_probes_back_when_it_ends():
    machine = Machine()
    gov = governor(machine)
    steps(machine, gov, 1.0, waiting_fraction=0.5)  # a busy neighbour on one of our cores
    assert gov.threads == 1 and machine.threads == [1]
    steps(machine, gov, 4.0, waiting_fraction=0.0)  # before the probe: stays at one
    assert machine.threads == [1]
    steps(machine, gov, 1.5, waiting_fraction=0.5)  # the probe finds the neighbour still there
    assert machine.threads == [1, 2, 1]
    steps(machine, gov, 6.0, waiting_fraction=0.0)  # it left: the next probe keeps both threads
    assert machine.threads == [1, 2, 1, 2] and gov.threads == 2
    steps(machine, gov, 6.0, waiting_fraction=0.0)
    assert machine.threads == [1, 2, 1, 2]


def test_the_engine_gets_a_governor_only_when_nobody_chose_the_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LAYERZOO_THREAD_GOVERNOR", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ThreadGovernor.for_engine("cpu", None) is not None
        assert ThreadGovernor.for_engine("cpu", 2) is None  # the user's num_threads
        assert ThreadGovernor.for_engine("cuda", None) is None
        assert ThreadGovernor.for_engine("cpu", None, compiled_decode=True) is None  # guards pin the count
        monkeypatch.setenv("LAYERZOO_THREAD_GOVERNOR", "0")
        assert ThreadGovernor.for_engine("cpu", None) is None
        monkeypatch.delenv("LAYERZOO_THREAD_GOVERNOR")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert ThreadGovernor.for_engine("cpu", None) is None
        torch.set_num_threads(1)
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert ThreadGovernor.for_engine("cpu", None) is None  # nothing to lower
    finally:
        torch.set_num_threads(before)


def test_a_running_engine_lowers_its_threads_under_contention(tmp_path):
    """The runner consults the governor every step: a contended machine (the counter says our
    threads waited the whole time) leaves the engine generating on one thread, with the same tokens."""
    from layerzoo import LLM, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
        clock = iter(range(10**6))
        delay = iter(range(0, 10**15, 10**9))  # one second of waiting per second of clock
        runner = llm.engine.runner
        runner.thread_governor = ThreadGovernor(
            2, window_s=1, probe_s=10**9, read_delay=lambda: next(delay), clock=lambda: next(clock)
        )
        assert llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids == expected
        assert torch.get_num_threads() == 1 and runner.thread_governor.changes == 1
        torch.set_num_threads(2)
        if ThreadGovernor.for_engine("cpu", None) is not None:  # no OMP_NUM_THREADS here
            # a resize would invalidate every compiled decode step (dynamo guards the thread count)
            assert LLM(max_model_len=64, compile_decode=True).engine.runner.thread_governor is None
            assert LLM(max_model_len=64).engine.runner.thread_governor is not None
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(run_queue_delay_ns() is None, reason="no /proc/self/task/*/schedstat on this system")
def test_run_queue_delay_counts_time_spent_waiting_for_a_cpu():
    """A process sharing its one CPU with a busy process waits for about half of its time."""
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import os, subprocess, sys, time
os.sched_setaffinity(0, {{{cpu}}})
from layerzoo.runtime.cpu_contention import run_queue_delay_ns
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # inherits the one-CPU mask
try:
    time.sleep(0.3)
    d0, t0 = run_queue_delay_ns(), time.monotonic()
    while time.monotonic() - t0 < 1.0:
        pass
    print((run_queue_delay_ns() - d0) / 1e9 / (time.monotonic() - t0))
finally:
    busy.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert float(out.stdout) > 0.15
