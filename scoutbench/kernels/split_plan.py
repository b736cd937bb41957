"""The split of a block selection between a device pool and the CPU (ScoutAttention's B_cpu = B_pred minus B_gpu),
one entry point whose backend is chosen here: one call of the CPU kernel library on a CPU where it is built, torch
ops elsewhere (CUDA without the fused select-and-split, torch's CPU kernels forced). The fused device op that also
selects (`fused_ops.select_and_split`) reuses the torch ops as its reference.

The tables are a `runtime.block_table.BlockTable`'s (each with its trash column): block_slot `[B, Hkv, nB + 1]`
(the pool slot of each block, -1 when host-only), slot_ready and slot_block `[B, Hkv, S + 1]`.
"""

from __future__ import annotations

import torch

from scoutbench.kernels import cpu_attention


def locate(ids: torch.Tensor, valid: torch.Tensor, block_slot: torch.Tensor, slot_ready: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the selected blocks `ids` `[B, Hkv, k]` (entries with `valid` False are padding) can be read: (on_device
    = selected, resident and ready; pending = selected and resident, its copy still in flight; slot = the pool slot,
    -1 if not resident), each `[B, Hkv, k]`."""
    num_slots, max_blocks = slot_ready.shape[-1] - 1, block_slot.shape[-1] - 1
    slot = block_slot.gather(-1, ids.clamp(0, max_blocks))
    resident = valid & (slot >= 0)
    ready = slot_ready.gather(-1, torch.where(resident, slot, num_slots))
    return resident & ready, resident & ~ready, slot


def split_plan(ids: torch.Tensor, valid: torch.Tensor, victims: torch.Tensor, available: torch.Tensor,
               block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor,
               every_resident: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The split of the selection `ids` (`valid` entries) packed with a recall's `victims` `[B, Hkv, k]` and
    `available` `[B, Hkv]`: (SplitPlan data `[B, Hkv, 3k + 4]` int64: the ids with the CPU part's first, each group
    in selection order, their pending flags, `victims`, and n_cpu / n_selected / `available` / n_resident; the pool
    slots the device part reads `[B, Hkv, S]` bool: the selected ready ones, or with `every_resident` every resident
    block whose copy has landed). One kernel call on a CPU with the library (`every_resident` excepted), else
    `split_reference`: the same values bit for bit."""
    if not every_resident and ids.device.type == "cpu" and cpu_attention.library() is not None:
        return _native(ids, valid, victims, available, block_slot, slot_ready, slot_block)
    return split_reference(ids, valid, victims, available, block_slot, slot_ready, slot_block, every_resident)


def split_reference(ids: torch.Tensor, valid: torch.Tensor, victims: torch.Tensor, available: torch.Tensor,
                    block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor,
                    every_resident: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_plan` in torch ops (~28 per layer)."""
    num_slots = slot_ready.shape[-1] - 1
    on_device, pending, slot = locate(ids, valid, block_slot, slot_ready)
    on_cpu = valid & ~on_device
    order = torch.argsort(on_cpu.to(torch.uint8), dim=-1, descending=True, stable=True)  # CPU blocks first
    counts = torch.stack([on_cpu.sum(-1), valid.sum(-1), available, (slot_block[..., :num_slots] >= 0).sum(-1)],
                         dim=-1)
    data = torch.cat([ids.gather(-1, order), pending.gather(-1, order).long(), victims, counts], dim=-1)
    if every_resident:
        pool = slice(0, num_slots)
        return data, (slot_block[..., pool] >= 0) & slot_ready[..., pool]
    pool_use = torch.zeros(slot_ready.shape, dtype=torch.bool, device=ids.device)
    pool_use.scatter_(-1, torch.where(on_device, slot, num_slots), True)
    return data, pool_use[..., :num_slots]


def _native(ids: torch.Tensor, valid: torch.Tensor, victims: torch.Tensor, available: torch.Tensor,
            block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_plan` in one call of the CPU kernel library (csrc/split_plan.cpp), one pass per row."""
    batch, kv_heads, k = ids.shape
    num_slots, max_blocks = slot_ready.shape[-1] - 1, block_slot.shape[-1] - 1
    ids, victims, available = (_contiguous_long(t) for t in (ids, victims, available))
    valid = cpu_attention.contiguous(valid)
    data = torch.empty((batch, kv_heads, 3 * k + 4), dtype=torch.long)
    pool_use = torch.empty((batch, kv_heads, num_slots), dtype=torch.bool)
    code = cpu_attention.library().sb_split_plan(
        batch * kv_heads, k, ids.data_ptr(), valid.data_ptr(), block_slot.data_ptr(), max_blocks,
        slot_ready.data_ptr(), slot_block.data_ptr(), num_slots, victims.data_ptr(), available.data_ptr(),
        data.data_ptr(), pool_use.data_ptr())
    cpu_attention.check_call(code, "split", ids=ids)
    return data, pool_use


def _contiguous_long(t: torch.Tensor) -> torch.Tensor:
    return cpu_attention.contiguous(t) if t.dtype == torch.long else t.to(torch.long).contiguous()
