"""layerzoo plugin for Qwen3 (dense), Qwen3-MoE and Qwen2.

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl

DENSE_KIND = "qwen3.decoder"
MOE_KIND = "qwen3_moe.decoder"
QWEN2_KIND = "qwen2.decoder"
KINDS = (DENSE_KIND, MOE_KIND, QWEN2_KIND)


@hookimpl
def register_architectures(register):
    register("Qwen3ForCausalLM", "layerzoo_qwen3.model:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "layerzoo_qwen3.model:Qwen3MoeForCausalLM")
    register("Qwen2ForCausalLM", "layerzoo_qwen3.model:Qwen2ForCausalLM")
    # transformers' bare decoder (no LM head), the layout Qwen3-Embedding checkpoints are saved in:
    # loaded as an embedder (LLM.embed, /v1/embeddings), never for generation.
    register("Qwen3Model", "layerzoo_qwen3.model:Qwen3Model")


@hookimpl
def register_layer_kinds(register):
    register(DENSE_KIND, "layerzoo_qwen3.model:Qwen3DecoderLayer", "GQA attention with QK-norm + SwiGLU MLP")
    register(MOE_KIND, "layerzoo_qwen3.model:Qwen3MoeDecoderLayer", "Qwen3 attention + softmax top-k MoE (or dense MLP)")
    register(QWEN2_KIND, "layerzoo_qwen3.model:Qwen2DecoderLayer", "GQA attention with q/k/v bias, no QK-norm + SwiGLU MLP")


@hookimpl
def register_chat_formats(register):
    # Qwen3 and Qwen2.5 write Hermes-style <tool_call> JSON and <think> reasoning.
    for architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM"):
        register(architecture, "hermes")

@hookimpl
def register_weight_mappings(register):
    register("Qwen3ForCausalLM", "layerzoo_qwen3.weights:dense_name_map")  # its optional mtp.* head
    register("Qwen3MoeForCausalLM", "layerzoo_qwen3.weights:moe_name_map")
    register("Qwen3Model", "layerzoo_qwen3.weights:bare_decoder_name_map")


# Capability answers: none of our own. Every qwen3 layer is the core's paged attention plus a
# SwiGLU MLP or the core's routed experts, so the core's defaults are the true answers (the kit
# checks them): attention over the KV cache rewinds by lowering the cursor, batches across
# sequences and keeps nothing per sequence beside the pool; no recurrent state, so no replay-tail
# capture; the core answers the FP8 state of its attention and the graph veto of its experts.


@hookimpl
def register_test_configs(register):
    from layerzoo_qwen3.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
