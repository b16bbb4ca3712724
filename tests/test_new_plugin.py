"""``layerzoo new-plugin``: the skeleton it writes installs with pip into a fresh venv (next to
nothing but the core's wheel), passes its own first test there, and passes the conformance kit
(``layerzoo check-plugin NAME``); a bad NAME or an occupied folder is a one-line user error."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layerzoo.entrypoints.cli import main
from layerzoo.entrypoints.new_plugin import PluginNames

ROOT = Path(__file__).resolve().parents[1]


def test_names_follow_the_plugin_name():
    names = PluginNames.of("my_model2")
    assert (names.package, names.dist, names.architecture, names.kind) == (
        "layerzoo_my_model2", "layerzoo-my-model2", "MyModel2ForCausalLM", "my_model2.decoder")


def test_the_skeleton_is_written_and_imports_only_public_core_names(tmp_path, capsys):
    out = tmp_path / "plugin"
    assert main(["new-plugin", "demo_zoo", "--dir", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["README.md", "layerzoo_demo_zoo/__init__.py", "layerzoo_demo_zoo/model.py",
                     "layerzoo_demo_zoo/test_configs.py", "pyproject.toml", "tests/test_demo_zoo.py"]
    pyproject = (out / "pyproject.toml").read_text()
    assert '[project.entry-points.layerzoo]\ndemo_zoo = "layerzoo_demo_zoo"' in pyproject
    for source in out.rglob("*.py"):
        text = source.read_text()
        assert "__" + "NAME__" not in text and "__" + "CLASS__" not in text, source
        for node in ast.walk(ast.parse(text)):  # valid Python, public core names only
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layerzoo."):
                assert not any(p.startswith("_") for p in node.module.split(".")) and ".runtime" not in node.module
                assert not any(a.name.startswith("_") for a in node.names)


def test_the_default_folder_is_named_after_the_distribution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new-plugin", "zoo"]) == 0
    assert (tmp_path / "layerzoo-zoo" / "layerzoo_zoo" / "__init__.py").is_file()


@pytest.mark.parametrize("name", ["Bad-Name", "2fast", "class", "my model", "_"])
def test_a_bad_name_is_a_user_error_naming_it(name, tmp_path, capsys):
    assert main(["new-plugin", name, "--dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"NAME {name!r}" in err and "lowercase Python identifier" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_an_occupied_folder_is_a_user_error_naming_it(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert main(["new-plugin", "zoo", "--dir", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "taken") in err and "not empty" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["keep.txt"]
    # an empty folder is fine ("from an empty folder")
    (tmp_path / "empty").mkdir()
    assert main(["new-plugin", "zoo", "--dir", str(tmp_path / "empty")]) == 0


def test_the_skeleton_installs_and_passes_its_test_and_the_kit(tmp_path):
    """pip-installed (not editable) into a venv holding only the core's wheel; the venv reuses this
    environment's torch and test tools instead of installing them."""
    from layerzoo.testing.wheels import venv_with_wheels

    venv = venv_with_wheels(ROOT, tmp_path, {})
    # the installed core's own command writes the skeleton (its templates ship as package data)
    written = venv.run(venv.layerzoo, "new-plugin", "demo_zoo", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    source = tmp_path / "layerzoo-demo-zoo"
    install = venv.run(venv.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", source, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr

    listing = venv.run(venv.layerzoo, "plugins", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "demo_zoo" in listing.stdout and "DemoZooForCausalLM" in listing.stdout

    tests = venv.run(venv.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=source)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "3 passed" in tests.stdout

    kit = venv.run(venv.layerzoo, "check-plugin", "demo_zoo", cwd=tmp_path)
    assert kit.returncode == 0, kit.stdout + kit.stderr
    last = kit.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 false") and "FALSE CLAIM" not in kit.stdout
    assert "DemoZooForCausalLM  demo_zoo.decoder  decode_graph_unsupported" in kit.stdout
    graph_rows = [line for line in kit.stdout.splitlines() if "reused graph slot" in line or "captured decode ==" in line]
    assert graph_rows and all(" pass " in row for row in graph_rows), graph_rows
