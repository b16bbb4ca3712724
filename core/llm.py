"""The Python API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import attrs

from layerzoo.config import EngineConfig
from layerzoo.engine import Engine
from layerzoo.errors import UserError
from layerzoo.hub import resolve_model
from layerzoo.model import load_model
from layerzoo.sampling import SamplingParams
from layerzoo.sequence import Sequence
from layerzoo.tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).parent / "embedded" / "tiny-qwen3-stdlib"


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def _output(seq: Sequence) -> RequestOutput:
    reason = seq.finish_reason.value if seq.finish_reason else None
    completion = CompletionOutput(0, seq.text, list(seq.output_token_ids), reason, seq.stop_reason)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.finished)


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a local checkpoint directory or a hub repo id; None picks the embedded demo model.
        dtype: ``"auto"`` (the checkpoint's dtype; fp32 on CPU), ``"float32"``, ``"bfloat16"``, ...
        revision: hub revision (branch, tag or commit) when ``model`` is a repo id.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: Any = "auto",
        *,
        revision: str | None = None,
        device: str = "cpu",
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.model_dir = resolve_model(str(model or DEFAULT_MODEL), revision=revision)
        self.engine_config = EngineConfig(dtype=dtype, device=device, max_model_len=max_model_len, seed=seed)
        self.loaded = load_model(self.model_dir, self.engine_config)
        self.tokenizer = Tokenizer.from_dir(self.model_dir, config=self.loaded.hf_config)
        self.engine = Engine(self.loaded, self.tokenizer, max_model_len=max_model_len)

    @property
    def capabilities(self):
        return self.loaded.model.capabilities

    def _sequence(self, prompt: str | dict, params: SamplingParams, index: int) -> Sequence:
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            raise UserError(f"prompt {index}: expected a string or a dict with 'prompt_token_ids', got {prompt!r:.80}")
        if not ids:
            raise UserError(f"prompt {index}: it has no tokens")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise UserError(f"prompt {index}: token ids must be ints in [0, {vocab})")
        return Sequence(ids, params, request_id=str(index), prompt=text)

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (batched together); results in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self._sequence(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
        self.engine.run(seqs)
        return [_output(s) for s in seqs]

    def stream(self, prompt: str | dict, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced."""
        seq = self._sequence(prompt, sampling_params or SamplingParams(), 0)
        self.engine.add(seq)
        try:
            while not seq.finished:
                for out in self.engine.step():
                    if out.seq is seq and out.text_delta:
                        yield out.text_delta
        finally:
            if not seq.finished:
                self.engine.abort(seq)
