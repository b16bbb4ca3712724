"""layerzoo plugin for Qwen3 (dense), Qwen3-MoE and Qwen2.

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl
from layerzoo.capability_table import PerLayer, attention_fp8_state, capability_hookimpls, experts_decode_graph_unsupported

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
    register("Qwen3MoeForCausalLM", "layerzoo_qwen3.weights:moe_name_map")
    register("Qwen3Model", "layerzoo_qwen3.weights:bare_decoder_name_map")


# Capability answers for our own layers. Each is a claim about what the layer really does:
# attention over the KV cache rewinds by lowering the cursor, batches across sequences, keeps no
# per-sequence buffers and no host-side work, so every veto is False, except a captured decode for
# an MoE layer whose experts run the torch grouped matmul (CPU), which reads expert counts on the host. Replay-tail capture is not
# claimed: no qwen3 layer has recurrent state to capture. FP8 calibration is live: the attention's
# FP8 KV scales freeze while requests run.
_QWEN3_ANSWERS = {
    "uses_local_mla_prefill": False,  # no MLA form: prefill reads the whole cached prefix
    "fp8_calibration_frozen": attention_fp8_state,
    # False for dense layers (and for the kind alone)
    "decode_graph_unsupported": PerLayer(experts_decode_graph_unsupported, without_layer=False),
    "decode_multi_seq_unsupported": False,
    "decode_rollback_unsupported": False,
    "decode_verify_multi_unsupported": False,
    "graph_stale_on_new_sequence": False,
    "is_ssm_layer": False,
    "supports_replay_tail_split": False,
}

globals().update(capability_hookimpls({kind: _QWEN3_ANSWERS for kind in KINDS}))


@hookimpl
def register_test_configs(register):
    from layerzoo_qwen3.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
