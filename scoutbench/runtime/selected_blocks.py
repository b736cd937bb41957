"""The attention of a block selection over a cache that is a table of blocks, on the device that holds it: in place by
block id on a CPU (`InPlaceBlocks`: the CPU kernel reads the selected blocks where they are), gathered into contiguous
rows on CUDA (`GatheredBlocks`: one index_select per K and V into static rows, then the dense decode kernel), so that
a block-selection method (methods/selection.py) chooses this object once at bind and branches on no device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scoutbench.kernels.attention import StepLengths, block_sparse_attention, decode_attention


class InPlaceBlocks:
    """CPU: the selected blocks attended by id, in place."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor,
               scale: float, lengths: StepLengths) -> torch.Tensor:
        batch, kv_heads, num_tokens, head_dim = keys.shape
        blocked = (batch, kv_heads, num_tokens // self.block_size, self.block_size, head_dim)
        return block_sparse_attention(q, keys.view(blocked), values.view(blocked), block_ids, scale,
                                      lengths.valid_len).o.to(q.dtype)


class GatheredBlocks:
    """CUDA: the selection `[B, rows, pages]` gathered into contiguous rows (static buffers: a captured graph
    rewrites them) and attended there."""

    def __init__(self, ctx: Any, caches: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: int, pages: int,
                 block_size: int, num_blocks: int):
        batch, device = ctx.batch, ctx.device
        gather_shape = (batch, rows, pages * block_size, ctx.head_dim)
        self.gathered_k = torch.empty(gather_shape, dtype=ctx.dtype, device=device)
        self.gathered_v = torch.empty(gather_shape, dtype=ctx.dtype, device=device)
        kv_head = torch.arange(rows, device=device) // (rows // ctx.num_kv_heads)
        self._row_base = ((torch.arange(batch, device=device)[:, None] * ctx.num_kv_heads + kv_head[None, :])
                          * num_blocks)[:, :, None]  # [B, rows, 1]: the first block of each row's KV head
        # per sparse layer, its K and V caches as tables of blocks, and the gather buffers as rows of blocks
        self._block_tables = {layer: tuple(c.view(-1, block_size * ctx.head_dim) for c in kv)
                              for layer, kv in caches.items()}
        self._gathered_rows = tuple(g.view(batch * rows * pages, -1) for g in (self.gathered_k, self.gathered_v))

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor,
               scale: float, lengths: StepLengths) -> torch.Tensor:
        flat_ids = (self._row_base + block_ids).view(-1)
        for table, gathered in zip(self._block_tables[layer], self._gathered_rows, strict=True):
            torch.index_select(table, 0, flat_ids, out=gathered)
        return decode_attention(q, self.gathered_k, self.gathered_v, scale, lengths=lengths)


def selected_blocks(ctx: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                    sparse_layers: Sequence[int], rows: int, pages: int, block_size: int,
                    num_blocks: int) -> InPlaceBlocks | GatheredBlocks:
    """The attention of the selected blocks on `ctx.device`: gathered on CUDA, in place elsewhere."""
    if ctx.device.type == "cuda":
        caches = {layer: (keys[layer], values[layer]) for layer in sparse_layers}
        return GatheredBlocks(ctx, caches, rows, pages, block_size, num_blocks)
    return InPlaceBlocks(block_size)
