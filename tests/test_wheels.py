"""The entry point works from installed wheels, with no repository on sys.path."""

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    prefix = {"qwen3": "layerzoo_qwen3-", "layerzoo-llama": "layerzoo_llama-"}.get(source.name, "layerzoo-")
    return next(out.glob(f"{prefix}*.whl"))


def test_installed_wheels_list_qwen3(tmp_path, tiny_qwen3_dir):
    wheels = tmp_path / "wheels"
    core = build_wheel(ROOT, wheels)
    # Every source and header the C++ kernels' build reads ships in the core wheel (a missing one
    # turns the kernels off, with a log line, wherever layerzoo is installed from the wheel).
    from zipfile import ZipFile

    from layerzoo.kernels import cpp_build

    shipped = set(ZipFile(core).namelist())
    kernels_dir = Path(cpp_build.__file__).parent
    needed = {"layerzoo/kernels/" + path.relative_to(kernels_dir).as_posix() for path in (*cpp_build.SOURCES, *cpp_build.HEADERS)}
    assert needed <= shipped, sorted(needed - shipped)
    plugin = build_wheel(ROOT / "plugins" / "qwen3", wheels)
    llama = build_wheel(ROOT / "examples" / "layerzoo-llama", wheels)  # the third-party example
    assert core.name.startswith("layerzoo-0") and plugin.name.startswith("layerzoo_qwen3-")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", core, plugin, llama], check=True)
    # The runtime dependencies (torch, pluggy, ...) come from this test's environment, appended
    # after the fresh venv's own site-packages; .pth files there (editable installs of this
    # repository) are not processed, so `layerzoo` can only come from the wheel.
    fresh_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "_deps.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LAYERZOO_PLUGINS", "LAYERZOO_DISABLE_PLUGINS")}
    where = subprocess.run(
        [python, "-c", "import layerzoo, layerzoo_qwen3; print(layerzoo.__file__); print(layerzoo_qwen3.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
    ).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where

    listing = subprocess.run([venv / "bin" / "layerzoo", "plugins", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr
    qwen3 = next(p for p in json.loads(listing.stdout)["plugins"] if p["name"] == "qwen3")
    assert set(qwen3["architectures"]) == {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM", "Qwen3Model"}
    assert set(qwen3["layer_kinds"]) == {"qwen3.decoder", "qwen3_moe.decoder", "qwen2.decoder"}
    llama_plugin = next(p for p in json.loads(listing.stdout)["plugins"] if p["name"] == "llama")
    assert set(llama_plugin["architectures"]) == {"LlamaForCausalLM", "MistralForCausalLM"}

    # Every op's torch implementation ships in the wheel (each op folder is a listed package).
    ops = subprocess.run(
        [python, "-c", "from layerzoo.kernels import OPS, backends_of\nfrom layerzoo.plugins.manager import resolve_object\n"
         "print(sum(callable(resolve_object(backends_of(op)['torch'])) for op in OPS), len(OPS))"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )
    assert ops.returncode == 0, ops.stderr
    resolved, total = ops.stdout.split()
    assert resolved == total, ops.stdout

    generated = subprocess.run(
        [venv / "bin" / "layerzoo", "generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1", "--max-tokens", "3"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )
    assert generated.returncode == 0, generated.stderr
    assert len(generated.stdout.split()) == 4
