"""``layerzoo new-plugin NAME [--dir PATH]``: write the skeleton of a plugin distribution.

The skeleton (templates in ``layerzoo/templates/new_plugin``) is a pip-installable folder: a
pyproject with the ``layerzoo`` entry point, a package registering one small architecture built
from the core's public blocks (``<Name>ForCausalLM``, layer kind ``<name>.decoder``), its
capability table, a ``register_test_configs`` for the conformance kit, and a first test. Once
installed it passes its own test and ``layerzoo check-plugin NAME``.
"""

from __future__ import annotations

import argparse
import keyword
import re
from pathlib import Path

import attrs

from layerzoo.errors import UserError

TEMPLATES = Path(__file__).parent.parent / "templates" / "new_plugin"
SUFFIX = ".tmpl"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


@attrs.frozen
class PluginNames:
    """Every spelling of one plugin name, as the templates use them."""

    name: str  # entry-point name, the `layerzoo check-plugin` argument: "my_model"
    package: str  # import package: "layerzoo_my_model"
    dist: str  # distribution: "layerzoo-my-model"
    class_prefix: str  # "MyModel"
    architecture: str  # "MyModelForCausalLM"
    kind: str  # "my_model.decoder"

    @classmethod
    def of(cls, name: str) -> PluginNames:
        check_name(name)
        prefix = "".join(part.capitalize() for part in name.split("_") if part)
        return cls(name, f"layerzoo_{name}", f"layerzoo-{name.replace('_', '-')}", prefix,
                   f"{prefix}ForCausalLM", f"{name}.decoder")

    def substitutions(self) -> dict[str, str]:
        return {"__NAME__": self.name, "__PACKAGE__": self.package, "__DIST__": self.dist,
                "__CLASS__": self.class_prefix, "__ARCH__": self.architecture, "__KIND__": self.kind}


def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name) or keyword.iskeyword(name) or not name.strip("_"):
        raise UserError(
            f"new-plugin: NAME {name!r} is not a plugin name: expected a lowercase Python identifier "
            "(a-z first, then a-z, 0-9 or _), e.g. my_model"
        )


def render(text: str, names: PluginNames) -> str:
    for token, value in names.substitutions().items():
        text = text.replace(token, value)
    return text


def target_path(relative: Path, names: PluginNames) -> Path:
    """Where a template file goes: ``package/`` becomes the import package, tests are named after it."""
    parts = list(relative.with_name(relative.name.removesuffix(SUFFIX)).parts)
    if parts[0] == "package":
        parts[0] = names.package
    if parts[0] == "tests" and parts[-1] == "test_plugin.py":
        parts[-1] = f"test_{names.name}.py"
    return Path(*parts)


def write_skeleton(name: str, directory: Path | None = None) -> Path:
    """Write the skeleton of plugin ``name`` into ``directory`` (default ``./layerzoo-<name>``),
    which must not exist or be empty. Returns the folder written."""
    names = PluginNames.of(name)
    out = Path(directory) if directory is not None else Path.cwd() / names.dist
    check_target(out)
    templates = sorted(p for p in TEMPLATES.rglob(f"*{SUFFIX}") if p.is_file())
    assert templates, f"no templates under {TEMPLATES} (package data missing from the install?)"
    try:
        for template in templates:
            dest = out / target_path(template.relative_to(TEMPLATES), names)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(render(template.read_text(), names))
    except OSError as exc:  # no permission, disk full, a read-only file system
        raise UserError(f"new-plugin: cannot write into {str(out)!r}: {exc.strerror or exc} ({exc.filename or out})") from None
    return out


def check_target(out: Path) -> None:
    """``out`` must be a new or empty folder, below folders (a file on the way cannot hold one)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"new-plugin: --dir {str(out)!r} is a file; expected a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"new-plugin: folder {str(out)!r} already exists and is not empty; expected a new or empty folder (--dir PATH)")
    existing = next((parent for parent in out.absolute().parents if parent.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"new-plugin: --dir {str(out)!r} cannot be made: {str(existing)!r} is a file, not a folder")


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("new-plugin", help="write the skeleton of a plugin (pyproject, hookimpls, test config, first test)")
    parser.add_argument("name", metavar="NAME", help="the plugin's entry-point name, a lowercase identifier (e.g. my_model)")
    parser.add_argument("--dir", default=None, help="the folder to write (new or empty; default ./layerzoo-NAME)")
    return parser


def cmd_new_plugin(args) -> int:
    names = PluginNames.of(args.name)
    out = write_skeleton(args.name, Path(args.dir) if args.dir else None)
    print(f"wrote plugin {names.name!r} ({names.architecture}, layer kind {names.kind}) into {out}")
    print(f"next: pip install -e {out}  &&  python -m pytest {out / 'tests'}  &&  layerzoo check-plugin {names.name}")
    return 0
