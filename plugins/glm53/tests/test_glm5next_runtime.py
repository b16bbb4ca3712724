"""GLM-5.3-Flash on the paged runtime: the k-pool rows (per token and per 4 tokens) in the paged
pool, preemption, what `layerzoo plugins` reports for its layer kinds, and the refusals."""

import json
import shutil

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.entrypoints.cli import main
from layerzoo.errors import UserError
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.loading.model_loading import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts_of(vocab):
    return [[(i * s + 3) % vocab for i in range(n)] for s, n in ((5, 30), (7, 25), (11, 34), (13, 21))]


def test_pooled_rows_are_rows_of_the_paged_pool(next_tiny):
    path, _ = next_tiny
    specs = load_model(path).model.kv_cache_specs()
    # Only the indexed layers (1, 2) keep KV; the full one (1) its latent, the indexer key and
    # gate per token and one pooled key per 4 tokens; the IndexShare layer (2) its latent only.
    assert sorted(specs) == [1, 2]
    assert specs[1].extra_rows == (("index_k", 16), ("index_gate", 16)) and specs[1].pooled_rows == (("index_pool", 16, 4),)
    assert specs[2].extra_rows == () and specs[2].pooled_rows == ()
    assert specs[1].bytes_per_token == 4 * (16 + 16 + 16) + 4 * 16 // 4 and specs[2].bytes_per_token == 4 * 16
    llm = LLM(path, dtype="float32", block_size=8)
    rows = llm.engine.kv.rows[1]
    assert rows["index_pool"].shape[1:] == (2, 1, 16) and rows["index_k"].shape[1:] == (8, 1, 16)


def test_pooled_rows_hold_their_pools_after_chunks_and_decodes(next_tiny):
    """Two prefill chunks ending inside pools, then one-token decode steps (the batched decode
    path), over a shuffled block table: every logit matches transformers, and every complete
    pool's row is kpool_compress of its 4 tokens' per-token rows (rewritten as its pool filled)."""
    from layerzoo.layers.context import ForwardContext
    from layerzoo.runtime.kv_pool import PagedKVCache
    from layerzoo.runtime.state_pool import SsmStep, StatePool
    from layerzoo_glm53.ops.kpool_compress.reference import kpool_compress

    path, hf_model = next_tiny
    model = load_model(path).model
    ids = torch.randint(0, 131, (30,), generator=torch.Generator().manual_seed(4))
    table = [3, 0, 2, 1]  # blocks of 8 tokens, not in position order
    kv = PagedKVCache(model.kv_cache_specs(), 4, 8)
    pool = StatePool(model.state_specs(), 1)
    steps, done, hidden = [7, 6] + [1] * 17, 0, []
    with torch.inference_mode():
        for n in steps:
            ctx = ForwardContext.for_paged(seq_ids=[0], query_lens=[n], context_lens=[done + n], block_tables=[table],
                                           block_size=8, num_decodes=int(n == 1), kv_cache=kv)
            ctx.ssm = SsmStep(pool=pool, slots=(0,))
            hidden.append(model(ids[done : done + n], ctx))
            done += n
        logits = model.compute_logits(torch.cat(hidden))
    with torch.no_grad():
        torch.testing.assert_close(logits, hf_model(ids[None]).logits[0], atol=2e-4, rtol=0)
    rows = kv.rows[1]
    keys = rows["index_k"][table].reshape(32, 16)[:28].view(7, 4, 16)
    gates = rows["index_gate"][table].reshape(32, 16)[:28].view(7, 4, 16)
    pooled = rows["index_pool"][table].reshape(8, 16)[:7]
    ape = model.layers[1].self_attn.indexer.index_kpool_compress_ape.detach()
    # Within a few fp32 ulps, not bitwise: the engine compressed each pool in a batch of another
    # shape (torch's softmax vectorizes by shape), which moved a row by 1.5e-8 (2 ulps) when this
    # test ran alone; a row left stale (three tokens) or pooled from the next pool's is off by 2.8.
    torch.testing.assert_close(pooled, kpool_compress(keys, gates, ape, torch.full((7,), 4)), atol=1e-7, rtol=1e-6)


def test_block_size_must_be_a_multiple_of_kpool(next_tiny):
    path, _ = next_tiny
    with pytest.raises(UserError, match="block_size.*multiple of 4"):
        LLM(path, dtype="float32", block_size=6)
    spec = KVCacheSpec.latent(8, 0, torch.float32)
    spec.check_block_size(5)  # no pooled rows: any block size


def test_preemption_keeps_outputs(next_tiny, next_helpers):
    path, hf_model = next_tiny
    prompts = prompts_of(hf_model.config.text_config.vocab_size)
    per_token = sum(s.bytes_per_token for s in load_model(path).model.kv_cache_specs().values())
    small = dict(dtype="float32", block_size=8, max_num_batched_tokens=32, enable_prefix_caching=False, max_num_seqs=4)
    # The recurrent-state pool is sized first; the KV cache gets what is left: 64 tokens.
    state = LLM(path, **small).engine.runner.pool
    state_bytes = sum(t.numel() * t.element_size() for ts in (state.conv, state.recurrent) for t in ts.values())
    llm = LLM(path, kv_cache_memory=state_bytes + per_token * 64, max_model_len=64, **small)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [next_helpers.hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert llm.engine.blocks.num_free_blocks() == llm.engine.blocks.num_blocks


def test_plugins_lists_the_glm5next_layer_kinds(capsys):
    assert main(["plugins", "--json"]) == 0
    glm = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}["glm53"]
    assert "Glm5NextForConditionalGeneration" in glm["architectures"]
    kda = glm["layer_kinds"]["glm53.glm5_next_kda"]["capabilities"]
    dsa = glm["layer_kinds"]["glm53.glm5_next_dsa"]["capabilities"]
    assert kda["is_ssm_layer"] and kda["uses_ssm_pool"] and kda["supports_replay_tail_split"]
    assert not kda["decode_rollback_unsupported"] and not kda["graph_stale_on_new_sequence"]
    assert not dsa["is_ssm_layer"] and dsa["supports_replay_tail_split"] and not dsa["graph_stale_on_new_sequence"]
    assert not dsa["uses_local_mla_prefill"] and not dsa["decode_graph_unsupported"]


def test_vision_weights_are_skipped_and_the_mtp_layer_maps_onto_the_head(next_tiny):
    from layerzoo_glm53.glm5_next import name_map

    path, _ = next_tiny
    mapped = name_map(load_model(path).model.config)
    assert mapped("model.visual.blocks.0.attn.qkv.weight") is None
    # The NextN layer after the 4 decoder layers: the MTP head's block (dropped by a load without the head).
    assert mapped("model.language_model.layers.4.self_attn.q_a_proj.weight") == "mtp.block.self_attn.q_a_proj.weight"
    assert mapped("model.language_model.layers.0.hc_attn_fn") == "model.layers.0.attn_hc.fn"
    assert mapped("model.layers.3.hc_ffn_scale") == "model.layers.3.ffn_hc.scale"
    assert mapped("model.language_model.layers.1.self_attn.indexer.index_kpool_compress_ape") == (
        "model.layers.1.self_attn.indexer.index_kpool_compress_ape")
    assert mapped("model.language_model.layers.1.mlp.experts.3.up_proj.weight").name == "model.layers.1.mlp.experts.gate_up_proj"


def test_image_inputs_are_refused_by_name(next_tiny, tmp_path):
    path, _ = next_tiny
    bad = tmp_path / "with-image-token"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["image_token_id"], config["video_token_id"] = 100, 101
    (bad / "config.json").write_text(json.dumps(config))
    llm = LLM(bad, dtype="float32", block_size=8)
    for token, key in ((100, "image_token_id"), (101, "video_token_id")):
        with pytest.raises(UserError, match=f"{key} {token}"):
            llm.generate([{"prompt_token_ids": [1, 2, token, 3]}], GREEDY)
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("key,value,words", [
    ("index_topk", 6, "index_topk"),
    ("indexer_types", ["full", "full", "full", "shared"], "indexer_types"),  # a shared layer after a KDA layer
    ("index_kpool_always_select_tail", False, "index_kpool_always_select_tail"),
    ("qk_rope_head_dim", 4, "qk_rope_head_dim"),
    ("layer_types", ["linear_attention"] * 3 + ["mamba"], "layer_types"),
])
def test_bad_config_is_a_user_error_naming_the_key(next_tiny, tmp_path, key, value, words):
    path, _ = next_tiny
    bad = tmp_path / key
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"][key] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=words):
        load_model(bad)


def test_released_config_spellings_are_read(next_tiny, tmp_path):
    """``linear_attn_config`` and the "deepseek_sparse_attention" layer type of the released config."""
    path, _ = next_tiny
    other = tmp_path / "released"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    text = config["text_config"]
    text["layer_types"] = ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention", "linear_attention"]
    text["linear_attn_config"] = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}
    text["linear_num_heads"], text["linear_head_dim"] = 64, 128  # overridden by linear_attn_config
    (other / "config.json").write_text(json.dumps(config))
    model = load_model(other).model
    assert model.config.layer_types[1] == "indexed_attention" and model.layers[0].self_attn.num_heads == 2


def test_bf16_model_keeps_mhc_and_kda_conv_weights_in_fp32(next_tiny, next_helpers):
    """As transformers keeps them: the mHC fn/base/scale, the KDA convs, A_log and dt_bias stay
    fp32 in a bf16 model (the conv runs on fp32 weights), and bf16 greedy starts as fp32's does."""
    path, hf_model = next_tiny
    from layerzoo.engine_args import EngineArgs

    model = load_model(path, EngineArgs(dtype="bfloat16")).model
    kda, dsa = model.layers[0], model.layers[1]
    assert kda.self_attn.q_proj.weight.dtype == torch.bfloat16
    for p in (kda.self_attn.q_conv1d.weight, kda.self_attn.A_log, kda.self_attn.dt_bias, kda.self_attn.conv_weight,
              kda.attn_hc.fn, dsa.ffn_hc.base, dsa.ffn_hc.scale):
        assert p.dtype == torch.float32
    prompts = prompts_of(hf_model.config.text_config.vocab_size)
    llm = LLM(path, dtype="bfloat16", block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    agree = sum(o.outputs[0].token_ids == next_helpers.hf_greedy(hf_model, p, 1) for o, p in zip(outs, prompts))
    assert agree >= 3


def test_decode_step_traces_whole_with_no_host_read(next_helpers, tmp_path):
    """The decode_graph_unsupported False claim on the layers' side: a decode step (KDA decode via
    delta_rule_decode, k-pool selection and pooled-row writes, mHC) traces as one graph
    (``fullgraph=True``, dynamo only) and gives the eager step's output. Dense MLPs: a routed-expert
    layer's CPU reference reads its expert counts on the host (the core's MoE reference too); on
    CUDA the grouped matmul's Triton op (with its clamp) has no host read."""
    from layerzoo.layers.context import ForwardContext
    from layerzoo.runtime.kv_pool import PagedKVCache
    from layerzoo.runtime.state_pool import SsmStep, StatePool

    next_helpers.save_tiny(tmp_path, next_helpers.text_config(mlp_layer_types=["dense"] * 4))
    model = load_model(tmp_path).model
    kv = PagedKVCache(model.kv_cache_specs(), 4, 8)
    pool = StatePool(model.state_specs(), 1)
    ids = torch.randint(0, 131, (15,), generator=torch.Generator().manual_seed(2))

    def ctx_for(n, done):
        ctx = ForwardContext.for_paged(seq_ids=[0], query_lens=[n], context_lens=[done + n], block_tables=[[1, 3, 0, 2]],
                                       block_size=8, num_decodes=int(n == 1), kv_cache=kv)
        ctx.ssm = SsmStep(pool=pool, slots=(0,))
        return ctx

    with torch.inference_mode():
        model(ids[:13], ctx_for(13, 0))
        model(ids[13:14], ctx_for(1, 13))  # eager once: the ops are resolved
        ctx = ctx_for(1, 14)
        ctx.shape_static = True
        tensors = [*(t for rows in kv.rows.values() for t in rows.values()), *pool.conv.values(), *pool.recurrent.values()]
        saved = [t.clone() for t in tensors]
        eager = model(ids[14:], ctx)
        for t, s in zip(tensors, saved):
            t.copy_(s)
        traced = torch.compile(lambda x: model(x, ctx), backend="eager", fullgraph=True, dynamic=False)(ids[14:])
    torch.testing.assert_close(traced, eager)
