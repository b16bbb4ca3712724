"""Thread defaults: the pool follows the CPU affinity, and the user's own settings win."""

import os
import subprocess
import sys

import pytest

from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.runtime import threads


def test_default_threads_follow_the_affinity_mask():
    assert threads.default_num_threads({}) == len(os.sched_getaffinity(0))
    assert threads.default_num_threads({"OMP_NUM_THREADS": "3"}) is None  # torch obeys the user's variable


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to restrict the mask to 1")
def test_a_process_pinned_to_one_cpu_gets_one_thread():
    cpu = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{cpu}}}); os.environ.pop('OMP_NUM_THREADS', None)\n"
        "import layerzoo, torch; torch.set_num_threads(8)\n"
        "from layerzoo.runtime.threads import apply_thread_defaults; print(apply_thread_defaults())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_an_explicit_count_wins_and_a_lower_one_is_kept():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        assert threads.apply_thread_defaults(1) == 1
        assert threads.apply_thread_defaults() == 1  # never raised behind the caller's back
    finally:
        torch.set_num_threads(before)


def test_num_threads_is_validated():
    with pytest.raises(UserError, match="^num_threads:"):
        EngineArgs(num_threads=0)
