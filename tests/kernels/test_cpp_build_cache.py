"""The C++ build's cache (`layerzoo.kernels.cpp_build`): keyed by what the build reads, not by
where the sources sit, so two checkouts of the same code share one library; the first build says
so on stderr; a missing compiler is one line naming the package to install. A one-op library
stands in for the real sources (a minute to compile) so that the test builds in seconds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from layerzoo.kernels import cpp_build

SOURCE = r'''
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include "../plus.h"

at::Tensor plus_const(const at::Tensor& x) { return x.add(PLUS); }

TORCH_LIBRARY(NAMESPACE, m) { m.def("plus_const(Tensor x) -> Tensor", &plus_const); }
'''


def _checkout(root: Path, namespace: str, plus: int = 2) -> Path:
    (root / "op").mkdir(parents=True)
    (root / "op" / "plus_cpu.cpp").write_text(SOURCE.replace("NAMESPACE", namespace))
    (root / "plus.h").write_text(f"#define PLUS {plus}\n")
    return root


def _use(monkeypatch, root: Path) -> None:
    monkeypatch.setattr(cpp_build, "_HERE", root)
    monkeypatch.setattr(cpp_build, "SOURCES", [root / "op" / "plus_cpu.cpp"])
    monkeypatch.setattr(cpp_build, "HEADERS", [root / "plus.h"])
    monkeypatch.setattr(cpp_build, "_state", {})


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(cpp_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cpp_build.ENV, raising=False)
    return tmp_path / "cache"


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_two_checkouts_share_one_build_and_only_the_first_announces_it(tmp_path, cache, monkeypatch, capfd):
    namespace = f"layerzoo_cache_test_{os.getpid()}"
    first = _checkout(tmp_path / "checkout-a", namespace)
    second = tmp_path / "checkout-b"
    shutil.copytree(first, second)

    _use(monkeypatch, first)
    assert cpp_build._build() == (True, "")
    assert cpp_build._state["how"] == "built"
    assert "compiling the C++ CPU kernels" in capfd.readouterr().err
    assert getattr(torch.ops, namespace).plus_const(torch.zeros(3)).tolist() == [2.0, 2.0, 2.0]
    library = Path(cpp_build._state["library"])
    assert library.is_relative_to(cache) and library.is_file()
    built_at = library.stat().st_mtime_ns

    _use(monkeypatch, second)  # the same code elsewhere: loaded, not compiled
    assert cpp_build._build() == (True, "")
    assert cpp_build._state["how"] == "cached" and cpp_build._state["library"] == str(library)
    assert "compiling" not in capfd.readouterr().err
    assert library.stat().st_mtime_ns == built_at

    (second / "plus.h").write_text("#define PLUS 3\n")  # a header edit is another build
    changed = cpp_build._build_name()
    _use(monkeypatch, first)
    assert cpp_build._build_name() != changed


def test_a_missing_compiler_is_one_line_naming_the_package(tmp_path, cache, monkeypatch):
    _use(monkeypatch, _checkout(tmp_path / "checkout", "layerzoo_cache_test_unbuilt"))
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    ok, why = cpp_build._build()
    assert not ok and cpp_build._state["how"] == "failed"
    assert "no C++ compiler" in why and "install g++" in why and "\n" not in why
    assert not list(cache.glob("*/*.so"))
