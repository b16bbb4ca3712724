"""Qwen3's optional MTP head (Qwen3-Next's ``mtp.*`` layout, ``mtp_num_hidden_layers``): loaded
strictly when speculation asks for ``method "mtp"``, skipped otherwise; greedy MTP outputs equal
plain decoding (`layerzoo.testing.mtp`); and the embedded default model's trained head
(``mtp.safetensors``) loads, drafts what the training script's transformers head computes, keeps
greedy outputs and is accepted on held-out-style text."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import CheckpointError
from layerzoo.loading.model_loading import load_model
from layerzoo.loading.model_packages import DEFAULT_MODEL
from layerzoo.speculative.mtp_drafter import MtpDrafter
from layerzoo.testing import mtp as mtp_checks
from layerzoo.testing.checkpoints import add_mtp_head, copy_checkpoint

MTP = EngineArgs(speculative_config=mtp_checks.mtp_config(2))
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def qwen3_mtp(tmp_path_factory, qwen3_tiny):
    path = tmp_path_factory.mktemp("qwen3-mtp")
    qwen3_tiny.save_tiny(path, qwen3_tiny.dense_config())
    return path, add_mtp_head(path, "qwen", source_layer=2)


def test_head_loads_strictly_when_mtp_is_asked_for(qwen3_mtp, tmp_path):
    path, added = qwen3_mtp
    assert "mtp.fc.weight" in added and "mtp.layers.0.self_attn.q_norm.weight" in added
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, MTP).model
    assert model.mtp is not None and model.mtp.layer_index == 3 and 3 in model.kv_cache_specs()
    x = torch.randn(3, 96)  # eh_proj may be repacked for the CPU: compare what it computes
    torch.testing.assert_close(model.mtp.eh_proj(x), x @ tensors["mtp.fc.weight"].T)
    torch.testing.assert_close(model.mtp.enorm.weight, tensors["mtp.pre_fc_norm_embedding.weight"])
    torch.testing.assert_close(model.mtp.hnorm.weight, tensors["mtp.pre_fc_norm_hidden.weight"])
    torch.testing.assert_close(model.mtp.norm.weight, tensors["mtp.norm.weight"])
    torch.testing.assert_close(model.mtp.block.self_attn.k_norm.weight, tensors["mtp.layers.0.self_attn.k_norm.weight"])
    plain = load_model(path).model  # no speculation: the head's keys are skipped, nothing built
    assert plain.mtp is None and sorted(plain.kv_cache_specs()) == [0, 1, 2]
    no_fc = copy_checkpoint(path, tmp_path / "a", lambda t: t.pop("mtp.fc.weight"))
    with pytest.raises(CheckpointError, match=r"lacks the MTP head's tensor mtp\.fc\.weight"):
        load_model(no_fc, MTP)
    no_block = copy_checkpoint(path, tmp_path / "b", lambda t: t.pop("mtp.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"mtp\.block\.mlp\.up_proj\.weight"):
        load_model(no_block, MTP)
    load_model(no_block)  # without MTP the head is not read at all


def test_mtp_greedy_outputs_equal_plain_decoding(qwen3_mtp):
    path, _ = qwen3_mtp
    st = mtp_checks.greedy_equals_plain(path, 131).engine.stats
    assert st.spec_verify_steps > 0 and st.spec_draft_tokens > 0 and st.preemptions > 0


def test_mtp_drafts_equal_a_recompute(qwen3_mtp):
    path, _ = qwen3_mtp
    assert mtp_checks.drafts_equal_recompute(path, 131) >= 5


def test_mtp_rows_that_waited_for_the_head_write_what_their_step_would_have(qwen3_mtp):
    path, _ = qwen3_mtp
    pause = range(4, 4 + MtpDrafter.PENDING_ROWS)  # decode steps (the prompt takes steps 0 and 1)
    assert mtp_checks.drafts_equal_recompute(path, 131, pause=pause) >= 5


def test_mtp_head_runs_only_for_sequences_asked_for_drafts(qwen3_mtp):
    """A random head is rarely right: adaptive MTP asks for its guesses now and then, and the head
    runs in those steps only (it ran in every step before)."""
    path, _ = qwen3_mtp
    for k in (1, 3):
        ran, steps = mtp_checks.head_runs_only_when_asked(path, 131, k)
        assert 0 < ran < steps / 3, (k, ran, steps)


# -- the embedded default model's trained head ------------------------------------------------------


def test_embedded_model_ships_its_head_beside_the_unchanged_base():
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    index = json.loads((DEFAULT_MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    base, head = load_file(DEFAULT_MODEL / "model.safetensors"), load_file(DEFAULT_MODEL / "mtp.safetensors")
    assert all(k.startswith("mtp.") for k in head) and not any(k.startswith("mtp.") for k in base)
    assert index == {**{k: "model.safetensors" for k in base}, **{k: "mtp.safetensors" for k in head}}
    assert load_model(DEFAULT_MODEL).model.mtp is None  # LLM() without MTP never builds it


def _script():
    spec = importlib.util.spec_from_file_location("make_default_model", REPO / "scripts" / "make_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_embedded_head_drafts_what_the_training_script_computes():
    """The convention training used (row p: the base's normed hidden at p, the embedding of token
    p + 1, RoPE position p) is the one the engine drafts with: the shipped head's chained drafts
    after a prefill equal the transformers head's argmaxes, its carry fed back one row later."""
    transformers = pytest.importorskip("transformers")
    script = _script()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    head = script.TrainableMtpHead(base).eval()
    head.load_state_dict({k[len("mtp."):]: v.float() for k, v in load_file(DEFAULT_MODEL / "mtp.safetensors").items()})
    tok = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    prompt = tok("import os\nimport sys\n\n\ndef main(argv):\n    for name in")["input_ids"]

    llm = LLM(str(DEFAULT_MODEL), dtype="float32", speculative_config=mtp_checks.mtp_config(2))
    made = mtp_checks.record_drafts(llm)
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    ids = prompt + list(out.outputs[0].token_ids)
    length, drafts = made[0]
    assert length == len(ids) and len(drafts) == 2

    with torch.no_grad():
        x = torch.tensor([ids])
        hidden = base.model(input_ids=x).last_hidden_state
        y_first = head(hidden[:, :-1], x[:, 1:])  # rows 0..T-2; the last one drafts the first token
        first = int(y_first[0, -1].argmax())
        # The chained row: the head's own normed output at the last row as the hidden, fed its draft.
        embeds = base.model.embed_tokens(x[:, 1:])
        z = head.fc(torch.cat([head.pre_fc_norm_embedding(embeds), head.pre_fc_norm_hidden(hidden[:, :-1])], -1))
        positions = torch.arange(z.shape[1]).unsqueeze(0)
        carry = head.norm(head.layers[0](z, position_ids=positions, position_embeddings=base.model.rotary_emb(z, positions)))
        second = head(torch.cat([hidden[:, :-1], carry[:, -1:]], 1), torch.cat([x[:, 1:], torch.tensor([[first]])], 1))
    assert drafts == [first, int(second[0, -1].argmax())]


def test_embedded_head_keeps_greedy_outputs_and_is_accepted():
    prompts = [
        "import os\nimport sys\n\n\ndef main(argv):\n",
        'class Buffer:\n    """A buffer."""\n\n    def __init__(self, size):\n',
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    llm = LLM(dtype="float32", speculative_config=mtp_checks.mtp_config(1))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    st = llm.engine.stats
    # A trained head: a random one is accepted on well under 5% of its drafts.
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens / st.spec_draft_tokens > 0.4


def test_embedded_head_reuses_the_target_pass_context():
    """A step whose head rows are its one pass's rows (decodes, prompts, verifies that kept every
    draft) runs the head on the target's context; one whose verifies rejected drafts, or whose
    sequences the head skips in part (not asked for drafts), on that context cut to the kept rows
    of the sequences it runs for. Each has the positions, slots, tables and RoPE a context built
    for the head would have. Greedy outputs stay those of plain decoding."""
    prompts = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Buffer:\n    def __init__(self, size):\n"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    llm = LLM(dtype="float32", speculative_config={**mtp_checks.mtp_config(1), "adaptive": False})
    drafter, model = llm.engine.runner.mtp, llm.engine.runner.model
    outcomes, pass_context = [], drafter._pass_context
    asked, draft, steps, skipped = drafter.proposer.drafts_now, drafter.draft, itertools.count(), []

    def skipping(plan, tokens, kept_rows):  # every third step the head skips the last decoding sequence
        skipped[:] = [plan.decodes[-1].seq_id] if plan.decodes and next(steps) % 3 == 0 else []
        draft(plan, tokens, kept_rows)

    drafter.draft = skipping
    drafter.proposer.drafts_now = lambda seq_id: asked(seq_id) and seq_id not in skipped

    def checked(groups):
        target = drafter._passes[0][2] if len(drafter._passes) == 1 else None
        reused = pass_context(groups)
        if reused is None:
            outcomes.append(None)
            return None
        ctx, hidden = reused
        outcomes.append("as is" if ctx is target else "cut" if len(ctx.seq_ids) == len(target.seq_ids) else "part")
        lens = [len(g.next_ids) for g in groups]
        assert ctx.positions.tolist() == [p for g in groups for p in range(g.start, g.start + len(g.next_ids))]
        tables = [row.tolist() for row in ctx.block_tables]  # each sequence's (padding past its blocks unread)
        fresh = drafter._context([g.seq_id for g in groups], lens, [g.start + n for g, n in zip(groups, lens)], tables)
        for name in ("slot_mapping", "token_seqs", "context_lens_tensor", "block_tables"):
            assert torch.equal(getattr(ctx, name), getattr(fresh, name)), name
        assert ctx.query_lens == fresh.query_lens and ctx.context_lens == fresh.context_lens
        cos, sin = model.rotary.cos_sin(ctx.positions, hidden.dtype)
        assert torch.equal(ctx.cos_sin[0], cos) and torch.equal(ctx.cos_sin[1], sin)
        return reused

    drafter._pass_context = checked
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert "as is" in outcomes and "cut" in outcomes and "part" in outcomes, outcomes


def test_embedded_head_chains_on_the_first_rows_tables(monkeypatch):
    """Chained rows (k > 1) run on a decode context cut from the head step's block tables: it equals
    the context built from the sequences' tables; greedy outputs stay those of plain decoding. (The
    Python chain, as a head without the one-call step runs it: `layerzoo.layers.fused_mtp` off.)"""
    from layerzoo.layers.model import CausalLM

    monkeypatch.setattr(CausalLM, "_plan_mtp", lambda self: None)
    prompts = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Buffer:\n    def __init__(self, size):\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    llm = LLM(dtype="float32", speculative_config={**mtp_checks.mtp_config(3), "adaptive": False})
    drafter, built = llm.engine.runner.mtp, []
    chain_context = drafter._chain_context

    def checked(ctx, seqs, positions):
        chained = chain_context(ctx, seqs, positions)
        tables = [ctx.block_tables[i].tolist() for i in seqs]
        fresh = drafter._context([ctx.seq_ids[i] for i in seqs], [1] * len(seqs), [p + 1 for p in positions], tables)
        for name in ("positions", "slot_mapping", "token_seqs", "context_lens_tensor", "block_tables"):
            assert torch.equal(getattr(chained, name), getattr(fresh, name)), name
        assert (chained.seq_ids, chained.query_lens, chained.context_lens, chained.num_decodes) == (
            fresh.seq_ids, fresh.query_lens, fresh.context_lens, fresh.num_decodes)
        built.append(len(seqs))
        return chained

    drafter._chain_context = checked
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert sum(built) > 0
