"""docs/writing-a-plugin.md stays true: every code block it quotes from a file is still in that
file, every ``layerzoo ...`` command parses with the CLI, every pytest option exists, and every
``layerzoo.*`` name and hook it mentions resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-plugin.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
SOURCE = re.compile(r"<!-- from: (\S+) -->\n$")


def blocks() -> list[tuple[str, str, str | None]]:
    """``(language, text, quoted file or None)`` of every fenced block, in order."""
    text = DOC.read_text()
    out = []
    for match in BLOCK.finditer(text):
        source = SOURCE.search(text[: match.start()][-300:])
        out.append((match.group(1), match.group(2), source.group(1) if source else None))
    return out


QUOTED = [(path, body) for _, body, path in blocks() if path is not None]


def test_the_doc_quotes_the_example_plugin():
    files = {path for path, _ in QUOTED}
    assert len(QUOTED) >= 10
    assert {"examples/layerzoo-llama/pyproject.toml", "examples/layerzoo-llama/layerzoo_llama/__init__.py",
            "examples/layerzoo-llama/layerzoo_llama/model.py", "examples/layerzoo-llama/layerzoo_llama/test_configs.py"} <= files


@pytest.mark.parametrize("path,body", QUOTED, ids=[f"{p}:{i}" for i, (p, _) in enumerate(QUOTED)])
def test_a_quoted_block_is_still_in_its_file(path, body):
    source = (ROOT / path).read_text()
    assert body in source, f"docs/writing-a-plugin.md quotes a block that {path} no longer holds:\n{body}"


def console_commands() -> list[list[str]]:
    return [shlex.split(line[2:]) for lang, body, _ in blocks() if lang == "console"
            for line in body.splitlines() if line.startswith("$ ")]


def test_the_layerzoo_commands_parse():
    from layerzoo.entrypoints.cli import _parser

    commands = [c[1:] for c in console_commands() if c[0] == "layerzoo"]
    assert {c[0] for c in commands} >= {"new-plugin", "check-plugin"}
    for argv in commands:
        _parser().parse_args(argv)  # SystemExit (a failed test) on an unknown command or flag


def test_the_pytest_options_exist():
    from layerzoo.testing import pytest_plugin

    class Group:
        def __init__(self):
            self.options = set()

        def addoption(self, name, **kwargs):
            self.options.add(name)

    group = Group()
    pytest_plugin.pytest_addoption(type("Parser", (), {"getgroup": lambda self, name: group})())
    used = {arg.split("=")[0] for c in console_commands() if c[:3] == ["python", "-m", "pytest"] for arg in c[3:] if arg.startswith("--")}
    assert used and used <= group.options


def test_every_layerzoo_name_and_hook_it_mentions_exists(resolve_dotted):
    from layerzoo import hookspecs

    text = DOC.read_text()
    names = set(re.findall(r"`(layerzoo(?:\.\w+)+)", text))
    assert "layerzoo.capability_table.capability_hookimpls" in names
    for name in sorted(names):
        resolve_dotted(name)
    hooks = set(re.findall(r"`(register_\w+)`", text))
    assert len(hooks) == 7
    for hook in hooks:
        assert callable(getattr(hookspecs, hook))
