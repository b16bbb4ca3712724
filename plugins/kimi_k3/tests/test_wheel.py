"""layerzoo-kimi-k3 installs alone on top of the core (no other plugin) and serves Kimi Linear:
its KDA layers find the conv and KDA ops in the core's shared kernels."""

import json
from pathlib import Path

from layerzoo.testing.wheels import venv_with_wheels

ROOT = Path(__file__).resolve().parents[3]


def test_the_plugin_alone_on_the_core_serves_kimi_linear(tmp_path, kimi_tiny):
    path, hf_model = kimi_tiny
    venv = venv_with_wheels(ROOT, tmp_path, {"plugins/kimi_k3": "layerzoo_kimi_k3-"})

    listing = venv.run(venv.layerzoo, "plugins", "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    names = {p["name"] for p in json.loads(listing.stdout)["plugins"]}
    assert "kimi_k3" in names and not names & {"ssm", "qwen3"}

    prompt = [5, 9, 2, 7, 7, 1, 30, 4]
    code = ("import json, sys; from layerzoo import LLM, SamplingParams\n"
            f"out = LLM({str(path)!r}, dtype='float32').generate([{{'prompt_token_ids': {prompt}}}], "
            "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
            "print(json.dumps(out[0].outputs[0].token_ids))")
    run = venv.run(venv.python, "-c", code, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    import torch

    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 8:].tolist()
    assert json.loads(run.stdout.strip().splitlines()[-1]) == expected
