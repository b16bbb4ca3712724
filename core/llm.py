"""The Python API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import attrs

from layerzoo import settings
from layerzoo.engine_args import EngineArgs, check_kernel_backend
from layerzoo.entrypoints.chat import prepare_chat
from layerzoo.entrypoints.progress import GenerateBar, bars_enabled
from layerzoo.errors import UserError
from layerzoo.loading.hub import resolve_model
from layerzoo.loading.model_loading import load_model
from layerzoo.loading.model_packages import DEFAULT_MODEL
from layerzoo.runtime import tensor_parallel
from layerzoo.runtime.engine import LLMEngine
from layerzoo.runtime.malloc import trim, tune_malloc
from layerzoo.runtime.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from layerzoo.runtime.sequence import FinishReason, Sequence
from layerzoo.runtime.threads import apply_thread_defaults, usable_cpus
from layerzoo.sampling import SamplingParams
from layerzoo.tokenization.chat_formats import ToolCall
from layerzoo.tokenization.token_ids_only import TokenIdsOnly
from layerzoo.tokenization.tokenizer import Tokenizer


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # LLM.chat: ``text`` read in the model's chat format (layerzoo.tokenization.chat_formats): the message's
    # content (None when it is only tool calls), its reasoning (None without) and its tool calls.
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, Any] = attrs.field(factory=dict)
    # SamplingParams(prompt_logprobs=k): per prompt token None (the first) or {token_id: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None


def check_text(text: str, where: str) -> str:
    """``text`` if it can be encoded (UTF-8); a lone surrogate is named with its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"{where}: not valid Unicode text: a lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None
    return text


def check_token_ids(ids: Any, where: str) -> list[int]:
    """A list of token ids (ints; bools, floats and None are refused)."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UserError(f"{where}: expected a list of int token ids, got {ids!r:.80}")
    return list(ids)


def renamed(exc: UserError, request_id: str, where: str) -> UserError:
    """The engine's refusal of a prompt, which names the request by its id (``request 39``),
    re-worded for a caller who knows that prompt as ``where`` (``prompt 2``, ``prompt.1``)."""
    message = str(exc)
    ours = f"request {request_id}: "
    if not message.startswith(ours):
        return exc
    return UserError(f"{where}: {message.removeprefix(ours)}")


def check_tensor_parallel_size(args: EngineArgs) -> None:
    """On CPU every spawned rank needs a core of its own: more ranks than the CPUs this process
    may use are refused before any worker is spawned. (CUDA ranks are counted against the
    devices when the group forms; a torchrun launch brings its own processes.)"""
    size = args.tensor_parallel_size
    if size == 1 or torch_device_type(args.device) != "cpu" or tensor_parallel.torchrun_world() is not None:
        return
    cpus = usable_cpus()
    if size > cpus:
        raise UserError(
            f"tensor_parallel_size: {size} ranks on CPU need a core each, but this process may use {cpus} CPU(s); "
            f"use tensor_parallel_size <= {cpus}"
        )


def release_loading_memory() -> None:
    """What loading kept only to load: the parsed GGUF file (shared by the model's and the
    tokenizer's loading; its memory map holds the pages read) and the heap pages the checkpoint's
    tensors passed through."""
    from layerzoo.loading.gguf_loading import forget_opened

    forget_opened()
    gc.collect()
    trim()


def prompt_tokens(tokenizer: Tokenizer | None, prompt: str | dict, where: str = "prompt") -> tuple[list[int], str | None]:
    """A prompt's token ids and text.

    A string (or ``{"prompt": text}``) is encoded; ``{"prompt_token_ids": [...]}`` passes its ids
    (with ``"prompt"`` kept as the text, if given). Without a tokenizer only ids are accepted.
    """
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        return check_token_ids(prompt["prompt_token_ids"], f"{where}: prompt_token_ids"), text
    if isinstance(prompt, dict) and "prompt" in prompt:
        text, where = prompt["prompt"], f"{where}: prompt"
    else:
        text = prompt
    if not isinstance(text, str):
        raise UserError(
            f"{where}: expected a string, {{'prompt': text}} or {{'prompt_token_ids': [...]}}, got {text!r:.80}"
        )
    if tokenizer is None:
        raise UserError(f"{where}: skip_tokenizer_init=True takes token ids only ({{'prompt_token_ids': [...]}}), got text")
    return tokenizer.encode(check_text(text, where)), text


def check_params(params: Any, where: str = "sampling_params") -> SamplingParams:
    """``params`` re-validated as it is now: a list changed in place since it was built (``stop``) is caught."""
    if not isinstance(params, SamplingParams):
        hint = " (write SamplingParams(**{...}))" if isinstance(params, dict) else ""
        raise UserError(f"{where}: expected a SamplingParams, got {type(params).__name__} {params!r:.60}{hint}")
    attrs.validate(params)
    params.__attrs_post_init__()
    return params


def check_stop_strings(tokenizer, params: SamplingParams) -> None:
    """Stop strings match text; without a tokenizer there is none (token ids stop with ``stop_token_ids``)."""
    if isinstance(tokenizer, TokenIdsOnly) and params.stop:
        raise UserError("SamplingParams.stop: stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")


def as_prompt_list(prompts: Any) -> list:
    """``prompts`` as a list: one prompt (a string or dict) or a list/tuple of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise UserError(
        f"prompts: expected a string, a dict or a list of them, got {type(prompts).__name__} {prompts!r:.60}"
    )


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
    prompt_logprobs = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
    return RequestOutput(
        first.request_id, first.prompt, first.prompt_token_ids, outputs, all(s.finished for s in seqs), metrics, prompt_logprobs
    )


def embedding_output(seq: Sequence) -> EmbeddingRequestOutput:
    """A pooling request's output: its embedding once its prompt has run (``outputs`` None before,
    or when it ended otherwise: aborted)."""
    done = seq.finish_reason is FinishReason.POOLED
    return EmbeddingRequestOutput(
        seq.request_id, seq.prompt, seq.prompt_token_ids, EmbeddingOutput(seq.pooled.embedding()) if done else None, seq.finished
    )


def pooling_params(engine: LLMEngine, pooling: str | None, normalize: bool) -> PoolingParams:
    """``LLM.embed``'s arguments as `PoolingParams`; ``pooling`` None takes the model's method."""
    method = engine.default_pooling().method if pooling is None else pooling
    return PoolingParams(method, normalize)


def load_tokenizer(model_dir: Path, hf_config: dict, tokenizer: str | Path | None, skip: bool, revision: str | None):
    """The model's tokenizer, one from elsewhere (``tokenizer=``), or none at all (``skip_tokenizer_init``)."""
    if not isinstance(skip, bool):
        raise UserError(f"skip_tokenizer_init: expected True or False, got {skip!r}")
    if skip:
        if tokenizer is not None:
            raise UserError("tokenizer: given together with skip_tokenizer_init=True; pass one or the other")
        return TokenIdsOnly.from_dir(model_dir, hf_config)
    if tokenizer is None:
        return Tokenizer.from_dir(model_dir, config=hf_config)
    if not str(tokenizer).strip():
        raise UserError("tokenizer: expected a tokenizer directory or hub repo id, got an empty string")
    return Tokenizer.from_dir(resolve_model(str(tokenizer), revision=revision), config=hf_config)


def torch_device_type(device) -> str:
    return str(device).split(":", 1)[0]


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a local checkpoint directory or a hub repo id; None picks the embedded demo model.
        tokenizer: a tokenizer directory or hub repo id to use instead of the model's own.
        skip_tokenizer_init: load no tokenizer: prompts are ``{"prompt_token_ids": [...]}`` and
            outputs carry token ids (their text is empty); EOS ids come from the model's config.
        dtype: ``"auto"`` (the checkpoint's dtype; fp32 on CPU), ``"float32"``, ``"bfloat16"``, ...
        revision: hub revision (branch, tag or commit) when ``model`` is a repo id.
        max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size, enable_prefix_caching,
        max_model_len, enable_chunked_prefill: see `layerzoo.runtime.engine.EngineArgs`.
        tensor_parallel_size: ranks the model is split over. N > 1 spawns N-1 worker processes
            (gloo on CPU, NCCL on CUDA); under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) the
            launch's processes are the ranks, and on every rank but 0 the constructor serves
            rank 0's steps until rank 0 shuts down, then exits the process (``SystemExit(0)``).
            `shutdown` (or leaving a ``with`` block, or the interpreter's exit) ends the workers.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: Any = "auto",
        *,
        revision: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        tokenizer: str | Path | None = None,
        skip_tokenizer_init: bool = False,
        **engine_args: Any,
    ):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise UserError(f"LLM(): unknown argument(s) {', '.join(sorted(unknown))}")
        if model is not None and not str(model).strip():
            raise UserError("model: expected a checkpoint directory or a hub repo id, got an empty string (None: the embedded demo model)")
        self.model_dir = resolve_model(str(DEFAULT_MODEL if model is None else model), revision=revision)
        self.args = EngineArgs(dtype=dtype, device=device, seed=seed, **engine_args)
        check_kernel_backend(self.args.device)
        check_tensor_parallel_size(self.args)
        # Every rank builds this same LLM: the workers get these arguments (the model resolved).
        same = dict(dtype=dtype, device=device, seed=seed, tokenizer=tokenizer,
                    skip_tokenizer_init=skip_tokenizer_init, **engine_args)
        tp = tensor_parallel.join(self.args.tensor_parallel_size, self.args.device, type(self), (str(self.model_dir),), same)
        threads = self.args.num_threads
        if tp is not None:
            launch = tp.launch
            device = tensor_parallel.rank_device(self.args.device, launch.local_rank)
            self.args = attrs.evolve(self.args, tensor_parallel_size=launch.world_size, device=device)
            if threads is None and not settings.text("OMP_NUM_THREADS"):
                threads = tensor_parallel.threads_per_rank(launch.local_world_size)
        apply_thread_defaults(threads)
        if torch_device_type(self.args.device) == "cpu":
            tune_malloc()  # large activations reuse heap blocks instead of fresh mmap pages (layerzoo.runtime.malloc)
        try:
            self.loaded = load_model(self.model_dir, self.args)
            self.tokenizer = load_tokenizer(self.model_dir, self.loaded.hf_config, tokenizer, skip_tokenizer_init, revision)
            release_loading_memory()
            self.engine = LLMEngine(self.loaded, self.tokenizer, self.args)
        except BaseException as exc:
            if tp is not None:
                tp.end_after(exc)
            raise
        self._ids = itertools.count()
        if tp is not None:
            self._start_tensor_parallel(tp)

    def _start_tensor_parallel(self, tp) -> None:
        """Rank 0 drives the workers through its executor; a worker rank serves rank 0's steps
        until it shuts down. A spawned worker then returns to `worker_main`, which ends its
        process; a torchrun rank runs the caller's script, whose remaining lines are rank 0's
        alone, so it leaves by ``SystemExit(0)`` (its ``finally`` blocks still run)."""
        if tp.rank != 0:
            try:
                tp.serve(self.engine.runner)
            finally:
                tp.shutdown()
            if not tp.launch.spawned:
                raise SystemExit(0)
            return
        self.engine.executor = tensor_parallel.TensorParallelExecutor(self.engine.runner, tp)
        # Not on self: an AsyncLLM keeps only the engine. Also runs at interpreter exit.
        weakref.finalize(self.engine, tp.shutdown)

    def shutdown(self) -> None:
        """End the tensor-parallel workers, if any (idempotent; nothing to do in one process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def capabilities(self):
        """The model's capability record, with the FP8 calibration answers as they are now."""
        return self.engine.capabilities()

    @property
    def stats(self):
        return self.engine.stats

    def _add(self, prompt, params: SamplingParams, where: str) -> str:
        """Queue one prompt; its errors name it as ``where`` (``prompt 2``: its place in the call)."""
        check_stop_strings(self.tokenizer, params)
        ids, text = prompt_tokens(self.tokenizer, prompt, where)
        request_id = str(next(self._ids))
        try:
            self.engine.add_request(request_id, ids, params, text)
        except UserError as exc:
            raise renamed(exc, request_id, where) from None
        return request_id

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, all batched together; results in the order of the prompts.

        ``use_tqdm`` shows a progress bar with input and output tokens/s (None: on a terminal).
        """
        prompts = as_prompt_list(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, (list, tuple)):
            params = [check_params(p, f"sampling_params[{i}]") for i, p in enumerate(params)]
        else:
            params = [check_params(params)] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"sampling_params: got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        bar = GenerateBar(len(prompts), bars_enabled(use_tqdm))
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self._add(p, sp, f"prompt {i}"))
            pending = set(ids)
            while self.engine.has_unfinished():
                self.engine.step()
                for request_id in [r for r in pending if all(s.finished for s in self.engine.requests[r])]:
                    pending.discard(request_id)
                    seqs = self.engine.requests[request_id]
                    bar.finished(len(seqs[0].prompt_token_ids), sum(len(s.output_token_ids) for s in seqs))
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [request_output(self.engine.release(request_id)) for request_id in ids]

    def embed(
        self,
        prompts: str | dict | Seq[str | dict],
        pooling: str | None = None,
        normalize: bool = True,
        use_tqdm: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's shape: ``out.outputs.embedding``, ``hidden_size`` floats),
        in the order of the prompts, all batched together.

        The prompts run as prefills only (long ones in chunks); each is pooled from the model's
        final hidden states (after the final norm, before the LM head): ``pooling="last"`` takes the
        last prompt token's row, ``"mean"`` the mean of all its rows; None: the model's own method
        (``Qwen3Model`` checkpoints: last), else last. ``normalize`` L2-normalises the vector.
        Text is tokenized with the tokenizer's special tokens, as sentence-transformers does
        (Qwen3-Embedding's tokenizer appends ``<|endoftext|>``, the token its last-token pooling
        reads); ``{"prompt_token_ids": [...]}`` is pooled as given.
        """
        prompts = as_prompt_list(prompts)
        params = pooling_params(self.engine, pooling, normalize)
        ids = []
        bar = GenerateBar(len(prompts), bars_enabled(use_tqdm))
        try:
            for i, prompt in enumerate(prompts):
                ids.append(self._add_pooling(prompt, params, f"prompt {i}"))
            pending = set(ids)
            while self.engine.has_unfinished():
                self.engine.step()
                for request_id in [r for r in pending if self.engine.requests[r][0].finished]:
                    pending.discard(request_id)
                    bar.finished(len(self.engine.requests[request_id][0].prompt_token_ids), 0)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        outputs = [embedding_output(self.engine.release(request_id)[0]) for request_id in ids]
        for i, out in enumerate(outputs):
            if out.outputs is None:  # (the scheduler stopped it: it outgrew the whole KV cache)
                raise UserError(f"prompt {i}: its {len(out.prompt_token_ids)} tokens did not fit the KV cache; raise kv_cache_memory")
        return outputs

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Chat: one conversation (a list of ``{"role", "content"}`` messages) or a list of them,
        each rendered by the model's chat template and generated, all batched together.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) reach the template;
        ``tool_choice`` ``"auto"`` (the default with tools), ``"none"``, ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}`` (the last two constrain the output to
        calls whose arguments fit the tool's schema); ``chat_template_kwargs`` are template
        variables (``{"enable_thinking": False}``). Each completion keeps its raw ``text`` and
        carries ``content``, ``reasoning_content`` and ``tool_calls`` as read in the chat format
        the model's plugin registered (see `layerzoo.entrypoints.chat`).
        """
        from layerzoo.plugins.manager import get_registry

        if not isinstance(messages, (list, tuple)) or not messages:
            raise UserError("messages: expected a non-empty list of messages, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params = check_params(SamplingParams() if sampling_params is None else sampling_params)
        fmt = get_registry().chat_format(self.loaded.architecture)
        plans = [prepare_chat(self.tokenizer, fmt, list(conversation), params, tools=tools, tool_choice=tool_choice,
                              parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs)
                 for conversation in conversations]
        outputs = self.generate([{"prompt": plan.prompt} for plan in plans], [plan.params for plan in plans], use_tqdm)
        for plan, out in zip(plans, outputs):
            for c in out.outputs:
                parsed = plan.parse(c.text)
                c.content, c.reasoning_content, c.tool_calls = parsed.content, parsed.reasoning_content, parsed.tool_calls
        return outputs

    def _add_pooling(self, prompt, params: PoolingParams, where: str) -> str:
        ids, text = prompt_tokens(self.tokenizer, prompt, where)
        request_id = str(next(self._ids))
        try:
            self.engine.add_pooling_request(request_id, ids, params, text)
        except UserError as exc:
            raise renamed(exc, request_id, where) from None
        return request_id

    def stream(self, prompt: str | dict, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced.

        The text reaches this stream whoever steps the engine: another `generate` or `stream` may
        run it to the end while this one is paused, and the rest is yielded on the next read.
        One completion only (``n=1``): `generate` and `AsyncLLM` return all ``n``.
        """
        params = check_params(SamplingParams() if sampling_params is None else sampling_params)
        if params.n != 1:
            raise UserError(f"sampling_params.n: stream() yields one completion, got n={params.n} (use generate() or AsyncLLM for n > 1)")
        request_id = self._add(prompt, params, "prompt")
        (seq,) = self.engine.requests[request_id]
        # Text that could be the start of a stop string is held back until it is not.
        holdback = max(map(len, seq.params.stop), default=1) - 1
        sent = 0
        try:
            while True:
                if not seq.finished:
                    self.engine.step()
                ready = len(seq.text) if seq.finished else len(seq.text) - holdback
                if ready > sent:
                    piece = seq.text[sent:ready]
                    seq.num_text_sent = sent = ready  # the loop watchdog must not rewind sent text
                    yield piece  # meanwhile another caller may step the engine: look again after
                elif seq.finished:
                    return
        finally:
            if seq.finished:
                self.engine.release(request_id)
            else:
                self.engine.abort_request(request_id)
