"""The decode path stays short to read: from the runner's ``execute`` to the model's ``forward``
at most four frames (execute, _run_passes, _forward, the model), with no lambda between them."""

from __future__ import annotations

import traceback

from layerzoo.llm import LLM
from layerzoo.sampling import SamplingParams


def test_a_decode_step_reaches_the_model_in_four_frames(monkeypatch):
    llm = LLM(max_model_len=64, kv_cache_memory=1 << 24)
    model = llm.engine.runner.model
    stacks = []
    forward = type(model).forward

    def recording_forward(self, *args, **kwargs):
        stacks.append(traceback.extract_stack()[:-1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording_forward)
    llm.generate(["def f(x):", "import os"], SamplingParams(max_tokens=4, temperature=0))
    assert len(stacks) >= 4  # the prefill and the decode steps
    for stack in stacks:
        start = max(i for i, frame in enumerate(stack) if frame.name == "execute" and frame.filename.endswith("model_runner.py"))
        # torch's own nn.Module call frames are not ours to count
        ours = [frame.name for frame in stack[start:] if "torch/nn/modules" not in frame.filename]
        assert ours == ["execute", "_run_passes", "_forward"], ours
