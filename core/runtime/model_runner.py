"""The model runner: owns the device, executes a step plan, returns the step's tokens.

It holds the paged KV pool, the recurrent-state pool and the own-state layers' state objects, and
knows nothing of the scheduler: everything it does comes from the plan. For each plan it frees
what freed sequences held, carries out the plan's state copy orders, builds the step's
`ForwardContext` (positions, slot mapping, block tables, context lengths, state slots and
captures), runs the model, samples the plain rows and accepts or rejects each verify's drafts
(the next plan's `verified` and copy orders keep the state after the accepted rows). When a
layer answers ``decode_multi_seq_unsupported`` it runs each decode row on its own and the prefill
chunks as a separate pass, instead of one fused batch; ``decode_verify_multi_unsupported`` does
the same for verifies.

With tensor parallelism a worker rank's runner gets the same plan with its chunks as `ChunkRows`
(`execute_as_worker`): it runs the same passes, so every collective inside the model lines up,
and drops the logits; the plans carry everything else (frees, kept verify rows), so its pools stay
identical to rank 0's.
"""

from __future__ import annotations

import itertools
import logging

import attrs
import torch

from layerzoo.layers.context import ForwardContext
from layerzoo.layers.model import CausalLM
from layerzoo.runtime.cpu_contention import ThreadGovernor
from layerzoo.runtime.decode_capture import DecodeCapture
from layerzoo.runtime.graphs import DecodeGraphRunner, GraphConfig
from layerzoo.runtime.kv_pool import PagedKVCache
from layerzoo.runtime.plan import Chunk, StepPlan
from layerzoo.runtime.pooling import pooled_row_sums
from layerzoo.runtime.sampler import (
    NonFiniteLogitsError,
    Sampler,
    SamplingRow,
    apply_token_bitmask,
    prompt_logprob_entries,
    target_probs,
)
from layerzoo.runtime.state_pool import SsmStep, StatePool
from layerzoo.runtime.structured_outputs import StructuredOutputs
from layerzoo.runtime.thinking_budget import ThinkingBudgets
from layerzoo.speculative.acceptance import greedy_accept, rejection_sample

log = logging.getLogger(__name__)

# Prompt logprobs take logits at a prompt's rows this many at a time: a [rows, vocab] fp32 block
# each (256 x 152k: 156 MB), of which only the gathered values are kept.
PROMPT_LOGITS_ROWS = 256


class SlotTable:
    """Decode-graph slots: a small integer per running sequence, reused after it is freed."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.unused = list(range(max_slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}

    def slot(self, seq_id: int) -> int:
        if seq_id not in self.slot_of:
            assert self.unused, "more running sequences than slots"
            self.slot_of[seq_id] = self.unused.pop()
        return self.slot_of[seq_id]

    def free(self, seq_id: int) -> int | None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.unused.append(slot)
        return slot


@attrs.frozen
class StepResult:
    """What a step produced: per sequence its token (a list of tokens for a verify: the accepted
    drafts and one more), the ``(logprob, top)`` of plain sampled rows, per verify
    ``(drafted, accepted)``, and per sequence asking for prompt logprobs the entries of the prompt
    positions its rows scored, in order (from position ``len(seq.prompt_logprobs)`` on); per
    pooling sequence ``(rows, vector [hidden] fp32 CPU)``: the sum of the prompt rows it pooled
    in this step (mean) or its last row (last), for `layerzoo.runtime.pooling.PooledState.add`."""

    tokens: dict[int, int | list[int]]
    logprobs: dict[int, tuple]
    verifies: list[tuple[int, int]]
    prompt_logprobs: dict[int, list[dict[int, float]]] = attrs.field(factory=dict)
    pooled: dict[int, tuple[int, torch.Tensor]] = attrs.field(factory=dict)
    # The MTP head's work this step (`MtpDrafter.draft`: its step and chained rows): seconds, and
    # the sequences it drafted for; the engine prices drafting with them (`layerzoo.speculative.step_cost`).
    head_seconds: float = 0.0
    head_drafted: int = 0
    head_cold: bool = False  # the head ran a call of a shape it had not run before (`MtpDrafter.cold`)


@attrs.frozen
class MtpInputs:
    """What the MTP head runs on after a step (`ModelRunner.mtp_inputs`): its rows per sequence
    (`layerzoo.speculative.mtp_drafter.HeadRows`), the step's asks (seq_id -> drafts asked) and the
    sequences asked for a second token too (`MtpProposer.ask_second`: one more row through the
    head's block, whose collectives every rank must run)."""

    rows: list
    asked: dict[int, int]
    second_asks: frozenset[int] = frozenset()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        *,
        state_pool: StatePool | None = None,
        own_state_layers: dict[int, object] | None = None,
        eos_token_ids=(),
        max_slots: int = 64,
        graphs: GraphConfig | None = None,
        thread_governor: ThreadGovernor | None = None,
        structured_outputs: StructuredOutputs | None = None,
        thinking_budgets: ThinkingBudgets | None = None,
        mtp_drafter=None,
    ):
        self.model = model
        # MTP drafting (`layerzoo.speculative.mtp_drafter.MtpDrafter`): runs the model's MTP head
        # after each step's sampling, from the hidden states of the rows each sequence kept.
        self.mtp = mtp_drafter
        self.head_works = False  # the MTP head has work in this step (`MtpDrafter.begin`)
        self.structured_outputs = structured_outputs  # grammar masks of constrained requests (rank 0 samples)
        self.thinking_budgets = thinking_budgets  # forces </think> once a request's reasoning used its budget
        # Masks on a thread beside the forward pass: off, as measured. On CPU the thread took the
        # pass's cores (bench/structured_outputs.py 0.80x against 0.99x in line); on an H200 the
        # thread waited for the GIL while the step's thread launched kernels (0.55x against 0.78x).
        self.overlap_masks = False
        self.thread_governor = thread_governor  # CPU: fewer threads while the cores are contended
        self.kv = kv
        self.device = kv.device
        self.pool = state_pool
        self.own_layers = own_state_layers or {}  # layer index -> layer (alloc_state / release_state)
        self.own_states: dict[int, dict[int, object]] = {}  # seq_id -> layer index -> its state
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler()
        caps = model.capabilities
        # In-pass capture only when every layer honours it; else a chunk is split at each capture.
        self.in_pass_capture = caps is not None and caps.replay_tail_split_supported
        if self.pool is not None and caps is not None and not self.in_pass_capture:
            lc = next(lc for lc in caps.layers if not lc.supports_replay_tail_split)
            log.info(
                "state snapshots inside a prefill chunk take two passes: layer %d (%s) answers "
                "supports_replay_tail_split False (plugin %s)",
                lc.layer_index, lc.layer_class, lc.answered_by["supports_replay_tail_split"] or "default",
            )
        self.slots = SlotTable(max_slots)
        graph_config = self._graph_config(graphs or GraphConfig())
        self.decode_capture = DecodeCapture(model, kv, self.pool, self.own_layers, device=self.device) if graph_config.enabled else None
        self.graphs = DecodeGraphRunner(
            model.capabilities,
            graph_config,
            device=self.device,
            poll_fp8=getattr(model, "fp8_calibration_states", None),
            capture_fn=self.decode_capture.capture if self.decode_capture else None,
            replay_fn=self.decode_capture.replay if self.decode_capture else None,
        )
        self.per_sequence_decode = caps is not None and caps.decode_multi_seq_veto
        if self.per_sequence_decode:
            cause = next(c for c in caps.disabled() if c.query == "decode_multi_seq_unsupported")
            log.info("%s: decoding each sequence on its own", cause.describe())
        self.per_sequence_verify = caps is not None and caps.verify_multi_veto
        self._verify_route_logged = False
        self.kept_rows: dict[int, int] = {}  # seq_id -> rows kept by this step's verifies
        self.prompt_scored: dict[int, list[dict[int, float]]] = {}  # seq_id -> this step's prompt logprobs
        self.pooled: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> this step's pooled rows (StepResult.pooled)

    def _graph_config(self, config: GraphConfig) -> GraphConfig:
        if config.enabled and not config.captures_on(self.device.type):
            # On CPU compiling pays back only after thousands of steps (bench/decode_graphs.py): opt-in.
            return attrs.evolve(config, enabled=False, off_reason="decode compile off on cpu (compile_decode=False)")
        return config

    def free(self, seq_ids) -> None:
        """Sequences gave up their KV and state (finished, aborted, preempted): free their
        decode-graph slots (and the graphs that baked them in) and their own-layer states."""
        for seq_id in seq_ids:
            slot = self.slots.free(seq_id)
            if slot is not None:
                self.graphs.free_sequence(slot)
            self.free_own_states(seq_id)
        if self.mtp is not None and seq_ids:
            self.mtp.forget(seq_ids)

    def passes(self, plan: StepPlan) -> list[tuple[list[Chunk], int]]:
        """The forward passes for a plan: ``(chunks, number of leading decode rows)`` each.

        One-token decodes come first, then speculative verifies (several rows each), then prompt
        chunks. A layer that cannot decode several sequences at once gets one pass per decode; one
        that cannot verify several at once gets one pass per verify.
        """
        if plan.empty:  # a plan that only frees
            return []
        decodes = [c for c in plan.decodes if not c.is_verify]
        verifies = [c for c in plan.decodes if c.is_verify]
        if self.per_sequence_verify and len(verifies) > 1 and not self._verify_route_logged:
            cause = next(c for c in self.model.capabilities.disabled() if c.query == "decode_verify_multi_unsupported")
            log.info("%s: verifying each sequence's drafts on its own", cause.describe())
            self._verify_route_logged = True
        if not self.per_sequence_decode and not self.per_sequence_verify:
            return [(decodes + verifies + list(plan.prefills), len(decodes))]
        if self.per_sequence_decode:
            passes = [([d], 1) for d in decodes]
        else:
            passes = [(decodes, len(decodes))] if decodes else []
        rest = list(plan.prefills)
        if self.per_sequence_verify:
            passes += [([v], 0) for v in verifies]
        else:
            rest = verifies + rest
        if rest:
            passes.append((rest, 0))
        return passes

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan: free, copy states, forward every pass, sample and verify."""
        masks = None
        if self.structured_outputs is not None:  # grammar masks computed while the passes run
            masks = self.structured_outputs.start([c for c in plan.chunks if c.samples], background=self.overlap_masks)
        try:
            chunks, logits = self._run_passes(plan)
        except BaseException:
            if masks is not None:  # the mask thread holds the matchers until it is done
                masks.wait()
            raise
        return self._draft_next(plan, self._sample(plan, chunks, logits, masks=masks))

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[list[Chunk], torch.Tensor]:
        """`execute` up to the logits: the part with every collective of a tensor-parallel model."""
        return self._run_passes(plan)

    @torch.inference_mode()
    def sample(self, plan: StepPlan, chunks: list[Chunk], logits: torch.Tensor) -> StepResult:
        """`execute` after `forward` (rank 0 only), up to MTP drafting (`draft`): sample the plain
        rows, verify the drafts; ``kept_rows`` records the rows each verify kept."""
        return self._sample(plan, chunks, logits)

    def mtp_inputs(self, result: StepResult) -> MtpInputs | None:
        """What the MTP head runs on after this step (rank 0 decides: it has the sampled tokens and
        the schedule's asks), for the tensor-parallel workers to run it too; None without MTP."""
        if self.mtp is None:
            return None
        proposer = self.mtp.proposer
        return MtpInputs(self.mtp.head_rows(result.tokens, self.kept_rows), dict(proposer.asked), frozenset(proposer.second_asks))

    @torch.inference_mode()
    def draft(self, plan: StepPlan, result: StepResult, inputs: MtpInputs | None) -> StepResult:
        """`execute` after `sample` (rank 0): the MTP head's step over ``inputs``."""
        return self._draft_next(plan, result, inputs)

    def _draft_next(self, plan: StepPlan, result: StepResult, inputs: MtpInputs | None = None) -> StepResult:
        """MTP drafting: the head runs over the rows this step kept and chains the next drafts."""
        if self.head_works:
            if inputs is None:
                self.mtp.draft(plan, result.tokens, self.kept_rows)
            else:  # (tensor parallel: the rows rank 0 sent the workers)
                self.mtp.draft_rows(plan, inputs.rows)
            if self.mtp.drafted:  # (a step where the head drafted nothing keeps the defaults: no copy of the result)
                result = attrs.evolve(result, head_seconds=self.mtp.head_seconds, head_drafted=self.mtp.drafted,
                                      head_cold=self.mtp.cold)
        return result

    def shutdown(self) -> None:
        """Nothing to end in a single process (the tensor-parallel driver ends its workers)."""

    @torch.inference_mode()
    def execute_as_worker(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's step: the plan (`StepPlan.for_workers`) runs the same passes
        as on rank 0, so every collective lines up; the logits are dropped."""
        self._run_passes(plan)

    @torch.inference_mode()
    def draft_as_worker(self, plan: StepPlan, inputs: MtpInputs) -> None:
        """A tensor-parallel worker's MTP step after `execute_as_worker`: rank 0's head rows over
        this rank's hidden states, with rank 0's asks (its schedule's), so the head's collectives
        line up and this rank's head KV is what rank 0's is; the drafts are rank 0's too."""
        self.mtp.proposer.asked = dict(inputs.asked)
        self.mtp.proposer.second_asks = set(inputs.second_asks)
        self.mtp.draft_rows(plan, inputs.rows)

    def _prepare_states(self, plan: StepPlan) -> None:
        for seq_id, (kept, run) in plan.verified.items():  # the last plan's verifies, as decided
            for i, state in self.own_states.get(seq_id, {}).items():
                self.own_layers[i].keep_verified_rows(state, kept, run)
        for seq_id in plan.fresh_own_states:  # (re)started sequences: fresh own-layer states
            if seq_id in self.own_states:  # a rewind restarts them: graphs that baked the old ones go
                self.free([seq_id])
            self.own_states[seq_id] = {i: layer.alloc_state(seq_id) for i, layer in self.own_layers.items()}
        if self.pool is not None:
            self.pool.apply(plan.state_copies)

    def free_own_states(self, seq_id: int) -> None:
        for i, state in self.own_states.pop(seq_id, {}).items():
            self.own_layers[i].release_state(state)

    def _run_passes(self, plan: StepPlan) -> tuple[list[Chunk], torch.Tensor]:
        """Free and prepare the plan's states, run its passes: the chunks that sample and their
        logits ``[S, vocab]`` (fp32; a verify has 1 + d rows). A pure decode pass replays a
        captured step when the graph runner allows; every other pass runs the model eagerly."""
        if self.thread_governor is not None:
            self.thread_governor.after_step()  # between steps: no op runs while the pool is resized
        self.free(plan.freed)
        self._prepare_states(plan)
        sampling, logits = [], []
        self.head_works = self.mtp is not None and self.mtp.begin(plan)
        self.prompt_scored, self.pooled = {}, {}
        for chunks, num_decodes in self.passes(plan):
            for sub, sub_decodes, inner, after in self._capture_passes(chunks, num_decodes, plan):
                replayed = self._replay(sub, plan) if sub_decodes == len(sub) and not any(inner) else None
                if replayed is not None:
                    rows, out = list(sub), replayed
                else:
                    rows, out = self._forward(sub, sub_decodes, plan, inner)
                for seq_id, slot in after:
                    self.pool.copy(plan.state_slots[seq_id], slot)
                sampling.extend(rows)
                if out is not None:
                    logits.append(out)
        if not logits:
            return [], torch.empty(0, self.model.config.vocab_size)
        return sampling, torch.cat(logits) if len(logits) > 1 else logits[0]

    def _capture_passes(self, chunks: list[Chunk], num_decodes: int, plan: StepPlan):
        """One pass, or several when captures inside chunks cannot be taken in-pass.

        Yields ``(chunks, num_decodes, in-pass captures per chunk, [(seq_id, slot)] to copy after)``.
        A capture after a chunk's last row is a copy after the pass; one in between is handed to
        the layers (in-pass replay-tail capture) or, when some layer cannot honour that, the chunk
        is split there into consecutive passes. (Captures before a chunk's first row are among the
        plan's copy orders.)
        """
        if not plan.captures:
            yield chunks, num_decodes, (), []
            return
        pieces: list[list[tuple[Chunk, tuple, list]]] = []  # per chunk: its sub-chunks in order
        for chunk in chunks:
            planned = plan.captures.get(chunk.seq_id, ())
            inner = [(r, s) for r, s in planned if r < chunk.num_tokens]
            at_end = [(chunk.seq_id, s) for r, s in planned if r == chunk.num_tokens]
            # A verify's per-draft captures are in-pass: speculation is refused at start for any
            # pool layer that cannot capture inside a pass.
            if self.in_pass_capture or chunk.is_verify or not inner:
                pieces.append([(chunk, tuple(inner), at_end)])
                continue
            subs, lo = [], 0
            for row, slot in inner:
                subs.append((chunk.sub(lo, row - lo), (), [(chunk.seq_id, slot)]))
                lo = row
            subs.append((chunk.sub(lo, chunk.num_tokens - lo), (), at_end))
            pieces.append(subs)
        for j in range(max(len(p) for p in pieces)):
            this = [p[j] for p in pieces if len(p) > j]
            decodes = num_decodes if j == 0 else 0
            yield [c for c, _, _ in this], decodes, [i for _, i, _ in this], [a for _, _, after in this for a in after]

    def _forward(self, chunks: list[Chunk], num_decodes: int, plan: StepPlan, inner_captures=()):
        ctx = ForwardContext.for_paged(
            seq_ids=[c.seq_id for c in chunks],
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start + c.num_tokens for c in chunks],
            block_tables=[plan.block_tables[c.seq_id] for c in chunks],
            block_size=self.kv.block_size,
            num_decodes=num_decodes,
            kv_cache=self.kv,
            device=self.device,
        )
        if self.pool is not None:
            captures = tuple(tuple(c) for c in inner_captures) if any(inner_captures) else ()
            ctx.ssm = SsmStep(pool=self.pool, slots=tuple(plan.state_slots[c.seq_id] for c in chunks), captures=captures)
        if self.own_layers:
            ctx.layer_states = {i: tuple(self.own_states[c.seq_id][i] for c in chunks) for i in self.own_layers}
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, ctx)
        if self.head_works:  # the head's input: every row's final hidden state
            self.mtp.record(chunks, hidden, ctx)
        if any(c.prompt_rows[1] for c in chunks):
            self._score_prompt_rows(chunks, hidden)
        self._pool_rows(chunks, hidden)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return [], None
        if not any(chunks[i].is_verify for i in sampling):
            last = ctx.last_token_indices()[sampling]
            return [chunks[i] for i in sampling], self.model.compute_logits(hidden[last])
        # A verify chunk yields logits at every row: its ``1 + len(draft)`` rows, in order.
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))
        rows = [r for i in sampling for r in range(ends[i] - (1 + len(chunks[i].draft) if chunks[i].is_verify else 1), ends[i])]
        # Decodes and verifies alone sample every row: the hidden rows as they are, no gather.
        return [chunks[i] for i in sampling], self.model.compute_logits(hidden if len(rows) == hidden.shape[0] else hidden[rows])

    def _score_prompt_rows(self, chunks, hidden: torch.Tensor) -> None:
        """Prompt logprobs: logits at the prompt rows of the chunks whose requests ask, in blocks of
        at most `PROMPT_LOGITS_ROWS` rows, each reduced to its entries at once. A tensor-parallel
        worker (`ChunkRows`, no sequence) computes the same logits, for their collective, and drops them."""
        base = 0
        for chunk in chunks:
            lo, hi = chunk.prompt_rows
            seq = getattr(chunk, "seq", None)
            for a in range(base + lo, base + hi, PROMPT_LOGITS_ROWS):
                b = min(a + PROMPT_LOGITS_ROWS, base + hi)
                logits = self.model.compute_logits(hidden[a:b])
                if seq is None:
                    continue
                first = chunk.start + (a - base) + 1  # the prompt position row a predicts
                targets = seq.prompt_token_ids[first : first + b - a]
                entries = prompt_logprob_entries(logits, targets, seq.params.prompt_logprobs)
                self.prompt_scored.setdefault(seq.seq_id, []).extend(entries)
            base += chunk.num_tokens

    def _pool_rows(self, chunks, hidden: torch.Tensor) -> None:
        """Embeddings: the rows pooling sequences take from this pass's final hidden states
        ``hidden [T, H]`` (after the final norm), added to ``self.pooled``; a chunk split into
        passes (state captures) adds each piece. Tensor-parallel workers (`ChunkRows`) pool nothing."""
        spans, owners, base = [], [], 0
        for chunk in chunks:
            rows = chunk.pool_rows if getattr(chunk, "seq", None) is not None else None
            if rows is not None:
                spans.append((base + rows[0], base + rows[1], rows[2]))
                owners.append(chunk.seq_id)
            base += chunk.num_tokens
        for seq_id, (n, vector) in zip(owners, pooled_row_sums(hidden, spans)):
            if seq_id in self.pooled:  # a second piece of the same chunk in this step (mean)
                before, total = self.pooled[seq_id]
                n, vector = before + n, total + vector
            self.pooled[seq_id] = (n, vector)

    # -- sampling and verifying ----------------------------------------------------------------

    def _sample(self, plan: StepPlan, chunks: list[Chunk], logits: torch.Tensor, masks=None) -> StepResult:
        """Plain rows are sampled as one batch; each verify's drafts are accepted or rejected.

        First the grammar masks of constrained requests go on their rows, plain and verify rows
        alike, in one call: every path below (greedy argmax, sampling, acceptance) then sees only
        tokens the grammar allows, so a draft it forbids is rejected like any other mismatch. The
        rows a thinking budget forces (`layerzoo.runtime.thinking_budget`) get a one-token mask the same way.
        """
        self.kept_rows = {}
        result = StepResult({}, {}, [], self.prompt_scored, self.pooled)
        if masks is not None:  # started before the forward pass (`execute`)
            apply_token_bitmask(logits, masks.result(chunks))
        elif self.structured_outputs is not None:
            apply_token_bitmask(logits, self.structured_outputs.bitmask(chunks))
        if self.thinking_budgets is not None:  # rows apart from the grammar's (SamplingParams refuses both)
            apply_token_bitmask(logits, self.thinking_budgets.bitmask(chunks))
        if any(c.is_verify for c in chunks) and Sampler.argmax_only([self.sampling_row(c.seq) for c in chunks]):
            return self._sample_greedy(plan, chunks, logits, result)
        plain, plain_rows, row = [], [], 0
        for chunk in chunks:
            if chunk.is_verify:
                target = logits[row : row + 1 + len(chunk.draft)]
                result.tokens[chunk.seq.seq_id] = self._verify(plan, chunk, target, result)
                row += 1 + len(chunk.draft)
            else:
                plain.append(chunk)
                plain_rows.append(row)
                row += 1
        if plain:
            rows = logits if len(plain_rows) == len(logits) else logits[plain_rows]
            try:
                sampled = self.sampler(rows, [self.sampling_row(c.seq) for c in plain])
            except NonFiniteLogitsError as exc:  # name the requests, which the sampler cannot
                raise exc.for_requests([plain[b].seq.request_id for b in exc.rows]) from None
            for chunk, token, logprob, top in zip(plain, sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
                result.tokens[chunk.seq.seq_id] = token
                result.logprobs[chunk.seq.seq_id] = (logprob, top)
        return result

    def _sample_greedy(self, plan: StepPlan, chunks: list[Chunk], logits: torch.Tensor, result: StepResult) -> StepResult:
        """`_sample` for a step whose every row is plain greedy: one argmax pass over all its rows,
        verifies and plain rows alike, instead of a kernel call per verify and one for the rest
        (a verify step of the embedded model's speculative bench runs ~2 verifies beside plain rows)."""
        try:
            choices = self.sampler.greedy(logits)
        except NonFiniteLogitsError as exc:
            owners = [c.seq.request_id for c in chunks for _ in range(1 + len(c.draft))]
            raise exc.for_requests([owners[r] for r in exc.rows]) from None
        row = 0
        for chunk in chunks:
            if chunk.is_verify:
                end = row + 1 + len(chunk.draft)
                result.tokens[chunk.seq.seq_id] = self._keep_verify(plan, chunk, greedy_accept(chunk.draft, choices[row:end]), result)
                row = end
            else:
                result.tokens[chunk.seq.seq_id] = choices[row]
                result.logprobs[chunk.seq.seq_id] = (None, None)
                row += 1
        assert row == len(choices), "a logits row per plain row and per verify row"
        return result

    def sampling_row(self, seq, extra: list[int] | None = None) -> SamplingRow:
        return SamplingRow(
            params=seq.params,
            generator=seq.generator,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids + extra if extra else seq.output_token_ids,
            eos_token_ids=() if seq.params.ignore_eos else self.eos_token_ids,
        )

    def _verify(self, plan: StepPlan, chunk: Chunk, target: torch.Tensor, result: StepResult) -> list[int]:
        """The tokens a verify emits (its accepted drafts and one more; ``target [1 + d, vocab]``).

        Greedy requests accept the longest prefix of drafts equal to the target's choices; sampled
        requests use rejection sampling, which keeps the target distribution exactly. The rows'
        sampling parameters (penalties, min_tokens) see the drafts accepted before them. The
        state after the accepted rows is kept (pool: the per-draft slot; own states: told).
        """
        seq, draft = chunk.seq, list(chunk.draft)
        # The first row decides for all: min_tokens masking only turns off as output grows.
        if Sampler.argmax_only([self.sampling_row(seq)]):  # plain greedy: the argmax
            try:  # the plain rows' one-pass kernel, which also screens for NaN/inf
                choices = self.sampler.greedy(target)
            except NonFiniteLogitsError as exc:
                raise exc.for_requests([seq.request_id] * len(exc.rows)) from None
            accepted, emitted = greedy_accept(draft, choices)
        else:
            probs = target_probs(target, [self.sampling_row(seq, draft[:i]) for i in range(1 + len(draft))])
            if seq.params.greedy:
                accepted, emitted = greedy_accept(draft, probs.argmax(dim=-1).tolist())
            else:
                accepted, emitted = rejection_sample(draft, probs, None, seq.generator)
        return self._keep_verify(plan, chunk, (accepted, emitted), result)

    def _keep_verify(self, plan: StepPlan, chunk: Chunk, outcome: tuple[int, list[int]], result: StepResult) -> list[int]:
        """Record a verify's ``(accepted, emitted)``: keep the state after its kept rows; the emitted tokens."""
        accepted, emitted = outcome
        self.kept_rows[chunk.seq_id] = accepted + 1  # the states keep them with the next plan (`verified`)
        result.verifies.append((len(chunk.draft), accepted))
        return emitted

    # -- decode graphs ---------------------------------------------------------------------------

    def _replay(self, chunks: list[Chunk], plan: StepPlan) -> torch.Tensor | None:
        """A pure decode pass by a captured step: its logits, or None where the graph runner says
        to run it eagerly (it records why)."""
        if self.decode_capture is None:  # graphs off for the run (CPU without compile_decode): no slots
            return self.graphs.eager_while_off()
        slots = [self.slots.slot(c.seq_id) for c in chunks]
        self.decode_capture.stage(
            chunks,
            [plan.block_tables[c.seq_id] for c in chunks],
            [plan.state_slots[c.seq_id] for c in chunks] if self.pool is not None else None,
            {i: tuple(self.own_states[c.seq_id][i] for c in chunks) for i in self.own_layers} or None,
        )
        return self.graphs.replay(slots)
