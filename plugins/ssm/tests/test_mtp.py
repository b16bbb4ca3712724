"""The MTP head of Qwen3-Next and Qwen3.5 (dense and MoE): ``mtp.*`` loaded strictly when
speculation asks for ``method "mtp"``, skipped otherwise; MTP speculation's greedy outputs equal
plain decoding, and its drafts equal a recompute's (`layerzoo.testing.mtp`)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerzoo.engine_args import EngineArgs
from layerzoo.errors import CheckpointError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import mtp as mtp_checks
from layerzoo.testing.checkpoints import add_mtp_head

transformers = pytest.importorskip("transformers")

MTP = EngineArgs(speculative_config=mtp_checks.mtp_config(2))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12)


def _next(ssm_tiny, path):
    # Layers 1 and 3 are full attention; 3 is MoE (mlp_only_layers=[1]), the kind of the head's block.
    ssm_tiny.save_tiny(path, transformers.Qwen3NextForCausalLM, ssm_tiny.next_config())
    return 3, 151


def _qwen3_5(ssm_tiny, path):
    ssm_tiny.save_tiny(path, transformers.Qwen3_5ForCausalLM, ssm_tiny.qwen3_5_text_config(), seed=1)
    return 1, 139


def _qwen3_5_moe(ssm_tiny, path):
    dense = ssm_tiny.qwen3_5_text_config()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "layer_types", "max_position_embeddings", "tie_word_embeddings")
    config = transformers.Qwen3_5MoeTextConfig(**{k: getattr(dense, k) for k in keys}, **MOE,
                                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    ssm_tiny.save_tiny(path, transformers.Qwen3_5MoeForCausalLM, config, seed=2)
    return 1, 139


@pytest.fixture(scope="module", params=[_next, _qwen3_5, _qwen3_5_moe], ids=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def with_head(request, tmp_path_factory, ssm_tiny):
    path = tmp_path_factory.mktemp(request.param.__name__)
    source, vocab = request.param(ssm_tiny, path)
    add_mtp_head(path, "qwen", source_layer=source)
    return path, vocab


def test_head_loads_strictly_when_mtp_is_asked_for(with_head, tmp_path):
    path, _ = with_head
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, MTP).model
    layers = model.config.num_hidden_layers
    assert model.mtp is not None and model.mtp.layer_index == layers and layers in model.kv_cache_specs()
    torch.testing.assert_close(model.mtp.enorm.weight, tensors["mtp.pre_fc_norm_embedding.weight"])
    torch.testing.assert_close(model.mtp.hnorm.weight, tensors["mtp.pre_fc_norm_hidden.weight"])
    torch.testing.assert_close(model.mtp.norm.weight, tensors["mtp.norm.weight"])
    torch.testing.assert_close(model.mtp.block.self_attn.q_norm.weight, tensors["mtp.layers.0.self_attn.q_norm.weight"])
    assert load_model(path).model.mtp is None
    # A head tensor missing: named as the checkpoint spells it.
    tensors.pop("mtp.fc.weight")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks the MTP head's tensor mtp\.fc\.weight"):
        load_model(broken, MTP)


def test_mtp_greedy_outputs_equal_plain_decoding(with_head):
    path, vocab = with_head
    st = mtp_checks.greedy_equals_plain(path, vocab).engine.stats
    assert st.spec_verify_steps > 0 and st.preemptions > 0 and st.prefix_cache_hits > 0


def test_mtp_drafts_equal_a_recompute(with_head):
    path, vocab = with_head
    assert mtp_checks.drafts_equal_recompute(path, vocab) >= 5


def test_requests_with_logprobs_write_the_head_s_kv_but_draft_nothing(with_head):
    from layerzoo import LLM, SamplingParams

    path, vocab = with_head
    llm = LLM(path, dtype="float32", speculative_config=mtp_checks.mtp_config(3))
    made = mtp_checks.record_drafts(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = mtp_checks.prompts_for(vocab, (20,))[0]
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    plain = LLM(path, dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert out.token_ids == plain.token_ids and made == []
