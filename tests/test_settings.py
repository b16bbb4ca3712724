"""layerzoo.settings: one table of the environment variables, read through it alone.

The table stays complete (every ``LAYERZOO_*`` name in the source is declared, and every file it
says reads a variable names it), the README's table is the generated one, runtime code reads the
environment only through `layerzoo.settings`, values are read at call time, and a bad value is a
`UserError` naming the variable, also from the modules that read them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layerzoo import settings
from layerzoo.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?<![-\w])LAYERZOO_[A-Z0-9_]+")  # -DLAYERZOO_... is a C macro, not a variable


def source_files():
    for folder in ("core", "kernels", "plugins", "examples", "bench", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and "build" not in path.parts and path.name != "test_settings.py":
                yield path


def test_every_layerzoo_variable_in_the_source_is_declared():
    found = {}
    for path in source_files():
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    missing = {name: where for name, where in found.items() if name not in settings.SETTINGS}
    assert not missing, f"undeclared in layerzoo.settings.SETTINGS: {missing}"
    assert len(found) >= 20


@pytest.mark.parametrize("setting", settings.SETTINGS.values(), ids=list(settings.SETTINGS))
def test_each_declared_reader_names_its_variable(setting):
    assert setting.kind in settings.WHAT_IT_TAKES and setting.meaning and setting.read_by
    for rel in setting.read_by:
        assert setting.name in (ROOT / rel).read_text(), f"{rel} is said to read {setting.name} but never names it"


def test_the_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- settings table: python -m layerzoo.settings -->\n(.*?)<!-- end settings table -->", readme, re.S)
    assert block is not None, "README.md lost its settings table markers"
    assert block.group(1) == settings.markdown_table(), "README's table is stale: paste `python -m layerzoo.settings`"
    for name, setting in settings.SETTINGS.items():
        assert f"`{name}`" in block.group(1)


# Where runtime code touches os.environ other than to read a setting: copies handed to a child
# process, and edits of the process's own environment.
NOT_READS = {
    "core/server/process.py": "a child process's environment",
    "core/testing/wheels.py": "a child process's environment",
    "core/testing/distributed.py": "turns packing off in a rank before it loads",
    "kernels/cpp_build.py": "puts the ninja package's binary on PATH",
}


def environment_uses() -> dict[str, list[int]]:
    """Runtime modules (tests and conftests aside) that name ``os.environ`` / ``os.getenv``, with lines."""
    out = {}
    for folder in ("core", "kernels", "plugins", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if "tests" in path.parts or "build" in path.parts or path.name == "conftest.py":
                continue
            lines = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                     and node.attr in ("environ", "getenv", "getenvb", "environb")]
            if lines:
                out[rel] = lines
    return out


def test_only_settings_reads_the_environment():
    uses = environment_uses()
    assert "core/settings.py" in uses
    others = {rel: lines for rel, lines in uses.items() if rel != "core/settings.py" and rel not in NOT_READS}
    assert not others, f"read these through layerzoo.settings: {others}"


def test_settings_imports_no_torch_and_nothing_of_layerzoo_but_errors():
    tree = ast.parse((ROOT / "core" / "settings.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("layerzoo")} == {"layerzoo.errors"}
    code = "import sys, layerzoo.settings as s; s.markdown_table(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# -- the accessors ---------------------------------------------------------------------------------


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("LAYERZOO_FUSED_DECODE", raising=False)
    assert settings.flag("LAYERZOO_FUSED_DECODE") is True
    monkeypatch.setenv("LAYERZOO_FUSED_DECODE", "0")
    assert settings.flag("LAYERZOO_FUSED_DECODE") is False
    monkeypatch.setenv("LAYERZOO_FUSED_DECODE", "On")
    assert settings.flag("LAYERZOO_FUSED_DECODE") is True
    assert settings.flag("LAYERZOO_FUSED_DECODE", {"LAYERZOO_FUSED_DECODE": "no"}) is False  # a mapping instead
    monkeypatch.setenv("LAYERZOO_PROGRESS", "")
    assert settings.flag("LAYERZOO_PROGRESS") is None  # empty is unset: the tri-state default


@pytest.mark.parametrize(
    "read, name, value, expected",
    [
        (settings.flag, "LAYERZOO_PROGRESS", "maybe", "0 or 1"),
        (settings.flag, "LAYERZOO_CPP_KERNELS", "2", "0 or 1"),
        (settings.integer, "LAYERZOO_GGUF_GEMV_ROWS", "eight", "a whole number >= 0"),
        (settings.integer, "LAYERZOO_FP8_GEMV_ROWS", "-1", "a whole number >= 0"),
        (settings.seconds, "LAYERZOO_TP_TIMEOUT_S", "soon", "a number of seconds > 0"),
        (settings.seconds, "LAYERZOO_TP_TIMEOUT_S", "0", "a number of seconds > 0"),
        (settings.pairs, "LAYERZOO_PREFER", "Qwen3ForCausalLM", "comma-separated Name=plugin pairs"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_it_takes(read, name, value, expected):
    with pytest.raises(UserError, match=rf"^{name}: expected {re.escape(expected)}.*got {value!r}"):
        read(name, {name: value})


def test_typed_values():
    assert settings.integer("LAYERZOO_GGUF_GEMV_ROWS", {}) == 8
    assert settings.integer("LAYERZOO_GGUF_GEMV_ROWS", {"LAYERZOO_GGUF_GEMV_ROWS": "0"}) == 0
    assert settings.seconds("LAYERZOO_TP_TIMEOUT_S", {"LAYERZOO_TP_TIMEOUT_S": "2.5"}) == 2.5
    assert settings.names("LAYERZOO_PLUGINS", {}) is None
    assert settings.names("LAYERZOO_PLUGINS", {"LAYERZOO_PLUGINS": ""}) == []  # set to nothing: load none
    assert settings.names("LAYERZOO_PLUGINS", {"LAYERZOO_PLUGINS": "a, b,"}) == ["a", "b"]
    assert settings.pairs("LAYERZOO_PREFER", {"LAYERZOO_PREFER": "A=x, B=y"}) == {"A": "x", "B": "y"}
    assert settings.path("LAYERZOO_KERNEL_CACHE", {"LAYERZOO_KERNEL_CACHE": "~/k"}) == Path("~/k").expanduser()
    assert settings.text("CXX", {}) == "c++"
    assert [settings.switch("TRITON_INTERPRET", {"TRITON_INTERPRET": v}) for v in ("1", "TRUE", "on", "0", "yes", "")] == [
        True, True, True, False, False, False]  # as triton reads it; never an error
    assert settings.is_set("MALLOC_TRIM_THRESHOLD_", {"MALLOC_TRIM_THRESHOLD_": ""})


def test_an_undeclared_name_or_the_wrong_accessor_is_a_bug():
    with pytest.raises(LookupError, match="not declared"):
        settings.flag("LAYERZOO_" + "NO_SUCH_SETTING")
    with pytest.raises(LookupError, match="'int' setting, read as 'flag'"):
        settings.flag("LAYERZOO_GGUF_GEMV_ROWS")


# -- through the modules that read them ------------------------------------------------------------


def test_progress_bars_refuse_a_bad_value(monkeypatch):
    from layerzoo.entrypoints.progress import bars_enabled

    monkeypatch.setenv("LAYERZOO_PROGRESS", "maybe")
    with pytest.raises(UserError, match="^LAYERZOO_PROGRESS: expected 0 or 1"):
        bars_enabled()
    monkeypatch.setenv("LAYERZOO_PROGRESS", "1")
    assert bars_enabled() is True


def test_plugin_preferences_refuse_an_item_without_a_plugin():
    from layerzoo.plugins.manager import PluginRegistry

    with pytest.raises(UserError, match="^LAYERZOO_PREFER: expected"):
        PluginRegistry(env={"LAYERZOO_PREFER": "DupForCausalLM"})
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": "a", "LAYERZOO_DISABLE_PLUGINS": "b,c", "LAYERZOO_KERNEL_BACKEND": "torch"})
    assert (registry.only, registry.disabled, registry.kernel_backend) == (["a"], {"b", "c"}, "torch")


def test_torchrun_variables_and_the_collective_timeout(monkeypatch):
    from layerzoo.runtime import tensor_parallel

    assert tensor_parallel.torchrun_world({}) is None
    assert tensor_parallel.torchrun_world({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2, 1, 2)
    assert tensor_parallel.torchrun_world({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 4, 1, 2)
    with pytest.raises(UserError, match="^RANK: expected a whole number"):
        tensor_parallel.torchrun_world({"RANK": "one", "WORLD_SIZE": "2"})
    monkeypatch.setenv("LAYERZOO_TP_TIMEOUT_S", "soon")
    with pytest.raises(UserError, match="^LAYERZOO_TP_TIMEOUT_S: expected"):
        tensor_parallel.collective_timeout()
    monkeypatch.delenv("LAYERZOO_TP_TIMEOUT_S")
    assert tensor_parallel.collective_timeout().total_seconds() == 1800


def test_kernel_cache_folder(monkeypatch, tmp_path):
    from layerzoo.kernels import cpp_build

    monkeypatch.delenv("LAYERZOO_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpp_build.cache_dir() == tmp_path / "layerzoo" / "cpp-kernels"
    monkeypatch.setenv("LAYERZOO_KERNEL_CACHE", str(tmp_path / "mine"))
    assert cpp_build.cache_dir() == tmp_path / "mine"


def test_a_gemv_row_limit_is_read_when_its_module_is_imported():
    code = "import layerzoo.layers.gguf_linear as g; print(g.GEMV_ROWS)"
    run = lambda value: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                       env={**__import__("os").environ, "LAYERZOO_GGUF_GEMV_ROWS": value})
    assert run("3").stdout.strip() == "3"
    bad = run("three")
    assert bad.returncode != 0 and "LAYERZOO_GGUF_GEMV_ROWS: expected a whole number >= 0, got 'three'" in bad.stderr
