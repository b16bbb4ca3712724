"""docs/architecture.md stays true: every file it cites exists, every ``layerzoo.*`` name and every
``Class.member`` of the runtime's classes it names resolves, every capability query and every
registration hook has its row, and README links it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text()
TICKED = re.findall(r"`([^`\n]+)`", TEXT)

PATHS = sorted({t for t in TICKED if re.fullmatch(r"(core|kernels|plugins|examples|docs|tests)/[\w./-]*", t)})
DOTTED = sorted({t for t in TICKED if re.fullmatch(r"layerzoo(\.\w+)+", t)})
# Short ``Class.member`` references, by the module that defines the class.
CLASSES = {
    "ModelCapabilities": "layerzoo.plugins.capabilities",
    "Scheduler": "layerzoo.runtime.scheduler",
    "ModelRunner": "layerzoo.runtime.model_runner",
    "DecodeGraphRunner": "layerzoo.runtime.graphs",
    "ForwardContext": "layerzoo.layers.context",
}
MEMBERS = sorted({(m.group(1), m.group(2)) for t in TICKED if (m := re.fullmatch(rf"({'|'.join(CLASSES)})\.(\w+)", t))})


def has_member(cls: type, name: str) -> bool:
    """An attribute of the class, or an attribute its ``__init__`` sets, or an attrs field."""
    import inspect

    if hasattr(cls, name) or (attrs.has(cls) and name in attrs.fields_dict(cls)):
        return True
    return re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=", inspect.getsource(cls)) is not None


def test_the_doc_cites_enough_to_check():
    assert len(PATHS) >= 25 and len(DOTTED) >= 60 and len(MEMBERS) >= 15


@pytest.mark.parametrize("path", PATHS)
def test_every_cited_file_exists(path):
    assert (ROOT / path).exists(), f"docs/architecture.md cites {path}, which is gone"


@pytest.mark.parametrize("name", DOTTED)
def test_every_layerzoo_name_resolves(name, resolve_dotted):
    resolve_dotted(name)


@pytest.mark.parametrize("cls,member", MEMBERS, ids=[f"{c}.{m}" for c, m in MEMBERS])
def test_every_class_member_exists(cls, member):
    assert has_member(getattr(importlib.import_module(CLASSES[cls]), cls), member), f"{cls}.{member} is gone"


def test_every_capability_query_and_hook_has_its_row():
    from layerzoo import hookspecs
    from layerzoo.plugins.capabilities import QUERIES

    rows = {line.split("|")[1].strip().strip("`") for line in TEXT.splitlines() if line.startswith("| `")}
    hooks = {name for name in vars(hookspecs) if name.startswith("register_")}
    assert len(QUERIES) == 11 and len(hooks) == 7
    assert set(QUERIES) <= rows, f"queries without a row: {set(QUERIES) - rows}"
    assert hooks <= rows, f"hooks without a row: {hooks - rows}"


def test_readme_links_the_doc():
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
