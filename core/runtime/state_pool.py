"""The recurrent-state pool: slot-addressed conv and recurrent state for every pool layer.

Layers whose state is a fixed-size summary of the past (Gated DeltaNet, Mamba2) keep it here
rather than in the paged KV cache: per pool layer, one ``[num_slots, *conv_shape]`` tensor of the
last raw conv inputs and one ``[num_slots, *recurrent_shape]`` fp32 tensor of the recurrent state.
A slot holds one sequence's state across all pool layers; the same slot index addresses every
layer, so copying a slot (a prefix-cache snapshot, a rollback-ring entry, a per-draft state, an
``n > 1`` sibling) is one copy per layer. Addresses never move: slots are indices into tensors
allocated once.

`SlotAllocator` is the device-free half (which slot belongs to whom; the scheduler's ledger
holds it); `StatePool` owns the tensors (the model runner holds it). The last slot, `pad_slot`, is never handed out: the
pool's padding row, which padded decode rows write.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from layerzoo.layers.kv_cache import StateSpec


class SlotAllocator:
    """Which slots are free. Device-free; ``num_slots`` usable slots plus the padding slot."""

    def __init__(self, num_slots: int):
        assert num_slots >= 1
        self.num_slots = num_slots
        self.pad_slot = num_slots  # never allocated
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        assert self._free, "state pool exhausted"
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._used, f"state slot {slot} freed twice or never allocated"
        self._used.remove(slot)
        self._free.append(slot)

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free)
        assert not (set(self._free) & self._used)
        assert len(self._free) + len(self._used) == self.num_slots


class StatePool:
    """Per-layer conv and recurrent state tensors, ``num_slots + 1`` rows each (the last is the padding row)."""

    def __init__(self, specs: Mapping[int, StateSpec], num_slots: int, device: torch.device | str = "cpu"):
        assert specs, "a state pool needs at least one pool layer"
        self.specs = dict(specs)
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.pad_slot = num_slots  # the row padded and throwaway rows write to; no sequence's slot
        rows = num_slots + 1
        self.conv = {i: torch.zeros(rows, *s.conv_shape, dtype=s.conv_dtype, device=self.device) for i, s in self.specs.items()}
        self.recurrent = {
            i: torch.zeros(rows, *s.recurrent_shape, dtype=s.recurrent_dtype, device=self.device) for i, s in self.specs.items()
        }

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.specs)

    @staticmethod
    def bytes_for(specs: Mapping[int, StateSpec], num_slots: int) -> int:
        return (num_slots + 1) * sum(s.bytes_per_slot for s in specs.values())

    # -- whole-slot operations (every layer) --------------------------------------------------

    def apply(self, copies) -> None:
        """Carry out a plan's `StateCopy` orders, in order (``src`` None zeroes ``dst``)."""
        for order in copies:
            if order.src is None:
                self.zero(order.dst)
            else:
                self.copy(order.src, order.dst)

    def zero(self, slot: int) -> None:
        for i in self.specs:
            self.conv[i][slot].zero_()
            self.recurrent[i][slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Copy one slot's state, in every layer, into another (snapshots, ring entries, siblings)."""
        if src == dst:
            return
        for i in self.specs:
            self.conv[i][dst].copy_(self.conv[i][src])
            self.recurrent[i][dst].copy_(self.recurrent[i][src])

    # -- one layer's view ----------------------------------------------------------------------

    def copy_layer(self, layer: int, src_conv: torch.Tensor, src_recurrent: torch.Tensor, dst: int) -> None:
        """Write one layer's state (``[*conv_shape]``, ``[*recurrent_shape]``) into slot ``dst``."""
        self.conv[layer][dst].copy_(src_conv)
        self.recurrent[layer][dst].copy_(src_recurrent)


@attrs.define(kw_only=True)
class SsmStep:
    """The state-pool part of one step's `ForwardContext`.

    ``slots[b]`` is the live slot of the step's sequence ``b``: a pool layer reads its state there
    before the rows of ``b`` and writes it back after them. A fresh sequence's slot is zero.

    ``captures[b]`` lists ``(row, slot)`` pairs, rows ascending in ``1..query_lens[b]``: after
    the first ``row`` rows of sequence ``b`` in this pass, copy the layer's state into ``slot``.
    Prefix-cache snapshots (replay-tail capture), rollback-ring entries and per-draft states of a
    speculative verify are all captures.
    """

    pool: StatePool
    slots: tuple[int, ...]
    captures: tuple[tuple[tuple[int, int], ...], ...] = ()
    _slots_tensor: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    @property
    def slots_tensor(self) -> torch.Tensor:
        if self._slots_tensor is None:
            self._slots_tensor = torch.tensor(self.slots, dtype=torch.long, device=self.pool.device)
        return self._slots_tensor

    def captures_of(self, b: int) -> tuple[tuple[int, int], ...]:
        return self.captures[b] if self.captures else ()

    def pieces(self, b: int, num_rows: int) -> list[tuple[int, int, int | None]]:
        """Split sequence ``b``'s ``num_rows`` rows at its captures: ``(lo, hi, capture slot | None)``.

        The layer runs each piece starting from the state the previous one left, and after a piece
        with a slot it copies its state there.
        """
        out, lo = [], 0
        for row, slot in self.captures_of(b):
            assert lo <= row <= num_rows, (row, num_rows)
            if row > lo:
                out.append((lo, row, slot))
            else:  # a capture at the piece start: the state before any row (or after the last piece)
                out.append((lo, lo, slot))
            lo = row
        if lo < num_rows or not out:
            out.append((lo, num_rows, None))
        return out

