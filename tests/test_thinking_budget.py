"""Thinking budgets (``SamplingParams(thinking_token_budget=N)``, layerzoo.runtime.thinking_budget): after N
generated reasoning tokens the chat format's ``</think>`` is forced, then the answer follows.

End to end on the embedded random-weight Qwen3 (Hermes format: ``<think>`` / ``</think>``, five and
six tokens in its small vocabulary) given a template that opens ``<think>`` unless
``enable_thinking`` is false. The random model never closes its reasoning by itself, so without a
budget everything it writes is reasoning."""

from __future__ import annotations

import json

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.errors import UserError
from layerzoo.loading.model_packages import DEFAULT_MODEL
from layerzoo.runtime.sampler import apply_token_bitmask
from layerzoo.runtime.thinking_budget import ThinkingBudgets, one_token_bits

THINKING = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking-qwen3")
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "tokenizer_config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    cut = config["chat_template"].index("{%- if add_generation_prompt %}")
    config["chat_template"] = config["chat_template"][:cut] + THINKING
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir))


def end_ids(llm) -> list[int]:
    return llm.tokenizer.encode("</think>", add_special_tokens=False)


def find(ids: list[int], marker: list[int]) -> int:
    return next((i for i in range(len(ids) - len(marker) + 1) if ids[i:i + len(marker)] == marker), -1)


@pytest.mark.parametrize("budget", [0, 3, 8])
def test_the_reasoning_stops_at_the_budget_and_the_answer_follows(llm, budget):
    (free,) = llm.chat(ASK, SamplingParams(max_tokens=30, temperature=0))
    (out,) = llm.chat(ASK, SamplingParams(max_tokens=30, temperature=0, thinking_token_budget=budget))
    ids, end = out.outputs[0].token_ids, end_ids(llm)
    assert len(end) > 1 and find(free.outputs[0].token_ids, end) == -1  # unbudgeted: never closed
    assert find(ids, end) == budget  # exactly N reasoning tokens, then the marker
    assert ids[:budget] == free.outputs[0].token_ids[:budget]  # nothing changes before it
    c = out.outputs[0]
    assert len(llm.tokenizer.encode(c.reasoning_content or "", add_special_tokens=False)) <= budget
    assert c.content and "</think>" not in c.content and len(ids) == 30


def test_sampled_rows_are_forced_too(llm):
    for seed in (1, 2, 3):
        (out,) = llm.chat(ASK, SamplingParams(max_tokens=24, temperature=1.0, seed=seed, thinking_token_budget=5))
        ids = out.outputs[0].token_ids
        assert ids[5:5 + len(end_ids(llm))] == end_ids(llm), ids


def test_no_budget_change_without_open_reasoning(llm):
    # enable_thinking false: the template closes the reasoning in the prompt; nothing is forced.
    off = {"enable_thinking": False}
    (plain,) = llm.chat(ASK, SamplingParams(max_tokens=20, temperature=0), chat_template_kwargs=off)
    (budgeted,) = llm.chat(ASK, SamplingParams(max_tokens=20, temperature=0, thinking_token_budget=0), chat_template_kwargs=off)
    assert budgeted.outputs[0].token_ids == plain.outputs[0].token_ids


def test_speculative_verification_accepts_only_the_forced_marker(model_dir, llm):
    spec = LLM(str(model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    for budget in (0, 3, 7):
        params = SamplingParams(max_tokens=30, temperature=0, thinking_token_budget=budget)
        (want,) = llm.chat(ASK, params)
        (got,) = spec.chat(ASK, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    stats = spec.engine.stats
    # The n-gram drafts repeat the reasoning's pattern: the ones at the forced marker are rejected.
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_refused_beside_a_grammar_and_out_of_range():
    with pytest.raises(UserError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(UserError, match="thinking_token_budget: cannot be combined with structured_outputs"):
        SamplingParams(thinking_token_budget=4, structured_outputs={"regex": "a+"})


def test_tool_choice_required_keeps_its_grammar_within_the_budget(llm):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
    (out,) = llm.chat(ASK, SamplingParams(max_tokens=60, temperature=0, thinking_token_budget=2), tools=tools,
                      tool_choice="required")
    c = out.outputs[0]
    assert c.tool_calls and c.tool_calls[0].name == "get_time" and not c.reasoning_content


# -- the state machine, on made-up token ids --------------------------------------------------------

START, END = (90, 91), (92, 93, 94)


class Seq:
    def __init__(self, prompt, output, budget):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)
        self.params = SamplingParams(thinking_token_budget=budget)


def forced_after(budgets, seq) -> int | None:
    return budgets.forced(budgets.state(seq))


def test_a_marker_the_model_writes_opens_and_closes_the_count():
    b = ThinkingBudgets(START, END, vocab_size=100)
    seq = Seq([1, 2], [5, 90, 91, 6, 7], budget=3)  # the model opened <think> itself, then 2 tokens
    assert not b.opening(seq.prompt_token_ids) and forced_after(b, seq) is None
    seq.output_token_ids.append(8)  # the third: the marker's first token is next
    assert forced_after(b, seq) == 92
    seq.output_token_ids += [92]
    assert forced_after(b, seq) == 93
    seq.output_token_ids += [93, 94]
    assert forced_after(b, seq) is None  # closed: the answer runs free
    seq.output_token_ids += [1] * 10
    assert forced_after(b, seq) is None
    closed = Seq([1, 90, 91, 6, 92, 93, 94], [4, 4, 4, 4], budget=0)  # the prompt closed its reasoning
    assert forced_after(b, closed) is None
    itself = Seq([90, 91], [6, 92, 93, 94, 6, 6], budget=5)  # the model closed it before the budget
    assert forced_after(b, itself) is None


def test_the_state_follows_a_cut_output_and_a_verifys_drafts():
    b = ThinkingBudgets(START, END, vocab_size=100)
    seq = Seq([7, 90, 91], [1, 2, 3], budget=3)
    assert forced_after(b, seq) == 92
    seq.output_token_ids = [1, 2]  # a stop string or a rollback cut a token
    assert forced_after(b, seq) is None

    class Chunk:
        draft = (4, 92, 93)

    Chunk.seq = seq
    mask = b.bitmask([Chunk])
    # Rows: after [1,2] (free), after +4 (force 92), after +92 (force 93), after +93 (force 94)
    assert mask.rows.tolist() == [1, 2, 3]
    logits = torch.zeros(4, 100)
    apply_token_bitmask(logits, mask)
    assert logits[1:].argmax(-1).tolist() == [92, 93, 94] and bool((logits[0] == 0).all())


def test_one_token_bits_cover_the_sign_bit():
    tokens = [0, 31, 32, 63, 99]
    bits = one_token_bits(tokens, vocab_size=100)
    logits = torch.randn(len(tokens), 100)
    apply_token_bitmask(logits, type("M", (), {"bits": bits, "rows": torch.arange(len(tokens))})())
    assert logits.argmax(-1).tolist() == tokens
    assert ((logits > torch.finfo(logits.dtype).min).sum(-1) == 1).all()
