"""k-pool compression of the GLM-5.3-Flash indexer keys, plain torch (the CPU path and the reference).

A pool is ``k`` consecutive tokens of a sequence. Its key is a softmax-weighted sum of the tokens'
indexer keys, the weights per channel from the tokens' compress-gate scores plus a learned
position embedding ``ape`` (one row per slot of the pool)::

    logits[j, d] = gate[j, d] + ape[j, d]                  (fp32; slots j >= count are -inf)
    pooled[d]    = Σ_j softmax_j(logits[:, d])[j] · key[j, d]

As transformers' ``Glm5NextTextIndexer.get_pooled_states``: the probabilities are cast to the keys'
dtype before the weighted sum, and a pool without any valid slot comes out as zeros.
"""

from __future__ import annotations

import torch


def kpool_compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The pooled key of every pool.

    Args:
        keys: ``[P, k, D]`` the tokens' indexer keys (normed), pool after pool.
        gates: ``[P, k, D]`` the tokens' compress-gate scores ``x @ index_kpool_compress_gate.T``.
        ape: ``[k, D]`` the pool-slot position embedding.
        counts: ``[P]`` int64, how many leading slots of each pool hold tokens (``0..k``); the
            rest are ignored (a pool the step has only partly written).

    Returns:
        ``[P, D]`` in ``keys``' dtype.
    """
    P, k, D = keys.shape
    assert gates.shape == keys.shape and ape.shape == (k, D) and counts.shape == (P,), (keys.shape, gates.shape, ape.shape, counts.shape)
    valid = torch.arange(k, device=keys.device)[None, :] < counts[:, None]  # [P, k]
    logits = (gates.float() + ape.float()[None]).masked_fill(~valid[..., None], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=1)).to(keys.dtype)
    return (probs * keys).sum(dim=1)
