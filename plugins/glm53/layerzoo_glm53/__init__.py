"""layerzoo plugin for GLM-5.x: ``GlmMoeDsaForCausalLM`` (MLA + DSA sparse attention, MoE) and the
GLM-5.3-Flash text model ``Glm5NextForConditionalGeneration`` (KDA + k-pool DSA + mHC, MoE).

Loading this module registers names only; the model code (and torch) is imported when a
checkpoint of the architecture is loaded.
"""

from __future__ import annotations

from pathlib import Path

import layerzoo.capability_table
from layerzoo import hookimpl

DSA_KIND = "glm53.dsa"
GLM5_NEXT_KDA_KIND = "glm53.glm5_next_kda"
GLM5_NEXT_DSA_KIND = "glm53.glm5_next_dsa"

# op name -> (folder under ops/, function)
OPS = {
    "dsa_indexer_topk": ("dsa_indexer_topk", "dsa_indexer_topk"),
    "kpool_compress": ("kpool_compress", "kpool_compress"),
    "mhc_sinkhorn": ("mhc_sinkhorn", "mhc_sinkhorn"),
}


@hookimpl
def register_architectures(register):
    register("GlmMoeDsaForCausalLM", "layerzoo_glm53.glm_moe_dsa:GlmMoeDsaForCausalLM")
    register("Glm5NextForConditionalGeneration", "layerzoo_glm53.glm5_next:Glm5NextForConditionalGeneration")


@hookimpl
def register_layer_kinds(register):
    register(DSA_KIND, "layerzoo_glm53.glm_moe_dsa:DsaDecoderLayer", "MLA over the DSA indexer's top-k tokens (latent + indexer-key cache rows) + MLP/MoE (GLM-5)")
    register(GLM5_NEXT_KDA_KIND, "layerzoo_glm53.glm5_next:Glm5NextKdaLayer", "KDA (lower-bounded gate, pool state) + clamped MLP/MoE, each inside mHC (GLM-5.3-Flash)")
    register(GLM5_NEXT_DSA_KIND, "layerzoo_glm53.glm5_next:Glm5NextDsaLayer", "NoPE MLA over the k-pool indexer's picks (latent, per-token and per-k-token pooled cache rows) + clamped MLP/MoE, inside mHC (GLM-5.3-Flash)")


@hookimpl
def register_chat_formats(register):
    # GLM-5's <tool_call>name<arg_key>..</arg_key><arg_value>..</arg_value></tool_call> and <think>.
    for architecture in ("GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration"):
        register(architecture, "glm")

@hookimpl
def register_weight_mappings(register):
    register("GlmMoeDsaForCausalLM", "layerzoo_glm53.glm_moe_dsa:name_map")
    register("Glm5NextForConditionalGeneration", "layerzoo_glm53.glm5_next:name_map")


@hookimpl
def register_kernels(register):
    from layerzoo.kernels import register_op_folders

    register_op_folders(register, f"{__name__}.ops", Path(__file__).parent / "ops", OPS)


# Capability answers, each a claim the tests check: the layer keeps everything per token in the
# paged pool (the MLA latent and the indexer key are both rows of its KVCacheSpec), so lowering the
# KV cursor rewinds it, a capture row splits it exactly, and nothing per sequence lives beside the
# pool (graph_stale_on_new_sequence False). Its decode is batched with device-side top-k and no
# host values; its prefill always reads the paged context (never chunk-local MLA prefill).
#
# GLM-5.3-Flash's indexed layer answers as GLM-5's: its latent, the indexer's per-token key and
# gate rows and the pooled row of every k tokens are all rows of its KVCacheSpec (a pooled row is
# recomputed whenever a token of its pool is written, and read only once the pool is complete, so
# lowering the KV cursor rewinds it too). Its KDA layer answers as Kimi's: pool state (rollback
# ring and per-draft states rewind it), three-phase prefill, exact split at a capture row. mHC
# keeps nothing between steps. Decode of both is batched with no host values, except in a layer
# whose routed experts run the grouped matmul's torch backend (CPU), which reads each expert's
# row count on the host: such a layer answers decode_graph_unsupported True (dense layers and the
# kind alone False).
# Only what differs from the core's defaults (which also answer the FP8 state of the MLA and the
# graph veto of experts on the torch grouped matmul):
globals().update(layerzoo.capability_table.capability_hookimpls({
    DSA_KIND: {"supports_replay_tail_split": True},
    GLM5_NEXT_DSA_KIND: {"supports_replay_tail_split": True},
    GLM5_NEXT_KDA_KIND: {"is_ssm_layer": True, "supports_replay_tail_split": True},
}))


@hookimpl
def register_test_configs(register):
    from layerzoo_glm53.test_configs import CONFIGS, WRITER

    for architecture, config in CONFIGS.items():
        register(architecture, config, WRITER)
