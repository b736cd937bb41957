"""Fused device ops: a sparse method's small per-layer steps as one launch each on CUDA.

Why: on a GPU every torch call costs the host 5-20 us, and a sparse layer that scores its blocks, picks the top k,
splits them between the device pool and the CPU, attends its region and merges the two parts in some sixty small
calls is launch-bound (issue 34: the step must measure the methods, not Python). Each op here is a torch custom op
(`torch.ops.scoutbench.*`) with

- a CUDA kernel in Triton (`triton_select`, `triton_region`, `triton_speculate`), compiled where triton is installed:
  one launch, one torch call, one node of a CUDA graph;
- a torch reference (the ops it stands for, composed as the unfused path composes them), which serves every other
  device and is what the Triton kernels are tested against in triton's interpreter (tests/kernels/test_triton_*.py);
- a fake (meta) implementation, for capture and shape propagation.

Callers use an op where `backends.fused_ops_available(device)` (CUDA with triton, and emulated CUDA); on a CPU
they keep their compiled kernels, and on CUDA without triton the composite. Emulated CUDA keeps its device's data in
CPU tensors, so there an op reaches its CPU implementation, the op's body: it runs the op's Triton kernel where the
emulation runs triton's interpreter (`backends.EMULATED_TRITON`: the H200's path on a CPU), else the reference.
`select_and_split` and `speculate_count_` write a layer's static buffers (what a captured graph, the CPU worker and the
host read, with views made once: copying fresh outputs into them would cost a call each); `region_attention` and
`merged_output` return fresh tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from scoutbench.kernels import backends
from scoutbench.kernels.digest import rank_from_digests
from scoutbench.kernels.eviction import eviction_order
from scoutbench.kernels.partial_state import _interpolated
from scoutbench.kernels.split_plan import split_reference

NUM_COUNTS = 4  # a split plan's counts per row: n_cpu, n_selected, n_available, n_resident


def _triton_kernel(module: str, name: str) -> Callable[..., Any]:
    """`name` of the Triton kernel module `scoutbench.kernels.<module>`, imported when first needed (triton is
    optional)."""
    return getattr(importlib.import_module(f"scoutbench.kernels.{module}"), name)


def _interpreted(module: str, name: str) -> Callable[..., Any] | None:
    """The op's Triton kernel where an op's body serves emulated CUDA in triton's interpreter, else None (the body
    runs the reference)."""
    return _triton_kernel(module, name) if backends.EMULATED_TRITON == backends.INTERPRETED else None


# ---------------------------------------------------------------------------------------------- select and split
# registered as "select_split", the name profiles and the Triton kernel (docs/gpu.md) record
@torch.library.custom_op("scoutbench::select_split", mutates_args=("data", "pool_use"))
def select_and_split(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor, count: torch.Tensor,
                     block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor, with_victims: bool,
                     data: torch.Tensor, pool_use: torch.Tensor) -> None:
    """Digest scoring, top-k, the resident/CPU split and (`with_victims`) a recall's eviction order of one layer,
    for ScoutAttention's device side, written into the layer's preallocated plan (`data`, `pool_use`).

    q `[B, Hq, D]`; digests `[B, Hkv, nB, 2D]` (`DigestTable`'s rows: the bound is `rank_from_digests`, the group
    max, in the digests' dtype); blocked bool `[B, 1 or Hkv, nB]` and count `[B, 1 or Hkv]` (`CandidateBlocks`:
    the blocks not selectable and the valid selections, at most k <= nB, where k = (data's width - 4) / 3); the
    layer's `BlockTable` (block_slot `[B, Hkv, nB' + 1]`, slot_ready and slot_block `[B, Hkv, S + 1]`, each with its
    trash column).

    Writes `SplitPlan` data `[B, Hkv, 3k + 4]` int64: the first count selected ids, those the pool does not hold
    ready first, each group in descending score order; whether each is in flight to the pool; with `with_victims`
    the first k slots of `eviction.eviction_order` and how many of them a recall may fill (at most k), else 0
    and 0; n_cpu, n_selected, n_available, n_resident. And `pool_use` `[B, Hkv, S]` bool (S >= k): the pool slots
    the device part reads. Entries of ids and pending past n_selected are padding: their values are unspecified."""
    kernel = _interpreted("triton_select", "select_and_split")
    if kernel is not None:
        kernel(q, digests, blocked, count, block_slot, slot_ready, slot_block, with_victims, data, pool_use)
        return
    plan, used = select_and_split_reference(q, digests, blocked, count, (data.shape[-1] - NUM_COUNTS) // 3, block_slot,
                                            slot_ready, slot_block, with_victims)
    data.copy_(plan)
    pool_use.copy_(used)


def select_and_split_reference(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor, count: torch.Tensor,
                               k: int, block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor,
                               with_victims: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_and_split` in torch ops: (data, pool_use), fresh."""
    scores = rank_from_digests(q, digests)
    ids = torch.topk(scores.masked_fill(blocked, float("-inf")), k, dim=-1, sorted=True).indices
    valid = torch.arange(k, device=q.device) < count.unsqueeze(-1)
    valid = valid.expand(ids.shape)
    if with_victims:
        victims, available = eviction_order(slot_block, slot_ready, block_slot.shape[-1] - 1, ids, valid, scores)
        victims, available = victims[..., :k], available.clamp(max=k)
    else:
        victims, available = torch.zeros_like(ids), ids.new_zeros(ids.shape[:-1])  # (k may be 0)
    return split_reference(ids, valid, victims, available, block_slot, slot_ready, slot_block)


@select_and_split.register_fake
def _(q, digests, blocked, count, block_slot, slot_ready, slot_block, with_victims, data, pool_use):
    return None


@select_and_split.register_kernel("cuda")
def _(q, digests, blocked, count, block_slot, slot_ready, slot_block, with_victims, data, pool_use):
    _triton_kernel("triton_select", "select_and_split")(q, digests, blocked, count, block_slot, slot_ready,
                                                        slot_block, with_victims, data, pool_use)


# ---------------------------------------------------------------------------------------------- region attention
@torch.library.custom_op("scoutbench::region_attention", mutates_args=())
def region_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, slot_tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of q `[B, Hq, D]` over a region k/v `[B, Hkv, S * b, D]` of S block slots, each (sequence,
    KV head) row attending the first `slot_tokens[b, h, s]` tokens of slot s (`[B, Hkv, S]` int64; every row has
    an open token). Returns (o fp32 `[B, Hq, D]`, natural-log lse fp32 `[B, Hq]`): `attention.region_attention`'s
    contract, one launch."""
    kernel = _interpreted("triton_region", "region_attention")
    return (kernel or region_reference)(q, k, v, scale, slot_tokens)


def region_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, slot_tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`region_attention` in 15 torch calls (the unfused path on CUDA without triton, `attention.region_attention`):
    the closed tokens masked in place in the logits, and one softmax beside the LSE (every row has an open token),
    in fp32, or in fp64 for fp64 inputs (the exact reference tests/emulation/test_gpu.py holds the kernel to)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_slots = slot_tokens.shape[1:]
    block_size = k.shape[2] // num_slots
    accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
    q4 = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    closed = torch.arange(block_size, device=q.device) >= slot_tokens.unsqueeze(-1)  # [B, Hkv, S, b]
    logits = torch.matmul(q4, k.transpose(-1, -2)).to(accumulate).mul_(scale)
    logits.masked_fill_(closed.view(batch, num_kv_heads, 1, num_slots * block_size), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.matmul(torch.softmax(logits, dim=-1).to(v.dtype), v).to(accumulate)
    return out.view(batch, num_heads, head_dim), lse.view(batch, num_heads)


@region_attention.register_fake
def _(q, k, v, scale, slot_tokens):
    batch, num_heads, head_dim = q.shape
    return (q.new_empty((batch, num_heads, head_dim), dtype=torch.float32),
            q.new_empty((batch, num_heads), dtype=torch.float32))


@region_attention.register_kernel("cuda")
def _(q, k, v, scale, slot_tokens):
    return _triton_kernel("triton_region", "region_attention")(q, k, v, scale, slot_tokens)


# ---------------------------------------------------------------------------------------------- merged output
@torch.library.custom_op("scoutbench::merged_output", mutates_args=())
def merged_output(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The output of the exact LSE merge of two partial states (`partial_state.merged_output`), cast to `dtype`:
    the last step of a co-attention layer on the device (ScoutAttention, HGCA), one launch."""
    kernel = _interpreted("triton_region", "merged_output")
    if kernel is not None:
        return kernel(o_a, lse_a, o_b, lse_b, dtype)
    return _interpolated(o_a, lse_a, o_b, lse_b).to(dtype)


@merged_output.register_fake
def _(o_a, lse_a, o_b, lse_b, dtype):
    return o_a.new_empty(o_a.shape, dtype=dtype)


@merged_output.register_kernel("cuda")
def _(o_a, lse_a, o_b, lse_b, dtype):
    return _triton_kernel("triton_region", "merged_output")(o_a, lse_a, o_b, lse_b, dtype)


# ---------------------------------------------------------------------------------------------- speculated count
@torch.library.custom_op("scoutbench::speculate_count_",
                         mutates_args=("ranked", "mean_count", "current", "valid_len", "bias", "scratch"))
def speculate_count_(scores: torch.Tensor, uncached: torch.Tensor, scale: float, alpha: float, capacity: int,
                     positions: torch.Tensor, ranked: torch.Tensor, mean_count: torch.Tensor, current: torch.Tensor,
                     valid_len: torch.Tensor, bias: torch.Tensor, scratch: torch.Tensor) -> None:
    """InfiniGen's dynamic fetch count for one layer (`methods/infinigen.py`, the CUDA path), in place.

    scores `[B, Hkv, G, N]`: the partial query's raw scores against every slot of the partial keys; uncached fp32
    `[B, 1, 1, N]`: 0 where a slot holds a cached token, -inf after; positions int64 `[B]`: each sequence's cached
    tokens. The logits are `uncached + scale * fp32(scores)` (exactly fp32(score) * scale: the bias is 0 or -inf).
    Writes
    - ranked fp32 `[B, Hkv, 1, N]`: the group max of the logits, which the caller's top-k ranks;
    - mean_count fp32 `[]`: the mean over all B * Hq query heads of the number of logits above the head's max
      minus alpha (the original's count, which the host reads to size the fetch);
    - current int64 `[B]`: min(position, n), n = clamp(mean_count, 1, capacity) floored, where each sequence's
      current token goes after its fetched ones; valid_len int64 `[B]`: current + 1, the attended lengths;
    - bias `[B, 1, 1, W]`: 0 for the first valid_len slots of each row of the fetch target, -inf after (the lengths'
      mask, `StepLengths.bias`);
    - scratch int64 `[2]`: the kernel's global count and ticket (zero before and after a call; the reference does
      not touch it), owned by the caller so that no call allocates and two callers never share it.

    Why in place, where the other ops return fresh tensors: every output is a buffer made once at bind that a
    captured graph's later nodes and the host (`mean_count.item()`) read, so fresh outputs would each cost one copy
    into it: four of the calls the op saves. It stands for fifteen calls per sparse layer (the logits' add, amax,
    sub, gt, sum, mean, clamp, long, minimum and group amax; the lengths' add and copy, and their mask's index, lt
    and where). The name ends in `_`, torch's mark of an in-place op; its schema marks the buffers it writes, which
    is how a capture (on a GPU, and on emulated CUDA) records it as work on them."""
    kernel = _interpreted("triton_speculate", "speculate_count_")
    if kernel is not None:
        kernel(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count, current, valid_len, bias,
               scratch)
        return
    speculate_count_reference(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count, current,
                               valid_len, bias)


def speculate_count_reference(scores: torch.Tensor, uncached: torch.Tensor, scale: float, alpha: float,
                               capacity: int, positions: torch.Tensor, ranked: torch.Tensor, mean_count: torch.Tensor,
                               current: torch.Tensor, valid_len: torch.Tensor, bias: torch.Tensor) -> None:
    logits = torch.add(uncached, scores, alpha=scale)  # fp32(score) * scale, exactly
    counts = (logits > logits.amax(dim=-1, keepdim=True) - alpha).sum(dim=-1)
    torch.mean(counts, dtype=torch.float32, out=mean_count)
    # the integer bounds commute with the floor, which the conversion to int64 takes
    torch.minimum(positions, mean_count.clamp(1, capacity).long(), out=current)
    torch.add(current, 1, out=valid_len)
    torch.amax(logits, dim=2, keepdim=True, out=ranked)
    rows = bias.view(bias.shape[0], bias.shape[-1])
    rows.zero_().masked_fill_(torch.arange(rows.shape[-1], device=rows.device) >= valid_len[:, None], float("-inf"))


@speculate_count_.register_fake
def _(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count, current, valid_len, bias, scratch):
    return None


@speculate_count_.register_kernel("cuda")
def _(scores, uncached, scale, alpha, capacity, positions, ranked, mean_count, current, valid_len, bias, scratch):
    _triton_kernel("triton_speculate", "speculate_count_")(scores, uncached, scale, alpha, capacity, positions,
                                                           ranked, mean_count, current, valid_len, bias, scratch)
