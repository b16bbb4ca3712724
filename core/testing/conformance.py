"""The conformance kit: does every capability answer a layer gives hold on real outputs?

A capability answer is a promise; a false "supported" corrupts outputs silently. For each
architecture a plugin registers a tiny config for (`register_test_configs`), the kit writes a
random checkpoint, loads it through the engine's public surface (`LLM`) and, for each query some
layer answers "supported", runs the check that answer implies, comparing greedy token ids:

=================================  ==============================================================
answer                             check
=================================  ==============================================================
decode_rollback_unsupported False  rollback to a boundary, then decode again == uninterrupted
decode_multi_seq_unsupported False batched decode, arrivals staggered == per-sequence decode
decode_verify_multi_unsupported F  batched speculative verify, arrivals staggered == per-sequence verify
uses_local_mla_prefill False       prefix hits + chunked prefill == cold whole prefill
supports_replay_tail_split True    in-pass capture == the two-pass split (answer flipped)
supports_replay_tail_split True    a verify's per-draft captures: speculative decode == plain decode
is_ssm_layer True                  three-phase prefill == one-call prefill (answer flipped)
uses_ssm_pool True                 prefill resumed from a state snapshot == recompute
uses_ssm_pool True                 speculative decode == plain decode (drafts dropped by the cursor)
uses_ssm_pool False                alloc_state / release_state balance under abort and preemption
keeps_per_draft_states True        speculative decode (keep_verified_rows) == plain decode
decode_graph_unsupported False     captured decode == eager decode, and no capture fails
graph_stale_on_new_sequence False  sequences in reused graph slots == the same ones eagerly
fp8_calibration_frozen             moves None/False -> True once and never back
=================================  ==============================================================

The two graph checks run decode as a compiled step (``compile_decode=True``: on CPU, a minute or
two of compiling per architecture, one batch bucket); ``graphs=False`` (``check-plugin
--no-graphs``) reports them skipped instead.

The decode checks share four runs of the same prompts (`DecodeRuns`): plain and speculative
decoding, one sequence at a time and with arrivals two steps apart, so that decode rows and
verifies run fused with another sequence's prompt in the same pass. A difference is reported with
the step that sampled the first differing token (what ran in that pass); the batched-verify check
does not blame batching when speculative decoding is already wrong one sequence at a time (a
position bug in the verify rows: the speculative check says so). Where the architecture serves an
MTP head, the speculative checks also run the same prompts with the head's drafts (method
``"mtp"``, a random head written on a copy of the checkpoint: `Subject.mtp_checkpoint`) and name
each drafting method whose outputs differ from plain decoding.

An "unsupported" answer is never penalised (verdict ``not claimed``). A check whose feature is off
for the whole model (another layer vetoes it) or that could not happen (no prefix hit, no graph
captured) is ``skipped`` with the reason. A ``FAIL`` names the layer kinds making the claim, the
claim, the check and the first differing token.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from layerzoo.hookspecs import hookimpl
from layerzoo.plugins.capabilities import QUERIES
from layerzoo.plugins.lazy import resolve_object

PASS, FAIL, SKIP, NOT_CLAIMED = "pass", "FAIL", "skipped", "not claimed"


@attrs.frozen
class TestConfig:
    """One architecture's tiny config and the function writing a random checkpoint for it."""

    __test__ = False  # not a pytest class

    architecture: str
    config: dict
    writer: Any  # callable or "module:function": writer(path, config)
    plugin: str

    def write(self, path: Path) -> Path:
        config = {**self.config, "architectures": [self.architecture]}
        writer = self.writer if callable(self.writer) else resolve_object(self.writer)
        writer(path, config)
        return path


@attrs.frozen
class Verdict:
    """One (layer kind, query) row: the claim, the check run for it, and what came out."""

    architecture: str
    layer_kind: str
    query: str
    claim: Any
    check: str
    status: str
    detail: str = ""

    def describe(self) -> str:
        where = f"{self.architecture} / {self.layer_kind}: {self.query}={self.claim!r}"
        return f"{where} [{self.check}] {self.status}" + (f": {self.detail}" if self.detail else "")


def collect_test_configs(registry=None, plugins: Iterable[str] | None = None) -> list[TestConfig]:
    """Every test config the loaded plugins register (only ``plugins``' when given)."""
    from layerzoo.plugins.manager import get_registry

    registry = registry or get_registry()
    wanted = None if plugins is None else set(plugins)
    out: list[TestConfig] = []
    for impl in registry.pm.hook.register_test_configs.get_hookimpls():
        if wanted is not None and impl.plugin_name not in wanted:
            continue

        def register(architecture, config, writer, _plugin=impl.plugin_name):
            out.append(TestConfig(architecture, dict(config), writer, _plugin))

        impl.function(register=register)
    return out


def untested_architectures(registry=None, plugins: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """(plugin, architecture) pairs registered without a test config."""
    from layerzoo.plugins.manager import get_registry

    registry = registry or get_registry()
    covered = {tc.architecture for tc in collect_test_configs(registry, plugins)}
    return sorted(
        (reg.plugin, name) for name, reg in registry.architectures.entries.items()
        if name not in covered and (plugins is None or reg.plugin in set(plugins))
    )


# -- comparing token ids ---------------------------------------------------------------------------


def first_difference(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> str | None:
    """None when equal; else where the first token differs (sequence, output position, ids)."""
    for i, (a, b) in enumerate(zip(expected, got)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"sequence {i}, output token {j}: expected {x}, got {y}"
        if len(a) != len(b):
            return f"sequence {i}: expected {len(a)} tokens, got {len(b)}"
    if len(expected) != len(got):
        return f"expected {len(expected)} sequences, got {len(got)}"
    return None


def first_mismatch(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """``(sequence, output token)`` of the first differing token (or of a missing one); None when equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            return i, j
        if len(a) != len(b):
            return i, min(len(a), len(b))
    return None


class CheckFailed(Exception):
    """A check's outputs differ from its reference (the message says where)."""


class CheckSkipped(Exception):
    """A check could not exercise what it checks (the message says why)."""


def expect_equal(expected, got, what: str) -> None:
    diff = first_difference(expected, got)
    if diff is not None:
        raise CheckFailed(f"{what}: {diff}")


# -- running the engine -----------------------------------------------------------------------------


def greedy(max_tokens: int = 8):
    from layerzoo.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(vocab: int, length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ids in [1, vocab)."""
    return [1 + (7 * i * i + 13 * i + 31 * salt) % (vocab - 1) for i in range(length)]


def repetitive_prompt(vocab: int, length: int, salt: int = 0) -> list[int]:
    """A prompt that repeats a short phrase, so an n-gram proposer drafts from it."""
    phrase = prompt(vocab, 4, salt)
    return (phrase * length)[:length]


class Subject:
    """One checkpoint: builds `LLM`s for it with small settings and runs greedy generation."""

    BASE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, block_size=8)

    def __init__(self, path: Path, vocab: int, architecture: str, engine_args: dict | None = None):
        self.path, self.vocab, self.architecture = path, vocab, architecture
        self.engine_args = dict(engine_args or {})
        self.fp8_layers: set[int] = set()  # layers seen answering fp8_calibration_frozen non-None
        self.graph_runs: GraphRuns | None = None  # shared by the two graph checks (one compile)
        self.decode_runs: DecodeRuns | None = None  # shared by the decode and speculation checks
        self._mtp_dir: tempfile.TemporaryDirectory | None = None
        self._mtp_path: Path | None | str = "unknown"  # the checkpoint with an MTP head (`mtp_checkpoint`)

    def mtp_checkpoint(self) -> Path | None:
        """A copy of the checkpoint with a random MTP head written in the layout its plugin reads
        (`layerzoo.testing.checkpoints.add_mtp_head`: ``mtp.*`` or NextN), or None when the
        architecture has no head to serve. The head's block copies a decoder layer: the first one,
        in layer order, whose keys the head loads strictly."""
        if self._mtp_path == "unknown":
            self._mtp_path = self._write_mtp_checkpoint()
        return self._mtp_path

    def _write_mtp_checkpoint(self) -> Path | None:
        import shutil

        from layerzoo.errors import CheckpointError, UserError
        from layerzoo.layers.model import CausalLM
        from layerzoo.testing.checkpoints import add_mtp_head

        model = self.llm().engine.model
        if type(model).num_mtp_layers is CausalLM.num_mtp_layers:
            return None  # its plugin builds no head for this architecture
        keys = [k if isinstance(k, str) else k[0] for k in model.mtp_checkpoint_keys()]
        layout = "qwen" if any(k.startswith("mtp.") for k in keys) else "nextn"
        self._mtp_dir = tempfile.TemporaryDirectory(prefix="layerzoo-conformance-mtp-")
        for source in range(len(model.layers)):
            path = Path(self._mtp_dir.name) / f"head-from-{source}"
            shutil.copytree(self.path, path)
            add_mtp_head(path, layout, source_layer=source)
            try:
                self.llm(path, speculative_config=MTP_SPEC)
            except (CheckpointError, UserError, KeyError, RuntimeError):
                shutil.rmtree(path)  # the head's block is another kind of layer: try the next
                continue
            return path
        return None

    def llm(self, path: Path | None = None, **overrides):
        from layerzoo import LLM

        return LLM(path or self.path, **{**self.BASE, **self.engine_args, **overrides})

    @staticmethod
    def generate(llm, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy(max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def one_by_one(self, llm, prompts, max_tokens: int = 8) -> list[list[int]]:
        return [self.generate(llm, [p], max_tokens)[0] for p in prompts]


@attrs.frozen
class Run:
    """Greedy outputs of one run, and what each step of it ran.

    ``steps[k]``: the chunks of step ``k`` as ``(sequence, kind, first row position, rows)``,
    kind one of ``decode``, ``verify``, ``prompt``; ``sampled_in[i][j]``: the step that sampled
    output token ``j`` of sequence ``i`` (sequences numbered as the prompts)."""

    outputs: list[list[int]]
    steps: list[tuple[tuple[int, str, int, int], ...]]
    sampled_in: list[list[int]]

    def fused_steps(self) -> int:
        """Steps in which a decode row or a verify ran in one pass with another sequence's prompt."""
        return sum(
            any(kind != "prompt" and any(k == "prompt" and j != i for j, k, _, _ in chunks) for i, kind, _, _ in chunks)
            for chunks in self.steps
        )

    def where(self, sequence: int, token: int) -> str:
        """What ran in the step that sampled ``token`` of ``sequence`` (or should have)."""
        sampled = self.sampled_in[sequence]
        if not sampled:
            return "no token of it was sampled"
        k = sampled[min(token, len(sampled) - 1)]
        own, others = [], []
        for i, kind, start, rows in self.steps[k]:
            text = {"decode": "a decode row", "verify": f"a verify of {rows} rows"}.get(kind, f"prompt rows {start}..{start + rows - 1}")
            (own if i == sequence else others).append(text if i == sequence else f"sequence {i}'s {text}")
        alone = "alone in its pass" if not others else "in one pass with " + ", ".join(others)
        return f"sampled by {' and '.join(own) or 'nothing of its own'} at position {self._position(k, sequence)}, {alone}"

    def _position(self, k: int, sequence: int) -> int:
        return next(start for i, _, start, _ in self.steps[k] if i == sequence)


def run_greedy(llm, prompts: Sequence[Sequence[int]], max_tokens: int, stagger: int | None = None) -> Run:
    """Greedy generation step by step: one sequence at a time (``stagger`` None), or sequence
    ``i`` arriving at step ``i * stagger`` (its prompt then runs beside the earlier sequences'
    decode rows). Every step's chunks and the step of every sampled token are kept (`Run`)."""
    engine = llm.engine
    scheduler = engine.scheduler
    plans: list = []
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    index: dict[int, int] = {}
    seqs, steps, sampled_in = [], [], [[] for _ in prompts]
    run_id = f"conformance-{id(plans)}"
    scheduler.schedule = recording
    try:
        step = 0
        while len(seqs) < len(prompts) or engine.has_unfinished():
            due = not engine.has_unfinished() if stagger is None else step % stagger == 0
            if len(seqs) < len(prompts) and due:
                (seq,) = engine.add_request(f"{run_id}-{len(seqs)}", list(prompts[len(seqs)]), greedy(max_tokens))
                index[seq.seq_id] = len(seqs)
                seqs.append(seq)
            before = [len(q.output_token_ids) for q in seqs]
            engine.step()
            plan = plans[-1]
            steps.append(tuple(
                (index[c.seq.seq_id], "verify" if c.is_verify else "decode" if c in plan.decodes else "prompt", c.start, c.num_tokens)
                for c in plan.chunks if c.seq.seq_id in index
            ))
            for i, (q, n) in enumerate(zip(seqs, before)):
                sampled_in[i].extend([step] * (len(q.output_token_ids) - n))
            step += 1
    finally:
        del scheduler.schedule  # the class's method again
    for i in range(len(seqs)):
        engine.release(f"{run_id}-{i}")
    return Run([list(q.output_token_ids) for q in seqs], steps, sampled_in)


def expect_same_run(expected: Run, got: Run, what: str) -> None:
    """Raise `CheckFailed` naming the first differing token and what ran in the step of ``got``
    that sampled it."""
    at = first_mismatch(expected.outputs, got.outputs)
    if at is not None:
        raise CheckFailed(f"{what}: {first_difference(expected.outputs, got.outputs)}, {got.where(*at)}")


class _Boundaries:
    """Rollback-ring snapshots before the given positions (the scheduler's boundary interface)."""

    def __init__(self, positions: Iterable[int]):
        self.positions = set(positions)

    def before(self, seq, position: int) -> bool:
        return position in self.positions


class FlipAnswer:
    """A plugin answering ``query`` with ``value`` for every layer kind (or the given kinds) first."""

    def __init__(self, query: str, value: Any, kinds: Iterable[str] | None = None):
        self.kinds = None if kinds is None else set(kinds)
        self.value = value

        def answer(layer_kind):
            return self.value if self.kinds is None or layer_kind in self.kinds else None

        answer.__name__ = query
        setattr(self, query, hookimpl(tryfirst=True)(answer))


@contextlib.contextmanager
def flipped(query: str, value: Any, kinds: Iterable[str] | None = None):
    from layerzoo.testing import registered_plugin

    with registered_plugin(FlipAnswer(query, value, kinds), f"conformance-flip-{query}"):
        yield


# -- the checks ---------------------------------------------------------------------------------------


def check_rollback(s: Subject, caps) -> str:
    """Rollback to a boundary (ring snapshot just before it), then decode again == uninterrupted."""
    p, keep, total = prompt(s.vocab, 19), 4, 10
    llm = s.llm(enable_prefix_caching=False)
    (ref,) = s.generate(llm, [p], total)
    engine = llm.engine
    position = len(p) + keep
    engine.scheduler.boundaries = _Boundaries([position - 1, position - 3])
    (seq,) = engine.add_request("rollback", p, greedy(total))
    while len(seq.output_token_ids) < keep + 3:
        engine.step()
    engine.scheduler.rollback_to_boundary(seq, position)
    engine.outputs.reset(seq, engine.tokenizer.decode(seq.output_token_ids))
    engine.scheduler.boundaries = None
    engine.run_until_done()
    got = list(seq.output_token_ids)
    engine.release("rollback")
    expect_equal([ref], [got], f"after a rollback to position {position}")
    return f"rewound {keep + 3} -> {keep} output tokens"


# Fixed k (not the adaptive policy): every check must run verifies, whatever the acceptance.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1, "adaptive": False}
# The same through the checkpoint's own MTP head, for architectures that serve one (a random head
# on a copy of the checkpoint: `Subject.mtp_checkpoint`).
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
# The decode runs: prompts prefilled whole (a multi-row chunk continuing a sequence is a verify),
# no prefix caching (each run computes every row), one arrival every STAGGER steps.
DECODE_ENGINE = dict(enable_prefix_caching=False, max_num_batched_tokens=64)
DECODE_PROMPTS = (9, 14, 6)
DECODE_TOKENS = 16
STAGGER = 2


class DecodeRuns:
    """The runs the decode checks compare, made once per subject when first asked for: plain and
    speculative greedy decoding of the same repetitive prompts (an n-gram proposer drafts from
    them), one sequence at a time and with staggered arrivals."""

    def __init__(self, s: Subject):
        self.subject = s
        self.prompts = [repetitive_prompt(s.vocab, n, salt) for salt, n in enumerate(DECODE_PROMPTS)]
        self._runs: dict = {}  # (speculative, staggered) or "mtp" -> Run
        self.verifies = 0
        self.mtp_verifies = 0

    def get(self, speculative: bool, staggered: bool) -> Run:
        key = (speculative, staggered)
        if key not in self._runs:
            llm = self._llm(speculative)
            before = llm.stats.spec_verify_steps
            try:
                self._runs[key] = run_greedy(llm, self.prompts, DECODE_TOKENS, STAGGER if staggered else None)
            except BaseException:  # a claim that crashes the engine: the next check starts a new one
                self.__dict__["_llms"].pop(speculative, None)
                raise
            self.verifies += llm.stats.spec_verify_steps - before
        return self._runs[key]

    def _llm(self, speculative: bool):
        cache = self.__dict__.setdefault("_llms", {})
        if speculative not in cache:
            extra = {"speculative_config": SPEC} if speculative else {}
            cache[speculative] = self.subject.llm(**DECODE_ENGINE, **extra)
        return cache[speculative]

    def plain(self) -> Run:
        return self.get(False, False)

    def speculative(self) -> Run:
        run = self.get(True, False)
        if not any(kind == "verify" for steps in run.steps for _, kind, _, _ in steps):
            raise CheckSkipped("no speculative verify ran")
        return run

    def speculation_differs(self) -> str | None:
        """Where speculative decoding one sequence at a time differs from plain decoding, or None."""
        plain, spec = self.plain(), self.speculative()
        at = first_mismatch(plain.outputs, spec.outputs)
        return None if at is None else f"{first_difference(plain.outputs, spec.outputs)}, {spec.where(*at)}"

    def mtp(self) -> Run | None:
        """Speculative decoding one sequence at a time with drafts from the MTP head (None: the
        architecture has no head to serve); ``mtp_verifies`` counts its verifies."""
        if "mtp" not in self._runs:
            path = self.subject.mtp_checkpoint()
            if path is None:
                return None
            llm = self.subject.llm(path, **DECODE_ENGINE, speculative_config=MTP_SPEC)
            self._runs["mtp"] = run_greedy(llm, self.prompts, DECODE_TOKENS)
            self.mtp_verifies = llm.stats.spec_verify_steps
        return self._runs["mtp"]

    def mtp_differs(self) -> str | None:
        """Where MTP speculation one sequence at a time differs from plain decoding, or None (also
        when no verify ran or there is no head)."""
        run = self.mtp()
        if run is None:
            return None
        plain = self.plain()
        at = first_mismatch(plain.outputs, run.outputs)
        return None if at is None else f"{first_difference(plain.outputs, run.outputs)}, {run.where(*at)}"


def decode_runs(s: Subject) -> DecodeRuns:
    if s.decode_runs is None:
        s.decode_runs = DecodeRuns(s)
    return s.decode_runs


def _require_speculation(caps) -> None:
    if caps.speculation_blocker() is not None:
        raise CheckSkipped(f"speculative decoding is off: {caps.speculation_blocker().describe()}")


def check_multi_seq(s: Subject, caps) -> str:
    """Batched decode with staggered arrivals (decode rows fused with other sequences' prompts)
    == each sequence alone."""
    runs = decode_runs(s)
    batched = runs.get(False, True)
    expect_same_run(runs.plain(), batched, "batched decode (arrivals staggered) vs per-sequence decode")
    return f"{len(runs.prompts)} sequences, {batched.fused_steps()} steps fusing decode rows with a prompt"


def check_verify_multi(s: Subject, caps) -> str:
    """Batched verifies with staggered arrivals == each sequence's verifies alone. Not judged when
    speculative decoding one sequence at a time already differs from plain decoding (the verify
    rows themselves are wrong: the speculative check reports it); a difference that plain batched
    decoding shows too is said to be one."""
    _require_speculation(caps)
    runs = decode_runs(s)
    alone, batched = runs.speculative(), runs.get(True, True)
    at = first_mismatch(alone.outputs, batched.outputs)
    if at is None:
        return f"{runs.verifies} verifies, {batched.fused_steps()} steps fusing decode rows or verifies with a prompt"
    wrong_alone = runs.speculation_differs()
    if wrong_alone is not None:
        raise CheckSkipped(
            "batched verifies differ from per-sequence verifies, but speculative decode one sequence at a time "
            f"already differs from plain decode ({wrong_alone}): the verify rows are wrong without any batching"
        )
    diff = f"{first_difference(alone.outputs, batched.outputs)}, {batched.where(*at)}"
    plain_at = first_mismatch(runs.plain().outputs, runs.get(False, True).outputs)
    if plain_at is not None:
        plain = runs.get(False, True)
        raise CheckFailed(
            f"batched verify vs per-sequence verify: {diff}; batched decode without speculation differs too "
            f"({first_difference(runs.plain().outputs, plain.outputs)}, {plain.where(*plain_at)}): not specific to verifies"
        )
    raise CheckFailed(f"batched verify (arrivals staggered) vs per-sequence verify: {diff}")


def check_speculative(s: Subject, caps) -> str:
    """Speculative decode == plain decode, one sequence at a time: rejected drafts leave nothing
    behind (the KV cursor drops them; a pool layer restores the per-draft state its verify captured)."""
    return _speculation_equals_plain(s, caps, "speculative decode vs plain decode (one sequence at a time)")


def _speculation_equals_plain(s: Subject, caps, what: str) -> str:
    """The shared decode runs' speculative outputs equal their plain ones, with n-gram drafts and,
    where the architecture serves an MTP head, with the head's drafts; or `CheckFailed` saying
    ``what`` and each drafting method that differs."""
    _require_speculation(caps)
    runs = decode_runs(s)
    diffs = {"n-gram": runs.speculation_differs(), "mtp": runs.mtp_differs()}
    wrong = [f"{method} drafts: {diff}" for method, diff in diffs.items() if diff is not None]
    if wrong:
        raise CheckFailed(f"{what}: " + "; ".join(wrong))
    detail = f"{runs.verifies} verifies"
    if runs.mtp() is not None:
        detail += f", {runs.mtp_verifies} with MTP drafts"
    return detail


def check_verify_captures(s: Subject, caps) -> str:
    """A pool layer's per-draft captures inside a verify: speculative decode == plain decode."""
    return check_speculative(s, caps) + ", rejected drafts restored from per-draft captures"


def check_prefix_and_chunks(s: Subject, caps) -> str:
    long = prompt(s.vocab, 37)
    other = long[:27] + prompt(s.vocab, 5, salt=3)
    cold = s.generate(s.llm(enable_prefix_caching=False, enable_chunked_prefill=False), [long])
    llm = s.llm(max_num_batched_tokens=12, ssm_snapshot_interval=8)
    s.generate(llm, [other])
    warm = s.generate(llm, [long])
    hits = llm.stats.prefix_cache_hits + llm.stats.state_snapshot_hits
    expect_equal(cold, warm, "prefix hit + chunked prefill (12-token chunks) vs cold whole prefill")
    return f"{hits} prefix hits, chunks of 12"


def check_snapshot_restore(s: Subject, caps) -> str:
    long = prompt(s.vocab, 37)
    other = long[:27] + prompt(s.vocab, 5, salt=3)
    cold = s.generate(s.llm(enable_prefix_caching=False), [long])
    llm = s.llm(ssm_snapshot_interval=8)
    s.generate(llm, [other])
    warm = s.generate(llm, [long])
    if llm.stats.state_snapshot_hits == 0:
        raise CheckSkipped("no prefill resumed from a state snapshot")
    expect_equal(cold, warm, "prefill resumed from a state snapshot vs recompute")
    return f"{llm.stats.state_snapshot_hits} snapshot hits"


def _flip_check(s: Subject, query: str, value: Any, workload: Callable) -> None:
    claimed = workload(s)
    with flipped(query, value):
        reference = workload(s)
    expect_equal(reference, claimed, f"answer as given vs {query}={value!r}")


def _capture_workload(s: Subject):
    """Prefills that take state snapshots inside their chunks, then one resuming from them."""
    long = prompt(s.vocab, 37)
    other = long[:27] + prompt(s.vocab, 5, salt=3)
    # Chunks of 10 rows, snapshots every 8: captures fall inside chunks, and the last prompt
    # resumes from one of them.
    llm = s.llm(max_num_batched_tokens=10, ssm_snapshot_interval=8)
    # Resumed close to its end, so that the restored state weighs on the next tokens.
    outs = s.generate(llm, [other, long[:20]]) + s.generate(llm, [long[:26]])
    if llm.stats.state_snapshot_hits == 0:
        raise CheckSkipped("no prefill resumed from a state snapshot")
    return outs


def check_replay_tail_split(s: Subject, caps) -> str:
    _flip_check(s, "supports_replay_tail_split", False, _capture_workload)
    return "in-pass capture vs two-pass split, resumed from a snapshot"


def check_three_phases(s: Subject, caps) -> str:
    try:
        _flip_check(s, "is_ssm_layer", False, lambda s: s.generate(s.llm(enable_prefix_caching=False), [prompt(s.vocab, 23)]))
    except (AttributeError, NotImplementedError, TypeError) as exc:
        raise CheckSkipped(f"no one-call prefill to compare with ({type(exc).__name__}: {exc})") from exc
    return "three phases vs one call"


def check_own_state_balance(s: Subject, caps) -> str:
    """alloc_state / release_state pair up, with one request aborted mid-decode and preemptions
    forced by a KV cache that holds about two sequences."""
    llm = s.llm(enable_prefix_caching=False, max_model_len=48, kv_cache_memory=_kv_bytes_for(s, 2 * 56))
    counts = {"alloc": 0, "release": 0}
    live: set[int] = set()
    for i in caps.own_state_layers:
        layer = llm.engine.model.layers[i]
        alloc, release = layer.alloc_state, layer.release_state

        def counted_alloc(seq_id, _alloc=alloc):
            state = _alloc(seq_id)
            counts["alloc"] += 1
            live.add(id(state))
            return state

        def counted_release(state, _release=release):
            assert id(state) in live, "release_state of a state never allocated (or released twice)"
            live.discard(id(state))
            counts["release"] += 1
            return _release(state)

        layer.alloc_state, layer.release_state = counted_alloc, counted_release
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", prompt(s.vocab, 9 + i, i), greedy(30)) for i in range(4)]
    for _ in range(3):
        engine.step()
    engine.abort_request("r1")
    engine.run_until_done()
    for i in (0, 2, 3):
        engine.release(f"r{i}")
    if counts["alloc"] != counts["release"] or live:
        raise CheckFailed(f"{counts['alloc']} alloc_state vs {counts['release']} release_state calls ({len(live)} states live)")
    return f"{counts['alloc']} allocs, {engine.stats.preemptions} preemptions, 1 abort"


def _kv_bytes_for(s: Subject, tokens: int) -> int | float:
    """KV-cache bytes holding about ``tokens`` tokens (the default fraction when no layer writes KV)."""
    specs = s.llm(enable_prefix_caching=False, max_model_len=48).engine.model.kv_cache_specs()
    per_token = sum(spec.bytes_per_token for spec in specs.values())
    return per_token * tokens if per_token else 0.25


def check_per_draft_states(s: Subject, caps) -> str:
    """An own-state layer's keep_verified_rows: speculative decode == plain decode."""
    return _speculation_equals_plain(s, caps, "speculative decode (kept verified rows) vs plain decode")


# Captured decode: one engine with compile_decode=True (on CPU each compile of a decode step takes
# up to a minute or two, so both graph checks share it and stay in one batch bucket and table
# width), against an eager engine running the same sequences.
GRAPH_ENGINE = dict(compile_decode=True, enforce_eager=False, enable_prefix_caching=False)
GRAPH_TOKENS = 8


@attrs.frozen
class GraphRuns:
    """Three sequences, each alone and one after the other, eagerly and under captured decode.

    Each sequence after the first takes the graph slot the one before it left, so its captured run
    replays the graph captured with an earlier sequence (or a recaptured one, when a layer says
    graphs go stale). Every step decodes one row (bucket 1) over at most 4 blocks (table width 4):
    one compile. (Padded buckets are the runtime's own tests' business.)
    """

    eager: list[list[int]]  # [sequence] output token ids
    captured: list[list[int]]
    graphs: dict  # the captured engine's graph stats
    # why captured decode stopped for the rest of the run (a capture failed, a replay turned out
    # not to be static), and during which sequence; None when it never stopped
    abandoned: str | None
    abandoned_in: int | None


def graph_prompts(vocab: int) -> list[list[int]]:
    return [prompt(vocab, n, salt) for salt, n in enumerate((11, 17, 7))]


def graph_runs(s: Subject) -> GraphRuns:
    """The subject's `GraphRuns`, made once and shared by both graph checks."""
    if s.graph_runs is None:
        prompts = graph_prompts(s.vocab)
        eager_llm = s.llm(**{**GRAPH_ENGINE, "compile_decode": False, "enforce_eager": True})
        eager = s.one_by_one(eager_llm, prompts, GRAPH_TOKENS)
        llm = s.llm(**GRAPH_ENGINE)
        runner = llm.engine.runner.graphs
        captured, abandoned_in = [], None
        for i, p in enumerate(prompts):
            captured.extend(s.generate(llm, [p], GRAPH_TOKENS))
            if runner.abandoned is not None and abandoned_in is None:
                abandoned_in = i
        s.graph_runs = GraphRuns(eager, captured, dict(llm.stats.graphs), runner.abandoned, abandoned_in)
    return s.graph_runs


def _require_captures(runs: GraphRuns) -> None:
    if not runs.graphs.get("captures"):
        raise CheckSkipped(f"no decode graph captured ({runs.graphs.get('eager_reasons') or 'eager'})")


def check_graphs(s: Subject, caps) -> str:
    """Captured decode of the first sequence == eager decode, and no capture fails."""
    runs = graph_runs(s)
    if runs.abandoned is not None and (runs.abandoned_in == 0 or "capture failed" in runs.abandoned):
        raise CheckFailed(f"captured decode was abandoned: {runs.abandoned}")
    _require_captures(runs)
    expect_equal(runs.eager[:1], runs.captured[:1], "captured decode vs eager decode")
    return f"{runs.graphs['captures']} captures, {runs.graphs.get('replays', 0)} replays"


def check_graph_slot_reuse(s: Subject, caps) -> str:
    """The later sequences, each in the slot the one before it left, under captured decode ==
    eagerly. A replay that stops being static once a new sequence holds the slot breaks the claim too."""
    runs = graph_runs(s)
    if runs.abandoned_in == 0:
        raise CheckSkipped(f"captured decode was abandoned before any slot was reused: {runs.abandoned}")
    if runs.abandoned is not None:
        raise CheckFailed(f"captured decode stopped once new sequences took the graph's slots: {runs.abandoned}")
    _require_captures(runs)
    expect_equal(runs.eager[1:], runs.captured[1:], "sequences in reused graph slots vs the same sequences eagerly")
    return f"slots reused, {runs.graphs['captures']} captures, {runs.graphs.get('dropped', 0)} dropped"


def check_fp8_monotone(s: Subject, caps) -> str:
    llm = s.llm(kv_cache_dtype="fp8", fp8_calibration_tokens=24, enable_prefix_caching=False)
    engine = llm.engine
    history: list[tuple] = [tuple(lc.fp8_calibration_frozen for lc in engine.capabilities().layers)]
    for i in range(3):
        engine.add_request(f"f{i}", prompt(s.vocab, 10, i), greedy(6))
        while engine.has_unfinished():
            engine.step()
            history.append(tuple(lc.fp8_calibration_frozen for lc in engine.capabilities().layers))
        engine.release(f"f{i}")
    for layer in range(len(history[0])):
        answers = [h[layer] for h in history]
        for step, (a, b) in enumerate(zip(answers, answers[1:])):
            if a is True and b is not True:
                raise CheckFailed(f"layer {layer} went back from True to {b!r} at step {step + 1}")
            if a is None and b is not None or a is False and b is None:
                raise CheckFailed(f"layer {layer} moved {a!r} -> {b!r} at step {step + 1}")
    s.fp8_layers = {layer for hs in history for layer, h in enumerate(hs) if h is not None}
    if not s.fp8_layers:
        raise CheckSkipped("no layer runs online FP8 calibration")
    froze = sum(1 for layer in range(len(history[0])) if history[-1][layer] is True)
    return f"{froze} layers froze over {len(history) - 1} steps"


@attrs.frozen
class Check:
    query: str
    claim: Any  # the "supported" answer this check verifies
    name: str
    run: Callable
    # The model-level reason the check cannot run (another layer vetoes the feature), or None.
    blocked: Callable = lambda caps: None


def _veto(query: str, feature: str):
    def blocked(caps):
        lc = next((lc for lc in caps.layers if lc.answers[query]), None)
        return None if lc is None else f"{feature} is off: layer {lc.layer_index} ({lc.layer_kind}) answers {query}=True"

    return blocked


CHECKS: tuple[Check, ...] = (
    Check("decode_rollback_unsupported", False, "rollback == uninterrupted", check_rollback,
          _veto("decode_rollback_unsupported", "rollback")),
    Check("decode_multi_seq_unsupported", False, "batched decode (staggered) == per-sequence", check_multi_seq,
          _veto("decode_multi_seq_unsupported", "batched decode")),
    Check("decode_verify_multi_unsupported", False, "batched verify (staggered) == per-sequence", check_verify_multi,
          _veto("decode_verify_multi_unsupported", "batched verify")),
    Check("uses_local_mla_prefill", False, "prefix hit + chunks == cold prefill", check_prefix_and_chunks,
          _veto("uses_local_mla_prefill", "prefix matching and chunked prefill")),
    Check("supports_replay_tail_split", True, "in-pass capture == two-pass split", check_replay_tail_split,
          lambda caps: None if caps.replay_tail_split_supported else "not every layer answers True: no in-pass capture"),
    Check("is_ssm_layer", True, "three phases == one-call prefill", check_three_phases),
    Check("supports_replay_tail_split", True, "per-draft captures: speculative == plain", check_verify_captures,
          lambda caps: None if caps.stateful_layers else "the model keeps no recurrent state: a verify captures none"),
    Check("uses_ssm_pool", True, "snapshot restore == recompute", check_snapshot_restore,
          lambda caps: None if caps.stateful_layers else "the model keeps no recurrent state"),
    Check("uses_ssm_pool", True, "speculative decode == plain decode", check_speculative),
    Check("uses_ssm_pool", False, "alloc/release balance (abort, preemption)", check_own_state_balance),
    Check("keeps_per_draft_states", True, "keep_verified_rows == feeding kept rows", check_per_draft_states),
    Check("decode_graph_unsupported", False, "captured decode == eager", check_graphs,
          _veto("decode_graph_unsupported", "decode graphs")),
    Check("graph_stale_on_new_sequence", False, "reused graph slot == fresh", check_graph_slot_reuse,
          _veto("decode_graph_unsupported", "decode graphs")),
)
FP8_CHECK = "None/False -> True once, never back"


def _claimants(caps, query: str, claim: Any) -> list[str]:
    """Layer kinds (in layer order, once each) answering ``query`` with ``claim``."""
    kinds: list[str] = []
    for lc in caps.layers:
        if query == "keeps_per_draft_states" and lc.uses_ssm_pool:
            continue  # asked only about own-state layers
        if lc.answers[query] == claim and lc.layer_kind not in kinds:
            kinds.append(lc.layer_kind)
    return kinds


GRAPH_QUERIES = ("decode_graph_unsupported", "graph_stale_on_new_sequence")
GRAPHS_OFF = "graph checks off (they compile decode steps: minutes per architecture on CPU)"


def check_checkpoint(
    path: Path, architecture: str, queries: Iterable[str] | None = None, engine_args: dict | None = None,
    graphs: bool = True,
) -> list[Verdict]:
    """Run every check a layer's answers call for on the checkpoint at ``path`` (only those of
    ``queries`` when given), with extra `EngineArgs` fields ``engine_args`` in every engine.
    ``graphs=False`` reports the captured-decode checks (`GRAPH_QUERIES`) skipped without running
    them."""
    import json

    wanted = set(QUERIES if queries is None else queries)
    checks = [c for c in CHECKS if c.query in wanted]

    vocab = json.loads((Path(path) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab).get("vocab_size") or vocab["vocab_size"]
    subject = Subject(Path(path), vocab, architecture, engine_args)
    try:
        caps = subject.llm().capabilities
    except Exception as exc:  # e.g. an answer promising methods the layer lacks, refused at build
        message = f"{type(exc).__name__}: {exc}"
        query = next((q for q in QUERIES if q in message), "-")
        return [Verdict(architecture, "(model)", query, "-", "the model builds under its answers", FAIL, message)]
    verdicts: list[Verdict] = []
    kinds = list(dict.fromkeys(lc.layer_kind for lc in caps.layers))
    by_query = {c.query for c in checks}
    for query in QUERIES:
        if query == "fp8_calibration_frozen" or query not in by_query:
            continue
        claimed = [c for c in checks if c.query == query and _claimants(caps, query, c.claim)]
        unclaimed = [k for k in kinds if all(k not in _claimants(caps, query, c.claim) for c in claimed)]
        for kind in unclaimed:
            answer = next(lc.answers[query] for lc in caps.layers if lc.layer_kind == kind)
            verdicts.append(Verdict(architecture, kind, query, answer, "-", NOT_CLAIMED))
        for check in claimed:
            status, detail = _run(check, subject, caps) if graphs or query not in GRAPH_QUERIES else (SKIP, GRAPHS_OFF)
            for kind in _claimants(caps, query, check.claim):
                verdicts.append(Verdict(architecture, kind, query, check.claim, check.name, status, detail))
    if "fp8_calibration_frozen" not in wanted:
        return verdicts
    status, detail = _run(Check("fp8_calibration_frozen", None, FP8_CHECK, check_fp8_monotone), subject, caps)
    calibrating = {lc.layer_kind for lc in caps.layers if lc.layer_index in subject.fp8_layers}
    for kind in kinds:
        if kind in calibrating or status == FAIL and not calibrating:
            verdicts.append(Verdict(architecture, kind, "fp8_calibration_frozen", "live", FP8_CHECK, status, detail))
        else:
            verdicts.append(Verdict(architecture, kind, "fp8_calibration_frozen", None, "-", NOT_CLAIMED))
    return verdicts


def _run(check: Check, subject: Subject, caps) -> tuple[str, str]:
    reason = check.blocked(caps)
    if reason is not None:
        return SKIP, reason
    try:
        return PASS, check.run(subject, caps)
    except CheckSkipped as exc:
        return SKIP, str(exc)
    except CheckFailed as exc:
        return FAIL, str(exc)
    except Exception as exc:  # a claim that makes the engine crash is a false claim too
        return FAIL, f"{type(exc).__name__}: {exc}"


def check_test_config(tc: TestConfig, workdir: Path | None = None, graphs: bool = True) -> list[Verdict]:
    """Write ``tc``'s checkpoint into ``workdir`` (a temporary folder if None) and check it."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="layerzoo-conformance-")))
        path = Path(workdir) / tc.architecture
        tc.write(path)
        return check_checkpoint(path, tc.architecture, graphs=graphs)


def check_plugins(plugins: Iterable[str] | None = None, workdir: Path | None = None, graphs: bool = True) -> list[Verdict]:
    """Check every architecture the given plugins (all loaded plugins when None) test-register."""
    verdicts: list[Verdict] = []
    for tc in collect_test_configs(plugins=plugins):
        verdicts.extend(check_test_config(tc, workdir, graphs))
    return verdicts


def failures(verdicts: Iterable[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.status == FAIL]


def format_table(verdicts: Sequence[Verdict]) -> str:
    """Claims x verdicts, one row per (architecture, layer kind, query, check)."""
    header = ("architecture", "layer kind", "query", "claim", "check", "verdict")
    rows = [header] + [
        (v.architecture, v.layer_kind, v.query, repr(v.claim) if not isinstance(v.claim, str) else v.claim, v.check,
         v.status + (f" ({v.detail})" if v.detail else ""))
        for v in verdicts
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * min(160, len(lines[0])))
    return "\n".join(lines)
