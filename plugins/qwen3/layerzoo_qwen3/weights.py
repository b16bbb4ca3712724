"""Checkpoint-name mapping for Qwen3-MoE: per-expert HF tensors into stacked expert parameters."""

from __future__ import annotations

import re

from layerzoo.loader import Target

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_name_map(config):
    """``name_map(key)`` placing ``...experts.{e}.{gate,up,down}_proj.weight`` into
    ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``; other keys unchanged."""
    num_experts = config.num_experts

    def name_map(key: str):
        match = _EXPERT.match(key)
        if match is None:
            return key
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj":
            return Target(f"{prefix}.down_proj", (expert,), (num_experts,))
        return Target(f"{prefix}.gate_up_proj", (expert, 0 if proj == "gate_proj" else 1), (num_experts, 2))

    return name_map
