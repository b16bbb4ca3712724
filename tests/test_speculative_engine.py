"""Speculative decoding through the engine: bugs found by trying it as a user would, each pinned.

* a stop token inside an accepted draft run must not feed earlier tokens to the detokenizer twice;
* rows that do not verify keep their logprobs in a step that also verifies another sequence;
* sampled requests keep the model's distribution (rejection sampling, not "accept everything");
* an own-state layer is told how many verify rows were kept, and its outputs depend on it.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from layerzoo import LLM, SamplingParams, hookimpl  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.testing import ProposerPlugin, ScriptedProposer, registered_plugin, running_sum_layer  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def scripted(expected=None, **kw):
    proposer = ScriptedProposer(expected, **kw)
    return proposer, registered_plugin(ProposerPlugin("scripted", proposer), "scripted-proposer")


def spec_llm(path=None, k=3, **engine_args):
    # Fixed k: these tests are about verification, which the adaptive policy would run less often.
    return LLM(path, dtype="float32", speculative_config={"method": "scripted", "num_speculative_tokens": k, "adaptive": False}, **engine_args)


def test_stop_token_inside_an_accepted_draft_run_keeps_the_text_whole():
    prompt = "import os\nimport sys\n"
    plain_llm = LLM(dtype="float32")
    ids = plain_llm.tokenizer.encode(prompt)
    base = plain_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    # Stop at a token first generated deep enough that it arrives inside a verify's accepted run.
    stop = next(t for i, t in enumerate(base.token_ids) if i >= 4 and t not in base.token_ids[:i])
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    plain = plain_llm.generate(prompt, params)[0].outputs[0]
    proposer, plugin = scripted({tuple(ids): base.token_ids}, wrong_every=0)
    with plugin:
        llm = spec_llm(k=4)
    spec = llm.generate(prompt, params)[0].outputs[0]
    assert llm.stats.spec_accepted_tokens > 0
    assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)


def test_logprobs_of_plain_rows_survive_a_step_with_a_verify():
    plain_llm = LLM(dtype="float32")
    ids = plain_llm.tokenizer.encode("def f(x):\n")
    base = plain_llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    proposer, plugin = scripted({tuple(ids): base.token_ids})
    with plugin:
        llm = spec_llm()
    with_logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    other = llm.tokenizer.encode("class A:\n")
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": other}], [GREEDY, with_logprobs])
    assert llm.stats.spec_verify_steps > 0
    assert outs[0].outputs[0].token_ids == base.token_ids
    wanted = outs[1].outputs[0]
    assert len(wanted.logprobs) == len(wanted.token_ids) == 24
    assert all(tok in entry for tok, entry in zip(wanted.token_ids, wanted.logprobs))


def test_sampled_speculative_outputs_keep_the_models_distribution(tiny_qwen3_dir):
    """Always drafting the model's most likely second token must not bias what is sampled there:
    the second token's distribution with speculation matches plain sampling (total variation;
    two plain runs of this size differ by about 0.07), and the drafted token is not over-represented
    (accepting every draft would make it every sample)."""
    prompt = {"prompt_token_ids": [3, 9, 27]}
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)  # drafts need room for one more
    trials = 2000

    def second_tokens(llm):
        return Counter(o.outputs[0].token_ids[1] for o in llm.generate([prompt] * trials, params))

    engine_args = dict(max_num_seqs=256, max_num_batched_tokens=4096)
    plain = second_tokens(LLM(tiny_qwen3_dir, dtype="float32", **engine_args))
    mode = plain.most_common(1)[0][0]
    proposer, plugin = scripted(fixed=[mode], vocab_size=64)
    with plugin:
        llm = spec_llm(tiny_qwen3_dir, k=1, **engine_args)
    spec = second_tokens(llm)
    assert llm.stats.spec_verify_steps == trials and 0 < llm.stats.spec_accepted_tokens < trials
    tv = 0.5 * sum(abs(plain[t] - spec[t]) for t in set(plain) | set(spec)) / trials
    assert tv < 0.15, f"total variation {tv:.3f} between sampled outputs with and without speculation"
    assert spec[mode] < 1.5 * plain[mode] + 40


# -- own-state layers ------------------------------------------------------------------------------

RUNNING_SUM_KIND = "test.running_sum"
RUNNING_SUM_ARCH = "RunningSumQwen3ForCausalLM"


class RunningSumPlugin:
    """Qwen3 whose decoder layers keep a running-sum state of their own (`running_sum_layer`)."""

    def __init__(self, per_draft=True):
        from layerzoo_qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM

        self.per_draft = per_draft
        layer = running_sum_layer(Qwen3DecoderLayer)
        layer.layer_kind = RUNNING_SUM_KIND
        self.layer = layer
        self.model = type(RUNNING_SUM_ARCH, (Qwen3ForCausalLM,), {"decoder_layer": layer})

    @hookimpl
    def register_architectures(self, register):
        register(RUNNING_SUM_ARCH, self.model)

    @hookimpl
    def register_layer_kinds(self, register):
        register(RUNNING_SUM_KIND, self.layer, "Qwen3 decoder with a running-sum state of its own (test)")

    @hookimpl(tryfirst=True)
    def uses_ssm_pool(self, layer_kind):
        return False if layer_kind == RUNNING_SUM_KIND else None

    @hookimpl(tryfirst=True)
    def keeps_per_draft_states(self, layer_kind):
        return self.per_draft if layer_kind == RUNNING_SUM_KIND else None


@pytest.fixture(scope="module")
def running_sum_dir(tiny_qwen3_dir, tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("running-sum") / "model"
    shutil.copytree(tiny_qwen3_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [RUNNING_SUM_ARCH]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_own_state_layer_keeps_exactly_the_verified_rows(running_sum_dir):
    prompts = [[5, 7, 11, 13, 17, 19], [2, 4, 8, 16, 32], [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]]
    with registered_plugin(RunningSumPlugin(), "running-sum"):
        plain = LLM(running_sum_dir, dtype="float32")
        base = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        # The state really matters: the same weights without it decode something else.
        proposer, plugin = scripted({tuple(p): out for p, out in zip(prompts, base)}, vocab_size=64)
        with plugin:
            llm = spec_llm(running_sum_dir)
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert llm.stats.spec_verify_steps > 0 and 0 < llm.stats.spec_accepted_tokens < llm.stats.spec_draft_tokens
    assert outs == base
    assert not llm.engine.states.own


def test_running_sum_state_changes_the_output(running_sum_dir, tiny_qwen3_dir):
    prompt = [{"prompt_token_ids": [5, 7, 11, 13, 17, 19]}]
    without = LLM(tiny_qwen3_dir, dtype="float32").generate(prompt, GREEDY)[0].outputs[0].token_ids
    with registered_plugin(RunningSumPlugin(), "running-sum"):
        with_state = LLM(running_sum_dir, dtype="float32").generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert with_state != without


def test_a_greedy_step_picks_every_row_in_one_argmax_pass(tiny_qwen3_dir):
    """Two verifies and a plain row in one step: all their rows go through one ``argmax_finite``
    call (one per step), the outputs stay those of plain decoding, and NaN logits name the request
    whose rows hold them, not a neighbour's."""
    from layerzoo.kernels import cpp_build
    from layerzoo.runtime.sampler import NonFiniteLogitsError
    from layerzoo.testing import generate_counting_ops

    if not cpp_build.available():
        pytest.skip("needs the C++ kernels")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16]]
    plain = LLM(tiny_qwen3_dir, dtype="float32")
    base = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    # The first two draft their own continuations (every third proposal wrong); the third never drafts.
    proposer, plugin = scripted({tuple(p): out for p, out in zip(prompts[:2], base[:2])})
    with plugin:
        llm = spec_llm(tiny_qwen3_dir)
    steps = llm.stats.steps
    outs, argmax_calls = generate_counting_ops(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY, "layerzoo_cpu::argmax_finite")
    steps = llm.stats.steps - steps
    assert outs == base
    assert llm.stats.spec_verify_steps >= 4  # both drafting sequences verify from the first decode step on
    assert 0 < llm.stats.spec_accepted_tokens < llm.stats.spec_draft_tokens
    assert argmax_calls == steps

    model = llm.engine.runner.model
    real = model.compute_logits

    def nan_in_the_second_verify(hidden):
        logits = real(hidden)
        if hidden.shape[0] > 3:  # a verify step: the plain row, then the verifies' 4 rows each
            logits[-4:].fill_(math.nan)  # the second request's
        return logits

    model.compute_logits = nan_in_the_second_verify
    for request_id, p in zip(["one", "two", "three"], prompts):
        llm.engine.add_request(request_id, p, GREEDY)
    with pytest.raises(NonFiniteLogitsError) as failed:
        llm.engine.run_until_done()
    assert failed.value.request_ids == ["two"]


def test_greedy_verifies_take_the_one_pass_argmax_and_name_a_request_with_nan_logits(tiny_qwen3_dir):
    """A greedy verify picks its targets with the sampler's ``argmax_finite`` (as plain rows do):
    no aten argmax in the run, and NaN logits in a verify fail the request by name instead of
    becoming a token."""
    from layerzoo.kernels import cpp_build
    from layerzoo.runtime.sampler import NonFiniteLogitsError
    from layerzoo.testing import generate_counting_ops

    if not cpp_build.available():
        pytest.skip("needs the C++ kernels")
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    proposer, plugin = scripted(fixed=[5, 6, 7], wrong_every=0)  # drafts every step
    with plugin:
        llm = spec_llm(tiny_qwen3_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, kernel_calls, aten_calls = generate_counting_ops(llm, [prompt], params, "layerzoo_cpu::argmax_finite", "aten::argmax")
    assert llm.stats.spec_verify_steps > 0
    assert kernel_calls > llm.stats.spec_verify_steps and aten_calls == 0

    model = llm.engine.runner.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: real(hidden).fill_(math.nan) if hidden.shape[0] > 1 else real(hidden)  # verifies only
    verifies = llm.stats.spec_verify_steps
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits \(NaN or inf\).*request\(s\) "):
        llm.generate([prompt], params)
    assert llm.stats.spec_verify_steps == verifies  # the verify failed before it was counted
