"""Checkpoint-name mapping for Qwen3-MoE: per-expert HF tensors into stacked expert parameters."""

from __future__ import annotations

from layerzoo.layers.moe import stacked_expert_target
from layerzoo.layers.mtp import qwen_mtp_target


def dense_name_map(config):
    """``name_map(key)`` for Qwen3: the ``mtp.*`` head (Qwen3-Next's layout) onto ``mtp.*`` (the
    loader skips those targets when the model was built without its head); other keys unchanged."""

    def name_map(key: str):
        return qwen_mtp_target(key) if key.startswith("mtp.") else key

    return name_map


def moe_name_map(config):
    """``name_map(key)`` placing ``...experts.{e}.{gate,up,down}_proj.weight`` into
    ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``; other keys unchanged."""
    num_experts = config.num_experts

    def name_map(key: str):
        return stacked_expert_target(key, num_experts) or key

    return name_map


def bare_decoder_name_map(config):
    """``name_map(key)`` for transformers' bare ``Qwen3Model`` save (Qwen3-Embedding's layout): its
    keys are the decoder's own (``embed_tokens.weight``, ``layers.0...``, ``norm.weight``), which
    live under ``model.`` here; there is no ``lm_head`` to load."""

    def name_map(key: str):
        return key if key.startswith("model.") else f"model.{key}"

    return name_map
