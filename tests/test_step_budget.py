"""The step token budget: 512 on CPU unless the user sets one (prompts that arrive together finish
their prefills one after another instead of all at the end of one long step)."""

from types import SimpleNamespace

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import CPU_STEP_BUDGET, DEVICE_STEP_BUDGET, EngineArgs, default_step_budget


def test_the_default_budget_depends_on_the_device_and_the_user_wins():
    assert default_step_budget(EngineArgs()) == CPU_STEP_BUDGET == 512
    cuda = SimpleNamespace(device="cuda:0", max_num_batched_tokens=None)  # EngineArgs checks CUDA is there
    assert default_step_budget(cuda) == DEVICE_STEP_BUDGET == 2048
    assert default_step_budget(EngineArgs(max_num_batched_tokens=100)) == 100


def test_requests_arriving_together_get_their_first_tokens_in_turn(tiny_qwen3_dir):
    """Four 300-token prompts: with the CPU default the first two fit the first step and get
    their first token there, and the rest follow; one 2048-token step would finish all four together."""
    llm = LLM(tiny_qwen3_dir, dtype="float32", max_model_len=400)
    assert llm.engine.scheduler.config.max_num_batched_tokens == CPU_STEP_BUDGET
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 58 + 5 for j in range(300)]} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    firsts = sorted(o.metrics["time_to_first_token_s"] for o in outs)
    assert firsts[0] < firsts[-1]
    assert llm.stats.steps >= 4  # 1200 prompt tokens cannot fit fewer steps of 512
