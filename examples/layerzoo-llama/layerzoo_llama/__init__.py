"""layerzoo plugin for Llama and Mistral, written as a third party would: it imports only the
public modules of layerzoo (no underscore names, nothing from ``layerzoo.runtime``).

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl

LLAMA_KIND = "llama.decoder"
KINDS = (LLAMA_KIND,)


@hookimpl
def register_architectures(register):
    register("LlamaForCausalLM", "layerzoo_llama.model:LlamaForCausalLM")
    register("MistralForCausalLM", "layerzoo_llama.model:MistralForCausalLM")


@hookimpl
def register_layer_kinds(register):
    register(LLAMA_KIND, "layerzoo_llama.model:LlamaDecoderLayer", "GQA attention (RoPE, optional bias) + SwiGLU MLP")


# Capability answers: the layer is the core's paged attention plus a gated MLP, so it rewinds by
# lowering the KV cursor, batches across sequences, and keeps no per-sequence buffers or host
# work. Replay-tail capture is not claimed: there is no recurrent state to capture.
_ANSWERS = {
    "uses_local_mla_prefill": False,
    "decode_graph_unsupported": False,
    "decode_multi_seq_unsupported": False,
    "decode_rollback_unsupported": False,
    "decode_verify_multi_unsupported": False,
    "graph_stale_on_new_sequence": False,
    "is_ssm_layer": False,
    "supports_replay_tail_split": False,
}


def _answer(query: str, layer_kind: str):
    return _ANSWERS[query] if layer_kind in KINDS else None


@hookimpl
def uses_local_mla_prefill(layer_kind):
    return _answer("uses_local_mla_prefill", layer_kind)


@hookimpl
def fp8_calibration_frozen(layer_kind, layer):
    # Live state of the core attention's FP8 KV scales (None unless the KV cache is FP8).
    if layer_kind not in KINDS or layer is None:
        return None
    return getattr(getattr(layer, "self_attn", layer), "fp8_calibration_frozen", None)


@hookimpl
def decode_graph_unsupported(layer_kind):
    return _answer("decode_graph_unsupported", layer_kind)


@hookimpl
def decode_multi_seq_unsupported(layer_kind):
    return _answer("decode_multi_seq_unsupported", layer_kind)


@hookimpl
def decode_rollback_unsupported(layer_kind):
    return _answer("decode_rollback_unsupported", layer_kind)


@hookimpl
def decode_verify_multi_unsupported(layer_kind):
    return _answer("decode_verify_multi_unsupported", layer_kind)


@hookimpl
def graph_stale_on_new_sequence(layer_kind):
    return _answer("graph_stale_on_new_sequence", layer_kind)


@hookimpl
def is_ssm_layer(layer_kind):
    return _answer("is_ssm_layer", layer_kind)


@hookimpl
def supports_replay_tail_split(layer_kind):
    return _answer("supports_replay_tail_split", layer_kind)
