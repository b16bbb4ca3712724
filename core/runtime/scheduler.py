"""The scheduler: which sequences run in the next step, and what happens to them after it.

Device-free: it owns the ledger (`CacheLedger`: KV blocks, the prefix cache and, for a model with
recurrent state, state slots, snapshots and the rollback ring), moves sequences between the waiting
queue and the running list, and plans each step (`layerzoo.runtime.plan.StepPlan`) as decode rows
(one token per running sequence, or a speculative verify) followed by prefill chunks, within a
token budget (chunked prefill) and a cap on running sequences. When blocks run out it preempts the most recently admitted sequence by recompute: its
blocks are freed, its tokens (prompt and output so far) kept, and it is prefilled again later, so
outputs do not change. Steps that run nothing while requests wait, many in a row, raise
`SchedulerStalled` naming the stuck sequence: blocks nobody frees would otherwise livelock the engine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

import attrs

from layerzoo.errors import SchedulerStalled
from layerzoo.plugins.capabilities import Cause, ModelCapabilities
from layerzoo.runtime.cache_ledger import CacheLedger
from layerzoo.runtime.plan import Chunk, StateCopy, StepPlan
from layerzoo.runtime.sequence import FinishReason, Sequence, Status
from layerzoo.speculative.proposers import propose_for

log = logging.getLogger(__name__)

# Consecutive steps that may run nothing while requests are unfinished before the scheduler says
# it is stuck. A step that only preempts runs nothing, and a request waiting for room gets it
# within a step or two of a preemption; this many in a row means blocks leaked (a livelock).
MAX_STALLED_STEPS = 64


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    chunked_prefill: bool = True

    def __attrs_post_init__(self):
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1


class Scheduler:
    """Waiting queue (FCFS), running list, and the step plan between them."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheLedger,
        capabilities: ModelCapabilities | None = None,
        eos_token_ids: Iterable[int] = (),
        *,
        proposer=None,
        num_speculative_tokens: int = 0,
        draft_policy=None,
        boundaries=None,
    ):
        self.config = config
        self.cache = cache
        self.capabilities = capabilities
        # Asked per sequence and step (drafts, forks): the layer scan once, here.
        self.local_mla_prefill = capabilities is not None and capabilities.local_mla_prefill
        self.eos_token_ids = frozenset(eos_token_ids)
        # Speculative decoding: drafts to verify after each decoding sequence's last token.
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        # How many drafts each sequence gets (`speculative.adaptive.AdaptiveDraftLength`), or None: all k.
        self.draft_policy = draft_policy
        # Tokens before which a rollback-ring snapshot is taken (`watchdog.BoundaryTokens`), or None.
        self.boundaries = boundaries
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_stalled_steps = MAX_STALLED_STEPS
        self._stalled_steps = 0  # consecutive plans that ran nothing while requests were unfinished
        self._freed: list[int] = []  # seq_ids that gave up their KV and state since last taken
        # The last plan's verifies: seq_id -> (rows kept, rows run, the pool copy that keeps them).
        self._verified: dict[int, tuple[int, int, StateCopy | None]] = {}
        self.chunked_prefill = config.chunked_prefill and (capabilities is None or capabilities.chunked_prefill_allowed)

    # -- requests ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING and seq.num_cached == 0
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_frees(self) -> bool:
        """Whether sequences gave up their state since the last plan: the next plan has the runner
        free what it holds for them."""
        return bool(self._freed)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence now and free everything it holds."""
        if seq.finished:
            return
        seq.finish(FinishReason.ABORT)
        self.free_sequence(seq)

    def free_sequence(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks and drop it from the queues."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        """Give back everything ``seq`` holds; the next plan has the runner do the same."""
        self.cache.free(seq)
        seq.num_cached = 0
        self._verified.pop(seq.seq_id, None)
        if self.draft_policy is not None:
            self.draft_policy.forget(seq.seq_id)
        self._freed.append(seq.seq_id)

    def take_freed(self) -> tuple[int, ...]:
        """The seq_ids that gave up their KV and state since the last call: the runner frees what
        it holds for them (decode-graph slots, own-layer states)."""
        freed, self._freed = tuple(self._freed), []
        return freed

    # -- planning ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        decodes, prefills, preempted, finished = [], [], [], []
        scheduled: set[int] = set()
        # Sequences the draft policy answers 0 for, without asking (most steps of one that does not draft).
        quiet = self.draft_policy.quiet(self.num_speculative_tokens) if self.draft_policy is not None else {}
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncached != 1 or budget == 0 or seq.pools:
                continue  # (a pooling request's last prompt row is a prefill chunk: it never decodes)
            if self._outgrows_cache(seq):
                finished.append(seq)
                continue
            if not self._make_room(seq, len(seq), preempted, scheduled, may_preempt_self=True):
                continue
            draft = [] if len(seq) < quiet.get(seq.seq_id, 0) else self._draft(seq, budget - 1)
            decodes.append(Chunk(seq, seq.num_cached, 1 + len(draft), tuple(draft)))
            scheduled.add(seq.seq_id)
            budget -= 1 + len(draft)
        for seq in list(self.running):
            if seq.status is Status.RUNNING and seq.num_uncached > (0 if seq.pools else 1) and budget > 0:
                n = self._chunk_len(seq, budget)
                if n and self._make_room(seq, seq.num_cached + n, preempted, scheduled):
                    prefills.append(Chunk(seq, seq.num_cached, n))
                    scheduled.add(seq.seq_id)
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            head = self.waiting[0]
            if self._outgrows_cache(head):
                finished.append(head)
                continue
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            prefills.append(chunk)
            budget -= chunk.num_tokens
        self._reserve_lookahead(decodes + prefills)
        plan = self._plan(tuple(decodes), tuple(prefills), tuple(preempted), tuple(finished))
        self._check_progress(plan)
        now = time.monotonic()
        for chunk in plan.chunks:
            chunk.seq.timings.first_scheduled = chunk.seq.timings.first_scheduled or now
        return plan

    def _plan(self, decodes, prefills, preempted, finished) -> StepPlan:
        """The step's plan: its chunks with their block tables, and the state work they need."""
        chunks = decodes + prefills
        tables = {c.seq.seq_id: self.cache.table(c.seq.seq_id) for c in chunks}
        freed = self.take_freed()
        verified, self._verified = self._verified, {}
        kept = {seq_id: (rows, run) for seq_id, (rows, run, _) in verified.items()}
        state = self.cache.plan_states(chunks, self._before_boundary)
        # The kept verify states first: the slots the ledger freed after the verify may be reused below.
        keeps = tuple(copy for _, _, copy in verified.values() if copy is not None)
        if keeps:
            state["state_copies"] = keeps + state["state_copies"]
        return StepPlan(decodes, prefills, preempted, finished, tables, freed=freed, verified=kept, **state)

    def _check_progress(self, plan: StepPlan) -> None:
        """Raise `SchedulerStalled` after ``max_stalled_steps`` plans in a row that ran nothing
        while requests are unfinished: blocks that nothing frees (a bug) would otherwise keep the
        engine stepping forever with every request waiting."""
        if plan.chunks or plan.finished or not self.has_unfinished():
            self._stalled_steps = 0
            return
        self._stalled_steps += 1
        if self._stalled_steps >= self.max_stalled_steps:
            raise SchedulerStalled(self._stall_report())

    def _stall_report(self) -> str:
        """Which sequence is stuck and where the blocks it needs are."""
        seq = self.waiting[0] if self.waiting else self.running[0]
        state = "waiting" if self.waiting else "running"
        blocks = self.cache.blocks
        needed = blocks.blocks_for(len(seq))
        report = (
            f"no progress for {self._stalled_steps} steps: request {seq.request_id!r} (sequence {seq.seq_id}, "
            f"{state}, {len(seq)} tokens) needs {needed} KV blocks and {blocks.num_free_blocks()} of "
            f"{blocks.num_blocks} are free"
        )
        running = {s.seq_id for s in self.running}
        by_id = {s.seq_id: s for s in self.waiting}
        holders = [sid for sid in blocks.sequences() if sid not in running]
        if holders:
            held = ", ".join(
                f"sequence {sid}" + (f" (request {by_id[sid].request_id!r}, waiting)" if sid in by_id else "")
                + f": {len(blocks.block_table(sid))} blocks"
                for sid in holders
            )
            report += f"; blocks held by sequences that are not running (a preemption or free that left them behind?): {held}"
        return report

    def _before_boundary(self, chunk: Chunk) -> bool:
        """Whether a one-token chunk feeds a token the loop watchdog may rewind to (a ring entry)."""
        return self.boundaries is not None and chunk.num_tokens == 1 and self.boundaries.before(chunk.seq, chunk.start)

    def _outgrows_cache(self, seq: Sequence) -> bool:
        """Finish (length) a sequence the whole KV cache could not hold one more token of: waiting
        for room would wait forever."""
        blocks = self.cache.blocks
        if blocks.blocks_for(len(seq)) <= blocks.num_blocks:
            return False
        log.warning("request %s stopped: %d tokens need more KV blocks than the cache has (%d)",
                    seq.request_id, len(seq), blocks.num_blocks)
        seq.finish(FinishReason.LENGTH)
        self.free_sequence(seq)
        return True

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens to verify after ``seq``'s last token, within the budget, the request's
        ``max_tokens`` and the context, in blocks that are free now (speculation never preempts)."""
        # Requests that want logprobs do not speculate: a verify yields no logprobs per token.
        if self.proposer is None or budget <= 0 or seq.params.logprobs is not None or not self._may_verify(seq):
            return []
        room = min(budget, self.config.max_model_len - len(seq) - 1, self.num_speculative_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        policy = self.draft_policy
        token_ids = seq.token_ids
        if room > 0 and policy is not None:
            room = policy.draft_length(seq.seq_id, token_ids, room)
        draft = propose_for(self.proposer, seq.seq_id, token_ids, room) if room > 0 else []
        if not draft or not self.cache.can_grow(seq.seq_id, len(seq) + len(draft)):
            return []
        self.cache.grow(seq.seq_id, len(seq) + len(draft))
        return draft[:room]

    def _reserve_lookahead(self, chunks: list[Chunk]) -> None:
        """Blocks for the positions a proposer writes past each sampling chunk (the MTP head's
        chained rows, ``proposer.lookahead``) of the sequences it drafts for after this step
        (``proposer.drafts_now``, where it answers), where they are free now: never a preemption
        for them; a sequence without them gets a shorter draft. A verify may keep all its drafts,
        so its reserve starts after them."""
        lookahead = getattr(self.proposer, "lookahead", 0)
        if not lookahead:
            return
        chains = getattr(self.proposer, "drafts_now", None)
        for chunk in chunks:
            if (chains is None or chains(chunk.seq_id)) and chunk.samples:  # (the lookup first: most rows rest)
                wanted = chunk.start + chunk.num_tokens + lookahead
                if self.cache.can_grow(chunk.seq_id, wanted):
                    self.cache.grow(chunk.seq_id, wanted)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        if self.chunked_prefill:
            return min(seq.num_uncached, budget)
        # A prompt that may not be split runs whole, alone in the budget if need be.
        fits = seq.num_uncached <= budget or budget == self.config.max_num_batched_tokens
        return seq.num_uncached if fits else 0

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        """Give a waiting sequence its blocks (reusing cached prefix blocks) and its first chunk."""
        parent = seq.parent
        if parent is not None and not parent.finished and parent.num_cached < len(parent.prompt_token_ids):
            return None  # n > 1: wait until the first completion's prompt is cached, then share it
        if parent is not None and self.cache.holds(parent.seq_id) and self._may_fork():
            # As a prefix match, at most all prompt tokens but the last, whose row must run to
            # give the sibling its first logits: a prompt of whole blocks would otherwise share
            # every block and leave nothing to run (the sibling then waited for its parent to end).
            cursor = self.cache.fork(parent.seq_id, seq.seq_id, len(seq.prompt_token_ids) - 1)
            n = self._chunk_len_from(seq, cursor, budget)
            if n == 0 or not self.cache.can_grow(seq.seq_id, cursor + n):
                self.cache.free(seq)
                return None
            self.cache.grow(seq.seq_id, cursor + n)
        else:
            # Prompt logprobs score every prompt row: such a request matches no cached prefix (as in
            # vLLM) until they are all computed (a preemption after that may match again); mean
            # pooling adds every prompt row, so it matches none either.
            match = () if seq.prompt_logprobs_pending or seq.pools_every_row else seq.token_ids
            cursor = self.cache.match(match)
            n = self._chunk_len_from(seq, cursor, budget)
            if n == 0 or not self.cache.can_admit(match, cursor + n):
                return None
            cursor = self.cache.admit(seq.seq_id, match, cursor + n)
            n = self._chunk_len_from(seq, cursor, budget)
        seq.num_cached = cursor
        seq.status = Status.RUNNING
        self.running.append(seq)
        return Chunk(seq, cursor, n)

    def _chunk_len_from(self, seq: Sequence, cursor: int, budget: int) -> int:
        uncached = len(seq) - cursor
        if self.chunked_prefill:
            return min(uncached, budget)
        return uncached if uncached <= budget or budget == self.config.max_num_batched_tokens else 0

    def _make_room(
        self, seq: Sequence, num_tokens: int, preempted: list[Sequence], scheduled: set[int], may_preempt_self: bool = False
    ) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens`` positions, preempting later sequences if needed.

        Victims are taken from the back of the running list (the most recently admitted first),
        never one already planned in this step. A decode that still does not fit preempts itself;
        a prefill chunk just waits for a later step.
        """
        while not self.cache.can_grow(seq.seq_id, num_tokens):
            victims = [s for s in self.running if s is not seq and s.seq_id not in scheduled]
            if victims and self.running.index(victims[-1]) > self.running.index(seq):
                victim = victims[-1]
            elif may_preempt_self:
                victim = seq
            else:
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.cache.grow(seq.seq_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, keep the tokens, queue first for readmission."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.debug("preempted %r", seq)

    # -- after the step ----------------------------------------------------------------------

    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Advance the KV cursors of the plan's sequences and append sampled tokens.

        ``sampled`` maps ``seq_id`` to the token drawn for each chunk that samples, or for a
        verify chunk to the list of tokens it emitted (the accepted drafts and one more): the KV
        cursor then stops after the rows those consumed, past the rejected drafts. Returns the
        sequences that finished in this step (already freed).
        """
        finished = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.finished:  # aborted while the step ran
                continue
            tokens = sampled.get(seq.seq_id) if chunk.samples else None
            tokens = [tokens] if isinstance(tokens, int) else tokens or []
            assert len(tokens) <= chunk.num_tokens, (tokens, chunk)
            kept = 0
            for token in tokens:
                seq.output_token_ids.append(token)
                kept += 1
                reason = self.stop_reason(seq, token)
                if reason is not None:
                    seq.finish(*reason)
                    finished.append(seq)
                    break
            if chunk.is_verify:
                if not seq.finished:
                    self._keep_verified(plan, chunk, kept)
                self.cache.verified(seq)
                if self.draft_policy is not None:  # a verify emits its accepted drafts and one more
                    self.draft_policy.observe(seq.seq_id, len(chunk.draft), len(tokens) - 1)
                # Each kept token came from one row: the KV cursor stops after those rows.
                seq.num_cached = chunk.start + kept
                if kept < chunk.num_tokens:  # free the blocks only rejected drafts used
                    cursor = self.cache.drop_rejected(seq.seq_id, seq.num_cached + 1)
                    assert cursor >= seq.num_cached, (cursor, seq.num_cached)
            else:
                seq.num_cached = chunk.start + chunk.num_tokens
            self.cache.commit(seq)
            if seq.pools and seq.num_cached == len(seq):  # its prompt has run: pooled, nothing to decode
                seq.finish(FinishReason.POOLED)
                finished.append(seq)
            if tokens:
                seq.timings.first_token = seq.timings.first_token or time.monotonic()
        self.cache.commit_snapshots()
        for seq in finished:
            self.free_sequence(seq)
        return finished

    def _keep_verified(self, plan: StepPlan, chunk, kept: int) -> None:
        """The next plan tells the runner which of this verify's rows the sequence kept: its own-state
        layers keep the state after them, the pool copies it from the draft's slot (the live slot
        holds the state after every row)."""
        seq_id, run = chunk.seq.seq_id, chunk.num_tokens
        assert 1 <= kept <= run, (kept, run)
        copy = None
        if kept < run and seq_id in plan.draft_slots:
            copy = StateCopy(plan.draft_slots[seq_id][kept - 1], plan.state_slots[seq_id])
        self._verified[seq_id] = (kept, run, copy)

    def stop_reason(self, seq: Sequence, token: int) -> tuple[FinishReason, int | None] | None:
        """Token-level stop conditions (stop strings need text: the engine checks those)."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP, token
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            return FinishReason.LENGTH, None
        if len(seq) >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason=None) -> None:
        """Finish a sequence for a reason found outside the scheduler (a stop string)."""
        seq.finish(reason, stop_reason)
        self.free_sequence(seq)

    # -- rewinding ---------------------------------------------------------------------------

    def rollback_to_boundary(self, seq: Sequence, position: int) -> None:
        """Rewind ``seq`` so that it ends at ``position`` tokens (prompt included) and continues.

        Generated tokens past ``position`` are dropped, the KV cursor is lowered and blocks past
        it are freed. Declines with ``LayerStateNotRewindable`` (naming the layer) when a layer
        keeps state that lowering the cursor does not rewind.
        """
        assert len(seq.prompt_token_ids) <= position <= len(seq), (position, len(seq))
        if self.capabilities is not None:
            self.capabilities.check_rollback()
        del seq.output_token_ids[position - len(seq.prompt_token_ids) :]
        if seq.logprobs is not None:
            del seq.logprobs[position - len(seq.prompt_token_ids) :]
        if self.cache.holds(seq.seq_id):
            # The last kept token must be fed again to produce the next logits; a cursor already
            # below that (an earlier rewind, a preemption) stays where it is.
            cursor = self.cache.rewind(seq, min(position - 1, seq.num_cached))
            cursor = self._local_mla_rerun_start(seq, cursor, position)
            seq.num_cached = cursor
        seq.num_rollbacks += 1

    # -- chunk-local MLA prefill (uses_local_mla_prefill): every prefill row starts at position 0 --

    def _local_mla_cause(self, what: str) -> str | None:
        """None when no layer prefills chunk-locally; else why ``what`` is refused, naming the
        first such layer (logged once per scheduler and ``what``)."""
        if not self.local_mla_prefill:
            return None
        caps = self.capabilities
        query = "uses_local_mla_prefill"
        lc = next(lc for lc in caps.layers if lc.uses_local_mla_prefill)
        cause = Cause(what, query, lc.layer_index, lc.layer_class, lc.answered_by[query]).describe()
        logged = self.__dict__.setdefault("_local_mla_logged", set())
        if what not in logged:
            logged.add(what)
            log.warning("%s", cause)
        return cause

    def _may_fork(self) -> bool:
        """An ``n > 1`` sibling may prefill only a tail over its parent's forked blocks."""
        return self._local_mla_cause("n > 1 siblings sharing the prompt's blocks") is None

    def _may_verify(self, seq: Sequence) -> bool:
        """A speculative verify (several rows past position 0) may run for ``seq``."""
        return seq.num_cached == 0 or self._local_mla_cause("speculative verify") is None

    def _local_mla_rerun_start(self, seq: Sequence, cursor: int, position: int) -> int:
        """After a rollback to ``position``: the KV cursor to resume from. A chunk-local MLA prefill
        cannot re-run several rows past position 0, so a cursor below ``position - 1`` drops to 0
        (every token is recomputed, the recurrent state restarts)."""
        if not 0 < cursor < position - 1 or self._local_mla_cause("rollback to a mid-prompt snapshot") is None:
            return cursor
        cursor = self.cache.rewind(seq, 0)
        assert cursor == 0, cursor
        return cursor
