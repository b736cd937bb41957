"""Quest block digests: channel-wise min/max of post-RoPE keys per block, their query upper bound, and top-k.

`U(q, block) = sum_c max(q_c * max_c, q_c * min_c)` bounds `q . k` for every key of the block. It is computed as
two matmuls, `0.5 * (q @ (max + min) + |q| @ (max - min))`, which is the same quantity without a
`[.., G, blocks, D]` temporary. GQA: the query heads of a KV group are aggregated by max, so one selection serves
the whole group and is still an upper bound for each of its heads. Digests exist only for complete blocks.
"""

from __future__ import annotations

import torch


def block_digests(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Digests of the complete blocks of `keys` `[B, Hkv, N, D]` -> (kmax, kmin), each `[B, Hkv, N // b, D]`."""
    batch, num_kv_heads, num_keys, head_dim = keys.shape
    num_blocks = num_keys // block_size
    blocks = keys[:, :, : num_blocks * block_size].reshape(batch, num_kv_heads, num_blocks, block_size, head_dim)
    return blocks.amax(dim=3), blocks.amin(dim=3)


def upper_bound_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """Quest upper bound of each query head against each block, max-aggregated per KV group.

    q `[B, Hq, D]`, kmax/kmin `[B, Hkv, nB, D]` -> scores `[B, Hkv, nB]` (fp32, unscaled logits).
    """
    return bound_from_center_radius(q, kmax.float() + kmin.float(), kmax.float() - kmin.float())


def bound_from_center_radius(q: torch.Tensor, center2: torch.Tensor, radius2: torch.Tensor) -> torch.Tensor:
    """The same bound from fp32 `max + min` and `max - min` (`[B, Hkv, nB, D]`): a method that keeps these
    up to date at block completion skips the per-call conversions (they dominate on CPU at long context)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = center2.shape[1]
    q4 = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = 0.5 * (torch.matmul(q4, center2.transpose(-1, -2)) + torch.matmul(q4.abs(), radius2.transpose(-1, -2)))
    return scores.amax(dim=2)  # [B, Hkv, G, nB] -> group max


def select_top_blocks(scores: torch.Tensor, num_valid_blocks: torch.Tensor, k: int,
                      excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k blocks per (sequence, KV head) among the first `num_valid_blocks[b]` blocks, minus `excluded`.

    scores `[B, Hkv, nB]`; excluded: bool `[B, Hkv, nB]` or `[B, 1, nB]` (blocks that are always attended anyway).
    Returns (ids `[B, Hkv, k']` int64 with the valid selections first, in descending score order;
    count `[B, Hkv]` of valid selections), where `k' = min(k, nB)`.
    """
    num_blocks = scores.shape[-1]
    k = min(k, num_blocks)
    if k <= 0:
        empty = torch.zeros(*scores.shape[:2], 0, dtype=torch.long, device=scores.device)
        return empty, torch.zeros(scores.shape[:2], dtype=torch.long, device=scores.device)
    block_index = torch.arange(num_blocks, device=scores.device)
    allowed = block_index[None, None, :] < num_valid_blocks.to(scores.device)[:, None, None]
    if excluded is not None:
        allowed = allowed & ~excluded
    masked = scores.masked_fill(~allowed, float("-inf"))
    _, ids = torch.topk(masked, k, dim=-1, sorted=True)
    count = allowed.sum(dim=-1).clamp(max=k).expand(scores.shape[:2])
    return ids, count
