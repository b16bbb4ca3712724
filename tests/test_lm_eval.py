"""lm-eval-harness scores a loglikelihood task through `layerzoo serve`.

``lm_eval --model local-completions`` (its own CLI, in a subprocess) runs the multiple-choice
task of ``tests/data/lm_eval`` (ten items, shipped here) against a real server on the embedded
model: each choice is one completions request with ``echo``, ``logprobs`` and token ids, and
lm-eval sums the continuation's token logprobs. Its accuracy, and every choice's loglikelihood
and greediness, must equal the same scores computed offline with ``prompt_logprobs``.
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from layerzoo.loading.model_packages import DEFAULT_MODEL  # noqa: E402
from layerzoo.server.process import ServerProcess  # noqa: E402

TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
TASK = "layerzoo_tiny_mc"


def run_lm_eval(url: str, out: Path) -> tuple[dict, list[dict]]:
    """lm-eval's CLI against ``url``: (the task's results, its logged samples)."""
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model=layerzoo,base_url={url}/v1/completions,tokenizer={DEFAULT_MODEL},"
                            "tokenizer_backend=huggingface,max_retries=1",
            "--batch_size", "4", "--tasks", TASK, "--include_path", ".", "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "cache")}
    done = subprocess.run(args, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    (samples,) = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    with open(samples) as f:
        return json.load(open(results))["results"][TASK], [json.loads(line) for line in f]


def offline_scores(requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(loglikelihood of the continuation given the context, whether each of its tokens is the
    argmax) per (context, continuation), through ``LLM(...)`` and ``prompt_logprobs``, with the
    tokenization lm-eval uses (the HF tokenizer, no special tokens, the whole text split after
    the context's tokens)."""
    from layerzoo import LLM, SamplingParams

    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    prompts, starts = [], []
    for context, continuation in requests:
        # lm-eval's split: the context's own tokens, then the whole text's tokens past as many
        # (where a token spans the boundary, this is not the whole text's tokenization)
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        starts.append(len(context_ids))
        prompts.append({"prompt_token_ids": context_ids + whole[len(context_ids):]})
    outs = LLM().generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    scores = []
    for out, start in zip(outs, starts):
        ids, entries = out.prompt_token_ids, out.prompt_logprobs
        picked = [entries[i][ids[i]] for i in range(start, len(ids))]
        greedy = all(entries[i][ids[i]] >= max(entries[i].values()) for i in range(start, len(ids)))
        scores.append((sum(picked), greedy))
    return scores


def test_lm_eval_accuracy_through_the_server_equals_offline_scores(tmp_path):
    with ServerProcess() as server:
        results, samples = run_lm_eval(server.url, tmp_path)
    assert len(samples) == 10
    samples.sort(key=lambda s: s["doc_id"])
    # each sample's arguments: {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}, one per choice
    requests = [(a["arg_0"], a["arg_1"]) for s in samples for a in s["arguments"].values()]
    expected = offline_scores(requests)
    correct, at = 0, 0
    for s in samples:
        served = [(float(ll), greedy == "True") for ll, greedy in s["filtered_resps"]]
        offline = expected[at: at + len(served)]
        at += len(served)
        assert [ll for ll, _ in served] == pytest.approx([ll for ll, _ in offline], abs=1e-3), s["doc_id"]
        assert [g for _, g in served] == [g for _, g in offline], s["doc_id"]
        best = max(range(len(offline)), key=lambda i: offline[i][0])
        hit = best == int(s["target"])  # (the samples log the target as text)
        correct += hit
        assert s["acc"] == float(hit)
    assert results["acc,none"] == pytest.approx(correct / len(samples))
