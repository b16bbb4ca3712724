"""The runner's half of MTP drafting (`layerzoo.speculative.mtp` explains the whole).

Per step: `begin` forgets the last step's rows and says whether the head has work in the step
(most steps of sequences that rest have none: the runner then leaves the head alone); `record`
keeps each forward pass's chunks with their final hidden states; after sampling and verifying,
`draft` runs the model's MTP head over
the rows kept by each sequence it drafts for and by every prompt (row ``p`` fed the token at
``p + 1`` — the prompt's next token, the sampled token, or a verify's emitted ones — and the
target's hidden at ``p``), which writes the head's KV at those positions of the paged pool, then
chains one row at a time from each drafting sequence's last row, feeding back its own draft and
hidden, while its block table covers the position. The rows of a sequence it does not draft for
wait (`PENDING_ROWS` at most) and run before its next ones. Drafts are greedy (the head's argmax):
a verify treats them as a point proposal, so sampled requests stay exact under rejection sampling.
The head step is `CausalLM.mtp_draft` and the chained rows `CausalLM.mtp_chain`: on CPU, where the
head allows, one C++ call each (`layerzoo.layers.fused_mtp`), in which the rows that do not draft
run only the block's key/value part; elsewhere `mtp_step` op by op and the chain a row at a time.
"""

from __future__ import annotations

import collections
import itertools

import attrs
import torch

from layerzoo.layers.context import ForwardContext
from layerzoo.layers.model import CausalLM
from layerzoo.speculative.mtp import MtpProposer
from layerzoo.speculative.step_cost import step_clock


# Rows ``first .. end - 1`` of a pass's final hidden states ``[T, H]``: sliced only when the head
# runs them, so a sequence whose rows wait (most steps, once it stopped drafting) costs no tensor
# view per step.
Piece = tuple[torch.Tensor, int, int]


@attrs.define
class _Rows:
    """One sequence's head rows of this step: positions ``start .. start + len(next_ids) - 1``."""

    seq_id: int
    start: int
    next_ids: list[int]
    hidden: list[Piece]  # its target hidden states, in order
    drafts: bool  # its last row yields a token that drafting follows


@attrs.frozen
class HeadRows:
    """One sequence's head rows of a step as plain data: what rank 0 decides (it alone has the
    sampled tokens and the sequences) and a tensor-parallel worker gets, to run the same head rows
    over its own hidden states. ``pieces``: ``(index of a recorded piece, rows of it)``, in order."""

    seq_id: int
    start: int
    next_ids: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    drafts: bool


def _cut(rows: _Rows, lo: int, hi: int) -> _Rows:
    """Rows ``lo .. hi - 1`` of ``rows`` (indices from its first row)."""
    hidden, base = [], 0
    for states, first, end in rows.hidden:
        a, b = max(lo - base, 0), min(hi - base, end - first)
        if a < b:
            hidden.append((states, first + a, first + b))
        base += end - first
    return _Rows(rows.seq_id, rows.start + lo, rows.next_ids[lo:hi], hidden, rows.drafts)


def _stacked(groups: list[_Rows]) -> torch.Tensor:
    """The groups' hidden states, in order: ``[sum of their rows, H]``."""
    return torch.cat([states[first:end] for g in groups for states, first, end in g.hidden])


def _joined(pieces: list[_Rows]) -> _Rows:
    """Contiguous rows of one sequence, as one."""
    if len(pieces) == 1:
        return pieces[0]
    first, last = pieces[0], pieces[-1]
    next_ids, hidden = [t for p in pieces for t in p.next_ids], [h for p in pieces for h in p.hidden]
    return _Rows(first.seq_id, first.start, next_ids, hidden, last.drafts)


class _Waiting:
    """One sequence's rows the head has not run yet: contiguous, the last ``limit`` (whole steps)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pieces: collections.deque[_Rows] = collections.deque()
        self.rows = 0

    def end(self) -> int:
        last = self.pieces[-1]
        return last.start + len(last.next_ids)

    def fit(self, start: int) -> None:
        """Keep the rows before ``start`` (a rewind drops those past it), none unless they reach it."""
        while self.pieces and self.pieces[-1].start >= start:
            self.rows -= len(self.pieces.pop().next_ids)
        if self.pieces and self.end() > start:
            last = self.pieces.pop()
            self.rows -= len(last.next_ids) - (start - last.start)
            self.pieces.append(_cut(last, 0, start - last.start))
        if self.pieces and self.end() != start:  # a gap: these would not lead up to the new rows
            self.pieces.clear()
            self.rows = 0

    def add(self, rows: _Rows) -> None:
        if self.pieces and self.end() != rows.start:  # (contiguous, the usual decode step: nothing to fit)
            self.fit(rows.start)
        self.pieces.append(rows)
        self.rows += len(rows.next_ids)
        while self.rows - len(self.pieces[0].next_ids) >= self.limit:  # older rows go: their KV stays unwritten
            self.rows -= len(self.pieces.popleft().next_ids)

    def before(self, rows: _Rows) -> _Rows:
        """``rows`` with the waiting rows that lead up to them in front."""
        self.fit(rows.start)
        return _joined([*self.pieces, rows])


class MtpDrafter:
    # The most rows that wait per sequence the head does not draft for; older ones are dropped
    # (the head's KV there stays unwritten: drafts may suffer, outputs never). A drafting sequence
    # pauses for a step or two (a shadow guess scored between verifies); each shadow guess of the
    # adaptive policy (up to `MtpProposer.SHADOW_MAX_GAP` tokens apart) runs the waiting rows with
    # its own, so they cost it head rows: with 8 the low-acceptance workload's guesses ran 54 rows
    # each (6 sequences) past the fused few-row path, 2.4 ms against 1.2 ms with 4.
    PENDING_ROWS = 2

    def __init__(self, model, kv, proposer: MtpProposer, num_speculative_tokens: int):
        assert model.mtp is not None
        self.model, self.kv, self.proposer = model, kv, proposer
        self.k = num_speculative_tokens
        self.device = kv.device
        # Each recorded chunk with its pass's hidden states and its first row there (built from
        # `_passes` when the head has rows to find: none on a step where every sequence rests).
        self._pieces: list[tuple[object, torch.Tensor, int]] | None = None
        # The forward passes' contexts and hidden states, in order: a head step over exactly one
        # pass's rows reuses its context (positions, slots, tables, row queries, RoPE).
        self._passes: list[tuple[list, torch.Tensor, ForwardContext | None]] = []
        # The last step's head work (its step over the kept rows and the chained rows): seconds on
        # the engine's step clock (the drafts' .tolist() waits for the device) and the sequences it
        # drafted for; the engine's cost model reads them.
        self.head_seconds, self.drafted = 0.0, 0
        self.clock = step_clock(self.device.type)
        self.waiting: dict[int, _Waiting] = {}  # seq_id -> its rows the head has not run yet
        # The shapes of the head's calls run so far, and whether this step's head work ran one for
        # the first time (`cold`): the op-by-op path pays once per shape (on the AVX2 build of the
        # embedded model a head step at a new row count took 2.0-2.9 ms against ~0.4 ms after), a
        # cost the engine's cost model must not take for what each guess or draft costs.
        self._shapes: set[tuple[str, int, int]] = set()
        self.cold = False

    def begin(self, plan) -> bool:
        """Start a step: forget the last one's rows and head work. Returns whether the head has
        work in ``plan``: a prompt, an ask of the schedule, or a decode row it keeps (`_rests`).
        Without, the runner records no hidden states and does not call `draft` (what the step
        would have cost it: ~5 us of Python after the forward, from cold caches)."""
        self._pieces, self._passes = None, []
        self.head_seconds, self.drafted, self.cold = 0.0, 0, False
        return bool(plan.prefills) or bool(self.proposer.asked) or not self._all_resting(plan)

    def record(self, chunks, hidden: torch.Tensor, ctx: ForwardContext | None = None) -> None:
        """A forward pass's chunks, its final hidden states ``[T, H]`` (rows in chunk order) and,
        where the head may reuse it, its context."""
        self._passes.append((list(chunks), hidden, ctx))

    def _recorded(self) -> list[tuple[object, torch.Tensor, int]]:
        """The recorded chunks in order, each with its pass's hidden states and its first row there
        (its rows sliced only once kept)."""
        if self._pieces is None:
            self._pieces = []
            for chunks, hidden, _ in self._passes:
                base = 0
                for chunk in chunks:
                    self._pieces.append((chunk, hidden, base))
                    base += chunk.num_tokens
        return self._pieces

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.proposer.forget(seq_id)
            self.waiting.pop(seq_id, None)

    def draft(self, plan, tokens: dict, kept_rows: dict[int, int]) -> None:
        """Run the head over this step's kept rows of the sequences it drafts for (after the rows
        they left waiting) and of prompts, then chain; store each drafting sequence's drafts. The
        other sequences' rows wait. The runner calls it in inference mode (entering it again cost
        7 us a step), on steps where `begin` found work."""
        self.draft_rows(plan, self.head_rows(tokens, kept_rows))

    def _all_resting(self, plan) -> bool:
        """Whether every chunk of ``plan`` is a decode row `head_rows` keeps none of: the head has
        nothing to run or keep."""
        return all(not c.draft and self._rests(c.seq_id, c.start) for c in plan.decodes)

    def _rests(self, seq_id: int, position: int) -> bool:
        """Whether a decode row at ``position`` is too far before the policy's next guess for
        ``seq_id`` to run with it (`MtpProposer.rest`): the head need not keep it."""
        return position + self.PENDING_ROWS + 2 < self.proposer.resting.get(seq_id, 0)

    def draft_rows(self, plan, rows: list[HeadRows]) -> None:
        """`draft` from this step's head rows as `head_rows` gave them (a tensor-parallel worker
        gets rank 0's, with the asks of rank 0's schedule in its proposer)."""
        groups, prompts = [], {c.seq_id for c in plan.prefills}
        for g in self._attach(rows):
            if g.seq_id in prompts or (g.drafts and self.proposer.drafts_now(g.seq_id)):
                waiting = self.waiting.pop(g.seq_id, None)
                groups.append(g if waiting is None else waiting.before(g))
            else:
                self._wait(g)
        self._pieces = None
        try:
            if groups:
                started = self.clock()
                self._reusable = self._pass_context(groups)
                self.drafted = self._draft(plan, groups)
                self.head_seconds = self.clock() - started
        finally:
            self._passes = []
            self.proposer.step_done()

    def _wait(self, rows: _Rows) -> None:
        """Keep ``rows`` for the head's next step of their sequence (the last `PENDING_ROWS`)."""
        waiting = self.waiting.get(rows.seq_id)
        if waiting is None:
            waiting = self.waiting[rows.seq_id] = _Waiting(self.PENDING_ROWS)
        waiting.add(rows)

    def _draft(self, plan, groups: list[_Rows]) -> int:
        """The head's step over ``groups`` and the chained rows; returns how many sequences it drafted for."""
        tables = [plan.block_tables[g.seq_id] for g in groups]
        lens = [len(g.next_ids) for g in groups]
        ids = torch.tensor([t for g in groups for t in g.next_ids], dtype=torch.long, device=self.device)
        if self._reusable is not None:  # the pass's rows (or a prefix of each chunk's): from its context
            ctx, hidden = self._reusable
            previous = hidden if ctx.num_tokens == hidden.shape[0] else _stacked(groups)
        else:
            ctx = self._context([g.seq_id for g in groups], lens, [g.start + n for g, n in zip(groups, lens)], tables)
            previous = _stacked(groups)
        # The sequences that draft now (asked for drafts this step, or new to drafting); a prompt
        # chunk's other rows only write the head's KV.
        live = [i for i, g in enumerate(groups) if g.drafts and self.proposer.drafts_now(g.seq_id)]
        last = list(itertools.accumulate(lens))  # one past each sequence's last row
        # The rows through the whole block and the LM head: each drafting sequence's last, and the
        # one before where its second token was asked (`MtpProposer.ask_second`: a row that waited).
        asked_second = {i for i in live if lens[i] > 1 and groups[i].seq_id in self.proposer.second_asks}
        full, at = [], []  # those rows; where each drafting sequence's last is among them
        for i in live:
            if i in asked_second:
                full.append(last[i] - 2)
            at.append(len(full))
            full.append(last[i] - 1)
        self._shape("step", len(ids), len(full))
        carry, tokens = self.model.mtp_draft(ids, previous, ctx, torch.tensor(full, dtype=torch.long, device=self.device))
        first = ctx  # its block tables (a row per group) serve the chained rows
        if not live:
            return 0
        out = tokens.tolist()  # (waits for the device once)
        drafted = [[out[row]] for row in at]
        second = {j: out[row - 1] for j, (i, row) in enumerate(zip(live, at)) if i in asked_second}  # j (of live) -> its guess
        if asked_second:  # the chained rows follow each drafting sequence's last row alone
            pick = torch.tensor(at, dtype=torch.long, device=self.device)
            carry, tokens = carry.index_select(0, pick), tokens.index_select(0, pick)
        ends = [groups[i].start + lens[i] for i in live]  # each sequence's length after this step, less its new token
        # Chained row `step` sits at position end + step - 1: only where the table has its block (the
        # scheduler reserves them when blocks are free) and the sequence was asked for more drafts;
        # a draft that stops stays short.
        block = self.kv.block_size
        counts = []  # drafts per drafting sequence, its first included
        for j, i in enumerate(live):
            wanted, table, n = self.proposer.wanted(groups[i].seq_id), len(tables[i]), 1
            while n < min(wanted, self.k) and (ends[j] + n - 1) // block < table:
                n += 1
            counts.append(n)
        if any(n > 1 for n in counts):
            self._chain(first, live, ends, counts, tokens, carry, drafted)
        for j, i in enumerate(live):
            g = groups[i]
            self.proposer.store(g.seq_id, g.start + lens[i] + 1, drafted[j])
            if j in second:
                self.proposer.store_second(g.seq_id, g.start + lens[i] + 1, second[j])
        return len(live)

    def _chain(self, first: ForwardContext, live: list[int], ends: list[int], counts: list[int], tokens: torch.Tensor,
               carry: torch.Tensor, drafted: list[list[int]]) -> None:
        """The chained rows: ``counts[j] - 1`` more drafts for drafting sequence j (group ``live[j]``
        of ``first``), appended to ``drafted[j]``; in one call where the model's head takes it."""
        go = [j for j, n in enumerate(counts) if n > 1]
        long = dict(dtype=torch.long, device=self.device)
        tables = first.block_tables
        if len(live) != tables.shape[0]:
            tables = tables.index_select(0, torch.tensor(live, dtype=torch.long, device=tables.device))
        self._shape("chain", len(live), max(counts))
        chain = self.model.mtp_chain(tokens, carry, torch.tensor(counts, **long), torch.tensor(ends, **long), tables, self.kv)
        if chain is not None:
            rows = chain.tolist()
            for j in go:
                drafted[j] += rows[j][: counts[j] - 1]
            return
        for step in range(1, max(counts)):
            go = [j for j in go if step < counts[j]]
            ctx = self._chain_context(first, [live[j] for j in go], [ends[j] + step - 1 for j in go])
            ids = torch.tensor([drafted[j][-1] for j in go], **long)
            self._shape("step", len(go), len(go))
            out, tokens = self.model.mtp_draft(ids, carry[go], ctx, torch.arange(len(go), device=self.device))
            for j, token in zip(go, tokens.tolist()):
                drafted[j].append(token)
            carry = carry.clone()
            carry[go] = out

    def _shape(self, kind: str, rows: int, drafting: int) -> None:
        """Note a head call over ``rows`` rows drafting for ``drafting`` sequences (`cold`)."""
        key = (kind, rows, drafting)
        if key not in self._shapes:
            self._shapes.add(key)
            self.cold = True

    def _attach(self, rows: list[HeadRows]) -> list[_Rows]:
        """``rows`` with this rank's hidden states of their recorded pieces."""
        pieces = self._recorded()
        return [
            _Rows(r.seq_id, r.start, list(r.next_ids), [(pieces[i][1], pieces[i][2], pieces[i][2] + n) for i, n in r.pieces], r.drafts)
            for r in rows
        ]

    def head_rows(self, tokens: dict, kept_rows: dict[int, int]) -> list[HeadRows]:
        """This step's head rows per sequence (the pieces of one chunk split into passes joined)."""
        rows: list[HeadRows] = []
        where: dict[int, int] = {}  # seq_id -> its entry in rows
        for index, (chunk, _, _) in enumerate(self._recorded()):
            seq = chunk.seq
            if seq.pooled is not None:  # an embedding request: nothing to draft
                continue
            samples, n = chunk.samples, chunk.num_tokens
            if n == 1 and samples and self._rests(seq.seq_id, chunk.start):
                continue  # a decode row too far before the policy's next guess to run with it
            if chunk.draft:  # a verify: the accepted drafts and the token after them
                n = kept_rows.get(seq.seq_id, n)
                next_ids = list(tokens[seq.seq_id])[:n]
            elif n == 1 and samples:  # a decode: the token it sampled (no list of the sequence)
                next_ids = [tokens[seq.seq_id]]
            else:
                end = chunk.start + n
                next_ids = seq.token_ids[chunk.start + 1 : end + 1] if not samples else seq.token_ids[chunk.start + 1 : end] + [tokens[seq.seq_id]]
            if len(next_ids) < n:  # a verify whose emitted tokens were cut short (should not happen)
                n = len(next_ids)
            # Requests that want logprobs never verify drafts (the scheduler's rule): their rows only
            # write the head's KV.
            drafts = samples and seq.params.logprobs is None
            at = where.setdefault(seq.seq_id, len(rows))
            if at == len(rows):
                rows.append(HeadRows(seq.seq_id, chunk.start, tuple(next_ids), ((index, n),), drafts))
            else:  # the next piece of a chunk split at a state capture
                first = rows[at]
                assert first.start + len(first.next_ids) == chunk.start, (first, chunk)
                rows[at] = HeadRows(seq.seq_id, first.start, first.next_ids + tuple(next_ids), first.pieces + ((index, n),), drafts)
        return [r for r in rows if r.next_ids]

    def _pass_context(self, groups: list[_Rows]):
        """``(ctx, hidden)`` for the head from the step's one forward pass when the head's rows are
        its rows or a prefix of each of its chunks (verifies that rejected drafts), no chunk left
        out: the head runs at the same positions with the same tables. Every row kept: the
        target's context serves as is (its slots, row queries and RoPE); otherwise its kept rows
        are picked out of it. None otherwise: several passes (prompts split, captures), per-sequence
        states, a graph replay's fixed-shape context, or rows that differ."""
        if len(self._passes) != 1:
            return None
        chunks, hidden, ctx = self._passes[0]
        if ctx is None or ctx.shape_static or ctx.ssm is not None or ctx.layer_states is not None:
            return None
        lens, left = [], iter(groups)  # per chunk the head's rows of it (0: its sequence waits)
        g = next(left, None)
        for c in chunks:
            if g is None or g.seq_id != c.seq_id:
                lens.append(0)
                continue
            if g.start != c.start or not 0 < len(g.next_ids) <= c.num_tokens:
                return None
            lens.append(len(g.next_ids))
            g = next(left, None)
        if g is not None:  # rows of another pass
            return None
        if ctx.cos_sin is not None and type(self.model).forward is not CausalLM.forward:
            ctx.cos_sin = None  # a plugin's forward may rotate otherwise: the head takes the model's rotary
        if all(n == c.num_tokens for n, c in zip(lens, chunks)):
            return ctx, hidden
        return self._kept_rows(ctx, chunks, lens), hidden

    def _kept_rows(self, ctx: ForwardContext, chunks, lens: list[int]) -> ForwardContext:
        """``ctx`` cut to the first ``lens[i]`` rows of each chunk, the chunks with none left out
        (as `_context` would build it)."""
        keep, base = [], 0
        for chunk, n in zip(chunks, lens):
            keep.extend(range(base, base + n))
            base += chunk.num_tokens
        device = ctx.positions.device
        rows = torch.tensor(keep, dtype=torch.long, device=device)
        cos_sin = None if ctx.cos_sin is None else (ctx.cos_sin[0][rows], ctx.cos_sin[1][rows])
        kept = [i for i, n in enumerate(lens) if n]
        context_lens = tuple(chunks[i].start + lens[i] for i in kept)
        query_lens = tuple(lens[i] for i in kept)
        if len(kept) == len(chunks):  # every sequence: its tables as they are
            tables, token_seqs, seq_ids = ctx.block_tables, ctx.token_seqs[rows], ctx.seq_ids
        else:
            tables = ctx.block_tables.index_select(0, torch.tensor(kept, dtype=torch.long, device=ctx.block_tables.device))
            token_seqs = torch.tensor([j for j, n in enumerate(query_lens) for _ in range(n)], dtype=torch.long, device=device)
            seq_ids = tuple(ctx.seq_ids[i] for i in kept)
        return ForwardContext(
            positions=ctx.positions[rows], seq_ids=seq_ids, query_lens=query_lens, context_lens=context_lens,
            num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
            slot_mapping=ctx.slot_mapping[rows], block_tables=tables,
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=device),
            token_seqs=token_seqs, kv_cache=ctx.kv_cache, cos_sin=cos_sin,
        )

    def _chain_context(self, ctx: ForwardContext, seqs: list[int], positions: list[int]) -> ForwardContext:
        """A decode step of one row for each of ``seqs`` (indices of ``ctx``'s sequences) at
        ``positions``, on ``ctx``'s block tables (as `_context` would build it, without
        rebuilding the tables from lists)."""
        device, block = ctx.positions.device, self.kv.block_size
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        tables = ctx.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=ctx.block_tables.device))
        rows = torch.arange(len(seqs), device=device)
        lens = tuple(p + 1 for p in positions)
        return ForwardContext(
            positions=pos, seq_ids=tuple(ctx.seq_ids[i] for i in seqs), query_lens=(1,) * len(seqs), context_lens=lens,
            num_decodes=len(seqs), slot_mapping=tables[rows, pos // block] * block + pos % block, block_tables=tables,
            context_lens_tensor=torch.tensor(lens, dtype=torch.long, device=device), token_seqs=rows, kv_cache=ctx.kv_cache,
        )

    def _context(self, seq_ids, query_lens, context_lens, tables) -> ForwardContext:
        """The head's rows as the target's would be: leading one-row sequences are decodes."""
        decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        return ForwardContext.for_paged(
            seq_ids=seq_ids, query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            block_size=self.kv.block_size, num_decodes=decodes, kv_cache=self.kv, device=self.device,
        )
