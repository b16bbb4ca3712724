"""The k-pool DSA indexer of GLM-5.3-Flash: which cached tokens each query of an indexed layer sees.

Per token ``x [hidden]`` with the MLA query residual ``q_resid``::

    q    = wq_b(q_resid)                       [Hi, Di]     (no RoPE: the text tower is NoPE)
    key  = LayerNorm(wk(x))                    [Di]
    gate = x @ index_kpool_compress_gate.T     [Di]
    w    = weights_proj(x) · Hi^-0.5           [Hi]         fp32

Tokens are grouped in pools of ``k = index_kpool`` (pool ``j`` = positions ``j*k .. j*k+k-1``);
a pool's key is the softmax-over-slots of ``gate + index_kpool_compress_ape`` weighting the keys
(op ``kpool_compress``). A query at position ``p`` scores only the **complete** pools it sees
(``j < (p+1) // k``) as the GLM-5 indexer scores tokens (op ``dsa_indexer_topk``), keeps the
``index_topk // k`` best, expands them to their tokens, and always adds the raw tail: the
``(p+1) % k`` tokens of its own incomplete pool.

Cache rows (`KVCacheSpec`): the per-token ``index_k`` and ``index_gate`` rows and the pooled
``index_pool`` row (one per ``k`` tokens, `KVCacheSpec.pooled_rows`), all in the paged pool under
the layer's block tables. Whenever a step writes tokens of a pool, the pool's row is recomputed
from the per-token rows of the tokens written so far; a pool is only read once complete, so its row
then holds exactly its ``k`` tokens — also after a rewind (speculation, preemption), since a
rewritten token recomputes its pool's row, and after a prefix hit (blocks hold whole pools).

Selections use `layerzoo_glm53.indexer.Selection`; a pick that is no token (a pool a row cannot
see, an absent tail slot) is `NO_PICK`, a position past every sequence, which the attention masks.
"""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.layers.context import ForwardContext
from layerzoo.plugins.ops import kernel
from layerzoo_glm53.indexer import Selection

KEY_ROW, GATE_ROW, POOL_ROW = "index_k", "index_gate", "index_pool"
NO_PICK = 1 << 40  # a position no sequence reaches: masked as "not visible" by the attention


class KPoolIndexer(nn.Module):
    """``select(x [T, hidden], q_resid [T, q_lora_rank], ctx) -> Selection``; writes the step's rows."""

    def __init__(self, *, layer_index: int, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int,
                 index_topk: int, kpool: int):
        super().__init__()
        assert index_topk % kpool == 0, (index_topk, kpool)
        self.layer_index = layer_index
        self.num_heads, self.head_dim, self.kpool = num_heads, head_dim, kpool
        self.index_topk = index_topk
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden_size))
        self._topk = kernel("dsa_indexer_topk")
        self._compress = kernel("kpool_compress")

    @property
    def top_pools(self) -> int:
        return self.index_topk // self.kpool

    @property
    def extra_rows(self) -> tuple[tuple[str, int], ...]:
        return ((KEY_ROW, self.head_dim), (GATE_ROW, self.head_dim))

    @property
    def pooled_rows(self) -> tuple[tuple[str, int, int], ...]:
        return ((POOL_ROW, self.head_dim, self.kpool),)

    # -- writing the rows ----------------------------------------------------------------------

    def _write(self, x: torch.Tensor, ctx: ForwardContext) -> None:
        """The step's per-token rows, then the pooled row of every pool the step wrote into."""
        kv, layer = ctx.kv_cache, self.layer_index
        kv.write_row(layer, KEY_ROW, self.k_norm(self.wk(x))[:, None, :], ctx)
        kv.write_row(layer, GATE_ROW, (x @ self.index_kpool_compress_gate.t())[:, None, :], ctx)
        nd = ctx.num_decodes
        if nd:  # one pool per decode row, on the device: the row's own position is its pool's last written
            self._write_pools(torch.arange(nd, device=x.device), ctx.positions[:nd], ctx)
        if nd == ctx.num_seqs:
            return
        rows, ends = [], []  # (sequence row, last written position) of every pool the prefill rows touch
        k = self.kpool
        for b in range(nd, ctx.num_seqs):
            first, last = ctx.context_lens[b] - ctx.query_lens[b], ctx.context_lens[b] - 1
            for j in range(first // k, last // k + 1):
                rows.append(b)
                ends.append(min(j * k + k - 1, last))
        device = x.device
        self._write_pools(torch.tensor(rows, device=device), torch.tensor(ends, device=device), ctx)

    def _write_pools(self, seq_rows: torch.Tensor, ends: torch.Tensor, ctx: ForwardContext) -> None:
        """Recompute the pooled row of the pool holding position ``ends[i]`` of sequence
        ``seq_rows[i]``, from its tokens up to ``ends[i]``."""
        kv, layer, k = ctx.kv_cache, self.layer_index, self.kpool
        keys, gates = kv.row(layer, KEY_ROW), kv.row(layer, GATE_ROW)  # [N, bs, 1, Di]
        block_size = keys.shape[1]
        first = ends - ends % k  # the pool's first position; the pool lies in one block
        blocks = ctx.block_tables[seq_rows, first // block_size]
        token_slots = (blocks * block_size + first % block_size)[:, None] + torch.arange(k, device=ends.device)
        flat_keys, flat_gates = keys.view(-1, self.head_dim), gates.view(-1, self.head_dim)
        pooled = self._compress(
            flat_keys[token_slots], flat_gates[token_slots], self.index_kpool_compress_ape, ends - first + 1
        )
        pool_slots = blocks * (block_size // k) + (first % block_size) // k
        kv.write_pooled_row(layer, POOL_ROW, pooled[:, None, :], pool_slots)

    # -- selecting -----------------------------------------------------------------------------

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext) -> Selection:
        T, k = x.shape[0], self.kpool
        self._write(x, ctx)
        q = self.wq_b(q_resid).view(T, self.num_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [T, Hi]
        pools = ctx.kv_cache.pooled_row(self.layer_index, POOL_ROW)  # [N, bs / k, 1, Di]
        nd = ctx.num_decodes
        decode = None
        if nd:
            # Batched, no host values: each row scores its table's width of pool rows; a pool it
            # cannot see (incomplete, or past its length) is masked by its last visible pool index.
            keys = pools[ctx.block_tables[:nd]].reshape(nd, -1, self.head_dim)
            decode = self._picks(q[:nd, None], weights[:nd, None], keys, ctx.positions[:nd, None])[:, 0]
        prefill = {}
        if nd == ctx.num_seqs:
            return Selection(decode, prefill)
        per_block = pools.shape[1]
        starts = ctx.query_start_tensor().tolist()
        for b in range(nd, ctx.num_seqs):
            complete, rows = ctx.context_lens[b] // k, slice(starts[b], starts[b + 1])
            blocks = ctx.block_tables[b, : -(-complete // per_block)]
            keys = pools.index_select(0, blocks).reshape(-1, self.head_dim)[:complete]
            prefill[b] = self._picks(q[None, rows], weights[None, rows], keys[None], ctx.positions[None, rows])[0]
        return Selection(decode, prefill)

    def _picks(self, q, weights, pool_keys, positions) -> torch.Tensor:
        """``q [B, n, Hi, Di]``, ``weights [B, n, Hi]``, ``pool_keys [B, P, Di]`` (pools ``0..P-1``),
        ``positions [B, n]`` → ``[B, n, top * k + k - 1]`` token picks (`NO_PICK` where none)."""
        k = self.kpool
        arange = torch.arange(k, device=positions.device)
        seen = positions + 1
        parts = []
        top = min(self.top_pools, pool_keys.shape[1])
        if top:
            last_pool = seen // k - 1  # the last complete pool each row sees (-1: none)
            chosen = self._topk(q, weights, pool_keys, last_pool, top, self.softmax_scale)  # [B, n, top]
            tokens = chosen[..., None] * k + arange  # [B, n, top, k]
            visible = (chosen <= last_pool[..., None])[..., None].expand_as(tokens)
            parts.append(tokens.masked_fill(~visible, NO_PICK).flatten(-2))
        if k > 1:  # the raw tail: the row's own incomplete pool, up to its position
            tail_count = seen % k
            tail = (seen - tail_count)[..., None] + arange[: k - 1]
            parts.append(tail.masked_fill(arange[: k - 1] >= tail_count[..., None], NO_PICK))
        return torch.cat(parts, dim=-1)
