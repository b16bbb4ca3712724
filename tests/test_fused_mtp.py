"""The MTP head's step as one C++ call (`layerzoo.layers.fused_mtp`), on the embedded model and its
trained head: the same drafts and the same head KV as the op-by-op path, each head step one call
(its chained rows one more), the rows that only catch up running the block's key/value part."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.kernels import cpp_build
from layerzoo.layers.fused_mtp import MtpStepPlan
from layerzoo.layers.model import CausalLM
from layerzoo.loading.model_packages import DEFAULT_MODEL
from layerzoo.speculative.mtp import MtpProposer
from layerzoo.speculative.mtp_drafter import MtpDrafter

pytestmark = pytest.mark.skipif(not cpp_build.available(), reason="the C++ CPU kernels are not built here")

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Buffer:\n    def __init__(self, size):\n", "# a\n"]


def _generate(k: int, monkeypatch, fused: bool, head_flags=None, prompts=PROMPTS, dtype="float32", seconds=None):
    """Greedy MTP decoding (fixed k) of PROMPTS: the outputs, every draft stored, the calls the head
    made per drafter step, the head's KV cache and the one-call plan. ``head_flags``: the head's
    ``(mask_position0, carry_normed)`` set before the first step (the other conventions' branches).
    ``seconds``: a list that gets every second token stored, ``(length, token)``, each ask asking one."""
    calls, drafts = {"draft": [], "mtp_step": [], "mtp_draft": 0}, []
    with monkeypatch.context() as patch:
        if seconds is not None:
            ask, store_second = MtpProposer.propose_for, MtpProposer.store_second

            def asked_with_second(self, seq_id, token_ids, k):
                self.ask_second(seq_id)
                return ask(self, seq_id, token_ids, k)

            patch.setattr(MtpProposer, "propose_for", asked_with_second)
            patch.setattr(MtpProposer, "store_second", lambda self, seq_id, length, token: (
                seconds.append((length, token)), store_second(self, seq_id, length, token)))
        if not fused:
            patch.setattr(CausalLM, "_plan_mtp", lambda self: None)
        step, draft, store, mtp_draft = CausalLM.mtp_step, MtpDrafter._draft, MtpProposer.store, CausalLM.mtp_draft

        def counted_step(self, token_ids, *args):
            calls["mtp_step"].append(token_ids.shape[0])
            return step(self, token_ids, *args)

        def counted_draft(self, plan, groups):
            before = calls["mtp_draft"]
            draft(self, plan, groups)
            calls["draft"].append(calls["mtp_draft"] - before)

        def counted(self, *args):
            calls["mtp_draft"] += 1
            return mtp_draft(self, *args)

        patch.setattr(CausalLM, "mtp_step", counted_step)
        patch.setattr(CausalLM, "mtp_draft", counted)
        patch.setattr(MtpDrafter, "_draft", counted_draft)
        patch.setattr(MtpProposer, "store", lambda self, seq_id, length, made: (drafts.append((length, made)), store(self, seq_id, length, made)))
        llm = LLM(str(DEFAULT_MODEL), dtype=dtype, speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive": False})
        if head_flags is not None:
            llm.engine.model.mtp.mask_position0, llm.engine.model.mtp.carry_normed = head_flags
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    model = llm.engine.model
    layer = model.mtp.layer_index
    return ([o.outputs[0].token_ids for o in outs], drafts, calls, (llm.engine.kv.k[layer].clone(), llm.engine.kv.v[layer].clone()),
            model.__dict__.get("_mtp_plan"))


@pytest.mark.parametrize("k,dtype", [(1, "float32"), (3, "float32"), (3, "bfloat16")])
def test_the_head_step_is_one_call_with_the_op_by_op_drafts_and_kv(k, dtype, monkeypatch):
    outs, drafts, calls, kv, plan = _generate(k, monkeypatch, fused=True, dtype=dtype)
    if plan is None and dtype == "bfloat16":
        pytest.skip("no few-row bf16 kernel on this CPU (AVX-512 BF16): the head runs op by op")
    ref_outs, ref_drafts, ref_calls, ref_kv, ref_plan = _generate(k, monkeypatch, fused=False, dtype=dtype)
    assert plan is not None and ref_plan is None
    assert outs == ref_outs
    assert drafts == ref_drafts and len(drafts) > 20  # bitwise the same logits' argmax, every step
    # The head's KV, written by catch-up rows (key/value part only) and draft rows alike, is the
    # op-by-op path's bit for bit.
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1]) and kv[0].abs().sum() > 0
    head_steps, rows, draft_rows, chains = plan.runs
    assert rows > draft_rows > 0  # rows that only caught up (a verify's rows before its last)
    # One head call per drafter step; its chained rows one call more (never the Python loop), and
    # op by op only for a prompt's rows past the one-call limit.
    assert calls["draft"] and set(calls["draft"]) == {1}
    assert (chains > 0) == (k > 1) and max(ref_calls["draft"]) == k
    assert head_steps == len(calls["draft"]) - len(calls["mtp_step"])
    assert all(n > plan.max_rows for n in calls["mtp_step"])


def test_the_one_call_step_keeps_the_other_heads_conventions(monkeypatch):
    """DeepSeek's and GLM's conventions on the same head: the embedding masked at position 0 (short
    prompts: their first rows run in the one call) and the raw ``y + r`` chained."""
    short = ["# a\n", "x = 1\n"]
    first_rows, run = [], MtpStepPlan.run

    def recorded(self, token_ids, previous, ctx, rows):
        out = run(self, token_ids, previous, ctx, rows)
        if out is not None:
            first_rows.append(int(ctx.positions.min()))
        return out

    monkeypatch.setattr(MtpStepPlan, "run", recorded)
    outs, drafts, _, kv, plan = _generate(3, monkeypatch, fused=True, head_flags=(True, False), prompts=short)
    ref_outs, ref_drafts, _, ref_kv, _ = _generate(3, monkeypatch, fused=False, head_flags=(True, False), prompts=short)
    assert plan.mask_position0 and not plan.carry_normed and plan.runs[3] > 0 and 0 in first_rows
    assert outs == ref_outs and drafts == ref_drafts
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1])
    normal = _generate(3, monkeypatch, fused=True, prompts=short)[1]
    assert drafts != normal  # the conventions change the drafts: both branches ran


def test_a_second_token_is_the_heads_draft_from_the_row_before_the_last(monkeypatch):
    """The head's guess at a step's token (`MtpProposer.ask_second`: its row before the last run
    through the whole block and the LM head beside the last) is what the head drafts from that row
    after a prefill of the tokens up to it, and the one-call step gives the op-by-op path's."""
    seconds, ref_seconds = [], []
    outs, drafts, _, kv, _ = _generate(3, monkeypatch, fused=True, prompts=PROMPTS[:1], seconds=seconds)
    ref_outs, ref_drafts, _, ref_kv, _ = _generate(3, monkeypatch, fused=False, prompts=PROMPTS[:1], seconds=ref_seconds)
    assert outs == ref_outs and drafts == ref_drafts and seconds == ref_seconds and len(seconds) > 5
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1])
    llm = LLM(str(DEFAULT_MODEL), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    [first] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1))
    tokens = list(first.prompt_token_ids) + list(outs[0])
    made = []
    monkeypatch.setattr(MtpProposer, "store", lambda self, seq_id, length, d: made.append((length, d[0])))
    for length, token in seconds[:6]:
        made.clear()
        llm.generate([{"prompt_token_ids": tokens[: length - 2]}], SamplingParams(temperature=0, max_tokens=1))
        assert made == [(length - 1, token)], (length, token, made)
