"""Speculative decoding's building blocks: config, n-gram proposer, acceptance rules, target_probs, registry."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layerzoo import hookimpl
from layerzoo.errors import PluginConflict, UserError
from layerzoo.plugins.manager import PluginRegistry, get_registry
from layerzoo.runtime.sampler import Sampler, SamplingRow, target_probs
from layerzoo.sampling import SamplingParams
from layerzoo.speculative import NgramProposer, Proposer, SpeculativeConfig, build_proposer
from layerzoo.speculative.acceptance import greedy_accept, rejection_sample, rejection_sample_batch

# -- config --------------------------------------------------------------------------------------


def test_config_parses_a_vllm_style_dict():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=1)
    defaults = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')  # a CLI flag's JSON
    assert (defaults.prompt_lookup_max, defaults.prompt_lookup_min) == (3, 1)
    assert SpeculativeConfig.parse(config) is config


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
WHERE = "speculative_config"


@pytest.mark.parametrize(
    "value,message",
    [
        ({**NGRAM, "lookahead": 2}, f"{WHERE}: unknown key 'lookahead' (expected one of: method,"),
        ({**NGRAM, "num_speculative_tokens": 0}, f"{WHERE}.num_speculative_tokens: expected an int >= 1, got 0"),
        ({**NGRAM, "num_speculative_tokens": "4"}, f"{WHERE}.num_speculative_tokens: expected an int >= 1, got '4'"),
        ({**NGRAM, "num_speculative_tokens": True}, f"{WHERE}.num_speculative_tokens: expected an int >= 1, got True"),
        ({**NGRAM, "method": 3}, f"{WHERE}.method: expected a non-empty string, got 3"),
        ({**NGRAM, "prompt_lookup_max": 2.0}, f"{WHERE}.prompt_lookup_max: expected an int >= 1, got 2.0"),
        ({**NGRAM, "prompt_lookup_min": 4}, f"{WHERE}.prompt_lookup_min: expected at most prompt_lookup_max (3), got 4"),
        ({"method": "ngram"}, f"{WHERE}.num_speculative_tokens: required key is missing"),
        (["ngram", 4], f"{WHERE}: expected a dict of settings, got list"),
        ("{not json", f"{WHERE}: expected a JSON object"),
    ],
)
def test_config_errors_name_the_key_and_what_was_expected(value, message):
    with pytest.raises(UserError) as info:
        SpeculativeConfig.parse(value)
    assert message in str(info.value)


# -- n-gram proposer -----------------------------------------------------------------------------


def brute_force_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The definition, literally: longest n first, then the most recent earlier occurrence; what
    followed it, continued with the period it implies where it runs into the end."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                period = length - n - i  # the suffix repeats the tokens this far back
                return [tokens[i + n + j % period] for j in range(k)]
    return []


def test_ngram_proposes_what_followed_the_most_recent_match():
    proposer = NgramProposer(prompt_lookup_max=2, prompt_lookup_min=1)
    #           0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 9, 1, 2, 7, 5, 1, 2]
    assert proposer.propose(tokens, 3) == [7, 5, 1]


def test_ngram_prefers_the_longer_match_over_a_more_recent_shorter_one():
    tokens = [3, 1, 2, 8, 1, 2, 9, 3, 1, 2]
    assert NgramProposer(3, 1).propose(tokens, 3) == [8, 1, 2]
    assert NgramProposer(2, 1).propose(tokens, 3) == [9, 3, 1]


def test_ngram_continues_a_repeat_past_the_end_and_proposes_nothing_without_a_match():
    proposer = NgramProposer(3, 1)
    # What followed the match runs into the end: the text repeats with that period, so the draft does.
    assert proposer.propose([5, 6, 5, 6], 4) == [5, 6, 5, 6]
    assert proposer.propose([1, 1, 1, 1], 4) == [1, 1, 1, 1]  # the occurrence may overlap the suffix
    assert proposer.propose([4, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert proposer.propose([1, 2, 3, 4], 4) == []
    assert proposer.propose([7], 4) == [] and proposer.propose([], 4) == []
    assert proposer.propose([5, 6, 5, 6], 0) == []
    assert NgramProposer(3, 2).propose([1, 2, 3, 1], 2) == []  # only a 1-gram matches
    assert NgramProposer(3, 1).propose([1, 2, 3, 1], 2) == [2, 3]


def test_proposer_protocol_and_batch_default():
    proposer = NgramProposer(2, 1)
    assert isinstance(proposer, Proposer)
    batch = [[1, 2, 9, 1, 2], [4, 5, 6], (8, 8)]
    assert proposer.propose_batch(batch, 2) == [[9, 1], [], [8, 8]]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 5),
    n_max=st.integers(1, 4),
    data=st.data(),
)
def test_ngram_matches_the_brute_force_definition(tokens, k, n_max, data):
    n_min = data.draw(st.integers(1, n_max))
    assert NgramProposer(n_max, n_min).propose(tokens, k) == brute_force_ngram(tokens, k, n_max, n_min)


def test_ngram_is_linear_on_long_sequences():
    # Adversarial for a candidate scan: the last token occurs every other position, never followed
    # by a longer match, so every candidate is visited. Quadratic code would take minutes.
    tokens = [t for i in range(10_000) for t in (0, i + 1)] + [0]
    start = time.perf_counter()
    assert NgramProposer(3, 1).propose(tokens, 4) == [10_000, 0, 10_000, 0]
    assert time.perf_counter() - start < 1.0


# -- greedy acceptance ---------------------------------------------------------------------------


def test_greedy_accept_all_first_rejected_and_middle():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == (3, [5, 6, 7, 8])  # all accepted: k + 1 tokens
    assert greedy_accept([5, 6, 7], [4, 6, 7, 8]) == (0, [4])  # first rejected: the target's token
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == (1, [5, 9])
    assert greedy_accept([], [3]) == (0, [3])
    assert greedy_accept([5, 6], torch.tensor([5, 6, 2])) == (2, [5, 6, 2])
    with pytest.raises(ValueError, match="expected 3 target tokens for 2 drafts"):
        greedy_accept([5, 6], [5, 6])


# -- rejection sampling: the target distribution, exactly ----------------------------------------

V, K, TRIALS = 5, 3, 40_000
P_VALUE = 1e-3  # at a fixed seed the test is deterministic; this only sets how far off "off" is


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of a chi-square goodness-of-fit test of ``samples`` (ids) against ``probs [V]``."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target gives probability 0 was emitted"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return float((empirical - probs.double()).abs().sum() / 2)


def dist(seed: int, rows: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * sharp, dim=-1)


P = dist(1, K + 1)  # the target's rows 0..K (row K: the bonus)
Q = dist(2, K)  # a draft model's rows, quite unlike P


def assert_follows_target(num_accepted: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor) -> None:
    """First token ~ p_0; second, given the first draft was accepted, ~ p_1; the bonus ~ p_K."""
    for position, mask in ((0, num_accepted >= 0), (1, num_accepted >= 1), (K, num_accepted == K)):
        samples = tokens[mask, position]
        assert samples.numel() > 2000, (position, samples.numel())
        assert chi_square_p_value(samples, p[position]) > P_VALUE, position
        assert total_variation(samples, p[position]) < 0.03, position


def draws_from(q: torch.Tensor, seed: int) -> torch.Tensor:
    """``[TRIALS, K]`` drafts, position i drawn from ``q[i]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=gen) for i in range(K)], dim=1)


def test_rejection_sampling_with_deterministic_drafts_preserves_the_target():
    drafts = P[:K].argmax(dim=-1).expand(TRIALS, K)  # likely drafts, so that all K are accepted often
    gen = torch.Generator().manual_seed(0)
    num, tokens = rejection_sample_batch(drafts, P.expand(TRIALS, -1, -1), None, generator=gen)
    assert_follows_target(num, tokens, P)
    # A deterministic draft is accepted with probability p_i(d_i).
    assert abs((num >= 1).double().mean() - P[0].max()) < 0.01
    emitted = torch.arange(K + 1)[None, :] <= num[:, None]
    assert ((tokens >= 0) == emitted).all()


def test_rejection_sampling_with_a_draft_distribution_preserves_the_target():
    drafts = draws_from(Q, seed=3)
    gen = torch.Generator().manual_seed(4)
    num, tokens = rejection_sample_batch(drafts, P.expand(TRIALS, -1, -1), Q.expand(TRIALS, -1, -1), generator=gen)
    assert_follows_target(num, tokens, P)
    # Acceptance rate of position 0: sum_x min(p(x), q(x)).
    assert abs((num >= 1).double().mean() - torch.minimum(P[0], Q[0]).sum()) < 0.01


def test_the_test_catches_wrong_rules():
    drafts = draws_from(Q, seed=5)
    # Always accepting emits the drafts themselves: distributed as q, not p.
    assert chi_square_p_value(drafts[:, 0], P[0]) < 1e-9
    # The right rule with the wrong q (another position's row).
    gen = torch.Generator().manual_seed(6)
    _, tokens = rejection_sample_batch(drafts, P.expand(TRIALS, -1, -1), Q[[1, 2, 0]].expand(TRIALS, -1, -1), generator=gen)
    assert chi_square_p_value(tokens[:, 0], P[0]) < 1e-9
    # Redrawing from p after a rejection, instead of from max(0, p - q): p's mass where q is high
    # is counted twice.
    num, tokens = rejection_sample_batch(drafts, P.expand(TRIALS, -1, -1), Q.expand(TRIALS, -1, -1), generator=gen)
    first = tokens[:, 0].clone()
    rejected = num == 0
    first[rejected] = torch.multinomial(P[0], int(rejected.sum()), replacement=True, generator=gen)
    assert chi_square_p_value(first, P[0]) < 1e-9
    # (Ignoring q altogether is no bug: the deterministic rule is exact for any draft distribution,
    # it only accepts less often.)
    _, tokens = rejection_sample_batch(drafts, P.expand(TRIALS, -1, -1), None, generator=gen)
    assert chi_square_p_value(tokens[:, 0], P[0]) > P_VALUE


def test_single_sequence_rejection_sample_follows_the_target():
    gen = torch.Generator().manual_seed(7)
    first = []
    for _ in range(3000):
        num, tokens = rejection_sample([1, 3, 0], P, None, generator=gen)
        assert len(tokens) == num + 1 and tokens[:num] == [1, 3, 0][:num]
        first.append(tokens[0])
    assert chi_square_p_value(torch.tensor(first), P[0]) > P_VALUE
    # Seeded: the same generator state gives the same result.
    a = rejection_sample([1, 3, 0], P, Q, generator=torch.Generator().manual_seed(11))
    b = rejection_sample([1, 3, 0], P, Q, generator=torch.Generator().manual_seed(11))
    assert a == b


def one_hot(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_targets_make_rejection_sampling_greedy_acceptance():
    gen = torch.Generator().manual_seed(8)
    for _ in range(200):
        draft = torch.randint(0, 3, (K,), generator=gen).tolist()
        argmax = torch.randint(0, 3, (K + 1,), generator=gen).tolist()
        assert rejection_sample(draft, one_hot(argmax), None, generator=gen) == greedy_accept(draft, argmax)


def test_certain_acceptance_and_empty_residuals_are_safe():
    # p_i(d_i) == 1: always accepted, the bonus from p_K.
    num, tokens = rejection_sample([2, 4], one_hot([2, 4, 1]), None)
    assert (num, tokens) == (2, [2, 4, 1])
    # q == p: never rejected.
    num, tokens = rejection_sample([1, 3, 0], P, P[:K].clone(), generator=torch.Generator().manual_seed(0))
    assert num == K
    # q above p everywhere (not a distribution, but rounding gets close): a rejection leaves no
    # residual mass, and the draw falls back to p instead of dividing 0 by 0.
    gen = torch.Generator().manual_seed(1)
    drafts = torch.tensor([[1, 3, 0]]).expand(2000, K)
    num, tokens = rejection_sample_batch(drafts, P.expand(2000, -1, -1), 2 * P[:K].expand(2000, -1, -1), generator=gen)
    assert (num < K).any()
    emitted = tokens[torch.arange(2000), num]
    assert ((emitted >= 0) & (emitted < V)).all()


def test_short_drafts_and_no_drafts():
    # k == 0: one token from p_0.
    assert rejection_sample([], one_hot([3]), None) == (0, [3])
    # Rows with fewer drafts than k stop there and take their bonus from p_len.
    target = torch.stack([one_hot([1, 2, 3, 4])] * 3)
    drafts = torch.tensor([[-1, -1, -1], [1, -1, -1], [1, 2, 3]])
    num, tokens = rejection_sample_batch(drafts, target, None, draft_lens=torch.tensor([0, 1, 3]))
    assert num.tolist() == [0, 1, 3]
    assert tokens.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1], [1, 2, 3, 4]]


def test_per_row_generators_make_a_seeded_row_independent_of_the_batch():
    drafts = torch.tensor([[1, 3, 0], [1, 3, 0]])
    alone = rejection_sample_batch(drafts[:1], P[None], Q[None], generator=[torch.Generator().manual_seed(5)])
    batched = rejection_sample_batch(
        drafts, P.expand(2, -1, -1), Q.expand(2, -1, -1), generator=[torch.Generator().manual_seed(5), None]
    )
    assert alone[0][0] == batched[0][0] and alone[1][0].tolist() == batched[1][0].tolist()


# -- target_probs: the Sampler's own distribution ------------------------------------------------


def sampling_row(params: SamplingParams, output=(), generator=None, eos=()) -> SamplingRow:
    return SamplingRow(
        params=params, generator=generator, prompt_token_ids=(1, 2), output_token_ids=output, eos_token_ids=eos
    )


def test_target_probs_is_one_hot_at_the_samplers_greedy_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    rows = [
        sampling_row(SamplingParams(temperature=0)),
        sampling_row(SamplingParams(temperature=0, repetition_penalty=3.0), output=(int(logits[1].argmax()),)),
        sampling_row(SamplingParams(temperature=0, min_tokens=2), eos=(int(logits[2].argmax()),)),
    ]
    probs = target_probs(logits, rows)
    tokens = Sampler()(logits, rows).token_ids
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor(tokens), 20).float())
    assert tokens[1] != int(logits[1].argmax()) and tokens[2] != int(logits[2].argmax())


def test_target_probs_applies_temperature_top_k_and_min_tokens_like_the_sampler():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.7, top_k=4, min_tokens=1)
    eos = int(logits[0].topk(2).indices[1])  # one of the top 4, masked until a token is generated
    probs = target_probs(logits, [sampling_row(params, eos=(eos,))])[0]
    masked = logits[0].clone()
    masked[eos] = float("-inf")
    keep = masked.topk(4).indices
    expected = torch.zeros(20)
    expected[keep] = torch.softmax(masked[keep] / 0.7, dim=-1)
    torch.testing.assert_close(probs, expected)


def test_target_probs_matches_the_samplers_empirical_distribution():
    vocab, trials = 8, 30_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(
        temperature=1.2, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
    )
    row = sampling_row(params, output=(0, 0, 3))
    probs = target_probs(logits, [row])[0]
    assert abs(float(probs.sum()) - 1) < 1e-5 and (probs == 0).any()  # top-p dropped something
    torch.manual_seed(3)
    samples = torch.tensor(Sampler()(logits.expand(trials, -1), [row] * trials).token_ids)
    assert chi_square_p_value(samples, probs) > P_VALUE


def test_target_probs_rejects_a_shape_mismatch():
    with pytest.raises(ValueError, match="R = 2 rows"):
        target_probs(torch.zeros(3, 4), [sampling_row(SamplingParams())] * 2)


# -- the registry --------------------------------------------------------------------------------


class ToyProposer:
    def __init__(self, config):
        self.k = config.num_speculative_tokens

    def propose(self, token_ids, k):
        return [token_ids[-1]] * k

    def propose_batch(self, token_ids, k):
        return [self.propose(ids, k) for ids in token_ids]


class ToyPlugin:
    @hookimpl
    def register_proposers(self, register):
        register("toy", ToyProposer)
        register("toy-lazy", "test_speculative_primitives:ToyProposer")


def test_builtin_ngram_proposer_is_registered_lazily():
    registry = get_registry()
    reg = registry.proposers.entries["ngram"]
    assert (reg.plugin, reg.target) == ("layerzoo.speculative", "layerzoo.speculative.proposers:NgramProposer.from_config")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=2)
    proposer = registry.proposer("ngram")(config)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.prompt_lookup_max, proposer.prompt_lookup_min) == (5, 2)
    assert isinstance(build_proposer(config), NgramProposer)


def test_unknown_method_lists_the_registered_ones():
    with pytest.raises(UserError) as info:
        get_registry().proposer("eagle")
    assert "unknown method 'eagle'" in str(info.value) and "'ngram'" in str(info.value)


def test_a_plugin_adds_a_proposer():
    registry = get_registry()
    registry.add_plugin(ToyPlugin(), name="toyspec")
    try:
        config = SpeculativeConfig(method="toy", num_speculative_tokens=2)
        proposer = build_proposer(config)
        assert isinstance(proposer, ToyProposer) and proposer.propose([4, 7], 2) == [7, 7]
        assert registry.proposers.entries["toy-lazy"].target == "test_speculative_primitives:ToyProposer"
        with pytest.raises(UserError, match="registered: 'mtp', 'ngram', 'toy', 'toy-lazy'"):
            registry.proposer("eagle")
    finally:
        registry.remove_plugin("toyspec")
    with pytest.raises(UserError, match="unknown method 'toy'"):
        registry.proposer("toy")


def test_two_plugins_claiming_a_method_conflict_until_one_is_preferred():
    class Mine:
        @hookimpl
        def register_proposers(self, register):
            register("ngram", ToyProposer)

    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    registry.add_plugin(Mine(), name="mine")
    with pytest.raises(PluginConflict, match="'layerzoo.speculative' and 'mine'"):
        registry.proposer("ngram")
    preferring = PluginRegistry(env={"LAYERZOO_PLUGINS": "", "LAYERZOO_PREFER": "ngram=mine"})
    preferring.load()
    preferring.add_plugin(Mine(), name="mine")
    assert preferring.proposer("ngram") is ToyProposer
