"""The text tower of a Qwen3.5-MoE vision-language checkpoint: text parity, image inputs refused."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.errors import UserError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, VISION_START, VISION_END = 130, 131, 132, 133


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, ssm_tiny):
    text = ssm_tiny.qwen3_5_text_config(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12
    ).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, temporal_patch_size=2, spatial_merge_size=1)
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("qwen3_5_moe_vlm")
    model = ssm_tiny.save_tiny(path, transformers.Qwen3_5MoeForConditionalGeneration, config, seed=3)
    return path, model


def test_text_tower_logits_match_transformers(vlm):
    path, hf_model = vlm
    loaded = load_model(path)
    assert loaded.architecture == "Qwen3_5MoeForConditionalGeneration"
    ids = torch.randint(0, 120, (77,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, [40, 37]), expected, atol=2e-4, rtol=0)


def test_text_tower_greedy_matches_transformers(vlm):
    path, hf_model = vlm
    prompt = list(range(3, 90))
    out = LLM(path, dtype="float32", max_num_batched_tokens=32).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0].token_ids
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert out == expected[0, len(prompt) :].tolist()


def test_image_placeholders_are_refused_with_a_clear_error(vlm):
    path, _ = vlm
    llm = LLM(path, dtype="float32")
    with pytest.raises(UserError, match="holds image and vision-start placeholder tokens, but only the text model of Qwen3_5MoeForConditionalGeneration"):
        llm.generate({"prompt_token_ids": [1, 2, VISION_START, IMAGE, VISION_END, 3]}, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()  # nothing half-accepted
