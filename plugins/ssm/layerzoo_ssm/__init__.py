"""layerzoo plugin for recurrent-state models: Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) and Mamba2.

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl
from layerzoo.capability_table import capability_hookimpls

GDN_KIND = "ssm.gated_deltanet"
GATED_ATTENTION_KIND = "ssm.gated_attention"
MAMBA2_KIND = "ssm.mamba2"
KINDS = (GDN_KIND, GATED_ATTENTION_KIND, MAMBA2_KIND)


@hookimpl
def register_architectures(register):
    register("Qwen3NextForCausalLM", "layerzoo_ssm.qwen3_next:Qwen3NextForCausalLM")
    register("Qwen3_5ForCausalLM", "layerzoo_ssm.qwen3_5:Qwen3_5ForCausalLM")
    register("Qwen3_5ForConditionalGeneration", "layerzoo_ssm.qwen3_5:Qwen3_5ForConditionalGeneration")
    register("Qwen3_5MoeForCausalLM", "layerzoo_ssm.qwen3_5:Qwen3_5MoeForCausalLM")
    register("Qwen3_5MoeForConditionalGeneration", "layerzoo_ssm.qwen3_5:Qwen3_5MoeForConditionalGeneration")
    register("Mamba2ForCausalLM", "layerzoo_ssm.mamba2:Mamba2ForCausalLM")


@hookimpl
def register_layer_kinds(register):
    register(GDN_KIND, "layerzoo_ssm.gated_deltanet:GatedDeltaNetDecoderLayer", "Gated DeltaNet (linear attention, pool state) + MLP/MoE")
    register(GATED_ATTENTION_KIND, "layerzoo_ssm.qwen3_next:GatedAttentionDecoderLayer", "gated full attention (q|gate, (1+w) norms, partial RoPE) + MLP/MoE")
    register(MAMBA2_KIND, "layerzoo_ssm.mamba2:Mamba2Block", "Mamba2 mixer (SSD, pool state)")


@hookimpl
def register_chat_formats(register):
    # Qwen3-Next chats like Qwen3 (<tool_call> JSON); Qwen3.5 writes Qwen3-Coder's XML calls
    # (<function=...><parameter=...>, vLLM's qwen3_coder). Both think in <think>. (Mamba2 has no chat format.)
    register("Qwen3NextForCausalLM", "hermes")
    for architecture in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                         "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        register(architecture, "qwen3_coder")

@hookimpl
def register_weight_mappings(register):
    register("Qwen3NextForCausalLM", "layerzoo_ssm.qwen3_next:name_map")
    register("Qwen3_5ForCausalLM", "layerzoo_ssm.qwen3_5:name_map")
    register("Qwen3_5ForConditionalGeneration", "layerzoo_ssm.qwen3_5:name_map")
    register("Qwen3_5MoeForCausalLM", "layerzoo_ssm.qwen3_5:name_map")
    register("Qwen3_5MoeForConditionalGeneration", "layerzoo_ssm.qwen3_5:name_map")
    register("Mamba2ForCausalLM", "layerzoo_ssm.mamba2:name_map")


@hookimpl
def register_kernels(register):
    from layerzoo_ssm.ops import register_all

    register_all(register)


# Capability answers for our own layers, each a claim the tests check:
# * every layer batches across sequences, keeps no host-side work and no per-sequence buffers
#   outside the pool, so the graph, multi-sequence, verify and staleness vetoes are False; except
#   that MoE experts on the torch grouped matmul (CPU) read expert counts on the host, so a layer
#   with them cannot run in a captured decode step;
# * the GDN layer prefills in the three phases (is_ssm_layer); the Mamba2 mixer keeps pool state
#   but prefills in one call, so it answers False;
# * both recurrent layers keep their state in the pool, whose rollback ring and per-draft states
#   rewind them, and split their prefill at a capture row exactly as a pass starting there would;
# * the gated attention reads the paged cache row by row, so its rows from a capture row on are
#   those of a pass starting there.
# Only what differs from the core's defaults (which also answer the FP8 state of the gated
# attention and the graph veto of experts on the torch grouped matmul):
globals().update(capability_hookimpls({
    GDN_KIND: {"is_ssm_layer": True, "supports_replay_tail_split": True},
    GATED_ATTENTION_KIND: {"supports_replay_tail_split": True},
    MAMBA2_KIND: {"supports_replay_tail_split": True},
}))


@hookimpl
def register_test_configs(register):
    from layerzoo_ssm.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
