"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice or a grammar.

The grammar engine is llguidance (Microsoft's, maintained, CPU wheels; vLLM's ``guidance``
backend): it compiles a constraint into a matcher over the tokenizer's vocabulary, which says
after any prefix of tokens which next tokens keep the text inside the language (a bitmask of
``ceil(V / 32)`` int32 words per row), consumes tokens and rolls them back. Nothing here parses
JSON Schema or regexes itself. (xgrammar was the other candidate; it imports transformers at
import time, which layerzoo keeps out of its runtime.)

The pieces, from the request inward:

- `StructuredOutputsParams`: vLLM's fields (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object`` and the JSON options). Exactly one constraint; it is compiled (without a
  tokenizer) on construction, so a bad schema, regex or grammar is a `UserError` naming the field.
- `GrammarCompiler`: one per tokenizer. Builds llguidance's tokenizer once (lazily: an engine
  that never sees a constraint never pays for it) and caches one compiled matcher per constraint;
  each request gets a deep copy (microseconds, where compiling a schema takes milliseconds).
- `GrammarState`: one request's matcher and the tokens it has consumed. Its state is a function
  of the sequence's output tokens only (`GrammarState.follow`), so a preemption (the same tokens
  recomputed), a prefix-cache hit (no tokens at all) or a rollback (tokens dropped) cannot put it
  out of step.
- `StructuredOutputs`: the model runner's. For a step's sampling chunks it brings each
  constrained sequence's matcher up to its tokens and computes one bitmask for all their logits
  rows at once (a verify's rows from the matcher advanced along its draft, then rolled back),
  which `layerzoo.runtime.sampler.apply_token_bitmask` applies to the logits before anything samples.

A constrained output ends with an EOS token, which the grammar allows only where the text is
complete (and forces once nothing else can follow); so ``ignore_eos`` and ``min_tokens`` are refused
beside a constraint (`SamplingParams`).
"""

from __future__ import annotations

import json as json_module
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import torch

from layerzoo.errors import UserError

# Compiled matchers kept per tokenizer (least recently used dropped first): a server sees the same
# few schemas over and over.
GRAMMAR_CACHE_SIZE = 256
PARALLEL_MASK_ROWS = 64
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace allowed between JSON tokens unless the request says otherwise: none, one space, or one
# line break and an indent (pretty-printing). vLLM's default allows any run of whitespace, which a
# small or random-weight model fills until max_tokens (the embedded model writes newlines forever):
# bounded, every gap costs a few tokens at most and the document gets finished.
JSON_WHITESPACE = r"(\n[ \t]{0,32}|[ ])?"


def _llguidance():
    """The grammar engine, imported on first use (an engine without constraints never loads it)."""
    try:
        import llguidance
    except ImportError as exc:  # a core dependency; missing only from a hand-made environment
        raise UserError("structured outputs need the llguidance package (pip install llguidance)") from exc
    return llguidance


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's multi-line error (source excerpts, caret lines) as one line for a UserError."""
    parts = [line.strip() for line in message.splitlines() if line.strip().strip("^")]
    text = " ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schema(value):
    """``json``: a dict, a JSON string of an object, or a pydantic model class → a dict."""
    if hasattr(value, "model_json_schema"):  # a pydantic model class, as vLLM accepts
        value = value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json_module.loads(value)
        except ValueError as exc:
            raise UserError(f"StructuredOutputsParams.json: expected a JSON schema, got text that is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UserError(f"StructuredOutputsParams.json: expected a JSON schema (an object), got {value!r:.80}")
    return value


def _closed_objects(schema):
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``additionalProperties: false`` (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_type(field: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise UserError(f"StructuredOutputsParams.{field}: expected {expected}, got {value!r:.80}")


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``).

    Exactly one of: ``json`` (a JSON schema: dict, JSON text or pydantic model class), ``regex``
    (Rust regex syntax), ``choice`` (the output is one of these strings), ``grammar`` (Lark, or
    llama.cpp's GBNF, as llguidance reads them), ``json_object=True`` (any JSON object). JSON
    options: ``disable_any_whitespace`` (no whitespace between tokens of the JSON),
    ``whitespace_pattern`` (the regex of the whitespace between them; default `JSON_WHITESPACE`,
    bounded, where vLLM allows any run), ``disable_additional_properties`` (objects without
    ``additionalProperties`` get ``false``). ``structural_tag`` is refused by name.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = attrs.field(default=None, converter=lambda v: list(v) if isinstance(v, tuple) else v)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The llguidance grammar the constraint compiles to (also the compiled-matcher cache key).
    spec: str = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self):
        if self.structural_tag is not None:
            raise UserError("StructuredOutputsParams.structural_tag: not supported by layerzoo (use json, regex, choice or grammar)")
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            got = "none" if not given else " and ".join(given)
            raise UserError(f"StructuredOutputsParams: expected exactly one of {', '.join(CONSTRAINTS)}; got {got}")
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            _check_type(flag, getattr(self, flag), isinstance(getattr(self, flag), bool), "True or False")
        _check_type("json_object", self.json_object, self.json_object in (None, True, False), "True, False or None")
        _check_type("whitespace_pattern", self.whitespace_pattern,
                    self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str), "a regex string or None")
        field = given[0]
        object.__setattr__(self, "spec", self._compile(field))
        error = self._validate(self.spec)
        if error:
            raise UserError(f"StructuredOutputsParams.{field}: invalid {self.kind}: {error}")

    @property
    def kind(self) -> str:
        """What the constraint is, in words (for messages)."""
        return {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                "json_object": "JSON object"}[next(n for n in CONSTRAINTS if getattr(self, n) not in (None, False))]

    def _compile(self, field: str) -> str:
        """The constraint as an llguidance grammar (a string); a type error names ``field``."""
        llg = _llguidance()
        if field in ("json", "json_object"):
            schema = {"type": "object"} if field == "json_object" else _schema(self.json)
            if self.disable_additional_properties:
                schema = _closed_objects(schema)
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            if not self.disable_any_whitespace:
                options["whitespace_pattern"] = self.whitespace_pattern if self.whitespace_pattern is not None else JSON_WHITESPACE
            try:
                return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except (ValueError, TypeError) as exc:
                raise UserError(f"StructuredOutputsParams.{field}: invalid JSON schema: {_one_line(str(exc))}") from None
        if field == "regex":
            _check_type("regex", self.regex, isinstance(self.regex, str), "a regex string")
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if field == "choice":
            _check_type("choice", self.choice, isinstance(self.choice, list) and bool(self.choice)
                        and all(isinstance(c, str) and c for c in self.choice), "a non-empty list of non-empty strings")
            return llg.grammar_from("choice", self.choice)
        _check_type("grammar", self.grammar, isinstance(self.grammar, str) and self.grammar.strip(), "a Lark or GBNF grammar string")
        try:
            return llg.grammar_from("grammar", self.grammar)
        except ValueError as exc:  # GBNF that does not convert
            raise UserError(f"StructuredOutputsParams.grammar: invalid grammar: {_one_line(str(exc))}") from None

    @staticmethod
    def _validate(spec: str) -> str:
        """llguidance's error for a grammar that does not compile ('' when it does)."""
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(spec)
        return _one_line(messages[0]) if is_error and messages else ""


# The fields a request may set (a dict of them becomes a StructuredOutputsParams).
FIELDS = tuple(a.name for a in attrs.fields(StructuredOutputsParams) if a.init)


def unknown_fields(values: dict) -> str | None:
    """A message naming the keys of ``values`` that are no `StructuredOutputsParams` field, or None."""
    unknown = sorted(str(k) for k in values if k not in FIELDS)
    if not unknown:
        return None
    return f"unknown field(s) {', '.join(unknown)} (expected some of {', '.join(FIELDS)})"


# -- compiling per tokenizer ---------------------------------------------------------------------


class GrammarCompiler:
    """Compiled matchers for one tokenizer, cached by constraint.

    ``vocab_size`` is the model's logits width; llguidance's vocabulary is the larger of it and
    the tokenizer's, so a bitmask row covers every logit (ids the tokenizer lacks are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the server adds requests from its event loop's threads
        self.compiled = 0  # matchers compiled (cache misses), for tests and stats

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built on first use: ~1 s for a 150k vocabulary)."""
        if self._ll_tokenizer is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise UserError("structured_outputs: the model runs without a tokenizer (skip_tokenizer_init), "
                                "and a constraint on text needs one")
            eos = list(getattr(self.tokenizer, "eos_token_ids", ()))
            if not eos:
                raise UserError("structured_outputs: the tokenizer has no EOS token id (generation_config.json or "
                                "config.json eos_token_id), and a constrained output ends with one")
            n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            self._ll_tokenizer = _llguidance().LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return self._ll_tokenizer

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: ``ceil(n_vocab / 32)``."""
        return (self.ll_tokenizer().vocab_size + 31) // 32

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher (initial state) for ``params``: a copy of the cached compiled one."""
        with self._lock:
            template = self._cache.get(params.spec)
            if template is None:
                template = _llguidance().LLMatcher(self.ll_tokenizer(), params.spec, log_level=0)
                if template.is_error():
                    field = next(n for n in CONSTRAINTS if getattr(params, n) not in (None, False))
                    raise UserError(f"StructuredOutputsParams.{field}: invalid {params.kind} for this tokenizer: "
                                    f"{_one_line(template.get_error())}")
                self._cache[params.spec] = template
                self.compiled += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(params.spec)
            return template.deep_copy()


# -- one request's grammar state -----------------------------------------------------------------


class GrammarState:
    """One sequence's matcher and the output tokens it has consumed."""

    def __init__(self, matcher, request_id: str):
        self.matcher = matcher
        self.request_id = request_id
        self.consumed: list[int] = []

    def follow(self, output_token_ids: Sequence[int]) -> None:
        """Bring the matcher to the state after ``output_token_ids``.

        Between two samplings a sequence's output only grows (tokens appended) or shrinks (a
        stop string or a watchdog rollback cut it): comparing the last consumed token tells which.
        Dropped tokens are rolled back, new ones consumed; a preemption's recompute changes
        nothing here, so it cannot advance the matcher twice.
        """
        n = len(self.consumed)
        if n > len(output_token_ids) or (n and output_token_ids[n - 1] != self.consumed[-1]):
            keep = 0
            while keep < min(n, len(output_token_ids)) and output_token_ids[keep] == self.consumed[keep]:
                keep += 1
            self._rollback(n - keep)
        for token in output_token_ids[len(self.consumed):]:
            if not self.matcher.consume_token(token):
                raise RuntimeError(
                    f"request {self.request_id}: token {token} after {len(self.consumed)} output tokens is outside "
                    f"its grammar, which masked it: {_one_line(self.matcher.get_error())}"
                )
            self.consumed.append(token)

    def _rollback(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            tokens = self.consumed[: len(self.consumed) - count]
            self.matcher.reset()  # rollback refused (too far back): replay the kept tokens
            self.consumed = []
            self.follow(tokens)
            return
        del self.consumed[len(self.consumed) - count :]


# -- a step's masks ------------------------------------------------------------------------------


@attrs.frozen
class TokenBitmask:
    """The step's grammar masks: ``bits [G, W]`` int32 (bit ``t % 32`` of word ``t // 32`` set:
    token ``t`` allowed) for the logits rows ``rows [G]`` (int64); other rows are unconstrained."""

    rows: torch.Tensor
    bits: torch.Tensor


class PendingBitmask:
    """A step's masks being computed: ``bits [G, W]``, each constrained sequence's rows from
    ``offsets[seq_id]`` on (``1 + len(draft)`` of them)."""

    def __init__(self, bits: torch.Tensor, offsets: dict[int, int], future: Future | None):
        self.bits, self.offsets, self.future = bits, offsets, future

    def wait(self) -> None:
        """Until the mask thread is done with the matchers, whatever it raised (a failed step)."""
        if self.future is not None:
            self.future.exception()

    def result(self, chunks) -> TokenBitmask:
        """The masks, with the logits row of each bitmask row for the sampling ``chunks`` in logits order."""
        if self.future is not None:
            self.future.result()  # re-raises what the mask thread raised
        rows = [0] * self.bits.shape[0]
        row = 0
        for chunk in chunks:
            n = 1 + len(chunk.draft)
            offset = self.offsets.get(chunk.seq.seq_id)
            if offset is not None:
                rows[offset : offset + n] = range(row, row + n)
            row += n
        return TokenBitmask(torch.tensor(rows, dtype=torch.long), self.bits)


class StructuredOutputs:
    """The model runner's grammar work: per sequence a `GrammarState`, per step one bitmask."""

    def __init__(self, tokenizer, vocab_size: int):
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        # Keyed by the Sequence object: a state lives as long as its sequence, through preemptions.
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._executor = None
        self._thread: ThreadPoolExecutor | None = None  # computes a step's masks beside its forward pass
        # From this many constrained rows in a step the masks are computed on llguidance's thread
        # pool; below it, in this thread: waking the pool cost more than it saved for the embedded
        # model's 2k vocabulary (2 busy cores, 8 rows: ~4 ms against 0.25; an H200's 16 cores,
        # bench/structured_outputs.py ratio 0.69x against 0.82x at 8 rows, 0.61x against 0.76x at 32).
        self.parallel_rows = PARALLEL_MASK_ROWS

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` for this tokenizer now (cached): a request is refused before it queues."""
        self.compiler.matcher(params)

    def state(self, seq) -> GrammarState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = GrammarState(self.compiler.matcher(seq.params.structured_outputs), seq.request_id)
        return state

    def bitmask(self, chunks) -> TokenBitmask | None:
        """Masks for the logits rows of a step's sampling ``chunks`` in logits order (a plain chunk
        has one row, a verify ``1 + len(draft)``), or None when no chunk's request has a
        constraint. `start` then `PendingBitmask.result` without the overlap."""
        pending = self.start(chunks, background=False)
        return None if pending is None else pending.result(chunks)

    def start(self, chunks, background: bool = True) -> PendingBitmask | None:
        """Bring each constrained sequence's matcher up to its tokens, then compute the masks of
        its rows (in this thread, or on a background thread while the forward pass runs: llguidance
        drops the GIL while it computes). ``chunks``: the step's sampling chunks, in any order.

        A verify's row ``i`` gets the mask after its first ``i`` drafts; the matcher walks the
        draft and is rolled back (all sequences at once on llguidance's thread pool for many rows).
        Rows after the first draft the grammar rejects keep an all-ones mask: that draft is
        rejected (its row forbids it), so nothing after it is ever used.
        """
        plain, verifies, offsets, total = [], [], {}, 0
        for chunk in chunks:
            if chunk.seq.params.structured_outputs is None:
                continue
            state = self.state(chunk.seq)
            state.follow(chunk.seq.output_token_ids)
            if chunk.draft:
                verifies.append((state.matcher, total, list(chunk.draft)))
            else:
                plain.append((state.matcher, total))
            offsets[chunk.seq.seq_id] = total
            total += 1 + len(chunk.draft)
        if not total:
            return None
        bits = torch.full((total, self.compiler.bitmask_words), -1, dtype=torch.int32)
        fill = self._fill_parallel if total >= self.parallel_rows else self._fill_here
        if not background:
            fill(bits, plain, verifies)
            return PendingBitmask(bits, offsets, None)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return PendingBitmask(bits, offsets, self._thread.submit(fill, bits, plain, verifies))

    def _fill_parallel(self, bits: torch.Tensor, plain, verifies) -> None:
        """llguidance's executor: the matchers on its thread pool, each writing its rows of ``bits``."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        words = bits.shape[1]
        # Both write rows of the same buffer (the executor wants a non-empty draft for the second).
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, bits.shape[0])
        if verifies:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(verifies, bits.data_ptr(), words * 4, bits.shape[0])

    @staticmethod
    def _fill_here(bits: torch.Tensor, plain, verifies) -> None:
        """The same masks in this thread: a verify's matcher walks the drafts the grammar accepts
        (one row each, then the row after them) and is rolled back."""
        row_bytes = bits.shape[1] * 4
        for matcher, row in plain:
            matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), row_bytes)
        for matcher, row, draft in verifies:
            valid = matcher.validate_tokens(draft)
            for i in range(valid + 1):
                matcher.unsafe_compute_mask_ptr(bits[row + i].data_ptr(), row_bytes)
                if i < valid:
                    matcher.consume_token(draft[i])
            if valid:
                matcher.rollback(valid)
