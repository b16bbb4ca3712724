"""Checking that a model's decode steps take the fused CPU decode call (`layerzoo.layers.fused_decode`)."""

from __future__ import annotations

from pathlib import Path

from layerzoo import LLM, SamplingParams


def fused_decode_run(model_dir: str | Path, prompt: list[int], max_tokens: int = 8):
    """One greedy request with top-2 logprobs: ``(token_ids, logprobs, plans)``, ``plans`` each
    decoder layer's fused decode plan (None where it decodes op by op; ``plan.runs[0]``: the steps
    it took). Run it again under ``LAYERZOO_FUSED_DECODE=0`` for the op-by-op path's tokens and
    logprobs, which the fused call must equal bit for bit."""
    llm = LLM(str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    plans = [layer.__dict__.get("_decode_plan") for layer in llm.engine.model.model.layers]
    return out.token_ids, out.logprobs, plans
