"""Kernel ops: backend choice per device, the env override, and fallbacks with a reason."""

import logging
import types

import pytest
import torch

from layerzoo.errors import KernelUnsupported, PluginError
from layerzoo.plugins.kernel_registry import KernelOp, kernels_report
from layerzoo.plugins.manager import PluginRegistry


def torch_impl(x):
    return ("torch", x)


def triton_impl(x):
    return ("triton", x)


def picky_triton(x):
    if getattr(x, "odd", False):
        raise KernelUnsupported("odd shapes are not served")
    return ("triton", x)


def fake_cuda_tensor(odd=False):
    return types.SimpleNamespace(device=torch.device("cuda", 0), odd=odd)


MOD = __name__


def op(env=None, triton=f"{MOD}:triton_impl"):
    return KernelOp("demo", {"torch": f"{MOD}:torch_impl", "triton": triton}, env or {})


def test_cpu_tensors_run_torch_and_cuda_tensors_run_triton():
    demo = op()
    assert demo(torch.zeros(1))[0] == "torch"
    assert demo(fake_cuda_tensor())[0] == "triton"
    assert demo.choose("cpu") == ("torch", "cpu tensors")


def test_env_override_picks_a_backend_for_every_device():
    assert op({"LAYERZOO_KERNEL_BACKEND": "triton"})(torch.zeros(1))[0] == "triton"
    assert op({"LAYERZOO_KERNEL_BACKEND": "torch"})(fake_cuda_tensor())[0] == "torch"
    only_torch = KernelOp("demo", {"torch": f"{MOD}:torch_impl"}, {"LAYERZOO_KERNEL_BACKEND": "triton"})
    backend, why = only_torch.choose("cpu")
    assert backend == "torch" and "no such backend" in why


def test_a_call_the_backend_cannot_serve_falls_back_with_a_reason(caplog):
    caplog.set_level(logging.INFO)
    demo = op(triton=f"{MOD}:picky_triton")
    assert demo(fake_cuda_tensor())[0] == "triton"
    assert demo(fake_cuda_tensor(odd=True))[0] == "torch"
    assert demo(fake_cuda_tensor(odd=True))[0] == "torch"
    assert demo.fallbacks == {"odd shapes are not served": 2}
    assert caplog.text.count("kernel demo falls back to torch: odd shapes are not served") == 1


def test_a_backend_that_does_not_import_falls_back():
    demo = op(triton="layerzoo_no_such_module:kernel")
    assert demo(fake_cuda_tensor())[0] == "torch"
    assert any("triton backend unavailable" in reason for reason in demo.fallbacks)


def test_an_op_needs_a_torch_backend():
    with pytest.raises(PluginError, match="no 'torch' backend"):
        KernelOp("demo", {"triton": f"{MOD}:triton_impl"})


def test_report_lists_ops_backends_and_the_choice_here():
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    rows = {row["op"]: row for row in kernels_report(registry, "cpu")}
    assert rows["rms_norm"]["backends"]["torch"] == "layerzoo.kernels"
    # C++ kernels run for CPU tensors; ops without one run in torch
    assert rows["paged_decode_attention"]["runs_here"] == "cpp" and rows["rms_norm"]["backends"]["cpp"] == "layerzoo.kernels"
    assert rows["moe_softmax_topk"]["runs_here"] == "torch"
    cuda = {row["op"]: row for row in kernels_report(registry, "cuda")}
    for name, row in cuda.items():
        assert row["runs_here"] == ("triton" if "triton" in row["backends"] else "torch"), name


def test_registry_dispatcher_is_cached_and_runs_the_reference():
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    silu = registry.kernel("silu_and_mul")
    assert registry.kernel("silu_and_mul") is silu
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(silu(gate, up), torch.nn.functional.silu(gate) * up)
