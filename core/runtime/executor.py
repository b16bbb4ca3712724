"""Executors: what runs the engine's step plans on the device(s).

The engine talks to one executor: it hands it each `StepPlan` (which also frees the sequences
that gave up their state since the last one) and takes back a `StepResult`. `InProcessExecutor` runs a plan on this
process's `ModelRunner`; the tensor-parallel executor (`layerzoo.runtime.tensor_parallel`) also
sends it to the worker ranks first. The runner itself stays the engine's to read (its decode-graph
stats, its KV pool): ``executor.runner`` is this process's runner either way.
"""

from __future__ import annotations

from typing import Protocol

from layerzoo.runtime.model_runner import ModelRunner, StepResult
from layerzoo.runtime.plan import StepPlan


class Executor(Protocol):
    runner: ModelRunner  # this process's runner (rank 0's under tensor parallelism)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step plan everywhere the model lives; rank 0's sampled result."""
        ...

    def shutdown(self) -> None:
        """End what the executor started beyond this process; idempotent."""
        ...


class InProcessExecutor:
    """One process, one runner: a plan runs as it is."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        """Nothing runs beyond this process."""
