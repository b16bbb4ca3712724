"""The Python API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import attrs

from layerzoo.engine import LLMEngine
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.hub import resolve_model
from layerzoo.model_loading import load_model
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
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, Any] = attrs.field(factory=dict)


def prompt_tokens(tokenizer: Tokenizer, prompt: str | dict, where: str = "prompt") -> tuple[list[int], str | None]:
    """A prompt's token ids and text: a string is encoded, a dict passes its ``prompt_token_ids``."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"]), prompt.get("prompt")
    raise UserError(f"{where}: expected a string or a dict with 'prompt_token_ids', got {prompt!r:.80}")


def request_output(seqs: Seq[Sequence]) -> RequestOutput:
    """A request's output from its sequences (one per completion)."""
    first = seqs[0]
    outputs = [
        CompletionOutput(
            s.index,
            s.text,
            list(s.output_token_ids),
            s.finish_reason.value if s.finish_reason else None,
            s.stop_reason,
            list(s.logprobs) if s.logprobs is not None else None,
            s.cumulative_logprob if s.logprobs is not None else None,
        )
        for s in seqs
    ]
    metrics = {
        **first.timings.summary(),
        "preemptions": sum(s.num_preemptions for s in seqs),
        "rollbacks": sum(s.num_rollbacks for s in seqs),
    }
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outputs, all(s.finished for s in seqs), metrics)


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a local checkpoint directory or a hub repo id; None picks the embedded demo model.
        dtype: ``"auto"`` (the checkpoint's dtype; fp32 on CPU), ``"float32"``, ``"bfloat16"``, ...
        revision: hub revision (branch, tag or commit) when ``model`` is a repo id.
        max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size, enable_prefix_caching,
        max_model_len, enable_chunked_prefill: see `layerzoo.engine.EngineArgs`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: Any = "auto",
        *,
        revision: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        **engine_args: Any,
    ):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise UserError(f"LLM(): unknown argument(s) {', '.join(sorted(unknown))}")
        self.model_dir = resolve_model(str(model or DEFAULT_MODEL), revision=revision)
        self.args = EngineArgs(dtype=dtype, device=device, seed=seed, **engine_args)
        self.loaded = load_model(self.model_dir, self.args)
        self.tokenizer = Tokenizer.from_dir(self.model_dir, config=self.loaded.hf_config)
        self.engine = LLMEngine(self.loaded, self.tokenizer, self.args)
        self._ids = itertools.count()

    @property
    def capabilities(self):
        """The model's capability record, with the FP8 calibration answers as they are now."""
        return self.engine.capabilities()

    @property
    def stats(self):
        return self.engine.stats

    def _add(self, prompt, params: SamplingParams, index: int) -> str:
        ids, text = prompt_tokens(self.tokenizer, prompt, f"prompt {index}")
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params, text)
        return request_id

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, all batched together; results in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self._add(p, sp, i))
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [request_output(self.engine.release(request_id)) for request_id in ids]

    def stream(self, prompt: str | dict, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced."""
        request_id = self._add(prompt, sampling_params or SamplingParams(), 0)
        (seq,) = self.engine.requests[request_id][:1]
        # Text that could be the start of a stop string is held back until it is not.
        holdback = max(map(len, seq.params.stop), default=1) - 1
        sent = 0
        try:
            while not seq.finished:
                self.engine.step()
                ready = len(seq.text) if seq.finished else len(seq.text) - holdback
                if ready > sent:
                    piece = seq.text[sent:ready]
                    seq.num_text_sent = sent = ready  # the loop watchdog must not rewind sent text
                    yield piece
        finally:
            if seq.finished:
                self.engine.release(request_id)
            else:
                self.engine.abort_request(request_id)
