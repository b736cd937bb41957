"""Moving tokens between caches and preallocated buffers: batched gathers of blocks or tokens, and the write of
each sequence's new token.

A gather is one flattened `index_select(..., out=)` into a preallocated, contiguous buffer: on CPU that is the
fastest form measured (2,048 of 65,536 tokens selected in blocks of 32, 1-2 threads: per-head advanced indexing
`k[b_idx, h_idx, ids]` is no faster, and a fresh allocation of 64 MiB per call runs 2-3x slower than a reused buffer).
"""

from __future__ import annotations

import torch


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Gather blocks of `block_size` tokens from a head-major cache into `out`.

    cache `[B, Hkv, N, D]`, contiguous, `N` a multiple of `block_size`; block_ids `[B, H, K]` int64, where `H` is
    `Hkv`, or a multiple of it for per-query-head selections (row `h` reads KV head `h // (H // Hkv)`);
    out `[B, H, K * block_size, D]`, contiguous (e.g. a view of the front of a flat buffer). `block_size=1`
    gathers single tokens. Returns `out`.
    """
    batch, num_kv_heads, num_tokens, head_dim = cache.shape
    heads = block_ids.shape[1]
    blocks_per_row = num_tokens // block_size
    kv_head = torch.arange(heads, device=block_ids.device) // (heads // num_kv_heads)
    row = torch.arange(batch, device=block_ids.device)[:, None] * num_kv_heads + kv_head[None, :]
    flat_ids = (row[:, :, None] * blocks_per_row + block_ids).reshape(-1)
    table = cache.view(batch * num_kv_heads * blocks_per_row, block_size * head_dim)
    torch.index_select(table, 0, flat_ids, out=out.view(-1, block_size * head_dim))
    return out


def write_tokens(cache: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 positions_host: list[int]) -> None:
    """cache `[B, H, N, D]` <- values `[B, H, D]`, sequence b at slot `positions[b]`.

    `positions_host` is the host copy of `positions`: when every sequence writes the same slot, one strided copy
    (no device index tensor, no sync) does it.
    """
    if min(positions_host) == max(positions_host):
        cache[:, :, positions_host[0]].copy_(values)
    else:
        cache[torch.arange(cache.shape[0], device=cache.device), :, positions] = values

