"""The partial-attention result every kernel and method exchanges, and its exact merge.

A part of attention over a subset of keys is `(o: fp32 [B, Hq, D], lse: fp32 [B, Hq])` with a natural-log LSE; an
empty part has `lse = -inf` and `o = 0`. This module depends on torch and the compiled CPU kernel's loader
(`cpu_attention`, which imports no other kernel module) only, so that every kernel (the torch path in `attention`,
the flashinfer adapter in `backends`, the Triton kernel) can build and merge parts without an import cycle
(docs/architecture.md, the import layers).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from scoutbench.kernels import cpu_attention


class PartialState(NamedTuple):
    """Attention over a subset of keys: normalised output and natural-log LSE, both fp32."""

    o: torch.Tensor  # [B, Hq, D] fp32
    lse: torch.Tensor  # [B, Hq] fp32


def expand_valid_len(valid_len: torch.Tensor, batch: int, num_kv_heads: int) -> torch.Tensor:
    if valid_len.dim() == 1:
        valid_len = valid_len[:, None].expand(batch, num_kv_heads)
    return valid_len


def row_lengths(valid_len: torch.Tensor | None, batch: int, num_kv_heads: int, num_keys: int,
                device: torch.device) -> torch.Tensor:
    """Valid keys of each (sequence, KV head) row, flattened to `[B * Hkv]` int32: what row-wise kernels
    (flashinfer pages, the Triton kernel) take."""
    if valid_len is None:
        return torch.full((batch * num_kv_heads,), num_keys, dtype=torch.int32, device=device)
    lengths = expand_valid_len(valid_len, batch, num_kv_heads).clamp(0, num_keys)
    return lengths.to(torch.int32).reshape(batch * num_kv_heads)


def empty_state(batch: int, num_heads: int, head_dim: int, device: torch.device | str) -> PartialState:
    return PartialState(torch.zeros(batch, num_heads, head_dim, device=device),
                        torch.full((batch, num_heads), float("-inf"), device=device))


def merge_states(*states: PartialState) -> PartialState:
    """Exact merge of partial results over disjoint key sets: `lse = logsumexp(lse_i)`, `o = sum exp(lse_i - lse) o_i`.

    Empty parts (lse = -inf) get weight 0; if every part is empty the result is the empty state, never NaN.
    Two parts (a method's per-layer merge) are one call of the compiled kernel on a CPU where it is built, and
    elsewhere `merged_output`'s interpolation and the LSE (6 calls where the general form takes 9).
    """
    if len(states) == 2:
        (o_a, lse_a), (o_b, lse_b) = states
        if cpu_attention.takes_merge2(o_a, lse_a, o_b, lse_b):
            return PartialState(*cpu_attention.merge2(o_a, lse_a, o_b, lse_b))
        return PartialState(_interpolated(o_a, lse_a, o_b, lse_b), torch.logaddexp(lse_a, lse_b))
    lses = torch.stack([s.lse for s in states])  # [P, B, Hq]
    total = torch.logsumexp(lses, dim=0)
    # an all-empty row (total -inf) is shifted by the lowest finite float instead: its weights are exp(-inf) = 0
    weights = torch.exp(lses - total.clamp(min=torch.finfo(total.dtype).min))  # exp(-inf) = 0 for empty parts
    out = (weights.unsqueeze(-1) * torch.stack([s.o for s in states])).sum(dim=0)
    return PartialState(out, total)


def merged_output(a: PartialState, b: PartialState) -> torch.Tensor:
    """The output of `merge_states(a, b)` without its LSE, for a method that reads only the output (5 calls off a
    CPU; `attention.merge_output` is a layer's merge on the decode path)."""
    if cpu_attention.takes_merge2(a.o, a.lse, b.o, b.lse):
        return cpu_attention.merge2(a.o, a.lse, b.o, b.lse)[0]
    return _interpolated(a.o, a.lse, b.o, b.lse)


def _interpolated(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """`o_a + share_b (o_b - o_a)`, b's share of the two parts' mass being `sigmoid(lse_b - lse_a)`: exactly o_b
    when a is empty (share 1) and o_a when b is (share 0); a's LSE is clamped to the lowest finite float, so two
    empty parts give share 0 and a's zero output, not NaN."""
    share_b = torch.sigmoid(lse_b - lse_a.clamp(min=torch.finfo(lse_a.dtype).min))
    return torch.lerp(o_a, o_b, share_b.unsqueeze(-1))


LN2 = math.log(2.0)


def lse_base2_to_natural(lse_base2: torch.Tensor) -> torch.Tensor:
    """FlashInfer reports log2-sum-exp2; everything else here is natural log."""
    return lse_base2 * LN2


def lse_natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    return lse / LN2
