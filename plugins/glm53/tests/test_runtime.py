"""GLM-5 on the paged runtime: the indexer keys as a cache row, preemption, and what
`layerzoo plugins` reports for the DSA layer kind."""

import json

from layerzoo import LLM, SamplingParams
from layerzoo.entrypoints.cli import main
from layerzoo.loading.model_loading import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts_of(vocab):
    return [[(i * s + 3) % vocab for i in range(n)] for s, n in ((5, 30), (7, 25), (11, 34), (13, 20))]


def test_indexer_keys_are_a_row_of_the_paged_pool(glm_tiny):
    path, _ = glm_tiny
    specs = load_model(path).model.kv_cache_specs()
    # Full indexer layers keep [latent | index key] per token; the IndexShare layer (2) only its latent.
    assert [s.extra_rows for s in specs.values()] == [(("index_k", 16),), (("index_k", 16),), (), (("index_k", 16),)]
    assert [s.bytes_per_token for s in specs.values()] == [4 * (24 + 8 + 16)] * 2 + [4 * (24 + 8)] + [4 * (24 + 8 + 16)]
    llm = LLM(path, dtype="float32", block_size=8)
    rows = llm.engine.kv.rows
    assert rows[0]["index_k"].shape[1:] == (8, 1, 16) and "index_k" not in rows[2]


def test_preemption_keeps_outputs(glm_tiny, glm_helpers):
    path, hf_model = glm_tiny
    prompts = prompts_of(hf_model.config.vocab_size)
    per_token = sum(s.bytes_per_token for s in load_model(path).model.kv_cache_specs().values())
    llm = LLM(path, dtype="float32", block_size=8, max_num_batched_tokens=32, enable_prefix_caching=False,
              max_num_seqs=4, kv_cache_memory=per_token * 64, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [glm_helpers.hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert llm.engine.blocks.num_free_blocks() == llm.engine.blocks.num_blocks


def test_plugins_lists_the_dsa_layer_kind(capsys):
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    glm = plugins["glm53"]
    assert glm["distribution"] == "layerzoo-glm53"
    assert sorted(glm["architectures"]) == ["Glm5NextForConditionalGeneration", "GlmMoeDsaForCausalLM"]
    caps = glm["layer_kinds"]["glm53.dsa"]["capabilities"]
    assert caps["graph_stale_on_new_sequence"] is False and caps["supports_replay_tail_split"]
    assert not caps["is_ssm_layer"] and not caps["uses_local_mla_prefill"] and not caps["decode_graph_unsupported"]


def test_mtp_weights_map_onto_the_head_and_further_nextn_layers_are_skipped(glm_tiny):
    """The first NextN layer (after the 4 decoder layers) maps onto the MTP head, which the loader
    drops when the model is built without it (the load above); later ones and mtp.* are skipped."""
    from layerzoo_glm53.glm_moe_dsa import name_map

    path, hf_model = glm_tiny
    config = load_model(path).model.config
    mapped = name_map(config)
    assert mapped("mtp.layers.0.eh_proj.weight") is None
    assert mapped("model.layers.4.self_attn.q_a_proj.weight") == "mtp.block.self_attn.q_a_proj.weight"
    assert mapped("model.layers.5.self_attn.q_a_proj.weight") is None
    assert mapped("model.layers.3.self_attn.indexer.wk.weight") == "model.layers.3.self_attn.indexer.wk.weight"


def test_bad_config_is_a_user_error_naming_the_key(glm_tiny, tmp_path):
    import shutil

    import pytest

    from layerzoo.errors import UserError

    path, _ = glm_tiny
    for key, value, words in (("q_lora_rank", None, "q_lora_rank"), ("indexer_types", ["shared", "full", "full", "full"], "indexer_types"),
                              ("index_topk_pattern", "FXSF", "index_topk_pattern")):
        bad = tmp_path / key
        shutil.copytree(path, bad)
        config = json.loads((bad / "config.json").read_text())
        config[key] = value
        if key == "index_topk_pattern":
            config.pop("indexer_types")
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=words):
            load_model(bad)


def test_fp8_latent_cache_keeps_indexer_keys_in_the_compute_dtype(glm_tiny, glm_helpers):
    import torch

    path, hf_model = glm_tiny
    prompts = prompts_of(hf_model.config.vocab_size)
    llm = LLM(path, dtype="float32", block_size=8, kv_cache_dtype="fp8", fp8_calibration_tokens=16)
    rows = llm.engine.kv.rows[0]
    assert rows["latent"].dtype == torch.float8_e4m3fn and rows["index_k"].dtype == torch.float32
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    # e4m3 latents move logits a little: the first tokens still agree with the fp32 reference
    agree = sum(o.outputs[0].token_ids[0] == glm_helpers.hf_greedy(hf_model, p, 1)[0] for o, p in zip(outs, prompts))
    assert agree >= 3
