"""layerzoo-glm53 installs alone on top of the core (no other plugin) and serves GLM-5
(its indexer op comes with the plugin, MLA and the MoE ops from the core)."""

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def build_wheel(source: Path, out: Path, prefix: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
                   check=True, capture_output=True)
    return next(out.glob(f"{prefix}*.whl"))


def test_the_plugin_alone_on_the_core_serves_glm_moe_dsa(tmp_path, glm_tiny):
    path, hf_model = glm_tiny
    wheels = tmp_path / "wheels"
    core = build_wheel(ROOT, wheels, "layerzoo-")
    plugin = build_wheel(ROOT / "plugins" / "glm53", wheels, "layerzoo_glm53-")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", core, plugin], check=True)
    # Runtime dependencies (torch, pluggy, ...) from this environment, after the venv's own
    # site-packages; .pth files there (editable installs of this repository) are not processed.
    fresh_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "_deps.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LAYERZOO_PLUGINS", "LAYERZOO_DISABLE_PLUGINS")}

    listing = subprocess.run([venv / "bin" / "layerzoo", "plugins", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr
    names = {p["name"] for p in json.loads(listing.stdout)["plugins"]}
    assert "glm53" in names and not names & {"ssm", "qwen3", "kimi_k3"}

    prompt = [5, 9, 2, 7, 7, 1, 30, 4, 11, 3, 60, 8]  # longer than index_topk (8)
    code = ("import json, sys; from layerzoo import LLM, SamplingParams\n"
            f"out = LLM({str(path)!r}, dtype='float32').generate([{{'prompt_token_ids': {prompt}}}], "
            "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
            "print(json.dumps(out[0].outputs[0].token_ids))")
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    ids = torch.tensor([prompt])
    with torch.no_grad():  # recomputed each step, as the other parity tests do
        for _ in range(6):
            ids = torch.cat([ids, hf_model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ids[0, len(prompt):].tolist()
