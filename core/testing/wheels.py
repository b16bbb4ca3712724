"""A fresh venv holding only the core's wheel and some plugins' wheels: for tests that a plugin
installs alone on top of the core, as a user would."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import attrs


@attrs.frozen
class WheelVenv:
    python: Path
    layerzoo: Path  # the venv's `layerzoo` command
    env: dict[str, str]  # run its commands with this (no PYTHONPATH, no plugin selection)

    def run(self, *args, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=self.env)


def build_wheel(source: Path, out: Path, prefix: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
                   check=True, capture_output=True)
    return next(out.glob(f"{prefix}*.whl"))


def venv_with_wheels(root: Path, tmp_path: Path, plugins: dict[str, str]) -> WheelVenv:
    """Build the core at ``root`` and ``plugins`` (folder under ``root`` -> wheel name prefix, e.g.
    ``{"plugins/glm53": "layerzoo_glm53-"}``) and install only them into a new venv under ``tmp_path``."""
    wheels = tmp_path / "wheels"
    built = [build_wheel(root, wheels, "layerzoo-")] + [build_wheel(root / f, wheels, p) for f, p in plugins.items()]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *built], check=True)
    # Runtime dependencies (torch, pluggy, ...) from this environment, after the venv's own
    # site-packages; .pth files there (editable installs of this repository) are not processed.
    fresh_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "_deps.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LAYERZOO_PLUGINS", "LAYERZOO_DISABLE_PLUGINS")}
    return WheelVenv(python, venv / "bin" / "layerzoo", env)
