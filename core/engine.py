"""The engine: requests in, one step at a time, outputs out.

``step()`` is the whole pipeline, linear: ``Scheduler.schedule`` → ``ModelRunner.run`` →
``Sampler`` → ``Scheduler.update`` → text, stop strings, outputs. Requests are added with
``add_request`` and can be aborted at any time; everything a sequence holds is freed when it
finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import attrs

from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.model_loading import LoadedModel
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.graphs import GraphConfig
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype
from layerzoo.runtime.model_runner import ModelRunner, token_at
from layerzoo.runtime.state_manager import StateConfig, StateManager, own_state_layer_map
from layerzoo.runtime.state_pool import StatePool
from layerzoo.runtime.watchdog import LoopWatchdog
from layerzoo.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan
from layerzoo.sampling import Sampler, SamplingParams, SamplingRow
from layerzoo.speculative import SpeculativeConfig, build_proposer  # noqa: F401 (SpeculativeConfig: typing)
from layerzoo.speculative.adaptive import AdaptiveDraftLength
from layerzoo.sequence import FinishReason, Sequence
from layerzoo.tokenizer import IncrementalDetokenizer, Tokenizer

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
        caps = self.model.capabilities
        self.max_model_len = min(args.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        specs = with_kv_cache_dtype(self.model.kv_cache_specs(), args.kv_cache_dtype)
        per_token = sum(s.bytes_per_token for s in specs.values())
        blocks_per_seq = (self.max_model_len + args.block_size) // args.block_size + 1
        spec = self._speculation(args.speculative_config, caps, args.speculative_fallback)
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
        if num_blocks < 2:
            pool = f" after the recurrent-state pool's {state_bytes} bytes" if state_bytes else ""
            raise UserError(
                f"kv_cache_memory={args.kv_cache_memory!r} holds fewer than 2 KV blocks of {args.block_size} tokens "
                f"({per_token} bytes/token){pool}"
            )
        prefix_caching = args.enable_prefix_caching and (caps is None or caps.prefix_matching_allowed)
        if args.enable_prefix_caching and not prefix_caching:
            cause = next(c for c in caps.disabled() if c.feature == "prefix-cache matching")
            log.warning("prefix caching is off: %s (LAYERZOO_MLA_PREFIX_SKIP=1 accepts the approximation)", cause.describe())
        self.blocks = BlockManager(num_blocks, args.block_size, enable_prefix_caching=prefix_caching)
        self.states = StateManager(
            pool_specs,
            own_state_layer_map(self.model, own_layers),
            state_config,
            self.blocks,
            device=self.model.lm_head.weight.device,
        )
        if self.states.active:
            self.blocks.match_limit = self.states.usable_prefix_blocks
        self.kv = PagedKVCache(
            specs, num_blocks, args.block_size, device=self.model.lm_head.weight.device,
            fp8_calibration_tokens=args.fp8_calibration_tokens,
        )
        self.kv.bind(self.model)  # attention layers see their FP8 scales (and answer fp8_calibration_frozen)
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=args.enable_chunked_prefill,
        )
        self.scheduler = Scheduler(config, self.blocks, caps, tokenizer.eos_token_ids)
        self.watchdog = LoopWatchdog(tokenizer, enabled_by_default=args.loop_watchdog)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.blocks,
            max_slots=args.max_num_seqs,
            graphs=GraphConfig(enabled=not args.enforce_eager),
            states=self.states,
            is_boundary=self._ring_boundary,
        )
        self.scheduler.on_release.append(self.runner.release)
        if self.states.active:
            self.scheduler.on_commit.append(self.states.commit_snapshots)
            self.scheduler.rewind_state = self.states.rewind
        self.speculative = spec
        if spec is not None:
            self.proposer = build_proposer(spec)
            self.scheduler.propose = self._propose
            self.draft_policy = AdaptiveDraftLength(self.proposer.propose, adaptive=spec.adaptive)
            self.scheduler.on_release.append(lambda seq: self.draft_policy.forget(seq.seq_id))
        self.sampler = Sampler()
        self.requests: dict[str, list[Sequence]] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self.stats = EngineStats(disabled_features=[c.describe() for c in caps.disabled()] if caps else [])

    @staticmethod
    def _speculation(config: SpeculativeConfig | None, caps, fallback: bool) -> SpeculativeConfig | None:
        """The speculative config to run with: refused at start when a layer cannot drop drafts."""
        blocker = caps.speculation_blocker() if config is not None and caps is not None else None
        if blocker is None:
            return config
        reason = (
            f"layer {blocker.layer_index} ({blocker.layer_class}) keeps its own state (uses_ssm_pool False) and does "
            f"not keep per-draft states (keeps_per_draft_states, plugin {blocker.plugin or 'default'}), so rejected "
            f"drafts cannot be dropped"
        )
        if not fallback:
            raise UserError(f"speculative_config: speculative decoding is not possible for this model: {reason} "
                            f"(speculative_fallback=True runs without it)")
        log.warning("speculative decoding is off: %s", reason)
        return None

    def _propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Drafts for one decoding sequence; none for requests that want logprobs."""
        if seq.params.logprobs is not None:
            return []
        token_ids = seq.token_ids
        k = self.draft_policy.draft_length(seq.seq_id, token_ids, min(max_tokens, self.speculative.num_speculative_tokens))
        return self.proposer.propose(token_ids, k) if k else []

    def _ring_boundary(self, seq: Sequence, position: int) -> bool:
        """Whether the token at ``position`` is one the loop watchdog may rewind to (a ring snapshot)."""
        return self.watchdog.enabled(seq) and token_at(seq, position) in self.watchdog.boundaries

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> list[Sequence]:
        """Queue a request; returns its ``params.n`` sequences (they share the prompt's blocks)."""
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already in use")
        self._check_prompt(request_id, prompt_token_ids)
        first = Sequence(prompt_token_ids, params, request_id, prompt)
        seqs = [first] + [
            Sequence(prompt_token_ids, params, request_id, prompt, index=i, parent=first) for i in range(1, params.n)
        ]
        for seq in seqs:
            self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.stats.prompt_tokens += len(prompt_token_ids)
        return seqs

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
            self._detok.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def release(self, request_id: str) -> list[Sequence]:
        """Forget a finished request (its sequences are returned to the caller)."""
        seqs = self.requests.pop(request_id)
        for seq in seqs:
            self._detok.pop(seq.seq_id, None)
        return seqs

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a new token (finished ones included)."""
        plan = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        if plan.empty:
            assert not self.scheduler.running, "running sequences but nothing scheduled"
            return []
        chunks, logits = self.runner.run(plan)
        verifies = [c for c in chunks if c.is_verify]
        if verifies:
            tokens = self._sample_with_verify(chunks, logits)
        else:
            sampled = self._sample(chunks, logits)
            tokens = dict(zip((c.seq.seq_id for c in chunks), sampled.token_ids))
        self.scheduler.update(plan, tokens)
        updated = [c.seq for c in chunks]
        if not verifies:
            for seq, logprob, top in zip(updated, sampled.logprobs, sampled.top_logprobs):
                self._record_logprobs(seq, logprob, top)
        num_sampled = 0
        for chunk in chunks:
            new = tokens[chunk.seq.seq_id]
            n = len(new) if isinstance(new, list) else 1
            num_sampled += n
            self._update_text(chunk.seq, n)
        self._update_stats(plan, num_sampled)
        self.watchdog.check(self, updated)
        return updated

    def _sample(self, chunks, logits):
        return self.sampler(logits, [self._sampling_row(c.seq, []) for c in chunks])

    def _sample_with_verify(self, chunks, logits) -> dict[int, int | list[int]]:
        """Sample plain rows as usual; accept or reject each verify chunk's drafts.

        Greedy requests accept the longest prefix of drafts equal to the target's choices; sampled
        requests use rejection sampling, which keeps the target distribution exactly. The rows'
        sampling parameters (penalties, min_tokens) see the drafts accepted before them.
        """
        from layerzoo.sampling import target_probs
        from layerzoo.speculative.acceptance import greedy_accept, rejection_sample

        out: dict[int, int | list[int]] = {}
        plain, plain_rows, row = [], [], 0
        for chunk in chunks:
            if not chunk.is_verify:
                plain.append(chunk)
                plain_rows.append(row)
                row += 1
                continue
            seq, draft = chunk.seq, list(chunk.draft)
            target = logits[row : row + 1 + len(draft)]
            row += 1 + len(draft)
            # The first row decides for all: min_tokens masking only turns off as output grows.
            if Sampler.argmax_only([self._sampling_row(seq, [])]):  # plain greedy: the argmax
                accepted, emitted = greedy_accept(draft, target.argmax(dim=-1).tolist())
            else:
                probs = target_probs(target, [self._sampling_row(seq, draft[:i]) for i in range(1 + len(draft))])
                if seq.params.greedy:
                    accepted, emitted = greedy_accept(draft, probs.argmax(dim=-1).tolist())
                else:
                    accepted, emitted = rejection_sample(draft, probs, None, seq.generator)
            self.runner.finish_verify(chunk, accepted + 1)
            self.stats.spec_verify_steps += 1
            self.stats.spec_draft_tokens += len(draft)
            self.stats.spec_accepted_tokens += accepted
            self.draft_policy.observe(seq.seq_id, len(draft), accepted)
            out[seq.seq_id] = emitted
        if plain:
            sampled = self._sample(plain, logits[plain_rows])
            out.update(zip((c.seq.seq_id for c in plain), sampled.token_ids))
        return out

    def _sampling_row(self, seq: Sequence, extra: list[int]) -> SamplingRow:
        return SamplingRow(
            params=seq.params,
            generator=seq.generator,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids + extra if extra else seq.output_token_ids,
            eos_token_ids=() if seq.params.ignore_eos else tuple(self.tokenizer.eos_token_ids),
        )

    def _record_logprobs(self, seq: Sequence, logprob, top) -> None:
        if seq.logprobs is None or logprob is None or not seq.output_token_ids:
            return
        entry = dict(top or [])
        entry[seq.output_token_ids[-1]] = logprob
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def _update_text(self, seq: Sequence, num_new: int = 1) -> None:
        """Detokenize the step's new tokens one by one; a stop string ends the text there, and
        tokens after the one that completed it (accepted speculative drafts) are dropped."""
        detok = self._detok.get(seq.seq_id)
        if detok is None or not seq.output_token_ids:
            return
        first = len(seq.output_token_ids) - num_new
        for index in range(first, len(seq.output_token_ids)):
            delta = detok.feed(seq.output_token_ids[index])
            seq.text += delta
            if self._stop_string(seq, delta):
                del seq.output_token_ids[index + 1 :]
                return

    def _stop_string(self, seq: Sequence, delta: str) -> bool:
        stops = seq.params.stop
        if not stops or not delta or seq.finished:
            return False
        # Only the new text, and the stop string's length before it, can hold a new match.
        start = max(0, len(seq.text) - len(delta) - max(map(len, stops)) + 1)
        hits = [(i, s) for s in stops if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return False
        cut, stop = min(hits)
        seq.text = seq.text[:cut]
        self.scheduler.finish(seq, FinishReason.STOP, stop)
        return True

    def reset_detokenizer(self, seq: Sequence) -> None:
        """Restart a sequence's incremental detokenizer after its output was rewound."""
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        for token in seq.output_token_ids:
            detok.feed(token)
        self._detok[seq.seq_id] = detok

    def _update_stats(self, plan: StepPlan, num_sampled: int) -> None:
        self.stats.steps += 1
        self.stats.generated_tokens += num_sampled
        self.stats.prefill_tokens_computed += sum(c.num_tokens for c in plan.prefills)
        self.stats.decode_tokens_computed += len(plan.decodes)
        self.stats.prefix_cache_queries = self.blocks.prefix_queries
        self.stats.prefix_cache_hits = self.blocks.prefix_hits
        self.stats.state_snapshots_taken = self.states.snapshots_taken
        self.stats.state_snapshot_hits = self.states.snapshot_hits
        self.stats.graphs = self.runner.graphs.summary()

    def run_until_done(self, seqs: Seq[Sequence] | None = None) -> None:
        while self.has_unfinished():
            self.step()

