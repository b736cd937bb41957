"""Lines 5-6 of ScoutAttention's Algorithm 1 on the device (methods/scout.py): B_pred = TopK(Q_pred K_digest^T), the
top `k_sel` selectable blocks by their Quest bound, and its split B_cpu = B_pred minus B_gpu, the selected blocks the
pool does not hold ready. With periodic recall the split also packs the recall's eviction order.

Two ways, chosen once when the method binds (`select_and_split_for`, so the step has no backend switch and the
method no device branch): `FusedSelectAndSplit`, one launch of `fused_ops.select_and_split` into each layer's static
split, where the fused ops serve the device and the method attends the selected blocks only; else `SelectAndSplit`,
in torch ops (`split_selection`: on a CPU one call of the kernel library)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scoutbench.kernels.backends import fused_ops_available
from scoutbench.kernels.digest import CandidateBlocks
from scoutbench.runtime.block_store import TieredBlockStore, select_and_split, split_selection
from scoutbench.runtime.block_table import pad_last
from scoutbench.runtime.scout_transport import DeviceSplit


def top_blocks(store: TieredBlockStore, layer: int, q: torch.Tensor, candidates: CandidateBlocks, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` `candidates` for query `q` `[B, Hq, D]`, per KV head with the group's query heads max-aggregated:
    ids `[B, Hkv, k]` (descending score, padding after the valid ones) and the scores `[B, Hkv, nB]`."""
    ids, scores = store.digests.select(layer, q, candidates)
    return pad_last(ids, k), scores


@dataclass
class Selection:
    """B_pred of one layer: `ids` `[B, Hkv, k]`, which are `valid`, the block `scores`, and whether its split packs
    a recall's eviction order."""

    ids: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    eviction_order: bool


class SelectAndSplit:
    """Lines 5 and 6 in torch ops, over the step's plan (`candidates`, `valid`: written in place each step).
    `every_resident`: B_gpu is every ready block of the pool, not only the selected ones (`device_blocks`)."""

    def __init__(self, store: TieredBlockStore, candidates: CandidateBlocks, valid: torch.Tensor, k_sel: int,
                 every_resident: bool):
        self.store, self.candidates, self.valid, self.k_sel = store, candidates, valid, k_sel
        self.every_resident = every_resident
        # what a split packs as its eviction order when no recall can follow (victims, available): read-only
        shape = valid.shape[:2]
        self.no_victims = (torch.zeros((*shape, k_sel), dtype=torch.long, device=valid.device),
                           torch.zeros(shape, dtype=torch.long, device=valid.device))

    def top_k(self, layer: int, q: torch.Tensor, eviction_order: bool) -> Selection:
        """Line 5: B_pred = TopK(q K_digest^T)."""
        ids, scores = top_blocks(self.store, layer, q, self.candidates, self.k_sel)
        return Selection(ids, self.valid, scores, eviction_order)

    def split(self, layer: int, B_pred: Selection) -> DeviceSplit:
        """Line 6: B_cpu = B_pred minus B_gpu (`split_selection`: B_cpu's blocks first in the split's ids)."""
        table = self.store.tables[layer]
        if B_pred.eviction_order:  # a recall copies at most the k_sel blocks the CPU computed: its first k_sel victims
            victims, available = table.victims(B_pred.ids, B_pred.valid, B_pred.scores)
            victims, available = victims[..., : self.k_sel], available.clamp(max=self.k_sel)
        else:
            victims, available = self.no_victims
        return DeviceSplit(*split_selection(table, B_pred.ids, B_pred.valid, victims, available,
                                            every_resident=self.every_resident))


class FusedSelectAndSplit:
    """Lines 5 and 6 in one fused launch into each sparse layer's static split (what a captured graph rewrites)."""

    def __init__(self, store: TieredBlockStore, candidates: CandidateBlocks, k_sel: int, device: torch.device):
        self.store, self.candidates = store, candidates
        self.splits = {layer: DeviceSplit.empty(store.batch, store.kv_heads, k_sel, store.pool_slots, device)
                       for layer in store.layers}

    def top_k(self, layer: int, q: torch.Tensor, eviction_order: bool) -> DeviceSplit:
        """Line 5, and line 6 in the same launch: B_pred is the split's selected ids (B_cpu's first)."""
        split = self.splits[layer]
        select_and_split(self.store, layer, q, self.candidates, eviction_order, split.split, split.pool_use)
        return split

    def split(self, layer: int, B_pred: DeviceSplit) -> DeviceSplit:
        """Line 6: made by `top_k`'s launch."""
        return B_pred


def select_and_split_for(store: TieredBlockStore, candidates: CandidateBlocks, valid: torch.Tensor, k_sel: int,
                         device_blocks: str, device: torch.device) -> SelectAndSplit | FusedSelectAndSplit:
    """Lines 5-6 as `device` serves them: one fused launch where the fused ops serve it and the device part attends
    the selected blocks only (a plan as wide as k_sel), else torch ops."""
    if fused_ops_available(device) and device_blocks == "selected" and candidates.k == k_sel:
        return FusedSelectAndSplit(store, candidates, k_sel, device)
    return SelectAndSplit(store, candidates, valid, k_sel, every_resident=device_blocks == "resident")
