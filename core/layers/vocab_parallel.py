"""The vocabulary split across the tensor-parallel ranks: embedding lookup and LM head.

Each rank holds ``ceil(V / N)`` consecutive vocabulary rows (the last rank's tail past ``V`` is
zeros). The embedding looks up the ids in its range, zeroes the rest and all-reduces, so every rank
gets the full ``[T, H]`` embeddings. The LM head computes this rank's logit columns and gathers
them (`gather_logits`), so every rank — rank 0 samples — has full ``[N, V]`` rows.

With one rank the embedding is the plain ``nn.Embedding`` and the head the plain ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import Shard, set_shard


def vocab_shard(vocab_size: int) -> Shard | None:
    """This rank's rows of a ``[V, H]`` vocabulary matrix (None with one rank)."""
    n = parallel_state.tp_size()
    return None if n == 1 else Shard(0, (vocab_size,), parallel_state.tp_rank(), n)


class VocabParallelEmbedding(nn.Module):
    """``ids [T]`` → ``[T, H]`` from this rank's vocabulary rows, summed over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard):
        super().__init__()
        (self.start, self.end), = shard.ranges()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(shard.local_size, hidden_size))
        set_shard(self, "weight", shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = torch.where(outside, 0, ids - self.start)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return parallel_state.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.end}) of {self.vocab_size}, {self.weight.shape[1]}"


def vocab_parallel_embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    shard = vocab_shard(vocab_size)
    return nn.Embedding(vocab_size, hidden_size) if shard is None else VocabParallelEmbedding(vocab_size, hidden_size, shard)


def parallel_lm_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    """``nn.Linear(H, this rank's vocabulary rows)``; its logits go through `gather_logits`."""
    shard = vocab_shard(vocab_size)
    head = nn.Linear(hidden_size, vocab_size if shard is None else shard.local_size, bias=False)
    set_shard(head, "weight", shard)
    return head


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's logit columns ``[N, V/n]`` → every rank's, side by side: ``[N, V]``."""
    if not parallel_state.is_parallel():
        return local
    return parallel_state.all_gather(local, dim=-1)[..., :vocab_size]
