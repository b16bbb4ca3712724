"""The engine: requests in, one step at a time, outputs out.

``step()`` is the whole pipeline, linear: ``Scheduler.schedule`` (a plain `StepPlan`) →
``ModelRunner.execute`` (tokens) → ``Scheduler.update`` (append, stop, free) → `OutputProcessor`
(text, stop strings, logprobs) → the loop watchdog's re-steers. The scheduler and the runner meet
only in the plan and the step's result; the engine passes both between them. Requests are added
with ``add_request`` and can be aborted at any time; everything a sequence holds is freed when it
finishes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import attrs
import torch

from layerzoo.distributed import parallel_state
from layerzoo.engine_args import EngineArgs, check_kv_cache_fits, default_step_budget, resolve_max_model_len
from layerzoo.errors import LayerStateNotRewindable, UserError
from layerzoo.layers.model import CausalLM
from layerzoo.loading.model_loading import LoadedModel
from layerzoo.plugins.capabilities import Feature
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.cache_ledger import CacheLedger
from layerzoo.runtime.cpu_contention import ThreadGovernor
from layerzoo.runtime.executor import Executor, InProcessExecutor
from layerzoo.runtime.graphs import GraphConfig
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype
from layerzoo.runtime.model_runner import ModelRunner, StepResult
from layerzoo.runtime.output_processor import OutputProcessor
from layerzoo.runtime.plan import StepPlan
from layerzoo.runtime.pooling import DEFAULT_POOLING, PoolingParams
from layerzoo.runtime.scheduler import Scheduler, SchedulerConfig
from layerzoo.runtime.sequence import FinishReason, Sequence
from layerzoo.runtime.state_ledger import StateConfig, StateLedger
from layerzoo.runtime.state_pool import StatePool
from layerzoo.runtime.structured_outputs import StructuredOutputs
from layerzoo.runtime.tensor_parallel import agree_on_min
from layerzoo.runtime.thinking_budget import ThinkingBudgets, check_budget_request
from layerzoo.runtime.watchdog import BoundaryTokens, LoopWatchdog
from layerzoo.sampling import SamplingParams
from layerzoo.speculative import SpeculativeConfig, build_proposer
from layerzoo.speculative.adaptive import AdaptiveDraftLength
from layerzoo.speculative.mtp_drafter import MtpDrafter
from layerzoo.speculative.proposers import propose_for
from layerzoo.speculative.step_cost import step_clock
from layerzoo.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable), or 8 GiB where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_budget_bytes(kv_cache_memory: float | int, needed_bytes: int) -> int:
    """The KV pool's size: the user's budget, never more than the longest possible workload needs."""
    if isinstance(kv_cache_memory, float) and 0 < kv_cache_memory <= 1:
        budget = int(available_memory() * kv_cache_memory)
    elif isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
        budget = kv_cache_memory
    else:
        raise UserError(f"kv_cache_memory: expected bytes (int > 0) or a fraction in (0, 1], got {kv_cache_memory!r}")
    return min(budget, needed_bytes)


@attrs.define
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens_computed: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    state_snapshots_taken: int = 0  # recurrent-state snapshots indexed for prefix matching
    state_snapshot_hits: int = 0  # sequences that resumed from one
    spec_verify_steps: int = 0  # speculative verifies run (one per sequence and step)
    spec_draft_tokens: int = 0  # drafts proposed and verified
    spec_accepted_tokens: int = 0  # drafts accepted
    watchdog: dict[str, int] = attrs.field(factory=dict)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts (None before any verify)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_tokens_per_verify(self) -> float | None:
        """Tokens a verify step emits on average: 1 + accepted drafts (None before any verify)."""
        return 1 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else None
    graphs: dict = attrs.field(factory=dict)
    disabled_features: list[str] = attrs.field(factory=list)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, args: EngineArgs | None = None):
        self.args = args = args or EngineArgs()
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, tokenizer
        torch.manual_seed(args.seed)  # unseeded requests draw from the global generator, as in vLLM
        caps = self.model.capabilities
        self.max_model_len = resolve_max_model_len(args.max_model_len, loaded.config.max_position_embeddings)
        spec = self._speculation(args.speculative_config, caps, args.speculative_fallback)
        if spec is None and self.model.mtp is not None:  # speculation fell back: the head and its KV go
            self.model.mtp = None
        specs = with_kv_cache_dtype(self.model.kv_cache_specs(), args.kv_cache_dtype)
        per_token = sum(s.bytes_per_token for s in specs.values())
        blocks_per_seq = (self.max_model_len + args.block_size) // args.block_size + 1
        state_config = StateConfig(
            max_seqs=args.max_num_seqs,
            snapshot_slots=args.ssm_snapshot_slots,
            ring_depth=args.ssm_ring_depth,
            snapshot_interval=args.ssm_snapshot_interval,
            draft_slots_per_seq=spec.num_speculative_tokens if spec else 0,
        )
        own_layers = caps.own_state_layers if caps else ()
        pool_specs = {i: s for i, s in self.model.state_specs().items() if i not in own_layers}
        # The state pool is sized first: its slots are fixed, the KV cache takes what is left.
        state_bytes = StatePool.bytes_for(pool_specs, state_config.num_slots) if pool_specs else 0
        needed = per_token * (self.max_model_len + args.block_size) * args.max_num_seqs
        if per_token:
            budget = kv_budget_bytes(args.kv_cache_memory, needed + state_bytes) - state_bytes
            num_blocks = num_blocks_for_budget(specs, args.block_size, max(budget, 0))
        else:  # no attention layer: blocks are bookkeeping only (prefix matching), as many as needed
            num_blocks = blocks_per_seq * args.max_num_seqs
        num_blocks = agree_on_min(num_blocks)  # tensor parallelism: rank 0 schedules for the smallest pool
        if num_blocks < 2:
            pool = f" after the recurrent-state pool's {state_bytes} bytes" if state_bytes else ""
            raise UserError(
                f"kv_cache_memory={args.kv_cache_memory!r} holds fewer than 2 KV blocks of {args.block_size} tokens "
                f"({per_token} bytes/token){pool}"
            )
        check_kv_cache_fits(num_blocks, args.block_size, self.max_model_len, args.kv_cache_memory)
        prefix_caching = args.enable_prefix_caching and (caps is None or caps.prefix_matching_allowed)
        if args.enable_prefix_caching and not prefix_caching:
            cause = next(c for c in caps.disabled() if c.feature is Feature.PREFIX_MATCHING)
            log.warning("prefix caching is off: %s (LAYERZOO_MLA_PREFIX_SKIP=1 accepts the approximation)", cause.describe())
        head = self.model.lm_head if self.model.lm_head is not None else self.model.model.embed_tokens  # an embedder has no head
        device = head.weight.device
        # The ledger (device-free, the scheduler's) and the pools it addresses (the runner's).
        self.blocks = BlockManager(num_blocks, args.block_size, enable_prefix_caching=prefix_caching)
        self.states = StateLedger(state_config, self.blocks, has_pool=bool(pool_specs), has_own_state=bool(own_layers))
        graphs = GraphConfig(enabled=not args.enforce_eager, compile_on_cpu=args.compile_decode)
        mtp = spec is not None and spec.method == "mtp"
        if mtp:
            self._check_mtp(loaded)
            if graphs.enabled:  # a captured step returns logits only; the head needs the hidden states
                graphs = attrs.evolve(graphs, enabled=False, off_reason="decode graphs off with MTP drafting")
        if parallel_state.is_parallel() and graphs.enabled:  # captured steps would hold the ranks' collectives
            graphs = attrs.evolve(graphs, enabled=False, off_reason="decode graphs off under tensor parallelism")
        self.kv = PagedKVCache(
            specs, num_blocks, args.block_size, device=device, fp8_calibration_tokens=args.fp8_calibration_tokens,
            pad_block=graphs.captures_on(device.type),
        )
        self.kv.bind(self.model)  # attention layers see their FP8 scales (and answer fp8_calibration_frozen)
        if caps is not None and self.kv.fp8:
            # Gathered at load, before the layers had scales: record what they answer now.
            self.model.capabilities = caps = caps.with_fp8_states(self.model.fp8_calibration_states())
        self.speculative = spec
        boundaries = BoundaryTokens(tokenizer, enabled_by_default=args.loop_watchdog)
        proposer = build_proposer(spec) if spec is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=default_step_budget(args),
                max_model_len=self.max_model_len,
                chunked_prefill=args.enable_chunked_prefill,
            ),
            CacheLedger(self.blocks, self.states),
            caps,
            tokenizer.eos_token_ids,
            proposer=proposer,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            draft_policy=AdaptiveDraftLength(
                proposer.propose, adaptive=spec.adaptive, propose_for=functools.partial(propose_for, proposer),
                peek=getattr(proposer, "peek", None), rest=getattr(proposer, "rest", None),
                ask_second=getattr(proposer, "ask_second", None), second=getattr(proposer, "second", None),
                shadow_max_gap=getattr(proposer, "shadow_max_gap", None),
            ) if spec is not None else None,
            boundaries=boundaries,
        )
        self.structured_outputs = StructuredOutputs(tokenizer, loaded.config.vocab_size)
        self.thinking_budgets = ThinkingBudgets.for_model(tokenizer, self._chat_format(loaded.architecture), loaded.config.vocab_size)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            state_pool=StatePool(pool_specs, state_config.num_slots, device) if pool_specs else None,
            own_state_layers={i: self.model.layers[i] for i in own_layers},
            eos_token_ids=tokenizer.eos_token_ids,
            max_slots=args.max_num_seqs,
            graphs=graphs,
            thread_governor=ThreadGovernor.for_engine(self.kv.device.type, args.num_threads, compiled_decode=args.compile_decode),
            structured_outputs=self.structured_outputs,
            thinking_budgets=self.thinking_budgets,
            mtp_drafter=MtpDrafter(self.model, self.kv, proposer, spec.num_speculative_tokens) if mtp else None,
        )
        # Runs the plans: this runner alone, or with the tensor-parallel workers (LLM swaps it then).
        self.executor: Executor = InProcessExecutor(self.runner)
        self.watchdog = LoopWatchdog(boundaries)
        self.outputs = OutputProcessor(tokenizer)
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = EngineStats(disabled_features=[c.describe() for c in caps.disabled()] if caps else [])
        self._clock = step_clock(self.kv.device.type)  # what the adaptive policy's step timings use

    @staticmethod
    def _chat_format(architecture: str):
        """The chat format the architecture's plugin registered (its reasoning markers), or None."""
        from layerzoo.plugins.manager import get_registry

        return get_registry().chat_format(architecture)

    @staticmethod
    def _check_mtp(loaded: LoadedModel) -> None:
        """``method "mtp"`` drafts with the checkpoint's own head: refuse a model without one."""
        model = loaded.model
        if model.mtp is None:
            declared = model.num_mtp_layers()
            why = (
                "its plugin builds no MTP head for this architecture" if type(model).num_mtp_layers is CausalLM.num_mtp_layers
                else "its config declares no MTP layers" if not declared else "the head was not built"
            )
            raise UserError(
                f"speculative_config.method: 'mtp' drafts with the checkpoint's multi-token-prediction head, and "
                f"{loaded.architecture} has none here ({why}); use method 'ngram'"
            )
        LLMEngine._check_mtp_block(model)

    @staticmethod
    def _check_mtp_block(model: CausalLM) -> None:
        """The head's block keeps only its KV in the pool (no state slot, no own state): refuse one
        whose capability answers say its layer keeps other state."""
        from layerzoo.plugins.capabilities import LayerCapabilities
        from layerzoo.plugins.manager import get_registry

        registry, block = get_registry(), model.mtp.block
        lc = LayerCapabilities.gather(registry.pm, layer_index=model.mtp.layer_index, layer_kind=registry.layer_kind_of(block),
                                      layer=block, engine_config=model.engine_config)
        for query, bad, why in (
            ("uses_ssm_pool", False, "keeps its own state"),
            ("is_ssm_layer", True, "keeps recurrent state"),
        ):
            if lc.answers[query] == bad:
                raise UserError(
                    f"speculative_config.method: 'mtp' runs the checkpoint's MTP head, whose block (layer "
                    f"{lc.layer_index}, {lc.layer_class}) {why} ({query}={bad}, plugin {lc.answered_by[query] or 'default'}): "
                    f"the head keeps only KV in the pool; use method 'ngram'"
                )

    @staticmethod
    def _speculation(config: SpeculativeConfig | None, caps, fallback: bool) -> SpeculativeConfig | None:
        """The speculative config to run with: refused at start when a layer cannot drop drafts."""
        blocker = caps.speculation_blocker() if config is not None and caps is not None else None
        if blocker is None:
            return config
        if blocker.query == "keeps_per_draft_states":
            why = "keeps its own state (uses_ssm_pool False) and does not keep per-draft states"
        else:
            why = "keeps recurrent state in the pool but cannot capture it inside a pass"
        reason = (
            f"layer {blocker.layer_index} ({blocker.layer_class}) {why} ({blocker.query}, plugin "
            f"{blocker.plugin or 'default'}), so rejected drafts cannot be dropped"
        )
        if not fallback:
            raise UserError(f"speculative_config: speculative decoding is not possible for this model: {reason} "
                            f"(speculative_fallback=True runs without it)")
        log.warning("speculative decoding is off: %s", reason)
        return None

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> list[Sequence]:
        """Queue a request; returns its ``params.n`` sequences (they share the prompt's blocks)."""
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already in use")
        if self.model.lm_head is None:
            raise UserError(
                f"request {request_id}: {self.loaded.architecture} is an embedding model (its checkpoint has no LM head): "
                f"it cannot generate; use LLM.embed() or POST /v1/embeddings"
            )
        self._check_prompt(request_id, prompt_token_ids)
        if params.logit_bias and (outside := [t for t in params.logit_bias if t >= self.loaded.config.vocab_size]):
            raise UserError(f"SamplingParams.logit_bias: token id {outside[0]} is outside the vocabulary "
                            f"[0, {self.loaded.config.vocab_size})")
        if params.structured_outputs is not None:  # compiled (and cached) now: a bad one never queues
            self.structured_outputs.check(params.structured_outputs)
        check_budget_request(params, self.thinking_budgets, self.loaded.architecture)
        first = Sequence(prompt_token_ids, params, request_id, prompt)
        seqs = [first] + [
            Sequence(prompt_token_ids, params, request_id, prompt, index=i, parent=first) for i in range(1, params.n)
        ]
        for seq in seqs:
            self.outputs.add(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.stats.prompt_tokens += len(prompt_token_ids)
        return seqs

    def add_pooling_request(
        self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, prompt: str | None = None
    ) -> list[Sequence]:
        """Queue an embedding request: its prompt runs as a prefill only (batched with whatever
        else runs, in chunks when long), its final hidden states pooled as ``pooling`` says; the
        sequence ends (finish reason ``pooled``) once its last prompt row has run, and frees its blocks."""
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already in use")
        self._check_prompt(request_id, prompt_token_ids)
        seq = Sequence(prompt_token_ids, SamplingParams(max_tokens=1), request_id, prompt, pooling=pooling)
        self.scheduler.add(seq)  # (no detokenizer: it makes no text)
        self.requests[request_id] = [seq]
        self.stats.prompt_tokens += len(prompt_token_ids)
        return [seq]

    def default_pooling(self) -> PoolingParams:
        """The pooling of embeddings whose caller names no method: the model's (``Qwen3Model``: last), else last."""
        return PoolingParams(self.model.default_pooling or DEFAULT_POOLING)

    def _check_prompt(self, request_id: str, ids: list[int]) -> None:
        if not ids:
            raise UserError(f"request {request_id}: the prompt has no tokens")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise UserError(f"request {request_id}: token ids must be ints in [0, {vocab})")
        self.model.check_prompt(request_id, ids)
        if len(ids) >= self.max_model_len:
            raise UserError(f"request {request_id}: the prompt has {len(ids)} tokens; the context length is {self.max_model_len}")
        blocks_needed = (len(ids) + self.args.block_size) // self.args.block_size
        if blocks_needed > self.blocks.num_blocks:
            raise UserError(
                f"request {request_id}: the prompt needs {blocks_needed} KV blocks but the cache has "
                f"{self.blocks.num_blocks}; raise kv_cache_memory"
            )

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            self.scheduler.abort(seq)
            self.outputs.remove(seq)
        self._free_when_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _free_when_idle(self) -> None:
        """Finished and aborted sequences are freed by the next plan; with no request left no next
        plan would come, so the frees go now, in a plan of their own (the runner's only channel)."""
        if self.scheduler.has_unfinished() or not self.scheduler.has_frees():
            return
        plan = self.scheduler.schedule()
        assert plan.empty and plan.freed, plan
        self._free(plan)

    def _free(self, plan: StepPlan) -> None:
        """Run a plan that only frees (nothing scheduled)."""
        self.executor.execute(plan)
        self.stats.graphs = self.runner.graphs.summary()  # (freeing drops stale graphs)

    def release(self, request_id: str) -> list[Sequence]:
        """Forget a finished request (its sequences are returned to the caller)."""
        seqs = self.requests.pop(request_id)
        for seq in seqs:
            self.outputs.remove(seq)
        return seqs

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a new token or finished (in scheduling too)."""
        started = self._clock()
        plan = self.scheduler.schedule()
        if plan.empty:
            assert not self.scheduler.running, "running sequences but nothing scheduled"
            if plan.freed:
                self._free(plan)
            return list(plan.finished)
        result = self.executor.execute(plan)
        updated = [c.seq for c in plan.chunks]
        before = [len(seq.output_token_ids) for seq in updated]
        for seq in updated:  # before update: a sequence that finishes in this step keeps them too
            if seq.seq_id in result.prompt_logprobs:
                self.outputs.record_prompt_logprobs(seq, result.prompt_logprobs[seq.seq_id])
            if seq.seq_id in result.pooled:
                seq.pooled.add(*result.pooled[seq.seq_id])
        self.scheduler.update(plan, result.tokens)
        for seq, n in zip(updated, before):
            if seq.seq_id in result.logprobs:
                self.outputs.record_logprobs(seq, *result.logprobs[seq.seq_id])
            # Only the tokens the scheduler kept: a stop inside a verify's accepted run ends it there.
            if (stop := self.outputs.process(seq, len(seq.output_token_ids) - n)) is not None:
                self.scheduler.finish(seq, FinishReason.STOP, stop)
        for resteer in self.watchdog.check(updated):
            self._resteer(resteer)
        self._update_stats(plan, result, sum(len(seq.output_token_ids) - n for seq, n in zip(updated, before)))
        self._time_step(plan, result, self._clock() - started)
        self._free_when_idle()
        return list(plan.finished) + updated

    def _time_step(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """A pure decode step's time, for the adaptive policy's cost model (steps with a prompt
        chunk measure the prompt, not what drafting costs): from its schedule to its outputs, since
        scheduling a verify's drafts and taking its tokens are work that grows with them (on the
        embedded model ~10% of a step of six sequences)."""
        policy = self.scheduler.draft_policy
        if policy is None or plan.prefills or not plan.decodes:
            return
        verifies = result.verifies  # (drafted, accepted) per verify
        policy.costs.observe(len(plan.decodes), sum(d for d, _ in verifies) if verifies else 0, len(verifies), seconds,
                             result.head_seconds, result.head_drafted, head_cold=result.head_cold)

    def _resteer(self, resteer) -> None:
        """Rewind a sequence stuck in a loop, as the watchdog asks, unless a layer cannot rewind."""
        seq = resteer.seq
        try:
            self.scheduler.rollback_to_boundary(seq, resteer.position)
        except LayerStateNotRewindable as exc:
            return self.watchdog.declined(resteer, exc)
        seq.params = attrs.evolve(seq.params, repetition_penalty=resteer.repetition_penalty)
        self.outputs.reset(seq, resteer.text)
        self.watchdog.resteered(resteer)

    def _update_stats(self, plan: StepPlan, result: StepResult, num_sampled: int) -> None:
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.spec_verify_steps += len(result.verifies)
        self.stats.spec_draft_tokens += sum(d for d, _ in result.verifies)
        self.stats.spec_accepted_tokens += sum(a for _, a in result.verifies)
        self.stats.watchdog = dict(self.watchdog.counts)
        self.stats.generated_tokens += num_sampled
        self.stats.prefill_tokens_computed += sum(c.num_tokens for c in plan.prefills)
        self.stats.decode_tokens_computed += len(plan.decodes)
        self.stats.prefix_cache_queries = self.blocks.prefix_queries
        self.stats.prefix_cache_hits = self.blocks.prefix_hits
        self.stats.state_snapshots_taken = self.states.snapshots_taken
        self.stats.state_snapshot_hits = self.states.snapshot_hits
        self.stats.graphs = self.runner.graphs.summary()

    def capabilities(self):
        """The model's capability record with the live ``fp8_calibration_frozen`` answers."""
        caps = self.model.capabilities
        if caps is None or not self.kv.fp8:
            return caps
        return caps.with_fp8_states(self.model.fp8_calibration_states())

    def features(self) -> dict[str, dict[str, Any]]:
        """What this engine does with its model and arguments: each feature on or off, with why
        (the engine argument or the capability answer that decided), for ``layerzoo plugins
        --capabilities``."""
        caps = self.capabilities()
        causes = {c.feature: c.describe() for c in caps.disabled()} if caps else {}
        args = self.args

        def by_answer(feature: Feature, on: bool, arg_off: str | None) -> dict[str, Any]:
            return {"on": on, "why": None if on else (arg_off or causes.get(feature, "off"))}

        graphs_on, graphs_why = self.runner.graphs.can_use_graphs()
        prefix_on = self.blocks.enable_prefix_caching
        return {
            "prefix_caching": by_answer(Feature.PREFIX_MATCHING, prefix_on, None if args.enable_prefix_caching else "enable_prefix_caching=False"),
            "chunked_prefill": by_answer(Feature.CHUNKED_PREFILL, self.scheduler.chunked_prefill,
                                         None if args.enable_chunked_prefill else "enable_chunked_prefill=False"),
            "decode_graphs": {"on": graphs_on, "why": graphs_why},
            "batched_decode": by_answer(Feature.BATCHED_DECODE, not self.runner.per_sequence_decode, None),
            "batched_verify": by_answer(Feature.BATCHED_VERIFY, not self.runner.per_sequence_verify, None),
            "speculative_decoding": {
                "on": self.speculative is not None,
                "why": None if self.speculative is not None else ("no speculative_config" if args.speculative_config is None
                                                                  else "a layer cannot drop rejected drafts (see the log)"),
                "method": getattr(self.speculative, "method", None),
            },
            "kv_cache": {"on": self.kv.num_blocks > 0, "why": None, "blocks": self.kv.num_blocks, "block_size": self.kv.block_size,
                         "tokens": self.kv.num_blocks * self.kv.block_size, "fp8_layers": len(self.kv.fp8)},
        }

    def shutdown(self) -> None:
        """End what the engine started beyond this process (tensor-parallel workers); idempotent."""
        self.executor.shutdown()

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

