"""The blocks of the paged KV cache: block tables, reference counts and the prefix cache.

Device-free: it hands out block ids and the KV pool is indexed by them. Block ``i`` of a table
holds positions ``[i * block_size, (i + 1) * block_size)``. A full, computed block can be
registered in the prefix index under a hash-chain key; when its last reference goes it stays
evictable (LRU) until a fresh block is needed and the free list is empty.

A lookup compares the block's token tuple and its parent's node serial, not just the hash, so a
hash collision can never match wrong tokens. Serials are never reused: a child whose parent was
evicted can no longer be reached, even when its parent's block id comes back with new content.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

_ROOT_HASH = 0
_ROOT_SERIAL = -1

# How many leading blocks of a prefix match (given their node serials) may be used: a model with
# recurrent state resumes only where a state snapshot exists (`StateLedger.usable_prefix_blocks`,
# passed by the `CacheLedger` that keeps both). None: all of them.
MatchLimit = Callable[[list[int]], int]


def _hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))  # deterministic across runs for ints (no str/bytes salt)


@dataclass(frozen=True, slots=True)
class _Node:
    """A block registered in the prefix index."""

    hash: int
    parent: int  # the parent node's serial, _ROOT_SERIAL for a first block
    tokens: tuple[int, ...]
    serial: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, lowest id first (a heap): a sequence growing alone takes one run of ids, which
        # the CPU prefill reads in place (paged_attention.reference._gather) instead of copying its
        # prefix per chunk and layer.
        self._free: list[int] = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 and registered; oldest first
        self._ref = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._keys: dict[int, list[tuple[int, int]]] = {}  # seq -> (hash, node serial) per committed full block
        self._index: dict[int, int] = {}  # hash -> block
        self._nodes: dict[int, _Node] = {}  # block -> its node, for registered blocks only
        self._serials = count()
        self.prefix_hits = 0
        self.prefix_queries = 0

    # -- queries
    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def sequences(self) -> list[int]:
        """The seq_ids holding blocks."""
        return list(self._tables)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` positions occupy."""
        return -(-num_tokens // self.block_size)

    # -- prefix lookup
    def _match(self, token_ids: Sequence[int], limit: MatchLimit | None) -> list[int]:
        """The cached blocks of the longest matched prefix, at most len(token_ids) - 1 tokens, cut
        where ``limit`` says."""
        if not self.enable_prefix_caching:
            return []
        bs, h, parent, blocks, serials = self.block_size, _ROOT_HASH, _ROOT_SERIAL, [], []
        for i in range(max(len(token_ids) - 1, 0) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = _hash_block(h, tokens)
            block = self._index.get(h)
            if block is None:
                break
            node = self._nodes[block]
            if node.tokens != tokens or node.parent != parent:  # a hash collision
                break
            blocks.append(block)
            serials.append(node.serial)
            parent = node.serial
        if limit is not None:
            del blocks[limit(serials) :]
        return blocks

    def prefix_serials(self, seq_id: int) -> list[int]:
        """The prefix-index node serial of each committed full block of a sequence, in order."""
        return [serial for _, serial in self._keys[seq_id]]

    def match_prefix(self, token_ids: Sequence[int], limit: MatchLimit | None = None) -> int:
        return len(self._match(token_ids, limit)) * self.block_size

    # -- admission
    def _fresh_needed(self, matched: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(matched))

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int, limit: MatchLimit | None = None) -> bool:
        matched = self._match(token_ids, limit)
        revived = sum(self._ref[b] == 0 for b in matched)  # leave the LRU, so no longer count as free
        return self._fresh_needed(matched, num_tokens) <= self.num_free_blocks() - revived

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int, limit: MatchLimit | None = None) -> int:
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        assert self.can_allocate(token_ids, num_tokens, limit)
        matched = self._match(token_ids, limit)
        if self.enable_prefix_caching:
            self.prefix_queries += max(len(token_ids) - 1, 0) // self.block_size
            self.prefix_hits += len(matched)
        for block in matched:  # references first, so fresh blocks cannot evict them
            self._take(block)
        table = matched + [self._new_block() for _ in range(self._fresh_needed(matched, num_tokens))]
        self._tables[seq_id] = table
        self._keys[seq_id] = [(self._nodes[b].hash, self._nodes[b].serial) for b in matched]
        return len(matched) * self.block_size

    # -- growth
    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        # (a table that covers them already is the usual case: every decode row and MTP lookahead
        # of every step asks, most within their last block)
        needed = self.blocks_for(num_tokens) - len(self._tables[seq_id])
        return needed <= 0 or needed <= self.num_free_blocks()

    def append(self, seq_id: int, num_tokens: int) -> None:
        table = self._tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return
        assert needed <= self.num_free_blocks()
        for _ in range(needed):
            table.append(self._new_block())

    # -- after a step computed KV
    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        table, keys = self._tables[seq_id], self._keys[seq_id]
        assert num_computed <= min(len(token_ids), len(table) * self.block_size)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(keys), num_computed // bs):
            parent_hash, parent = keys[-1] if keys else (_ROOT_HASH, _ROOT_SERIAL)
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = _hash_block(parent_hash, tokens)
            existing = self._index.get(h)
            if existing is None:
                assert table[i] not in self._nodes
                node = _Node(h, parent, tokens, next(self._serials))
                self._nodes[table[i]] = node
                self._index[h] = table[i]
            else:
                node = self._nodes[existing]
                if node.tokens != tokens or node.parent != parent:
                    return  # a hash collision: the chain cannot go on through this block
                # else the same prefix was computed twice: keep the existing entry, leave ours unregistered
            keys.append((h, node.serial))

    # -- release
    def free_sequence(self, seq_id: int) -> None:
        assert seq_id in self._tables, f"unknown sequence {seq_id}"
        for block in reversed(self._tables.pop(seq_id)):  # the tail first, so it is evicted first
            self._release(block)
        del self._keys[seq_id]

    def rewind(self, seq_id: int, num_tokens: int) -> int:
        table = self._tables[seq_id]
        assert 0 <= num_tokens <= len(table) * self.block_size
        keep, cursor = self.blocks_for(num_tokens), num_tokens
        if num_tokens % self.block_size:
            last = table[keep - 1]
            if last in self._nodes or self._ref[last] > 1:  # must not be overwritten
                keep -= 1
                cursor = keep * self.block_size
        for block in reversed(table[keep:]):
            self._release(block)
        del table[keep:]
        del self._keys[seq_id][num_tokens // self.block_size :]
        return cursor

    def fork(self, parent_id: int, child_id: int, num_tokens: int, limit: MatchLimit | None = None) -> int:
        assert child_id not in self._tables, f"sequence {child_id} already has blocks"
        parent = self._tables[parent_id]
        assert num_tokens <= len(parent) * self.block_size
        n = num_tokens // self.block_size
        if limit is not None:
            n = min(n, limit([serial for _, serial in self._keys[parent_id][:n]]))
        for block in parent[:n]:
            self._take(block)
        self._tables[child_id] = parent[:n]
        self._keys[child_id] = self._keys[parent_id][:n]
        return n * self.block_size

    # -- blocks
    def _new_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._nodes.pop(block).hash]
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        assert self._ref[block] > 0, f"block {block} freed twice"
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._nodes:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def check_invariants(self) -> None:
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks
        holders = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"a block is twice in the table of {seq_id}"
            assert len(self._keys[seq_id]) <= len(table)
            for block in table:
                holders[block] += 1
        assert holders == self._ref, "reference counts differ from the tables"
        assert self._keys.keys() == self._tables.keys()
        assert len(self._index) == len(self._nodes)
        for h, block in self._index.items():
            assert self._nodes[block].hash == h
        assert not (free & self._nodes.keys()), "a free block is still registered"
        assert evictable <= self._nodes.keys(), "an evictable block is not registered"
