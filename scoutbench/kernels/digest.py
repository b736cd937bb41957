"""Quest block digests: channel-wise min/max of post-RoPE keys per block, their query upper bound, and top-k.

`U(q, block) = sum_c max(q_c * max_c, q_c * min_c)` bounds `q . k` for every key of the block. It is computed as
one matmul, `0.5 * ([max + min | max - min] @ [q | |q|])`, which is the same quantity without a
`[.., G, blocks, D]` temporary. GQA: the query heads of a KV group are aggregated by max, so one selection serves
the whole group and is still an upper bound for each of its heads; or, per query head (Quest's own code, which
is MHA: each query head selects its own blocks of its KV head), one score row per query head. Digests exist only
for complete blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scoutbench.kernels import digest_native


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
    return bound_from_center_radius(q, *center_radius(kmax, kmin, torch.float32))


def center_radius(kmax: torch.Tensor, kmin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`max + min` and `max - min` of block digests, in `dtype` (what scoring reads).

    Computed in fp32. Stored in a 16-bit dtype, the center is rounded to nearest and the radius is widened by
    that rounding error and then rounded up (scaled by 1 + eps before round-to-nearest, whose error is at most
    eps / 2), so `0.5 * (q . c' + |q| . r')` still bounds `0.5 * (q . c + |q| . r)` from above: the score stays an
    upper bound of every key of the block, up to the rounding of the score itself.
    """
    kmax, kmin = kmax.float(), kmin.float()
    center, radius = kmax + kmin, kmax - kmin
    if dtype == torch.float32:
        return center, radius
    stored_center = center.to(dtype)
    widened = (radius + (center - stored_center.float()).abs()) * (1.0 + torch.finfo(dtype).eps)
    return stored_center, widened.to(dtype)


def bound_from_center_radius(q: torch.Tensor, center2: torch.Tensor, radius2: torch.Tensor) -> torch.Tensor:
    """The same bound from `max + min` and `max - min` (`[B, Hkv, nB, D]`, any one float dtype; q is cast to it)."""
    return bound_from_digests(q, torch.cat([center2, radius2], dim=-1))


def bound_from_digests(q: torch.Tensor, digests: torch.Tensor, per_query_head: bool = False) -> torch.Tensor:
    """The bound from digests kept as `[max + min | max - min]` (`[B, Hkv, nB, 2D]`, any float dtype; q is cast to
    it), fp32 `[B, Hkv, nB]` (`per_query_head`: `[B, Hq, nB]`, no group max): one matmul with the digests as the
    streamed row-major operand, what `DigestTable` keeps up to date at block completion, so a call converts
    nothing. At 32k tokens (1024 blocks, 8 KV heads, fp32, 8 MB per layer) on 2 CPU cores: 0.8 ms per layer, where
    `q @ center^T` and `|q| @ radius^T` took 1.6. On a CPU in fp32 the compiled kernel of `digest_native` computes
    the group max in one pass where it is built."""
    if not per_query_head and digest_native.supports(q, digests):
        return digest_native.bound_scores(q, digests)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = digests.shape[1]
    q4 = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).to(digests.dtype)
    both = torch.cat([q4, q4.abs()], dim=-1)  # [B, Hkv, G, 2D]
    scores = torch.matmul(digests, both.transpose(-1, -2))  # [B, Hkv, nB, G]
    if per_query_head:  # query head h of KV head h // G
        return scores.transpose(-1, -2).reshape(batch, num_heads, -1).float().mul_(0.5)
    return scores.amax(dim=-1).float().mul_(0.5)  # group max


def rank_from_digests(q: torch.Tensor, digests: torch.Tensor, per_query_head: bool = False) -> torch.Tensor:
    """`bound_from_digests` in the digests' dtype (the same values: that function's last step is an exact conversion
    to fp32), in seven torch calls, because a selecting method scores every sparse layer of every step."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = digests.shape[1]
    q4 = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if q4.dtype != digests.dtype:
        q4 = q4.to(digests.dtype)
    both = torch.cat([q4, q4.abs()], dim=-1).mul_(0.5)  # halving is exact: the bound's own rounding
    scores = torch.matmul(digests, both.transpose(-1, -2))  # [B, Hkv, nB, G]
    if per_query_head:  # query head h of KV head h // G
        return scores.transpose(-1, -2).reshape(batch, num_heads, -1)
    return scores.amax(dim=-1)


def select_top_blocks(scores: torch.Tensor, num_valid_blocks: torch.Tensor, k: int,
                      excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k blocks per (sequence, KV head) among the first `num_valid_blocks[b]` blocks, minus `excluded`.

    scores `[B, Hkv, nB]`; excluded: bool `[B, Hkv, nB]` or `[B, 1, nB]` (blocks that are always attended anyway).
    Returns (ids `[B, Hkv, k']` int64 with the valid selections first, in descending score order;
    count `[B, Hkv]` of valid selections), where `k' = min(k, nB)`.
    """
    candidates = CandidateBlocks.build(scores.shape[-1], num_valid_blocks, k, excluded, scores.device)
    return candidates.top(scores), candidates.count.expand(scores.shape[:2])


@dataclass(frozen=True)
class CandidateBlocks:
    """The blocks a top-k may pick: the first `num_valid_blocks[b]` of `num_blocks`, minus `excluded`. It depends
    on the positions only, so a method selecting in every layer of a step builds it once per step; `static` makes
    one whose tensors `update` rewrites in place every step, over every block the storage can hold (what a captured
    CUDA graph reads: a count of blocks taken from a Python int would be baked into it)."""

    blocked: torch.Tensor  # bool [B, 1 or Hkv, nB]: not selectable (the form `top` masks with, every layer)
    count: torch.Tensor  # [B, 1 or Hkv]: valid selections, min(k, selectable blocks)
    k: int  # selections per row, min(k, nB)
    excluded: torch.Tensor | None = None  # `static`: blocks never selectable ([1 or B, 1 or Hkv, nB])
    block_index: torch.Tensor | None = None  # `static`: arange(nB)

    @property
    def num_blocks(self) -> int:
        return self.blocked.shape[-1]

    @classmethod
    def static(cls, batch: int, num_blocks: int, k: int, excluded: torch.Tensor | None,
               device: torch.device) -> CandidateBlocks:
        """Candidates over `num_blocks` blocks for `update` to fill each step (nothing selectable until then)."""
        blocked = torch.ones((batch, 1, num_blocks), dtype=torch.bool, device=device)
        count = torch.zeros((batch, 1), dtype=torch.long, device=device)
        return cls(blocked, count, max(0, min(k, num_blocks)), excluded, torch.arange(num_blocks, device=device))

    def update(self, num_valid_blocks: torch.Tensor) -> None:
        """This step's candidates of a `static` one: the first `num_valid_blocks` `[B]` (device) blocks, in place."""
        torch.ge(self.block_index[None, None, :], num_valid_blocks[:, None, None], out=self.blocked)
        if self.excluded is not None:
            self.blocked.logical_or_(self.excluded)
        torch.clamp(self.num_blocks - self.blocked.sum(dim=-1), max=self.k, out=self.count)

    @classmethod
    def build(cls, num_blocks: int, num_valid_blocks: torch.Tensor, k: int, excluded: torch.Tensor | None,
              device: torch.device) -> CandidateBlocks:
        block_index = torch.arange(num_blocks, device=device)
        blocked = block_index[None, None, :] >= num_valid_blocks.to(device)[:, None, None]
        if excluded is not None:
            blocked = blocked | excluded
        k = max(0, min(k, num_blocks))
        return cls(blocked, (num_blocks - blocked.sum(dim=-1)).clamp(max=k), k)

    def top(self, scores: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """ids `[B, Hkv, k]` (int64) of the highest `scores` `[B, Hkv, nB]` among the candidates, the valid
        `count` first, in descending score order; into `out` = (values, ids) buffers where given."""
        if self.k == 0:
            return torch.zeros(*scores.shape[:2], 0, dtype=torch.long, device=scores.device)
        masked = scores.masked_fill(self.blocked, float("-inf"))
        if out is not None:
            torch.topk(masked, self.k, dim=-1, sorted=True, out=out)
            return out[1]
        return torch.topk(masked, self.k, dim=-1, sorted=True).indices
