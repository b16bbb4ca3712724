"""Kimi Linear on the paged runtime: preemption, an FP8 latent cache with online calibration, and
what `layerzoo plugins` reports for its layer kinds."""

import json

import torch

from layerzoo import LLM, SamplingParams
from layerzoo.entrypoints.cli import main
from layerzoo.loading.model_loading import load_model

MLA_LAYER = 2
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def hf_greedy(model, prompt, steps=GREEDY.max_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


def prompts_of(vocab):
    return [[(i * s + 3) % vocab for i in range(n)] for s, n in ((5, 60), (7, 45), (11, 70), (13, 30))]


def test_preemption_keeps_outputs(kimi_tiny):
    path, hf_model = kimi_tiny
    prompts = prompts_of(hf_model.config.vocab_size)
    per_token = sum(s.bytes_per_token for s in load_model(path).model.kv_cache_specs().values())
    assert per_token == 4 * (24 + 8)  # one MLA layer: kv_lora_rank + rope dims, fp32, one row per token
    small = dict(dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False, max_num_seqs=4)
    # The recurrent-state pool is sized first; the KV cache gets what is left: about 160 tokens.
    pool = LLM(path, **small).engine.runner.pool
    state_bytes = sum(t.numel() * t.element_size() for ts in (pool.conv, pool.recurrent) for t in ts.values())
    llm = LLM(path, kv_cache_memory=state_bytes + per_token * 160, max_model_len=160, **small)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p) for p in prompts]
    assert llm.engine.blocks.num_free_blocks() == llm.engine.blocks.num_blocks


def test_fp8_latent_cache_calibrates_online(kimi_tiny):
    path, hf_model = kimi_tiny
    prompts = prompts_of(hf_model.config.vocab_size)
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", fp8_calibration_tokens=40)
    engine = llm.engine
    assert engine.kv.rows[MLA_LAYER]["latent"].dtype == torch.float8_e4m3fn
    assert engine.model.fp8_calibration_states()[MLA_LAYER] is False  # calibrating
    assert engine.model.fp8_calibration_states()[0] is None  # KDA keeps no KV
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert engine.model.fp8_calibration_states()[MLA_LAYER] is True
    # e4m3 latents move logits a little: the first tokens still agree with the fp32 reference
    agree = sum(o.outputs[0].token_ids[0] == hf_greedy(hf_model, p, 1)[0] for o, p in zip(outs, prompts))
    assert agree >= 3


def test_plugins_lists_the_kimi_layer_kinds(capsys):
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    kimi = plugins["kimi_k3"]
    assert kimi["distribution"] == "layerzoo-kimi-k3" and kimi["architectures"] == ["KimiK3ForConditionalGeneration", "KimiLinearForCausalLM"]
    kda, mla = kimi["layer_kinds"]["kimi_k3.kda"]["capabilities"], kimi["layer_kinds"]["kimi_k3.mla"]["capabilities"]
    assert kda["is_ssm_layer"] and kda["uses_ssm_pool"] and kda["supports_replay_tail_split"]
    assert not mla["is_ssm_layer"] and mla["supports_replay_tail_split"] and not mla["uses_local_mla_prefill"]


def test_capabilities_of_a_kimi_model(kimi_tiny, capsys):
    path, _ = kimi_tiny
    assert main(["plugins", "--capabilities", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [layer["kind"] for layer in report["layers"]] == ["kimi_k3.kda", "kimi_k3.kda", "kimi_k3.mla", "kimi_k3.kda"]
    assert report["model"]["ssm_split_prefill_layers"] == [0, 1, 3]
    assert report["model"]["prefix_matching_allowed"] and report["model"]["replay_tail_split_supported"]
