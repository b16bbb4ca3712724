"""``SamplingParams(logit_bias={token_id: bias})`` (OpenAI's ``logit_bias``): the bias is added to
the token's logit in the sampler, for the whole batch at once, before penalties and sampling;
+100 forces a token and -100 bans one, greedy and sampled; logprobs stay the raw model's.
"""

import pytest
import torch

from layerzoo.errors import UserError
from layerzoo.runtime.sampler import Sampler, SamplingRow, target_probs
from layerzoo.sampling import SamplingParams


def rows_of(params_list, seed=0):
    return [SamplingRow(params=p, generator=torch.Generator().manual_seed(seed + i), prompt_token_ids=[1],
                        output_token_ids=[]) for i, p in enumerate(params_list)]


def test_validation():
    for bad in ({1: 101}, {1: -100.5}, {-1: 1.0}, {True: 1.0}, {"5": 1.0}, {1: float("nan")}, {1: True}, [1, 2]):
        with pytest.raises(UserError, match="SamplingParams.logit_bias"):
            SamplingParams(logit_bias=bad)
    given = {3: 100, 4: -100.0}
    params = SamplingParams(logit_bias=given)
    given[5] = 1.0  # a copy: later edits change nothing
    assert params.logit_bias == {3: 100, 4: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_sampler_forces_and_bans_per_row_greedy_and_sampled():
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(6, vocab) * 3
    top = logits.argmax(dim=-1).tolist()
    forced = [(b * 7 + 3) % vocab for b in range(6)]
    params = [
        SamplingParams(temperature=0, logit_bias={forced[0]: 100}),
        SamplingParams(temperature=1.0, logit_bias={forced[1]: 100}, logprobs=2),
        SamplingParams(temperature=0, logit_bias={top[2]: -100}),
        SamplingParams(temperature=1.0, logit_bias={top[3]: -100}),
        SamplingParams(temperature=0),  # no bias: unchanged
        SamplingParams(temperature=0, logit_bias={forced[5]: 0.5, (forced[5] + 1) % vocab: -0.5}),
    ]
    sampler = Sampler()
    for seed in range(20):
        out = sampler(logits.clone(), rows_of(params, seed))
        assert out.token_ids[0] == forced[0] and out.token_ids[1] == forced[1]
        assert out.token_ids[2] != top[2] and out.token_ids[3] != top[3]
        assert out.token_ids[2] == logits[2].clone().index_fill_(0, torch.tensor([top[2]]), -1e9).argmax().item()
        assert out.token_ids[4] == top[4]
        want = logits[5].clone()
        want[forced[5]] += 0.5
        want[(forced[5] + 1) % vocab] -= 0.5
        assert out.token_ids[5] == want.argmax().item()
        # logprobs are the raw model's: the bias does not show in them
        raw = torch.log_softmax(logits[1], dim=-1)
        assert out.logprobs[1] == pytest.approx(raw[forced[1]].item(), abs=1e-5)
    # the distribution speculative verification checks drafts against has the bias too
    probs = target_probs(logits.clone(), rows_of(params))
    assert probs[0, forced[0]] == 1.0 and probs[1, forced[1]] > 0.999
    assert probs[2, top[2]] == 0.0 and probs[3, top[3]] < 1e-30


@pytest.fixture(scope="module")
def llm():
    from layerzoo.llm import LLM

    torch.set_num_threads(1)
    return LLM()


def first_tokens(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_generate_forces_and_bans(llm):
    prompt = "import os\n"
    plain = first_tokens(llm, prompt, SamplingParams(temperature=0, max_tokens=4))
    token = 77
    for temperature in (0, 1.0):
        forced = first_tokens(llm, prompt, SamplingParams(temperature=temperature, seed=3, max_tokens=4, ignore_eos=True,
                                                          logit_bias={token: 100}))
        assert forced == [token] * 4
    banned = first_tokens(llm, prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={plain[0]: -100}))
    assert banned[0] != plain[0]
    # sampled: a banned token never comes, where it is the most likely one
    outs = llm.generate([prompt] * 8, SamplingParams(temperature=1.0, seed=1, max_tokens=1, logit_bias={plain[0]: -100}),
                        use_tqdm=False)
    assert all(o.outputs[0].token_ids[0] != plain[0] for o in outs)
    # a batch mixing biased and plain requests: the plain one is unchanged
    mixed = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100}),
                                            SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == [token] * 4 and mixed[1].outputs[0].token_ids == plain


def test_token_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.loaded.config.vocab_size
    with pytest.raises(UserError, match=rf"logit_bias: token id {vocab} is outside the vocabulary"):
        llm.generate("x", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)


def test_speculative_decoding_keeps_the_bias(llm):
    """Drafts are verified against the biased distribution: speculative == plain, greedy and seeded."""
    from layerzoo.llm import LLM

    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                   "adaptive": False})
    prompt = "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\n"
    plain = first_tokens(llm, prompt, SamplingParams(temperature=0, max_tokens=12))
    for params in (SamplingParams(temperature=0, max_tokens=12, logit_bias={plain[0]: -100, plain[3]: -100}),
                   SamplingParams(temperature=0.8, seed=4, max_tokens=12, logit_bias={plain[1]: 5.0})):
        want = first_tokens(llm, prompt, params)
        assert first_tokens(spec, prompt, params) == want
        if params.temperature == 0:
            assert plain[0] not in want and want != plain
    assert spec.stats.spec_draft_tokens > 0
