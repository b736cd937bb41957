"""InfiniGen's token speculation on a CPU, one entry point whose backend is chosen here: the kernel library's
scores-and-top-n in one call (`cpu_attention.top_tokens`) where it takes the call, else torch's matmul, mask, group
max and topk. The CUDA path's speculation writes static buffers a captured graph reads (`fused_ops.speculate_count_`
and the method's top-k into them)."""

from __future__ import annotations

import torch

from scoutbench.kernels import cpu_attention, fused_ops
from scoutbench.kernels.backends import fused_ops_available


def top_tokens(partial_q: torch.Tensor, partial_keys: torch.Tensor, partial_keys_t: torch.Tensor,
               uncached: torch.Tensor, lengths: torch.Tensor, n: int, scale: float, ordered: bool) -> torch.Tensor:
    """The `n` speculated tokens of each (sequence, KV head) row: those among the first `lengths[b]` whose partial
    keys score highest against any of the row's partial queries. partial_q `[B, Hkv, G, P]`; partial_keys
    `[B, Hkv, N, P]` and `partial_keys_t` its `[B, Hkv, P, N]` view; uncached `[B, 1, 1, N]` fp32 (0 for a cached
    token, -inf after: `lengths` as a mask); `ordered`: a sequence holds fewer than n tokens, so its valid ones must
    come first. Returns ids `[B, Hkv, n]` int64: the kernel's in ascending token order, torch's by score."""
    if cpu_attention.takes_top_tokens(partial_q, partial_keys):
        return cpu_attention.top_tokens(partial_q, partial_keys, lengths, n)
    scores = torch.add(uncached, torch.matmul(partial_q, partial_keys_t), alpha=scale)  # fp32(score) * scale
    # the order of the fetched tokens does not matter to their attention, only that the valid ones come first
    # (sorted: 2x slower at 32k on CPU)
    return scores.amax(dim=2).topk(n, dim=-1, sorted=ordered).indices


def speculate_count_(scores: torch.Tensor, uncached: torch.Tensor, scale: float, alpha: float, capacity: int,
                     positions: torch.Tensor, ranked: torch.Tensor, mean_count: torch.Tensor, current: torch.Tensor,
                     valid_len: torch.Tensor, bias: torch.Tensor, scratch: torch.Tensor) -> None:
    """InfiniGen's dynamic fetch count on a device, in place (`fused_ops.speculate_count_`'s contract): one launch
    where the fused ops serve the device, else the torch ops it stands for."""
    if fused_ops_available(scores.device):
        fused_ops.speculate_count_(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count, current,
                                   valid_len, bias, scratch)
    else:
        fused_ops.speculate_count_reference(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count,
                                            current, valid_len, bias)
