"""A multi-token-prediction (MTP) head: one more decoder block that drafts the token after next.

The checkpoints of GLM-5, Qwen3-Next / Qwen3.5 and the DeepSeek-V3 family ship one such layer
after the decoder. At position ``p`` it reads the target's hidden state ``h_p`` and the embedding
of the token at ``p + 1`` and predicts the token at ``p + 2``::

    e = enorm(embed(t[p + 1]))            # zeroed first where p == 0 (DeepSeek / GLM, as in vLLM)
    h = hnorm(h_p)
    x = eh_proj(cat([e, h]))              # [T, 2H] -> [T, H]
    y, r = block(x, None, ctx)            # a full decoder block of the model's own kind
    normed = norm(y + r)                  # shared_head.norm (DeepSeek / GLM), mtp.norm (Qwen)
    logits = lm_head(normed)

Chained drafting feeds the head its own output as the next ``h``: the normed hidden for GLM-5 and
Qwen3-Next (``carry_normed``), the raw ``y + r`` for DeepSeek-V3. The block is the plugin's (MLA +
MoE for GLM-5, gated full attention for Qwen3-Next); its ``layer_index`` is past the decoder's,
and its KV lives in the same paged pool, addressed by the same block tables as the target's.
The norms come from the plugin too (Qwen's are zero-centred). Names follow no checkpoint: each
plugin's name map says where its keys go.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from layerzoo.layers.base import DecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.norm import RMSNorm


class MtpHead(nn.Module):
    """One MTP layer: ``(embeddings [T, H], previous hidden [T, H]) -> (carry [T, H], normed [T, H])``.

    ``norm_class(dim, eps)`` builds the three norms (RMSNorm by default); ``mask_position0`` zeroes
    the embedding at position 0 (DeepSeek's and GLM's heads in vLLM); ``carry_normed`` says which
    hidden a chained step passes on.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        block: DecoderLayer,
        *,
        norm_class: Callable[[int, float], nn.Module] = RMSNorm,
        mask_position0: bool = True,
        carry_normed: bool = True,
    ):
        super().__init__()
        self.enorm = norm_class(hidden_size, eps)
        self.hnorm = norm_class(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = norm_class(hidden_size, eps)
        self.mask_position0 = mask_position0
        self.carry_normed = carry_normed

    @property
    def layer_index(self) -> int:
        """The block's index in the KV pool (past the decoder's layers)."""
        return self.block.layer_index

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds [T, H]`` (of the tokens one past each row), ``previous [T, H]`` -> ``(carry, normed)``."""
        if self.mask_position0:
            embeds = embeds.masked_fill((ctx.positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        hidden, residual = self.block(x, None, ctx)
        summed = hidden if residual is None else hidden + residual
        normed = self.norm(summed)
        return (normed if self.carry_normed else summed), normed


# -- checkpoint layouts -------------------------------------------------------------------------

# DeepSeek's NextN layout (DeepSeek-V3, GLM-4.5, GLM-5): the head is ``model.layers.{L}.*``, L =
# num_hidden_layers. Its own tensors, by the names `MtpHead` gives them:
_NEXTN_OWN = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "norm"))
# Copies of the model's embedding and LM head that the released checkpoints carry in the layer
# (vLLM loads the first MTP layer's embedding into the shared one): the model's own serve.
_NEXTN_COPIES = ("embed_tokens.", "shared_head.head.")
# Qwen3-Next / Qwen3.5: ``mtp.*``, the block under ``mtp.layers.0``.
_QWEN_OWN = (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"), ("fc", "eh_proj"), ("norm", "norm"))


def _own(rest: str, names) -> str | None:
    for theirs, ours in names:
        if rest.startswith(theirs + "."):
            return f"mtp.{ours}{rest[len(theirs):]}"
    return None


def nextn_target(key: str, layer: int) -> str | None:
    """Where a NextN checkpoint key of MTP layer ``layer`` loads in the model (``mtp.*``); None for
    the embedding / LM-head copies. ``key`` must start with ``model.layers.{layer}.``."""
    rest = key[len(f"model.layers.{layer}."):]
    if rest.startswith(_NEXTN_COPIES):
        return None
    return _own(rest, _NEXTN_OWN) or f"mtp.block.{rest}"


def nextn_head_keys(layer: int) -> list[str]:
    """The NextN head's own checkpoint keys (its block's are the model's layer names)."""
    return [f"model.layers.{layer}.{theirs}.weight" for theirs, _ in _NEXTN_OWN]


def qwen_mtp_target(key: str) -> str | None:
    """Where a Qwen3-Next / Qwen3.5 ``mtp.*`` key loads in the model (``mtp.*``, the block's
    ``mtp.layers.0.*`` under ``mtp.block``); None for the layers past the first (one is served,
    chained, as vLLM does with one)."""
    rest = key[len("mtp."):]
    if rest.startswith("layers."):
        index, _, inner = rest[len("layers."):].partition(".")
        return f"mtp.block.{inner}" if index == "0" else None
    return _own(rest, _QWEN_OWN) or f"mtp.{rest}"


def qwen_mtp_head_keys() -> list[str]:
    return [f"mtp.{theirs}.weight" for theirs, _ in _QWEN_OWN]


def drop_head_targets(name_map):
    """``name_map`` with every key that would load into the MTP head (``mtp.*`` targets) skipped:
    the model was built without its head (speculation did not ask for it)."""

    def mapped(key: str):
        target = name_map(key)
        name = getattr(target, "name", target)
        return None if isinstance(name, str) and name.startswith("mtp.") else target

    return mapped
