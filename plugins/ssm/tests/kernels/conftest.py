"""Kernel tests of the ssm plugin: torch references against each other and against transformers,
Triton kernels (under the interpreter on CPU) against the references, on odd and varlen shapes.

On a GPU the same tests run compiled: ``TRITON_INTERPRET=0`` (an already-set value wins) and
``LAYERZOO_TEST_DEVICE=cuda`` (the ``device`` fixture).
"""

import os

# Must be set before triton is imported anywhere in the process; an explicit value is honoured.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float = 1e-5) -> None:
    """Relative RMS error of ``out`` against ``ref`` below ``ratio``, and no NaN where ref has none."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    ref, out = ref.double().cpu(), out.double().cpu()
    assert not (out.isnan() & ~ref.isnan()).any(), f"{name}: NaN in the output (memory never written?)"
    err = (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e}"


@pytest.fixture
def assert_close():
    """``assert_close(name, ref, out, ratio=1e-5)``: relative RMS error check (NaN-aware)."""
    return _assert_close


@pytest.fixture
def device() -> torch.device:
    """Where a kernel test puts its tensors: ``$LAYERZOO_TEST_DEVICE`` (e.g. ``cuda``), else CPU."""
    return torch.device(os.environ.get("LAYERZOO_TEST_DEVICE", "cpu"))


@pytest.fixture
def nan_empty(monkeypatch):
    """Make torch.empty / empty_like return NaN-filled tensors, so unwritten output shows up."""
    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield
