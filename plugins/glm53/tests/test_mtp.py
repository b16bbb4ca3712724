"""GLM-5's MTP head (NextN layer ``model.layers.{num_hidden_layers}``): loaded strictly when
speculation asks for ``method "mtp"``, skipped otherwise; MTP speculation's greedy outputs equal
plain decoding, and its drafts equal a recompute's (`layerzoo.testing.mtp`)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from layerzoo import LLM
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import CheckpointError, UserError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import mtp as mtp_checks
from layerzoo.testing.checkpoints import add_mtp_head, copy_checkpoint

MTP = EngineArgs(speculative_config=mtp_checks.mtp_config(2))


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory, glm_helpers):
    path = tmp_path_factory.mktemp("glm-mtp")
    glm_helpers.save_tiny(path, glm_helpers.glm_config())
    # Layer 3 is a full-indexer MoE layer: the kind of the NextN block.
    return path, add_mtp_head(path, "nextn", source_layer=3)


def test_head_loads_strictly_when_mtp_is_asked_for(glm_mtp):
    path, added = glm_mtp
    assert "model.layers.4.eh_proj.weight" in added and "model.layers.4.self_attn.indexer.wk.weight" in added
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, MTP).model
    assert model.mtp is not None and model.mtp.layer_index == 4
    torch.testing.assert_close(model.mtp.enorm.weight, tensors["model.layers.4.enorm.weight"])
    torch.testing.assert_close(model.mtp.norm.weight, tensors["model.layers.4.shared_head.norm.weight"])
    torch.testing.assert_close(model.mtp.block.input_layernorm.weight, tensors["model.layers.4.input_layernorm.weight"])
    experts = model.mtp.block.mlp.experts.down_proj
    torch.testing.assert_close(experts[5], tensors["model.layers.4.mlp.experts.5.down_proj.weight"])
    assert 4 in model.kv_cache_specs()  # the head's KV pages with the decoder's
    plain = load_model(path).model
    assert plain.mtp is None and sorted(plain.kv_cache_specs()) == [0, 1, 2, 3]


def test_missing_or_misshapen_head_tensors_are_named(glm_mtp, tmp_path):
    path, _ = glm_mtp
    no_hnorm = copy_checkpoint(path, tmp_path / "a", lambda t: t.pop("model.layers.4.hnorm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks the MTP head's tensor model\.layers\.4\.hnorm\.weight"):
        load_model(no_hnorm, MTP)
    load_model(no_hnorm)  # without MTP the head is not read at all
    no_block = copy_checkpoint(path, tmp_path / "b", lambda t: t.pop("model.layers.4.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"mtp\.block\.self_attn\.kv_b_proj\.weight"):
        load_model(no_block, MTP)
    wide = copy_checkpoint(path, tmp_path / "c", lambda t: t.update({"model.layers.4.eh_proj.weight": torch.zeros(48, 97)}))
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_model(wide, MTP)


def test_mtp_is_refused_for_a_checkpoint_without_a_head(glm_tiny):
    path, _ = glm_tiny
    with pytest.raises(UserError, match=r"'mtp' .*GlmMoeDsaForCausalLM has none here \(its config declares no MTP layers\)"):
        LLM(path, speculative_config=mtp_checks.mtp_config(2))


def test_config_declaring_a_head_without_weights_is_an_error_naming_the_key(glm_tiny, tmp_path):
    path, _ = glm_tiny
    dst = copy_checkpoint(path, tmp_path / "declared", lambda t: None)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.enorm\.weight"):
        LLM(dst, speculative_config=mtp_checks.mtp_config(2))


def test_mtp_greedy_outputs_equal_plain_decoding(glm_mtp):
    path, _ = glm_mtp
    llm = mtp_checks.greedy_equals_plain(path, 131)
    st = llm.engine.stats
    assert st.spec_verify_steps > 0 and st.spec_draft_tokens > 0 and st.preemptions > 0 and st.prefix_cache_hits > 0


def test_mtp_drafts_equal_a_recompute(glm_mtp):
    path, _ = glm_mtp
    assert mtp_checks.drafts_equal_recompute(path, 131) >= 5


# -- GLM-5.3-Flash: the NextN layer after the KDA/DSA decoder, its block without mHC ---------------


@pytest.fixture(scope="module")
def flash_mtp(tmp_path_factory, next_helpers):
    path = tmp_path_factory.mktemp("glm5next-mtp")
    next_helpers.save_tiny(path, next_helpers.text_config())
    # Layer 1 is an indexed layer with its own indexer and the MoE: the kind of the NextN block.
    return path, add_mtp_head(path, "nextn", source_layer=1)


def test_flash_head_loads_strictly_when_mtp_is_asked_for(flash_mtp, tmp_path):
    path, added = flash_mtp
    assert "model.layers.4.hc_attn_fn" in added  # copied from a decoder layer: skipped (no mHC in the head)
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, MTP).model
    assert model.mtp is not None and 4 in model.kv_cache_specs()
    torch.testing.assert_close(model.mtp.hnorm.weight, tensors["model.layers.4.hnorm.weight"])
    torch.testing.assert_close(model.mtp.block.post_attention_layernorm.weight, tensors["model.layers.4.post_attention_layernorm.weight"])
    assert load_model(path).model.mtp is None
    no_enorm = copy_checkpoint(path, tmp_path / "flash", lambda t: t.pop("model.layers.4.enorm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks the MTP head's tensor model\.layers\.4\.enorm\.weight"):
        load_model(no_enorm, MTP)


def test_flash_mtp_greedy_outputs_equal_plain_decoding_and_drafts_a_recompute(flash_mtp):
    path, _ = flash_mtp
    st = mtp_checks.greedy_equals_plain(path, 131).engine.stats
    assert st.spec_verify_steps > 0 and st.preemptions > 0
    assert mtp_checks.drafts_equal_recompute(path, 131) >= 5
