"""What a verify costs on the machine at hand, measured from the engine's own steps.

The adaptive policy (`layerzoo.speculative.adaptive`) drafts a sequence's k tokens only while the
tokens a verify is expected to emit beyond the plain step's one pay for the time it adds. That time
depends on the CPU (how cheap extra rows of a small batch are, whether a verify leaves the fused
few-row decode path), the model and the batch, so it is measured here rather than assumed: the
engine reports each pure decode step (no prompt chunk in it) with its decoding sequences ``B``, the
draft rows ``D`` it verified, the sequences that verified, and its seconds from its schedule to its
outputs on `step_clock`, less the MTP head's work (its step and chained rows), reported apart with
the sequences it drafted for. Plain numbers only: no torch, no device.

Costs are priced in *sequence-steps*: a sequence's share ``plain[B] / B`` of a plain step of
``B`` decoding sequences (``plain[B]`` a decayed mean of measured seconds), which is what one
emitted token is worth. A step of ``B`` sequences verifying ``D`` drafts in all takes
``plain[B] + excess`` seconds, with ``excess = overhead + per_draft * D`` a decayed least-squares
fit in seconds over the measured verify steps (from a prior that counts as `PRIOR_WEIGHT` steps).
Seconds, because a draft row costs about the same time whatever the batch (the few-row kernels'
time grows with rows, not with sequences; the embedded model on a 2-core EPYC: ~65 us a row, a
plain step of 6 sequences ~1.2 ms): at a batch of 6 a row is a third of a sequence-step, for the
last request of a batch (B = 1) a small share. A fit in sequence-steps (the excess as a share of
the plain step, as before) priced that lone request's drafts as dear as the batch's. The policy
prices one sequence's ``k`` drafts at ``(overhead / verifiers + per_draft * k) / unit``
(``unit = plain[B] / B``; the fixed part is shared by the step's verifiers, ``verifiers`` their
decayed mean count), plus for MTP the head's seconds per sequence it drafts for (`head`; each
shadow guess is a head step too). A batch whose every step verifies gets a plain step now and then
to price them against (`PLAIN_PROBE`). The prior is a per-draft cost measured on other CPUs (a
share of a one-sequence plain step: `prior_step`) and no fixed part, so with the policy's margin
(`adaptive.VERIFY_COST`) an engine drafts as before until it has measured.

Timings are noisy on a shared machine: the decayed means follow the machine within some tens of
steps, a verify step's measured excess is capped (`MAX_EXCESS`: one slowed by another process must
not stop drafting for good) and the fitted parts are never below zero. While no sequence drafts
nothing is measured, so after `RELAX_AFTER` plain steps in a row each plain step relaxes the fit
toward the prior (`RELAX`), and the MTP head's seconds toward none: a fit (or one slow head
step) that once measured verifies as too dear lets a sequence whose drafts would be accepted
verify again after some tens of steps, and measure again.

Shadow guesses of a proposer that costs model work (the MTP head's step, for a sequence that does
not draft) are exploration: they buy the chance of finding text the head gets right. Their cost is
held to a share of the decode time (`EXPLORE_SHARE`): each measured step earns that share of its
time, the guesses the policy asked (`guesses`) spend their share of the step's head work, and the
policy asks for no guess while the balance is below zero (`may_guess`, `guess_wait`). The head's
price relaxes only while the balance could pay to measure it again.
"""

from __future__ import annotations

import math
import time

import attrs


def step_clock(device_type: str):
    """The clock steps are timed with: on CPU the engine thread's CPU time. Other processes on a
    shared machine stretch a step's wall time by whatever they take (wall-time ratios of plain and
    verify steps spread ~1x around their median on a busy 2-core host), not the thread's CPU time;
    and the process's CPU clock adds the other threads' time only at scheduler ticks (with two
    OpenMP threads a 1 ms step read 1 or 5 ms at HZ 250). The engine's thread runs its share of
    every parallel region and waits out the rest at the barrier, so on a quiet machine its CPU time
    is the step's wall time. Elsewhere wall time (the host waits for the device)."""
    return time.thread_time if device_type == "cpu" else time.perf_counter


# The prior, in one-sequence plain steps: a draft row's cost measured on a Xeon and a Zen 5 (their fixed part,
# 0.25, was mostly a margin for the acceptance estimate: the policy keeps it as `VERIFY_COST`). On a
# 2-core EPYC (bench/speculative.py's 6 sequences, CPU time) the fit found ~0.25 per row, no fixed part.
PRIOR_OVERHEAD = 0.0
PRIOR_PER_DRAFT = 0.1
# How many verify steps the prior counts as: the measurements outweigh it within a few steps.
PRIOR_WEIGHT = 3.0
# Decay per observation of the verify fit (about the last 30 verify steps count) and of the plain
# step means (about the last 10 plain steps of a batch size: the machine's speed drifts).
VERIFY_DECAY = 0.97
PLAIN_DECAY = 0.9
# After this many plain steps in a row, each further one moves the verify fit this close to the
# prior (about 20 steps to get most of the way).
RELAX_AFTER = 20
RELAX = 0.95
# The most a verify step's excess counts for, in plain steps of its batch.
MAX_EXCESS = 10.0
# How far (relative, or 0.01 sequence-steps) the costs move before the policy's per-sequence draft
# lengths are recomputed: the decayed plain means move a little every step, and recomputing every
# sequence's length each step cost ~10 us a step inside a step of the embedded model.
COSTS_TOLERANCE = 0.02
# Between verifies, a plain step (no head work, its batch measured before) moves the costs only
# through its batch's decayed plain mean (and, after RELAX_AFTER of them, the relaxing fit): they are
# checked again every this many plain steps in a row. Checking after each cost ~8 us a step, 0.5% of
# a plain step of the random-weight model of bench/speculative.py's low-acceptance workload.
PLAIN_RECHECK = 8
# A batch whose every step verifies never measures the plain step its verifies are priced against
# (six sequences drafting from their first step kept the prior's price for the whole run): the policy
# lets no sequence draft for one step when the batch has no plain mean, or after this many verify
# steps in a row (the mean goes stale as the machine's speed drifts; one plain step in 64 is ~1% of
# what drafting at high acceptance gains).
PLAIN_PROBE = 64
# The share of the decode steps' time that shadow guesses costing model work (the MTP head's step,
# run for sequences that do not draft) may take: each measured step earns this share of its time,
# the guesses the policy asked spend their share of the step's head seconds, and no guess is asked
# while the balance is below zero (it starts at a plain step's worth, and no more is saved up).
# Guesses that came true in part without making a sequence draft (a head right about half the time)
# came back every few tokens after their waits: six requests of the rewrite workload, MTP k <= 3,
# ran a head step in 24 of 128 steps (~0.8 ms each against a 1.0 ms plain step), 0.79x plain; 0.88x
# at a share of 3%. At 1% (a guess of six sequences every ~100 steps) the low-acceptance workload
# at one request ran 0.967x plain against 0.951x at 2% and 0.935x at 3%, the rewrite one at six
# 0.94x against 0.89x and 0.88x (one process, engines in turns).
EXPLORE_SHARE = 0.01


def _prior_sums() -> list[float]:
    """The prior's sums at weight 1 (x in sequence-steps): two pseudo-points (D = 1 and D = 4) on
    the prior line, PRIOR_WEIGHT in all."""
    sums = [0.0] * 5
    for d in (1.0, 4.0):
        w, x = PRIOR_WEIGHT / 2, PRIOR_OVERHEAD + PRIOR_PER_DRAFT * d
        for i, v in enumerate((w, w * d, w * d * d, w * x, w * x * d)):
            sums[i] += v
    return sums


_PRIOR_SUMS = _prior_sums()


@attrs.define
class StepCosts:
    """The measured cost of verifying, per the module docstring; `costs` is what the policy asks."""

    plain: dict[int, float] = attrs.field(factory=dict)  # B -> decayed mean seconds of a plain step
    batch: int = 1  # decoding sequences in the latest step: the batch the next drafts are priced for
    verifiers: float = 1.0  # decayed mean count of verifying sequences in a verify step
    # Decayed sums of the MTP head's seconds per sequence it drafted for and of their weight, and
    # the weight of its prior (no cost), which comes back while the head does not run (as the fit's does).
    _head_sums: tuple[float, float] = (0.0, 0.0)
    _head_prior: float = 0.0
    # Decayed sums of the measured excess = overhead + per_draft * D, in seconds (weights w, w*D,
    # w*D^2, w*x, w*x*D), and the weight of the prior's (in sequence-steps: converted when priced).
    _sums: list[float] = attrs.field(factory=lambda: [0.0] * 5)
    _prior_weight: float = 1.0
    version: int = 0  # bumped when the costs move (`COSTS_TOLERANCE`): the policy's cached draft lengths go stale
    plain_run: int = 0  # plain steps since the last verify step
    verify_run: int = 0  # verify steps since the last plain step
    _costs_at: tuple[int, tuple[float, float]] | None = None  # (version, costs()) of the last ask
    # Seconds shadow guesses may still spend (`EXPLORE_SHARE`; below 0: none now), from a plain
    # step's worth; and the guesses the policy asked of the head since the last measured step.
    explore: float = math.inf
    guesses: int = 0
    # Relaxing steps (`RELAX`) of the fit and of the head's price counted but not applied yet: the
    # plain steps between verifies only count them, and `_settle` applies them before the sums are read.
    _relax_due: int = 0
    _head_relax_due: int = 0

    def observe(self, batch: int, drafts: int, verifiers: int, seconds: float,
                head_seconds: float = 0.0, head_drafted: int = 0, head_cold: bool = False) -> None:
        """One pure decode step: ``batch`` decoding sequences, ``drafts`` draft rows verified by
        ``verifiers`` of them, ``seconds`` for the whole step of which ``head_seconds`` went to the
        MTP head's step and chained rows, drafting for ``head_drafted`` sequences (shadow guesses
        included: a plain step's head work is theirs). ``head_cold``: the head ran a shape for the
        first time (`MtpDrafter.cold`), a one-time cost: the step counts without it, and its
        guesses spend the head's usual price (a sequence-step's before any was measured)."""
        if batch <= 0 or seconds <= 0:
            return
        plain = self.plain.get(batch) if not drafts and not head_drafted and batch == self.batch else None
        if plain is not None and self._costs_at is not None:
            # A sequence that rests takes most steps this way: a plain step of the batch measured
            # last, no head work. What the general path does, in fewer operations: the Python after
            # a ~0.5 ms forward runs from cold caches, and the engine's `_time_step` took ~6 us of
            # each such step (1.3 us alone), ~3 us this way (0.75 us alone).
            self.guesses = 0  # (`_explore` without head work)
            self.explore = min(self.explore + EXPLORE_SHARE * seconds, plain)
            self._plain_step(batch, seconds, 0)
            if self.plain_run % PLAIN_RECHECK == 0:
                self._recheck()
            return
        if head_cold and head_drafted:
            seconds -= head_seconds
            if seconds <= 0:
                return
            price = self.head if self.head is not None else (self.unit(batch) or seconds / batch)
            self._explore(batch, seconds + price * head_drafted, price * head_drafted, head_drafted)
            head_seconds, head_drafted = 0.0, 0
        else:
            self._explore(batch, seconds, head_seconds, head_drafted)
        self._observe(batch, drafts, verifiers, seconds, head_seconds, head_drafted)
        self._recheck()

    def _recheck(self) -> None:
        """A new `version` when the costs moved by more than `COSTS_TOLERANCE` since it was last bumped."""
        costs = self._costs()
        before = self._costs_at[1] if self._costs_at is not None else None
        if before is None or any(abs(a - b) > COSTS_TOLERANCE * max(abs(b), 0.01) for a, b in zip(costs, before)):
            self.version += 1
            self._costs_at = (self.version, costs)

    def _observe(self, batch: int, drafts: int, verifiers: int, seconds: float, head_seconds: float, head_drafted: int) -> None:
        self._settle()
        self.batch = batch
        step = max(seconds - head_seconds, 0.0)
        if head_drafted:
            total, weight = self._head_sums
            self._head_sums = (PLAIN_DECAY * total + head_seconds / head_drafted, PLAIN_DECAY * weight + 1.0)
            self._head_prior *= PLAIN_DECAY
        if not drafts:
            self._plain_step(batch, step, head_drafted)
            return
        self.plain_run = 0
        self.verify_run += 1
        plain = self.plain.get(batch)
        if plain is None:  # nothing to compare with yet (every step of this batch verified)
            return
        excess = min(step - plain, MAX_EXCESS * plain)  # seconds (noise may make it < 0)
        self.verifiers = VERIFY_DECAY * self.verifiers + (1 - VERIFY_DECAY) * verifiers
        d = float(drafts)
        self._sums = [VERIFY_DECAY * v for v in self._sums]
        self._prior_weight *= VERIFY_DECAY
        for i, v in enumerate((1.0, d, d * d, excess, excess * d)):
            self._sums[i] += v

    def _plain_step(self, batch: int, step: float, head_drafted: int) -> None:
        """A step that verified nothing, ``step`` seconds without the head's work: the batch's plain
        mean, and the relaxing steps it counts once plain steps run long (`_settle` applies them)."""
        self.plain[batch] = self._decay(self.plain.get(batch), step, PLAIN_DECAY)
        self.plain_run += 1
        self.verify_run = 0
        if self.plain_run > RELAX_AFTER:  # the measurements fade; the prior's weight comes back
            self._relax_due += 1
            # (shadow guesses run the head on plain steps: those measure it; and the price comes
            # down only while the guesses' share of time could pay to measure it again: below,
            # six sequences each asked for drafts whenever it had, and the head ran for nothing)
            self._head_relax_due += not head_drafted and self.explore >= 0

    def _explore(self, batch: int, seconds: float, head_seconds: float, head_drafted: int) -> None:
        """Earn `EXPLORE_SHARE` of the step's own time, spend the guesses' share of its head work
        (the sequences it ran for that only guessed); hold at most a plain step's worth."""
        earned = EXPLORE_SHARE * max(seconds - head_seconds, 0.0)
        spent = head_seconds * min(self.guesses, head_drafted) / head_drafted if head_drafted else 0.0
        self.guesses = 0
        self.explore = min(self.explore + earned - spent, self.plain.get(batch, seconds))

    def may_guess(self) -> bool:
        """Whether a shadow guess that costs model work may be asked now (`EXPLORE_SHARE`)."""
        return self.explore >= 0.0

    def guess_wait(self) -> int:
        """Plain steps of the latest batch until `may_guess` (0: now)."""
        if self.explore >= 0.0:
            return 0
        step = self.plain.get(self.batch)
        if step is None:  # (a batch not measured plain yet: ask again after a step)
            return 1
        return math.ceil(-self.explore / (EXPLORE_SHARE * step)) if EXPLORE_SHARE > 0 else 1 << 30

    def wants_plain(self) -> bool:
        """Whether the next step should verify nothing (`PLAIN_PROBE`): the latest batch has no plain
        mean to price its verifies against, or it is `PLAIN_PROBE` verify steps old."""
        return self.verify_run > 0 and (self.batch not in self.plain or self.verify_run >= PLAIN_PROBE)

    @property
    def head(self) -> float | None:
        """Seconds of the MTP head's work per sequence it drafts for (a decayed mean, drawn toward no
        cost while the head does not run); None before any was measured (no head, or none yet)."""
        self._settle()
        total, weight = self._head_sums
        return None if not weight else total / (weight + self._head_prior)

    def _settle(self) -> None:
        """Apply the relaxing steps counted since the last call: ``n`` of them scale the sums by
        ``RELAX ** n`` and bring the prior's weight that far back toward 1 (each is the same affine step)."""
        if self._relax_due:
            f = RELAX ** self._relax_due
            self._sums = [f * v for v in self._sums]
            self._prior_weight = f * self._prior_weight + (1 - f)
            self._relax_due = 0
        if self._head_relax_due:
            f = RELAX ** self._head_relax_due
            self._head_sums = (f * self._head_sums[0], f * self._head_sums[1])
            self._head_prior = f * self._head_prior + (1 - f)
            self._head_relax_due = 0

    @staticmethod
    def _decay(mean: float | None, value: float, decay: float) -> float:
        return value if mean is None else decay * mean + (1 - decay) * value

    def prior_step(self) -> float:
        """Seconds the prior's units stand for: the prior is a share of a one-sequence plain step
        (where it was measured), and a draft row costs about the same time whatever the batch; the
        plain step of the smallest batch measured stands in for it (a small model's step costs about
        the same at any few rows; 1.0 before any). At the batch's sequence-step instead, a batch of
        six priced a row at a sixth of its cost (the embedded model on a 2-core EPYC: ~18 us against
        ~65 us measured), so once the fit relaxed back to the prior the MTP head's guesses looked
        worth their head steps there, and drafting did not pay."""
        return self.plain[min(self.plain)] if self.plain else 1.0

    def unit(self, batch: int | None = None) -> float | None:
        """Seconds of one sequence-step at ``batch`` (default: the latest): its share of a plain
        step, ``plain[B] / B``; a batch not measured plain takes the plain step of the nearest one
        that was (a small model's step costs about the same at any few rows). None before any."""
        batch = self.batch if batch is None else batch
        plain = self.plain.get(batch)
        if plain is None and self.plain:
            plain = self.plain[min(self.plain, key=lambda b: (abs(b - batch), b))]
        return None if plain is None else plain / batch

    def fit(self) -> tuple[float, float]:
        """``(overhead, per_draft)``: a verify step's excess over a plain step, in sequence-steps
        of the latest batch, as a fixed part and a part per draft row (both >= 0). The fit runs in
        seconds (a draft row costs about the same time at any batch, which makes it a larger share
        of a sequence-step the more sequences share the step); the prior joins it in seconds of
        `prior_step`."""
        self._settle()
        unit, step = self.unit() or 1.0, self.prior_step()
        pw = self._prior_weight
        w, sd, sdd, sx, sxd = (m + pw * p * (step if i >= 3 else 1.0) for i, (m, p) in enumerate(zip(self._sums, _PRIOR_SUMS)))
        det = w * sdd - sd * sd
        if det <= 1e-9 * max(w * sdd, 1e-12):  # every verify had the same D: all of it per draft row
            return 0.0, max(sx / sd if sd else PRIOR_PER_DRAFT * step, 0.0) / unit
        per_draft = (w * sxd - sd * sx) / det
        overhead = (sx - per_draft * sd) / w
        if per_draft < 0:  # more rows measured cheaper: noise; all of it fixed
            return max(sx / w, 0.0) / unit, 0.0
        if overhead < 0:  # (through the origin: its slope may be < 0 too)
            return 0.0, max(sxd / sdd, 0.0) / unit
        return overhead / unit, per_draft / unit

    def costs(self) -> tuple[float, float]:
        """``(verify_cost, draft_cost)`` of one sequence's verify in its sequence-steps (its share
        of a plain step of the current batch): the fixed part, and the part per draft. Computed
        once per observation (every sequence of a step asks), and kept (no new `version`) while
        it moves by less than `COSTS_TOLERANCE`: every sequence's draft length stays cached."""
        if self._costs_at is None:
            self._costs_at = (self.version, self._costs())
        return self._costs_at[1]

    def _costs(self) -> tuple[float, float]:
        overhead, per_draft = self.fit()
        verify = overhead / max(self.verifiers, 1.0)
        unit = self.unit()
        if self.head and unit:  # the MTP head's work, paid by each drafting sequence
            verify += self.head / unit
        return verify, per_draft
