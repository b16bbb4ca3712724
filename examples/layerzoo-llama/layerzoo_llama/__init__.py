"""layerzoo plugin for Llama and Mistral, written as a third party would: it imports only the
public modules of layerzoo (no underscore names, nothing from ``layerzoo.runtime``).

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl
from layerzoo.capability_table import attention_fp8_state, capability_hookimpls

LLAMA_KIND = "llama.decoder"
KINDS = (LLAMA_KIND,)


@hookimpl
def register_architectures(register):
    register("LlamaForCausalLM", "layerzoo_llama.model:LlamaForCausalLM")
    register("MistralForCausalLM", "layerzoo_llama.model:MistralForCausalLM")


@hookimpl
def register_chat_formats(register):
    # Llama 3.1+ JSON tool calls: the whole message is {"name": ..., "parameters": {...}}.
    # (Mistral's [TOOL_CALLS] format is not among the core's; it gets none.)
    register("LlamaForCausalLM", "llama3_json")


@hookimpl
def register_layer_kinds(register):
    register(LLAMA_KIND, "layerzoo_llama.model:LlamaDecoderLayer", "GQA attention (RoPE, optional bias) + SwiGLU MLP")


# Capability answers: the layer is the core's paged attention plus a gated MLP, so it rewinds by
# lowering the KV cursor, batches across sequences, and keeps no per-sequence buffers or host
# work. Replay-tail capture is not claimed: there is no recurrent state to capture.
_ANSWERS = {
    "uses_local_mla_prefill": False,
    "fp8_calibration_frozen": attention_fp8_state,  # live: the core attention's FP8 KV scales
    "decode_graph_unsupported": False,
    "decode_multi_seq_unsupported": False,
    "decode_rollback_unsupported": False,
    "decode_verify_multi_unsupported": False,
    "graph_stale_on_new_sequence": False,
    "is_ssm_layer": False,
    "supports_replay_tail_split": False,
}

globals().update(capability_hookimpls({kind: _ANSWERS for kind in KINDS}))


@hookimpl
def register_test_configs(register):
    from layerzoo_llama.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
