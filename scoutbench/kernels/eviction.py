"""The eviction order of a pool of block slots: which slots a recall may overwrite, and in which order.

ScoutAttention's periodic recall copies the blocks its CPU part just computed into the device pool; the slots it
takes are this order's first ones. One definition serves the unfused path (`BlockTable.victims`) and the fused
`select_and_split`'s reference, against which its Triton kernel is tested.
"""

from __future__ import annotations

import torch


def eviction_order(slot_block: torch.Tensor, slot_ready: torch.Tensor, max_blocks: int, ids: torch.Tensor,
                   valid: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eviction order of a table's pool slots (`slot_block`, `slot_ready` `[B, Hkv, S + 1]`, blocks below
    `max_blocks`) for a recall that follows the selection `ids` (`valid` entries, `[B, Hkv, k]`) with block
    `scores` `[B, Hkv, nB]`.

    Free slots come first, then resident blocks that are *not* in the selection, lowest score first (ties: lower
    slot first). Slots holding a selected block, or one whose copy is still in flight, are never evicted. Returns
    (slots `[B, Hkv, S]` in eviction order, available `[B, Hkv]` = how many of them may be used)."""
    num_slots, num_scored = slot_block.shape[-1] - 1, scores.shape[-1]
    selected = torch.zeros((*ids.shape[:-1], max_blocks + 1), dtype=torch.bool, device=ids.device)
    selected.scatter_(-1, torch.where(valid, ids, max_blocks), True)
    block = slot_block[..., :num_slots]
    held = block >= 0
    in_selection = selected.gather(-1, torch.where(held, block, max_blocks)) & held
    evictable = held & ~in_selection & slot_ready[..., :num_slots]
    block_score = scores.float().gather(-1, block.clamp(0, max(num_scored - 1, 0))) if num_scored else \
        torch.zeros(block.shape, device=ids.device)
    key = block_score.masked_fill(~evictable, float("inf")).masked_fill(~held, float("-inf"))
    order = torch.argsort(key, dim=-1, stable=True)
    return order, (key < float("inf")).sum(-1)
