"""layerzoo plugin for the Kimi family: Kimi Linear (KDA + NoPE MLA, DeepSeek-style MoE) and the
Kimi K3 text model (lower-bounded KDA gate, gated MLA, SiTU, latent MoE, AttnRes).

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of one of these architectures is loaded.
"""

from __future__ import annotations

from layerzoo import hookimpl
from layerzoo.capability_table import PerLayer, capability_hookimpls, conditional, experts_decode_graph_unsupported

KDA_KIND = "kimi_k3.kda"
MLA_KIND = "kimi_k3.mla"
KINDS = (KDA_KIND, MLA_KIND)


@hookimpl
def register_architectures(register):
    register("KimiLinearForCausalLM", "layerzoo_kimi_k3.kimi_linear:KimiLinearForCausalLM")
    register("KimiK3ForConditionalGeneration", "layerzoo_kimi_k3.kimi_k3:KimiK3ForConditionalGeneration")


@hookimpl
def register_layer_kinds(register):
    register(KDA_KIND, "layerzoo_kimi_k3.kimi_linear:KdaDecoderLayer", "Kimi Delta Attention (linear attention, pool state) + MLP/MoE (Kimi Linear, K3)")
    register(MLA_KIND, "layerzoo_kimi_k3.kimi_linear:MlaDecoderLayer", "multi-head latent attention (latent cache, NoPE, K3: output gate) + MLP/MoE")


@hookimpl
def register_chat_formats(register):
    # Kimi's tool-call section tokens (<|tool_calls_section_begin|> ...) and <think>.
    for architecture in ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"):
        register(architecture, "kimi")

@hookimpl
def register_weight_mappings(register):
    register("KimiLinearForCausalLM", "layerzoo_kimi_k3.kimi_linear:name_map")
    register("KimiK3ForConditionalGeneration", "layerzoo_kimi_k3.kimi_k3:name_map")


# Capability answers for our own layers, each a claim the tests check:
# * both kinds batch across sequences, keep no host-side work and no per-sequence buffers outside
#   the pools: the multi-sequence, verify and staleness vetoes are False;
# * the graph veto (`_decode_graph_unsupported`) is True on CPU, where the torch paths of both
#   decodes cannot be compiled into a captured step (the KDA reference checks cu_seqlens on the
#   host; the latent MLA decode's attention does not compile), and for a layer whose experts read
#   on the host (the torch grouped matmul, K3's SiTU experts on every device);
# * KDA answers as Gated DeltaNet: three-phase prefill, pool state (rollback ring and per-draft
#   states rewind it), exact split at a capture row;
# * MLA reads its latents from the paged cache, so lowering the KV cursor rewinds it and rows from
#   a capture row on are those of a pass starting there; it prefills chunk-locally only when the
#   engine runs with mla_prefill="local" (uses_local_mla_prefill then True).


def _decode_graph_unsupported(layer) -> bool:
    """True on CPU (the conformance kit's compiled decode fails there for KDA and MLA alike), for
    experts on the torch grouped matmul, and for K3's SiTU experts (on every device: they loop over
    the experts present, read on the host)."""
    from layerzoo_kimi_k3.kimi_k3 import SituExperts

    if next(layer.parameters()).device.type == "cpu":
        return True
    return experts_decode_graph_unsupported(layer) or any(isinstance(m, SituExperts) for m in layer.modules())


_decode_graph_unsupported.condition = "True on CPU, for experts on the torch grouped matmul, and for SiTU experts"

# Only what differs from the core's defaults (which also answer the MLA's FP8 state):
_COMMON = {"decode_graph_unsupported": PerLayer(_decode_graph_unsupported, without_layer=False), "supports_replay_tail_split": True}
globals().update(capability_hookimpls({
    KDA_KIND: {**_COMMON, "is_ssm_layer": True},
    MLA_KIND: _COMMON,
}))


# Not in the table: the answer depends on the engine's settings, not on the layer kind alone.
@conditional({MLA_KIND: "True when the engine runs with mla_prefill='local'"})
@hookimpl
def uses_local_mla_prefill(layer_kind, engine_config):
    if layer_kind == KDA_KIND:
        return False
    if layer_kind == MLA_KIND:
        return getattr(engine_config, "mla_prefill", "paged") == "local"
    return None


@hookimpl
def register_test_configs(register):
    from layerzoo_kimi_k3.test_configs import CONFIGS, WRITER, WRITERS

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITERS.get(architecture, WRITER))
