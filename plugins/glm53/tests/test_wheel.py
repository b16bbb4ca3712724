"""layerzoo-glm53 installs alone on top of the core (no other plugin) and serves GLM-5 and
GLM-5.3-Flash (their indexer, k-pool and mHC ops come with the plugin; MLA, KDA and the MoE ops
from the core)."""

import json
from pathlib import Path

import torch

from layerzoo.testing.wheels import venv_with_wheels

ROOT = Path(__file__).resolve().parents[3]


def test_the_plugin_alone_on_the_core_serves_glm_moe_dsa_and_glm5_next(tmp_path, glm_tiny, next_tiny):
    path, hf_model = glm_tiny
    venv = venv_with_wheels(ROOT, tmp_path, {"plugins/glm53": "layerzoo_glm53-"})

    listing = venv.run(venv.layerzoo, "plugins", "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    names = {p["name"] for p in json.loads(listing.stdout)["plugins"]}
    assert "glm53" in names and not names & {"ssm", "qwen3", "kimi_k3"}

    prompt = [5, 9, 2, 7, 7, 1, 30, 4, 11, 3, 60, 8]  # longer than index_topk (8)
    code = ("import json, sys; from layerzoo import LLM, SamplingParams\n"
            f"out = LLM({str(path)!r}, dtype='float32').generate([{{'prompt_token_ids': {prompt}}}], "
            "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
            "print(json.dumps(out[0].outputs[0].token_ids))")
    run = venv.run(venv.python, "-c", code, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    ids = torch.tensor([prompt])
    with torch.no_grad():  # recomputed each step, as the other parity tests do
        for _ in range(6):
            ids = torch.cat([ids, hf_model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ids[0, len(prompt):].tolist()

    path, hf_model = next_tiny
    prompt = [(7 * i + 3) % 131 for i in range(21)]  # longer than index_topk (8: two pools of 4)
    code = ("import json; from layerzoo import LLM, SamplingParams\n"
            f"out = LLM({str(path)!r}, dtype='float32', block_size=8).generate([{{'prompt_token_ids': {prompt}}}], "
            "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))\n"
            "print(json.dumps(out[0].outputs[0].token_ids))")
    run = venv.run(venv.python, "-c", code, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, hf_model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ids[0, len(prompt):].tolist()
