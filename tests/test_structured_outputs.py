"""Structured outputs (`SamplingParams(structured_outputs=...)`) through the engine.

The embedded tiny model has random-ish weights: left alone it writes no JSON, no regex match and
none of the choices (pinned below), so every valid output here is the grammar mask's doing.
Constrained requests run in batches beside unconstrained ones, which must not change; with
speculation and with preemption the constrained outputs equal the plain ones.
"""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")

from layerzoo import LLM  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.runtime.structured_outputs import GrammarCompiler, GrammarState, StructuredOutputs  # noqa: E402
from layerzoo.sampling import SamplingParams, StructuredOutputsParams  # noqa: E402
from layerzoo.testing import ProposerPlugin, ScriptedProposer, registered_plugin  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2,4}"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= "(" num op num ")"\nop ::= "+" | "-" | "*"\nnum ::= [0-9] | [1-9] [0-9]'
LARK = 'start: "let " NAME " = " NUMBER\nNAME: /[a-z]{1,5}/\nNUMBER: /[0-9]{1,3}/'

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_compact": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
    "lark": StructuredOutputsParams(grammar=LARK),
}
PROMPTS = ["import os\nimport sys\n", "def main():\n", "class Point:\n", "for i in range(10):\n", "x = [", "# a comment"]


def valid(kind: str, text: str) -> bool:
    """Whether ``text`` is in the language of the constraint named ``kind`` (checked without llguidance)."""
    if kind.startswith("json"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return (
            isinstance(value, dict) and set(value) == {"name", "age", "ok"} and isinstance(value["name"], str)
            and len(value["name"]) <= 8 and type(value["age"]) is int and 0 <= value["age"] <= 150
            and isinstance(value["ok"], bool)
        )
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "gbnf":
        return re.fullmatch(r"\((0|[1-9][0-9]?)[-+*](0|[1-9][0-9]?)\)", text) is not None
    if kind == "lark":
        return re.fullmatch(r"let [a-z]{1,5} = [0-9]{1,3}", text) is not None
    raise AssertionError(kind)


def greedy(constraint=None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 64, "structured_outputs": constraint, **kw})


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


def batch(llm, params_by_kind: dict) -> dict:
    """One generate call: each kind's params on its own prompt; kind -> CompletionOutput."""
    kinds = list(params_by_kind)
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))], [params_by_kind[k] for k in kinds])
    return {k: o.outputs[0] for k, o in zip(kinds, outs)}


def mixed_params(constrained: bool) -> dict:
    """Every constraint's greedy request (unconstrained when ``constrained`` is False) and two
    unconstrained requests, one greedy and one seeded sampled."""
    params = {k: greedy(c if constrained else None) for k, c in CONSTRAINTS.items()}
    params["plain_a"] = greedy()
    params["plain_b"] = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    return params


@pytest.fixture(scope="module")
def constrained_greedy(llm):
    """Greedy outputs of every constraint, in one batch with two unconstrained requests."""
    return batch(llm, mixed_params(True))


@pytest.fixture(scope="module")
def unconstrained_greedy(llm):
    """The same batch with no constraint at all."""
    return batch(llm, mixed_params(False))


# -- what the engine produces ---------------------------------------------------------------------


def test_greedy_outputs_are_in_their_language_and_end_there(constrained_greedy):
    for kind in CONSTRAINTS:
        out = constrained_greedy[kind]
        assert valid(kind, out.text), (kind, out.text)
        assert out.finish_reason == "stop", (kind, out.text)


def test_without_the_mask_the_model_writes_none_of_it(unconstrained_greedy):
    """The test above can fail: the same requests unconstrained produce nothing valid."""
    for kind in CONSTRAINTS:
        assert not valid(kind, unconstrained_greedy[kind].text), (kind, unconstrained_greedy[kind].text)


def test_unconstrained_rows_of_a_mixed_batch_are_unchanged(constrained_greedy, unconstrained_greedy):
    for name in ("plain_a", "plain_b"):
        assert constrained_greedy[name].token_ids == unconstrained_greedy[name].token_ids, name
        assert len(constrained_greedy[name].token_ids) > 0


def test_sampled_outputs_are_in_their_language(llm):
    params = {f"{k}#{s}": SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=64, structured_outputs=c)
              for k, c in CONSTRAINTS.items() for s in (1, 2)}
    params["plain"] = SamplingParams(temperature=1.0, seed=3, max_tokens=16)
    for name, out in batch(llm, params).items():
        if name != "plain":
            assert valid(name.split("#")[0], out.text), (name, out.text)
            assert out.finish_reason == "stop", (name, out.text)


def test_n_completions_each_follow_the_grammar(llm):
    (out,) = llm.generate("x = ", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, structured_outputs={"choice": CHOICES}))
    assert len(out.outputs) == 3 and all(o.text in CHOICES for o in out.outputs)


def test_json_object_gives_a_json_object(llm):
    out = llm.generate("{", greedy(StructuredOutputsParams(json_object=True), max_tokens=200))[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert out.text.lstrip().startswith("{")


def test_logprobs_come_from_the_masked_distribution(llm):
    out = llm.generate("x = ", greedy(StructuredOutputsParams(choice=CHOICES), logprobs=3))[0].outputs[0]
    assert out.text in CHOICES
    first = out.logprobs[0]
    allowed_first = {llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in CHOICES}
    best = max(first, key=first.get)
    assert best in allowed_first and first[best] > -1e30


# -- speculation, preemption, prefix cache --------------------------------------------------------


def scripted_llm(drafts: dict, wrong_every: int = 0):
    proposer = ScriptedProposer(drafts, wrong_every=wrong_every, vocab_size=2048)
    with registered_plugin(ProposerPlugin("scripted-so", proposer), "scripted-so-proposer"):
        return LLM(dtype="float32", speculative_config={"method": "scripted-so", "num_speculative_tokens": 4, "adaptive": False})


@pytest.mark.parametrize("parallel_rows", [1, 1000], ids=["thread-pool", "in-thread"])
def test_drafts_the_grammar_forbids_are_rejected_and_outputs_equal_plain_decoding(
    llm, constrained_greedy, unconstrained_greedy, parallel_rows
):
    """Drafts are the UNconstrained continuation (the grammar forbids them) for some requests and
    the constrained one (with every 3rd proposal's last draft wrong) for others: a verify keeps
    only what the grammar and the model agree on, so the outputs equal non-speculative decoding."""
    kinds = list(CONSTRAINTS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    plain = unconstrained_greedy
    drafts = {}
    for i, (kind, prompt) in enumerate(zip(kinds, prompts)):
        ids = tuple(llm.tokenizer.encode(prompt))
        source = plain[kind] if i % 2 else constrained_greedy[kind]
        drafts[ids] = list(source.token_ids)
    spec = scripted_llm(drafts, wrong_every=3)
    spec.engine.structured_outputs.parallel_rows = parallel_rows  # the masks on llguidance's pool or not
    outs = spec.generate(prompts, [greedy(CONSTRAINTS[k]) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].token_ids == constrained_greedy[kind].token_ids, kind
    stats = spec.stats
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens


def test_ngram_speculation_gives_the_plain_constrained_outputs(constrained_greedy):
    spec = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    kinds = list(CONSTRAINTS)
    outs = spec.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))], [greedy(CONSTRAINTS[k]) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].token_ids == constrained_greedy[kind].token_ids, kind
    assert spec.stats.spec_verify_steps > 0


def test_masks_computed_beside_the_forward_pass_give_the_same_outputs(constrained_greedy):
    """The accelerator path: a step's masks on a thread while its passes run (verifies included)."""
    spec = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    spec.engine.runner.overlap_masks = True
    kinds = list(CONSTRAINTS)
    outs = spec.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))], [greedy(CONSTRAINTS[k]) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].token_ids == constrained_greedy[kind].token_ids, kind
    assert spec.engine.structured_outputs._thread is not None


def test_sampled_speculation_stays_in_the_language(monkeypatch):
    from layerzoo.speculative.step_cost import StepCosts

    # Verifies priced at the prior: with measured step times the draft lengths, and so the seeded
    # draws, followed the machine's load, and some runs ended a 64-token JSON answer unclosed.
    monkeypatch.setattr(StepCosts, "observe", lambda self, *args, **kwargs: None)
    spec = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    kinds = list(CONSTRAINTS)
    outs = spec.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))],
                         [SamplingParams(temperature=1.0, seed=11, max_tokens=64, structured_outputs=CONSTRAINTS[k]) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert valid(kind, out.outputs[0].text), (kind, out.outputs[0].text)


def test_preemption_by_recompute_keeps_the_grammar_state(constrained_greedy):
    """A KV cache of 6 blocks of 16 tokens for 8 sequences: they preempt each other over and over;
    the recompute must not advance a matcher twice."""
    per_block = 4 * 2 * 2 * 64 * 4 * 16  # layers, K and V, KV heads, head dim, fp32, block size
    tight = LLM(dtype="float32", kv_cache_memory=6 * per_block, max_model_len=96, max_num_batched_tokens=32,
                enable_prefix_caching=False)
    kinds = list(CONSTRAINTS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    # Two long unconstrained requests first: the constrained ones, admitted after, are the victims.
    outs = tight.generate(["while True:\n", "import re\n"] + prompts, [greedy(), greedy()] + [greedy(CONSTRAINTS[k]) for k in kinds])
    constrained = outs[2:]
    assert sum(o.metrics["preemptions"] for o in constrained) > 0
    for kind, out in zip(kinds, constrained):
        assert out.outputs[0].token_ids == constrained_greedy[kind].token_ids, kind


def test_a_prefix_cache_hit_starts_from_the_grammar_start(llm):
    """A second run of the same long prompts reuses their cached blocks: same constrained outputs."""
    head = "# the answer, in the format asked for, follows after this line of text\n" * 3
    kinds = list(CONSTRAINTS)
    prompts = [head + PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    params = [greedy(CONSTRAINTS[k]) for k in kinds]
    first = llm.generate(prompts, params)
    hits = llm.stats.prefix_cache_hits
    again = llm.generate(prompts, params)
    assert llm.stats.prefix_cache_hits > hits
    for kind, a, b in zip(kinds, first, again):
        assert valid(kind, b.outputs[0].text), (kind, b.outputs[0].text)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, kind


def test_compiled_grammars_are_cached(llm):
    compiler = llm.engine.structured_outputs.compiler
    llm.generate("x", greedy(StructuredOutputsParams(regex="[0-9]{3}"), max_tokens=8))
    compiled = compiler.compiled
    llm.generate(["x", "y"], greedy(StructuredOutputsParams(regex="[0-9]{3}"), max_tokens=8))
    assert compiler.compiled == compiled


def test_tensor_parallel_ranks_sample_under_the_grammar(constrained_greedy):
    """Rank 0 samples (and masks); the workers only run the passes: outputs as in one process."""
    kinds = list(CONSTRAINTS)
    with LLM(dtype="float32", tensor_parallel_size=2) as tp:
        outs = tp.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))], [greedy(CONSTRAINTS[k]) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert valid(kind, out.outputs[0].text), (kind, out.outputs[0].text)
        assert out.outputs[0].token_ids == constrained_greedy[kind].token_ids, kind


# -- the grammar state follows the output tokens --------------------------------------------------


@pytest.fixture(scope="module")
def compiler(llm):
    return GrammarCompiler(llm.tokenizer, llm.loaded.config.vocab_size)


def mask_of(matcher, compiler) -> torch.Tensor:
    import llguidance.torch as llt

    bits = torch.full((1, compiler.bitmask_words), -1, dtype=torch.int32)
    llt.fill_next_token_bitmask(matcher, bits)
    return bits


def test_a_rollback_of_the_output_rolls_the_matcher_back(llm, compiler):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    tokens = llm.tokenizer.encode('{"name":"ab","age":12,"ok":true}', add_special_tokens=False)
    state = GrammarState(compiler.matcher(params), "r")
    state.follow(tokens)
    assert state.matcher.is_accepting()
    state.follow(tokens[:3])  # a rollback (the loop watchdog) cut the output
    fresh = GrammarState(compiler.matcher(params), "r")
    fresh.follow(tokens[:3])
    assert torch.equal(mask_of(state.matcher, compiler), mask_of(fresh.matcher, compiler))
    state.follow(tokens)  # and it grows again
    assert state.matcher.is_accepting() and state.consumed == tokens


@pytest.mark.parametrize("parallel_rows", [1, 1000], ids=["thread-pool", "in-thread"])
def test_verify_rows_get_the_masks_along_the_draft(llm, parallel_rows):
    """Row i of a verify has the mask after i drafts; the row of a forbidden draft forbids it."""
    import attrs

    from layerzoo.runtime.sequence import Sequence

    structured = StructuredOutputs(llm.tokenizer, llm.loaded.config.vocab_size)
    structured.parallel_rows = parallel_rows
    params = greedy(StructuredOutputsParams(regex="ab+c"))
    seq = Sequence(llm.tokenizer.encode("x"), params)
    a, b, c, z = (llm.tokenizer.encode(s, add_special_tokens=False)[0] for s in "abcz")

    @attrs.frozen
    class Verify:  # what `bitmask` reads of a Chunk
        seq: object
        draft: tuple

    mask = structured.bitmask([Verify(seq, (a, b, z, c))])
    allowed = ((mask.bits[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1).bool()
    assert mask.rows.tolist() == [0, 1, 2, 3, 4]
    assert allowed[0, a] and not allowed[0, b]  # nothing consumed: only "a"
    assert allowed[1, b] and not allowed[1, c]  # after "a": "b"
    assert allowed[2, b] and allowed[2, c] and not allowed[2, z]  # after "ab": the draft z is forbidden
    assert allowed[3:].all()  # past the forbidden draft: never used
    assert structured.state(seq).consumed == []  # the draft walk was rolled back


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": SCHEMA, "regex": "a"}, "got json and regex"),
        ({"regex": "a(b"}, "StructuredOutputsParams.regex: invalid regex: .*unclosed group"),
        ({"json": {"type": "wat"}}, "StructuredOutputsParams.json: invalid JSON schema: .*wat"),
        ({"json": "{not json"}, "StructuredOutputsParams.json: expected a JSON schema, got text that is not JSON"),
        ({"json": [1]}, "StructuredOutputsParams.json: expected a JSON schema"),
        ({"grammar": "start: foo"}, "StructuredOutputsParams.grammar: invalid grammar: .*foo"),
        ({"grammar": ""}, "StructuredOutputsParams.grammar: expected a Lark or GBNF grammar"),
        ({"choice": []}, "StructuredOutputsParams.choice: expected a non-empty list"),
        ({"choice": ["a", 1]}, "StructuredOutputsParams.choice: expected a non-empty list of non-empty strings"),
        ({"regex": 5}, "StructuredOutputsParams.regex: expected a regex string"),
        ({"structural_tag": "{}"}, "StructuredOutputsParams.structural_tag: not supported"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(UserError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refusals():
    with pytest.raises(UserError, match="SamplingParams.ignore_eos: cannot be True with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(UserError, match="SamplingParams.min_tokens: expected 0 with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})
    with pytest.raises(UserError, match="SamplingParams.structured_outputs: unknown field\\(s\\) jsn \\(expected some of json, regex"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(UserError, match="SamplingParams.structured_outputs: expected a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"choice": ("a", "b")}).structured_outputs.choice == ["a", "b"]


def test_a_model_without_a_tokenizer_refuses_constraints(llm):
    from layerzoo.tokenization.token_ids_only import TokenIdsOnly

    structured = StructuredOutputs(TokenIdsOnly(2048, [0]), 2048)
    with pytest.raises(UserError, match="structured_outputs: the model runs without a tokenizer"):
        structured.check(StructuredOutputsParams(regex="a"))
