"""layerzoo plugin for Llama and Mistral, written as a third party would: it imports only the
public modules of layerzoo (no underscore names, nothing from ``layerzoo.runtime``).

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl

LLAMA_KIND = "llama.decoder"


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


# Capability answers: none. The layer is the core's paged attention plus a gated MLP, for which
# the core's defaults are true: it rewinds by lowering the KV cursor, batches across sequences,
# keeps no per-sequence buffers or host work, has no recurrent state to capture, and the core
# answers its attention's FP8 state itself.


@hookimpl
def register_test_configs(register):
    from layerzoo_llama.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
