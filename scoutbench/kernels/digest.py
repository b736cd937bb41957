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


class DigestTable:
    """Per-layer digests (kmax/kmin, `[B, Hkv, max_blocks, D]` in the KV dtype) of complete blocks on the compute
    device, shared by every block-sparse method.

    On CPU it also keeps fp32 `max + min` and `max - min`, updated on every write, so scoring is two matmuls: the
    per-call conversions of every digest otherwise dominate selection at long context (3-5 ms at 32k on a core).
    """

    def __init__(self, layers: range, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device):
        self.kmax = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in layers}
        self.kmin = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in layers}
        on_cpu = torch.device(device).type == "cpu"
        self._center2 = {layer: torch.zeros(shape) for layer in layers} if on_cpu else None
        self._radius2 = {layer: torch.zeros(shape) for layer in layers} if on_cpu else None

    def __contains__(self, layer: int) -> bool:
        return layer in self.kmax

    def write(self, layer: int, index: tuple, kmax: torch.Tensor, kmin: torch.Tensor) -> None:
        """Store digests at `index` (over the `[B, Hkv, blocks]` dims)."""
        self.kmax[layer][index] = kmax
        self.kmin[layer][index] = kmin
        if self._center2 is not None:
            stored_max, stored_min = self.kmax[layer][index].float(), self.kmin[layer][index].float()
            self._center2[layer][index] = stored_max + stored_min
            self._radius2[layer][index] = stored_max - stored_min

    def scores(self, layer: int, q: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """`upper_bound_scores` of q `[B, Hq, D]` against the first `num_blocks` blocks -> `[B, Hkv, num_blocks]`."""
        if self._center2 is not None:
            return bound_from_center_radius(q, self._center2[layer][:, :, :num_blocks],
                                            self._radius2[layer][:, :, :num_blocks])
        return upper_bound_scores(q, self.kmax[layer][:, :, :num_blocks], self.kmin[layer][:, :, :num_blocks])

    def device_bytes(self) -> int:
        """The digests' bytes on the compute device (the CPU-only fp32 copies are not a device cost)."""
        return sum(t.numel() * t.element_size() for t in (*self.kmax.values(), *self.kmin.values()))
