"""The batched sampler against naive per-row references, plus seeding, statistics and validation."""

from __future__ import annotations

import math

import pytest
import torch

from layerzoo.errors import UserError
from layerzoo.runtime.sampler import Sampler, SamplingRow, apply_min_p, apply_penalties, apply_top_k_top_p
from layerzoo.sampling import SamplingParams

V = 50


def row(params: SamplingParams, prompt=(1, 2, 3), output=(), generator=None, eos=()) -> SamplingRow:
    return SamplingRow(params=params, generator=generator, prompt_token_ids=prompt, output_token_ids=output, eos_token_ids=eos)


def random_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(logits: torch.Tensor) -> list[set[int]]:
    """The ids left finite in each row of ``[B, V]``."""
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in logits]


# -- naive references: one row at a time, plain Python over the vocabulary -----------------------


def ref_softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    return [e / sum(exps) for e in exps]


def ref_top_k(values: list[float], k: int) -> set[int]:
    return set(sorted(range(len(values)), key=lambda i: -values[i])[:k])


def ref_top_p(values: list[float], p: float) -> set[int]:
    probs = ref_softmax(values)
    keep, mass = set(), 0.0
    for i in sorted(range(len(values)), key=lambda i: -probs[i]):
        if probs[i] == 0:
            break
        keep.add(i)
        mass += probs[i]
        if mass >= p:  # the minimal prefix whose mass reaches p
            break
    return keep


def ref_min_p(values: list[float], min_p: float) -> set[int]:
    probs = ref_softmax(values)
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def ref_penalties(values: list[float], p: SamplingParams, prompt, output) -> list[float]:
    out = list(values)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = list(output).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def ref_distribution(values: list[float], p: SamplingParams) -> list[float]:
    """softmax(logits / T) after min-p, top-k, then top-p over the renormalised survivors."""
    scaled = [v / p.temperature for v in values]
    keep = set(range(len(values)))
    if p.min_p > 0:
        keep &= ref_min_p(scaled, p.min_p)
    if p.top_k > 0:
        keep &= ref_top_k([v if i in keep else -math.inf for i, v in enumerate(scaled)], p.top_k)
    if p.top_p < 1:
        keep &= ref_top_p([v if i in keep else -math.inf for i, v in enumerate(scaled)], p.top_p)
    return ref_softmax([v if i in keep else -math.inf for i, v in enumerate(scaled)])


# -- filters and penalties ------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_per_row():
    logits = random_logits(6)
    ks = [1, 2, 5, 17, 49, V]
    filtered = apply_top_k_top_p(logits, torch.tensor(ks), torch.ones(6))
    for b, (k, keep) in enumerate(zip(ks, kept(filtered))):
        assert keep == ref_top_k(logits[b].tolist(), k) and len(keep) == k
        assert torch.equal(filtered[b][list(keep)], logits[b][list(keep)])  # survivors are untouched


def test_top_k_keeps_exactly_k_even_with_ties():
    filtered = apply_top_k_top_p(torch.zeros(1, 10), torch.tensor([3]), torch.ones(1))
    assert len(kept(filtered)[0]) == 3


def test_top_p_keeps_the_minimal_prefix_reaching_p():
    logits = random_logits(6, seed=1)
    ps = [0.05, 0.3, 0.5, 0.8, 0.95, 1.0]
    filtered = apply_top_k_top_p(logits, torch.full((6,), V), torch.tensor(ps))
    for b, (p, keep) in enumerate(zip(ps, kept(filtered))):
        assert keep == ref_top_p(logits[b].tolist(), p), p
    assert len(kept(filtered)[-1]) == V  # top_p = 1 keeps everything


def test_top_p_applies_to_the_mass_left_by_top_k():
    logits = random_logits(4, seed=2)
    ks, ps = [3, 10, 20, V], [0.9, 0.6, 0.7, 0.4]
    filtered = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for b, keep in enumerate(kept(filtered)):
        values = logits[b].tolist()
        top_k = ref_top_k(values, ks[b])
        assert keep == ref_top_p([v if i in top_k else -math.inf for i, v in enumerate(values)], ps[b])


def test_min_p_threshold():
    logits = random_logits(4, seed=3)
    min_ps = [0.0, 0.01, 0.2, 0.9]
    filtered = apply_min_p(logits, torch.tensor(min_ps))
    for b, keep in enumerate(kept(filtered)):
        assert keep == ref_min_p(logits[b].tolist(), min_ps[b])


def test_penalties_match_the_reference_per_row():
    logits = random_logits(5, seed=4)
    cases = [
        (SamplingParams(repetition_penalty=1.3), (1, 4, 4, 9), (9, 11)),
        (SamplingParams(repetition_penalty=0.7, presence_penalty=0.5), (2, 3), (3, 3, 7)),
        (SamplingParams(frequency_penalty=0.8), (5, 6), (6, 6, 6, 8)),
        (SamplingParams(repetition_penalty=2.0, presence_penalty=-1.0, frequency_penalty=1.5), (0, 1), (1, 2, 2, 49)),
        (SamplingParams(), (1, 2), (3, 4)),  # no penalties: unchanged, even next to penalised rows
    ]
    rows = [row(p, prompt, output) for p, prompt, output in cases]
    penalised = apply_penalties(logits, rows)
    for b, (p, prompt, output) in enumerate(cases):
        assert penalised[b].tolist() == pytest.approx(ref_penalties(logits[b].tolist(), p, prompt, output), abs=1e-5)


def test_repetition_penalty_sign_rule_includes_prompt_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    out = apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), prompt=(0, 1), output=(2, 3))])
    assert out.tolist() == [[1.0, -4.0, 1.0, -4.0, 1.0]]  # positive ÷ penalty, negative × penalty, token 4 unseen


def test_presence_and_frequency_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [row(params, prompt=(0, 0, 1), output=(1, 2, 2, 2))])
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0]]  # prompt-only token 0 is untouched


def test_greedy_rows_take_the_penalised_argmax():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))])
    assert out.token_ids == [1]


# -- min_tokens -----------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[10.0, 9.0, 8.0, 0.0]])  # 0 = EOS, 1 = a stop id, 2 = a plain token
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])
    sampler = Sampler()
    assert sampler(logits, [row(params, output=(5, 5), eos=(0,))]).token_ids == [2]
    assert sampler(logits, [row(params, output=(5, 5, 5), eos=(0,))]).token_ids == [0]


def test_min_tokens_holds_for_sampled_rows():
    logits = torch.tensor([[3.0, 3.0, 0.0, 0.0]]).repeat(2000, 1)
    rows = [row(SamplingParams(temperature=1.0, min_tokens=1), eos=(0, 1))] * 2000
    assert set(Sampler()(logits, rows).token_ids) == {2, 3}


# -- greedy fast path -----------------------------------------------------------------------------


def test_greedy_fast_path_is_argmax():
    logits = random_logits(8, seed=5)
    out = Sampler()(logits, [row(SamplingParams(temperature=0))] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8
    assert Sampler.argmax_only([row(SamplingParams(temperature=0))])
    assert not Sampler.argmax_only([row(SamplingParams(temperature=0, presence_penalty=0.1))])
    assert not Sampler.argmax_only([row(SamplingParams(temperature=0, logprobs=0))])


# -- seeding --------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=7)


def run_seeded(batch_size: int, position: int, steps: int = 12) -> list[int]:
    """Decode ``SEEDED`` for ``steps`` steps at ``position`` in a batch of varied neighbours."""
    generator = torch.Generator().manual_seed(SEEDED.seed)
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, seed=99),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=3, frequency_penalty=1.0),
    ]
    outputs: list[int] = []
    for step in range(steps):
        logits = random_logits(batch_size, seed=1000 * step + batch_size)
        logits[position] = random_logits(1, seed=step)[0]  # the request sees the same logits in every batch
        rows = []
        for b in range(batch_size):
            if b == position:
                rows.append(row(SEEDED, output=tuple(outputs), generator=generator))
            else:
                p = neighbours[b % len(neighbours)]
                rows.append(row(p, generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None))
        outputs.append(Sampler()(logits, rows).token_ids[position])
    return outputs


def test_a_seeded_request_samples_the_same_alone_and_in_any_batch():
    alone = run_seeded(1, 0)
    assert len(set(alone)) > 1  # it really samples
    for batch_size, position in [(3, 0), (3, 2), (8, 5), (16, 15)]:
        assert run_seeded(batch_size, position) == alone, (batch_size, position)


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    draws = [
        Sampler()(logits, [row(SamplingParams(seed=s), generator=torch.Generator().manual_seed(s))]).token_ids[0] for s in range(5)
    ]
    assert len(set(draws)) > 1


# -- statistics -----------------------------------------------------------------------------------

# Chi-square critical values at p = 0.001 for 1..4 degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}
STAT_LOGITS = [1.0, 0.2, -0.5, 0.8, -1.5]
STAT_CONFIGS = [
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
]


def check_frequencies(tokens: list[int], expected: list[float]) -> None:
    n = len(tokens)
    observed = [tokens.count(i) for i in range(len(expected))]
    assert max(abs(o / n - e) for o, e in zip(observed, expected)) < 0.01, (observed, expected)
    assert all(o == 0 for o, e in zip(observed, expected) if e == 0)  # filtered tokens never appear
    support = [(o, e * n) for o, e in zip(observed, expected) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in support)
    assert chi2 < CHI2_CRITICAL[len(support) - 1], (chi2, observed, expected)


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "seeded"])
def test_sampled_frequencies_match_the_filtered_softmax(seeded):
    """20k draws per config on V=5, the configs interleaved in one batch (per-row parameters)."""
    draws = 20_000
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1) if seeded else None
    rows = [row(STAT_CONFIGS[i % len(STAT_CONFIGS)], prompt=(), generator=generator) for i in range(draws * len(STAT_CONFIGS))]
    tokens = Sampler()(torch.tensor([STAT_LOGITS]).repeat(len(rows), 1), rows).token_ids
    for c, params in enumerate(STAT_CONFIGS):
        check_frequencies(tokens[c :: len(STAT_CONFIGS)], ref_distribution(STAT_LOGITS, params))


def test_stat_configs_really_filter():
    """Guards the statistical test: each config drops at least one token."""
    assert all(0.0 in ref_distribution(STAT_LOGITS, p) for p in STAT_CONFIGS)


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_top_n_descending():
    logits = random_logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler()(logits, [row(p, output=(4, 4)) for p in params])
    raw = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = torch.topk(raw[0], 5)
    assert [t for t, _ in out.top_logprobs[0]] == top_ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert [lp for _, lp in out.top_logprobs[0]] == sorted((lp for _, lp in out.top_logprobs[0]), reverse=True)
    for b in (0, 1):
        assert out.logprobs[b] == pytest.approx(raw[b, out.token_ids[b]].item(), abs=1e-6)
    assert out.top_logprobs[1] == []
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("n", 0),
        ("n", 17),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("skip_special_tokens", None),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(UserError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}:") and "\n" not in message


def test_validation_on_assignment_and_across_fields():
    params = SamplingParams()
    with pytest.raises(UserError, match=r"^SamplingParams\.top_p:"):
        params.top_p = 0
    with pytest.raises(UserError, match=r"^SamplingParams\.min_tokens:"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", n=16, logprobs=20, seed=1)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.skip_special_tokens
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword-only


def test_check_finite_names_every_bad_row_and_passes_huge_finite_logits():
    """The one-pass sum screen must miss nothing (inf and -inf in one row sum to NaN) and must not
    flag finite logits whose fp32 sum would overflow."""
    from layerzoo.runtime.sampler import NonFiniteLogitsError, check_finite

    logits = torch.zeros(4, 50)
    check_finite(logits)
    huge = torch.full((2, 50), 3e38)  # each finite; their fp32 sum is inf
    check_finite(huge)
    logits[1, 3], logits[3, 7], logits[3, 9] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(NonFiniteLogitsError) as err:
        check_finite(logits)
    assert err.value.rows == [1, 3]


def test_greedy_rows_take_the_one_pass_argmax_kernel_and_still_name_bad_rows():
    """On CPU the fast path runs ``argmax_finite`` (the C++ kernel where it builds): one pass for the
    argmax and the NaN/inf screen. Huge finite logits pass; a NaN or inf row raises naming it."""
    from torch.profiler import profile

    from layerzoo.kernels import cpp_build
    from layerzoo.runtime.sampler import NonFiniteLogitsError

    logits = random_logits(3, seed=9) * 1e37  # finite, fp32 sums overflow
    with profile() as prof:
        out = Sampler()(logits, [row(SamplingParams(temperature=0))] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    ran = {e.name for e in prof.events()}
    assert ("layerzoo_cpu::argmax_finite" in ran) == cpp_build.available(), sorted(ran)
    assert "aten::argmax" not in ran or not cpp_build.available()
    logits[2, 5] = float("inf")
    with pytest.raises(NonFiniteLogitsError) as err:
        Sampler()(logits, [row(SamplingParams(temperature=0))] * 3)
    assert err.value.rows == [2]
