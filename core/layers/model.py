"""The decoder-only model every architecture builds on, and loading one from a checkpoint.

An architecture plugin subclasses `CausalLM`, names its config class and builds its decoder
layers; module names follow the HF checkpoint (``model.layers.N.self_attn.q_proj``) so that most
tensors load without any mapping.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from layerzoo.config import DecoderConfig
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.layers import fused_mtp
from layerzoo.layers.base import DecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.rotary import RotaryEmbedding
from layerzoo.layers.split_prefill import three_phase_step
from layerzoo.layers.vocab_parallel import gather_logits, parallel_lm_head, vocab_parallel_embedding
from layerzoo.plugins.capabilities import ModelCapabilities

log = logging.getLogger(__name__)

_UNPLANNED = object()  # `CausalLM.mtp_draft`'s plan not asked for yet


class CausalLM(nn.Module):
    """Embedding → decoder layers → final norm → LM head.

    Subclasses set ``config_class`` and implement `build_layer`.
    """

    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    # False for an embedding-only checkpoint (transformers' ``Qwen3Model`` layout: no LM head): the
    # model's final hidden states are pooled into embeddings (`layerzoo.runtime.pooling`); it cannot generate.
    has_lm_head: ClassVar[bool] = True
    # How embeddings of this model are pooled when the caller names no method (None: `layerzoo.runtime.pooling.DEFAULT_POOLING`).
    default_pooling: ClassVar[str | None] = None

    def __init__(self, config: DecoderConfig, engine_config: EngineArgs | None = None):
        super().__init__()
        self.config = config
        self.engine_config = engine_config or EngineArgs()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.model = nn.Module()
        # vocab split across tensor-parallel ranks (plain nn.Embedding / nn.Linear with one rank)
        self.model.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(self.build_layer(i) for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = parallel_lm_head(config.hidden_size, config.vocab_size) if self.has_lm_head else None
        # The checkpoint's multi-token-prediction head (`layerzoo.layers.mtp.MtpHead`), built by
        # the plugin only when speculation asks for it (`mtp_requested`); None otherwise.
        self.mtp = None
        self.capabilities: ModelCapabilities | None = None

    def build_layer(self, layer_index: int) -> DecoderLayer:
        raise NotImplementedError

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def tied_weights(self) -> dict[str, str]:
        """Parameters that share storage when the checkpoint leaves one of them out."""
        if self.config.tie_word_embeddings and self.has_lm_head:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    @property
    def run_dtype(self) -> torch.dtype:
        """The dtype the model computes in: its embedding's output (the embedding's weight may be
        kept in a block format, `layerzoo.layers.gguf_linear.GGUFEmbedding`)."""
        embed = self.model.embed_tokens
        return getattr(embed, "dtype", None) or embed.weight.dtype

    def kv_cache_specs(self, dtype: torch.dtype | None = None) -> dict[int, KVCacheSpec]:
        """``layer index -> KVCacheSpec`` of every cache layer; an MTP head's block is one more,
        at its own index past the decoder's, so its KV pages with the target's."""
        dtype = dtype or self.run_dtype
        specs = {i: layer.kv_cache_spec(dtype) for i, layer in enumerate(self.layers)}
        if self.mtp is not None:
            specs[self.mtp.layer_index] = self.mtp.block.kv_cache_spec(dtype)
        return {i: spec for i, spec in specs.items() if spec is not None}

    # -- the MTP head ----------------------------------------------------------------------------

    def cache_layer(self, layer_index: int) -> nn.Module:
        """The module of KV-cache layer ``layer_index``: a decoder layer, or the MTP head's block."""
        if self.mtp is not None and layer_index == self.mtp.layer_index:
            return self.mtp.block
        return self.layers[layer_index]

    def num_mtp_layers(self) -> int:
        """How many MTP layers the checkpoint's config declares (plugins read their config key)."""
        return 0

    def mtp_requested(self) -> bool:
        """Whether to build and load the MTP head: speculation asks for ``method "mtp"``. Otherwise
        the head's weights are skipped (a full decoder layer of memory nothing would use)."""
        spec = self.engine_config.speculative_config
        return spec is not None and spec.method == "mtp" and self.num_mtp_layers() > 0

    def mtp_checkpoint_keys(self) -> list[str | tuple[str, ...]]:
        """Checkpoint keys the MTP head needs beyond its block (checked before the strict load so
        that a missing one is named as the checkpoint spells it; a tuple: any of its spellings);
        plugins with a head say which."""
        return []

    def mtp_step(self, token_ids: torch.Tensor, previous: torch.Tensor, ctx: ForwardContext, rows: torch.Tensor):
        """One MTP step: ``token_ids [T]`` (each row's next token), ``previous [T, H]`` (the target's
        or the last step's hidden) -> ``(carry [R, H], logits [R, vocab] fp32)`` at ``rows [R]``
        (the rows that draft: a prompt's rows only write the head's KV). A ``ctx`` whose ``cos_sin``
        is set (the target's context reused, `CausalLM.forward` set it) keeps it."""
        embeds = self.model.embed_tokens(token_ids)
        if ctx.cos_sin is None or ctx.cos_sin[0].dtype != embeds.dtype:  # set: the target's pass over these rows
            ctx.cos_sin = self.rotary.cos_sin(ctx.positions, embeds.dtype)
        carry, normed = self.mtp(embeds, previous, ctx)
        return carry[rows], self.compute_logits(normed[rows])

    def mtp_draft(self, token_ids: torch.Tensor, previous: torch.Tensor, ctx: ForwardContext, rows: torch.Tensor):
        """`mtp_step` and the greedy drafts: ``(carry [R, H], tokens [R] int64)``. On CPU, where the
        head allows (`layerzoo.layers.fused_mtp`), one C++ call that runs only the key/value part of
        the block for the rows not in ``rows``; otherwise `mtp_step` and the argmax."""
        plan = self.__dict__.get("_mtp_plan", _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self.__dict__["_mtp_plan"] = self._plan_mtp()
        if plan is not None:
            dtype = self.run_dtype
            if ctx.cos_sin is None or ctx.cos_sin[0].dtype != dtype:  # as mtp_step sets it
                ctx.cos_sin = self.rotary.cos_sin(ctx.positions, dtype)
            out = plan.run(token_ids, previous, ctx, rows)
            if out is not None:
                return out
        carry, logits = self.mtp_step(token_ids, previous, ctx, rows)
        return carry, logits.argmax(-1)

    def mtp_chain(self, tokens, carry, counts, ends, tables, kv):
        """The chained head steps after `mtp_draft` in one C++ call, where it took its one-call
        path: ``drafts [R, max(counts) - 1]`` (`layerzoo.layers.fused_mtp.MtpStepPlan.chain`);
        None where the caller chains step by step."""
        plan = self.__dict__.get("_mtp_plan")
        return None if plan is None else plan.chain(tokens, carry, counts, ends, tables, kv)

    def _plan_mtp(self):
        """The head's one-call plan (`layerzoo.layers.fused_mtp`), or None: a CPU model whose
        `mtp_step` is this class's (a plugin's own head step runs as it wrote it)."""
        if type(self).mtp_step is not CausalLM.mtp_step or self.mtp is None or self.run_dtype not in (torch.float32, torch.bfloat16):
            return None
        if next(self.mtp.parameters()).device.type != "cpu":
            return None
        return fused_mtp.plan_for(self)

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        """Refuse a prompt this model cannot serve (raise `layerzoo.errors.UserError`); default: accept."""

    def state_specs(self, dtype: torch.dtype | None = None) -> dict:
        """``layer index -> StateSpec`` of every layer with recurrent state (pool or own-state)."""
        dtype = dtype or self.run_dtype
        specs = {i: layer.state_spec(dtype) for i, layer in enumerate(self.layers)}
        return {i: spec for i, spec in specs.items() if spec is not None}

    def fp8_calibration_states(self, registry=None) -> list[bool | None]:
        """Each decoder layer's ``fp8_calibration_frozen`` answer, asked again now.

        ``capabilities`` is a snapshot taken when the model was built; online FP8 KV calibration
        freezes while requests run, so the graph gate polls this instead:
        ``ModelCapabilities.graphs_ready_after_fp8_calibration(model.fp8_calibration_states())``.
        """
        from layerzoo.plugins.capabilities import first_answer
        from layerzoo.plugins.manager import get_registry

        registry = registry or get_registry()
        hook = registry.pm.hook.fp8_calibration_frozen
        return [
            first_answer(hook, layer_kind=registry.layer_kind_of(layer), layer=layer, engine_config=self.engine_config)[0]
            for layer in self.layers
        ]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]`` → final hidden states ``[T, hidden]`` (normed)."""
        hidden = self.model.embed_tokens(input_ids)
        ctx.cos_sin = self.rotary.cos_sin(ctx.positions, hidden.dtype)
        residual = None
        split = self._split_prefill_layers() if ctx.is_prefill else ()
        for i, layer in enumerate(self.layers):
            if i in split:  # phase 2 runs every prompt sequence in one varlen call
                hidden, residual = three_phase_step(layer, hidden, residual, ctx, varlen=True)
            else:
                hidden, residual = layer(hidden, residual, ctx)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _split_prefill_layers(self) -> frozenset[int]:
        """Layers that prefill in three phases (they answered ``is_ssm_layer``)."""
        caps = self.capabilities
        return frozenset(caps.ssm_split_prefill_layers) if caps is not None else frozenset()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` → logits ``[N, vocab]`` in fp32 (on every tensor-parallel rank)."""
        if self.lm_head is None:
            raise UserError(f"{type(self).__name__} is an embedding model (no LM head): it computes no logits")
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device)."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, self.config.max_position_embeddings)
        for layer in [*self.layers, *([self.mtp.block] if self.mtp is not None else [])]:
            for module in layer.modules():
                if "rotary" in module.__dict__:
                    module.__dict__["rotary"] = self.rotary
