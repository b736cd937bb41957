"""Block residency for offloading methods: which blocks of which (sequence, KV head) sit in the device pool.

A sparse layer keeps every block in host memory (the authoritative copy, pinned on CUDA) and a fixed pool of
`num_slots` block slots per (sequence, KV head) on the device. `BlockTable` is the map between the two:

- `block_slot[b, h, j]`: the pool slot holding block `j`, or -1 when the block lives only in host memory;
- `slot_block[b, h, s]`: the block held by slot `s`, or -1 for an empty slot;
- `slot_ready[b, h, s]`: the slot's copy has completed. A recall flips a slot to "not ready" when it is issued
  and back to ready only once its copy event has completed (`poll`), so a block is never read half-copied.

Every tensor has one spare "trash" column at the end, so masked scatters need no compaction (and no host sync):
masked entries are redirected to the trash column and never read back. All tables live on the compute device.
The device-side attention of such a layer is `kernels/attention.region_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scoutbench.kernels.eviction import eviction_order
from scoutbench.kernels.split_plan import locate


class BlockTable:
    """Residency of one layer's blocks in a device pool of `num_slots` slots per (sequence, KV head)."""

    def __init__(self, batch: int, num_kv_heads: int, num_slots: int, max_blocks: int,
                 device: torch.device | str):
        self.batch, self.num_kv_heads = batch, num_kv_heads
        self.num_slots, self.max_blocks = num_slots, max_blocks
        self.device = torch.device(device)
        shape = (batch, num_kv_heads)
        self.block_slot = torch.full((*shape, max_blocks + 1), -1, dtype=torch.long, device=self.device)
        self.slot_block = torch.full((*shape, num_slots + 1), -1, dtype=torch.long, device=self.device)
        self.slot_ready = torch.zeros((*shape, num_slots + 1), dtype=torch.bool, device=self.device)
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (copy event, flat slot indices)
        # the views `assign` writes through, made once: a recall's bookkeeping issues only its own writes
        rows = batch * num_kv_heads
        self._block_slot_rows, self._slot_block_rows = self.block_slot.view(rows, -1), self.slot_block.view(rows, -1)
        self._block_slot_trash, self._slot_ready_flat = self.block_slot[..., max_blocks], self.slot_ready.view(-1)

    # ------------------------------------------------------------------ queries
    def poll(self) -> None:
        """Mark the slots of completed copies ready (a non-blocking `event.query()` per in-flight copy)."""
        if not self._pending:
            return
        still = []
        for event, flat in self._pending:
            if event.query():
                self.slot_ready.view(-1).index_fill_(0, flat, True)
            else:
                still.append((event, flat))
        self._pending = still

    @property
    def pending_copies(self) -> int:
        return len(self._pending)

    def locate(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the selected blocks `ids` `[B, Hkv, k]` (entries with `valid` False are padding) can be read
        (`split_plan.locate`): (on_device = selected, resident and ready; pending = selected and resident but its
        copy is still in flight, so it must be computed elsewhere; slot = the pool slot, -1 if not resident)."""
        return locate(ids, valid, self.block_slot, self.slot_ready)

    def victims(self, ids: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eviction order for a recall that follows the selection (`ids`, `valid`) with block `scores`
        (`eviction_order`): (slots `[B, Hkv, num_slots]` in eviction order, available `[B, Hkv]`)."""
        return eviction_order(self.slot_block, self.slot_ready, self.max_blocks, ids, valid, scores)

    def resident_sets(self) -> list[list[set[int]]]:
        """Host copy of the resident blocks per (sequence, KV head) (tests and tracing only: syncs)."""
        blocks = self.slot_block[..., : self.num_slots].cpu()
        return [[{int(j) for j in blocks[b, h] if j >= 0} for h in range(self.num_kv_heads)]
                for b in range(self.batch)]

    # ------------------------------------------------------------------ updates
    def assign(self, bh: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, event: Any = None) -> None:
        """Put `blocks[n]` into slot `slots[n]` of row `bh[n]` (= b * Hkv + h); 1-D device tensors, unique
        (row, slot) pairs. The previous occupants become host-only. With an `event`, the slots are usable only
        after `event` completes; with None they are ready at once (the data is already in place)."""
        if bh.numel() == 0:
            return
        block_slot, slot_block = self._block_slot_rows, self._slot_block_rows
        old = slot_block[bh, slots]
        block_slot[bh, torch.where(old >= 0, old, self.max_blocks)] = -1
        self._block_slot_trash.fill_(-1)
        block_slot[bh, blocks] = slots
        slot_block[bh, slots] = blocks
        flat = bh * (self.num_slots + 1) + slots
        self._slot_ready_flat[flat] = event is None
        if event is not None:
            self._pending.append((event, flat))

    def reset(self) -> None:
        self.block_slot.fill_(-1)
        self.slot_block.fill_(-1)
        self.slot_ready.fill_(False)
        self._pending.clear()


def pad_last(x: torch.Tensor, size: int, value: int | float | bool = 0) -> torch.Tensor:
    """Right-pad the last dimension of `x` to `size` with `value`."""
    if x.shape[-1] >= size:
        return x
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), (0, size - x.shape[-1]), value=int(value)).bool()
    return F.pad(x, (0, size - x.shape[-1]), value=value)
