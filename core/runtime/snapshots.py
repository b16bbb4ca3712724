"""Bookkeeping of recurrent-state snapshots: the prefix-cache index and the per-sequence rollback ring.

Device-free: both hand out and forget state-pool slot numbers; the copies themselves are the
model runner's (on the state pool). A prefix snapshot is keyed by the prefix-index node serial of the block that ends
at its position (serials are never reused, so a snapshot can only be found through the exact
chain of blocks it was computed for). A ring entry is keyed by the KV cursor it restores.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class SnapshotIndex:
    """Prefix-cache snapshots: node serial → state slot, at most ``capacity`` of them, LRU."""

    def __init__(self, capacity: int):
        assert capacity >= 0
        self.capacity = capacity
        self._slots: OrderedDict[int, int] = OrderedDict()  # serial -> slot, oldest first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, serial: int) -> bool:
        return serial in self._slots

    def usable_blocks(self, serials: Sequence[int]) -> int:
        """How many leading blocks of a matched prefix end on a snapshot (the deepest one wins)."""
        for n in range(len(serials), 0, -1):
            if serials[n - 1] in self._slots:
                return n
        return 0

    def lookup(self, serial: int) -> int:
        """The slot of a snapshot (marked recently used)."""
        self._slots.move_to_end(serial)
        return self._slots[serial]

    def full(self) -> bool:
        return len(self._slots) >= self.capacity

    def insert(self, serial: int, slot: int) -> None:
        assert serial not in self._slots and not self.full()
        self._slots[serial] = slot

    def evict_oldest(self) -> int:
        """Forget the least recently used snapshot; returns its slot for the caller to free."""
        _, slot = self._slots.popitem(last=False)
        return slot

    def slots(self) -> list[int]:
        return list(self._slots.values())


class RollbackRing:
    """Per sequence, the last ``depth`` ``(cursor, slot)`` snapshots taken before boundary tokens."""

    def __init__(self, depth: int):
        assert depth >= 0
        self.depth = depth
        self._entries: dict[int, deque[tuple[int, int]]] = {}

    def entries(self, seq_id: int) -> list[tuple[int, int]]:
        return list(self._entries.get(seq_id, ()))

    def push(self, seq_id: int, cursor: int, slot: int) -> int | None:
        """Record a snapshot; returns the slot of the entry it pushed out (to free), if any."""
        ring = self._entries.setdefault(seq_id, deque())
        assert not ring or ring[-1][0] < cursor, "ring cursors must increase"
        ring.append((cursor, slot))
        if len(ring) > self.depth:
            return ring.popleft()[1]
        return None

    def best_at_or_before(self, seq_id: int, cursor: int) -> tuple[int, int] | None:
        """The deepest entry whose cursor is ``<= cursor``."""
        best = None
        for entry in self._entries.get(seq_id, ()):
            if entry[0] <= cursor:
                best = entry
        return best

    def drop_after(self, seq_id: int, cursor: int) -> list[int]:
        """Forget entries past ``cursor`` (they describe tokens a rewind removed); returns their slots."""
        ring = self._entries.get(seq_id)
        freed = []
        while ring and ring[-1][0] > cursor:
            freed.append(ring.pop()[1])
        return freed

    def release(self, seq_id: int) -> list[int]:
        return [slot for _, slot in self._entries.pop(seq_id, ())]

    def slots(self) -> list[int]:
        """The slots of every sequence's entries."""
        return [slot for ring in self._entries.values() for _, slot in ring]

    def num_entries(self) -> int:
        return sum(len(r) for r in self._entries.values())
