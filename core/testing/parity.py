"""Tie-aware comparison of greedy generations (tensor parallel vs. one process, kernel vs. reference).

Two correct engines that sum in a different order (a row-parallel all-reduce, another kernel)
give logits that differ in the last bits, so where the reference's top two logits are a near-tie
the greedy choice may flip and the rest of that generation differs. Such a divergence is not a
bug; any other is. `greedy_divergences` finds the first divergence of every completion and sorts
it by the reference model's own top-2 margin at that position (teacher-forced on the reference's
tokens, so no logprobs need to be asked of the run under test).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Divergence:
    request: int  # index of the prompt
    position: int  # index in the completion of the first differing token
    expected: int  # the reference's token
    got: int | None  # the other run's (None: it ended earlier)
    margin: float  # the reference model's top-1 minus top-2 logit there

    def describe(self) -> str:
        return (
            f"request {self.request}, output token {self.position}: expected {self.expected}, got {self.got} "
            f"(reference top-2 margin {self.margin:.3g})"
        )


def greedy_margins(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The top-1 minus top-2 logit at each of ``completion``'s positions ``[len(completion)]``,
    teacher-forced: ``model`` (a loaded `CausalLM`) reads ``prompt + completion`` in one pass."""
    import torch

    from layerzoo.testing import prefill_logits

    tokens = list(prompt) + list(completion)
    logits = prefill_logits(model, tokens, [len(tokens)])  # [T, vocab]
    rows = logits[len(prompt) - 1 : len(tokens) - 1].float()  # row i predicts completion[i]
    top2 = torch.topk(rows, 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def greedy_divergences(
    model, prompts: list[list[int]], reference: list[list[int]], other: list[list[int]], near_tie: float = 1e-3
) -> tuple[list[Divergence], list[Divergence]]:
    """``(near_ties, real)``: the first divergence of each completion of ``other`` from
    ``reference`` (token ids per prompt), split by whether the reference's margin there is at
    most ``near_tie`` logits. A test asserts ``real == []``."""
    assert len(prompts) == len(reference) == len(other)
    ties, real = [], []
    for i, (prompt, ref, out) in enumerate(zip(prompts, reference, other)):
        at = next((k for k in range(len(ref)) if k >= len(out) or out[k] != ref[k]), None)
        if at is None:
            assert len(out) == len(ref), f"request {i}: {len(out) - len(ref)} tokens past the reference's end"
            continue
        margin = greedy_margins(model, prompt, ref[: at + 1])[at]
        d = Divergence(i, at, ref[at], out[at] if at < len(out) else None, margin)
        (ties if margin <= near_tie else real).append(d)
    return ties, real


def assert_same_greedy(model, prompts, reference, other, near_tie: float = 1e-3) -> list[Divergence]:
    """Fail on any divergence that is not at a near-tie of the reference; returns the near-ties."""
    ties, real = greedy_divergences(model, prompts, reference, other, near_tie)
    assert not real, "greedy outputs diverge away from near-ties:\n" + "\n".join(d.describe() for d in real)
    return ties


def engine_paths_workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (token ids) that take the engine's paths when run as two `generate` calls: six
    prompts, two longer than a small step budget (chunked), two repeating themselves (n-gram
    drafts that get accepted); then three that share the first call's prefixes (prefix hits).
    With a KV cache of a dozen blocks the first call preempts."""
    import random

    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    loop = rand(5)
    first = [rand(50), rand(7), loop * 6, rand(20), rand(45), rand(3) + loop * 3]
    second = [first[0][:48] + rand(5), first[4] + rand(9), first[2][:32] + rand(4)]
    return first, second


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    """Each prompt's greedy output token ids (``ignore_eos``: every run is ``max_tokens`` long)."""
    from layerzoo import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tensor_parallel_engine_parity(model_dir, vocab: int, world_size: int = 2, max_tokens: int = 16, **engine):
    """Run `engine_paths_workload` greedily on one process, then on ``world_size`` tensor-parallel
    ranks with the same settings, and assert the same greedy tokens (tie-aware). Returns the
    tensor-parallel engine's stats.

    The single-process engine runs first and is compared only after the ranks shut down: its
    layers were built outside any group, but a group alive in this process would make their
    collectives run."""
    from layerzoo import LLM

    first, second = engine_paths_workload(vocab)
    single = LLM(str(model_dir), **engine)
    expected = greedy_tokens(single, first, max_tokens) + greedy_tokens(single, second, max_tokens)
    with LLM(str(model_dir), tensor_parallel_size=world_size, **engine) as tp:
        got = greedy_tokens(tp, first, max_tokens) + greedy_tokens(tp, second, max_tokens)
        stats = tp.stats
    assert_same_greedy(single.engine.model, first + second, expected, got)
    return stats
