"""Kernel tests: Triton kernels run under the interpreter on CPU and are compared with their
plain-torch references on odd, ragged shapes.

On a GPU (``bench/gpu_check.sh``) the same tests run compiled: ``TRITON_INTERPRET=0`` (an
already-set value wins) and ``LAYERZOO_TEST_DEVICE=cuda`` (the ``device`` fixture).
"""

import os

# Must be set before triton is imported anywhere in the process; an explicit value is honoured.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from layerzoo import testing  # noqa: E402

triton = pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    """Where a kernel test puts its tensors: ``$LAYERZOO_TEST_DEVICE`` (e.g. ``cuda``), else CPU."""
    return testing.kernel_test_device()


@pytest.fixture
def nan_empty(monkeypatch):
    """Make torch.empty / empty_like return NaN-filled tensors, so unwritten output shows up."""
    testing.nan_filled_empty(monkeypatch)
    yield


@pytest.fixture
def assert_close():
    """``assert_close(name, ref, out, ratio=1e-5)``: relative RMS error check (NaN-aware)."""
    return testing.assert_close
