"""Qwen3.5: the Qwen3-Next layer pattern with split GDN projections, as text model or VLM text tower.

Differences from Qwen3-Next: the GDN projections are four separate, already contiguous matrices
(``in_proj_qkv`` in conv order, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), so there is no
per-group de-interleave. The multimodal checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``) keep the text weights under ``model.language_model.``;
only the text tower is served (the vision tower's ``model.visual.*`` is not loaded, and prompts
holding image or video placeholder ids are refused). Text positions use the same position on all
three M-RoPE axes, which makes M-RoPE the plain (partial) RoPE used here.
"""

from __future__ import annotations

import attrs

from layerzoo.config import hf
from layerzoo.errors import UserError
from layerzoo.layers.moe import stacked_expert_target
from layerzoo.layers.mtp import qwen_mtp_target
from layerzoo_ssm.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM


@attrs.frozen(kw_only=True)
class Qwen3_5Config(Qwen3NextConfig):
    image_token_id: int | None = hf(None, kind=int)
    video_token_id: int | None = hf(None, kind=int)
    vision_start_token_id: int | None = hf(None, kind=int)
    vision_end_token_id: int | None = hf(None, kind=int)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    config_class = Qwen3_5Config
    gdn_layout = "split"  # diff with Qwen3-Next: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """The MoE text model: the layer builder already follows ``num_experts``."""


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text tower of the vision-language checkpoint."""

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        c = self.config
        names = {c.image_token_id: "image", c.video_token_id: "video", c.vision_start_token_id: "vision-start"}
        names.pop(None, None)
        found = sorted({names[t] for t in token_ids if t in names})
        if found:
            raise UserError(
                f"request {request_id}: the prompt holds {' and '.join(found)} placeholder tokens, but only the "
                f"text model of {type(self).__name__} is served (image and video inputs are not supported)"
            )


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The text tower of the MoE vision-language checkpoint."""


def name_map(config: Qwen3_5Config):
    """Checkpoint keys onto the text model: the wrapper prefix dropped, the vision tower skipped,
    the ``mtp.*`` head onto ``mtp.*`` (dropped by the loader without the head), per-expert tensors stacked."""

    def mapped(key: str):
        if key.startswith("model.visual."):
            return None
        if key.startswith("mtp."):
            key = qwen_mtp_target(key)
            if key is None:
                return None
            return stacked_expert_target(key, config.num_experts) or key
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        return stacked_expert_target(key, config.num_experts) or key

    return mapped
