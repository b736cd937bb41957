"""Triton kernel of `fused_ops.speculate_count_`: InfiniGen's dynamic fetch count of one layer in one launch.

Contract: `fused_ops.speculate_count_` (the torch reference it is tested against in triton's interpreter,
tests/kernels/test_triton_speculate.py). Imported lazily (triton may be absent); with `TRITON_INTERPRET=1` set before
triton is imported it runs on CPU tensors.

Shape of the launch: one program per (sequence, KV head) row streams the row's G query heads twice, first for
each head's max logit (writing the group max, `ranked`, on the way), then for the number of logits within alpha of
it. The count's mean is over every query head of the batch, a reduction across programs, and the mean sizes each
sequence's `current`, `valid_len` and `bias`: so each program adds its row's count to a global total and then takes
a ticket, and the program that draws the last ticket writes the mean and the per-sequence outputs and resets both
counters to zero for the next launch. Why this and not one program looping over all rows: that one program would
stream the whole `[B, Hkv, G, N]` scores on one SM (at 64k tokens, megabytes per layer), where the ticket keeps
every row's program in parallel and costs two atomics per row. It is sound without any co-residency assumption:
no program waits for another; both atomics are acq_rel at GPU scope, so a program's count is added before its
ticket is taken, and the last ticket's holder acquires every earlier ticket's release and with it every row's
count; the reset happens after the last add (every add precedes its program's ticket). The counters are the
caller's `scratch` (zero at bind), so launches on one stream never share a half-updated counter and a captured
graph replays the same protocol.

Exactness: the logits are `uncached + scale * fp32(score)` with the bias 0 or -inf, so fp32(score) * scale exactly
however the compiler rounds the multiply-add, as torch's add computes them; a head's count compares each logit
with `max - fp32(alpha)` as torch does. The total is an exact integer; the mean is its correctly rounded fp32
quotient by B * Hq (`div_rn`), which is torch's mean wherever the total is below 2^24 (then every partial sum of
torch's fp32 accumulation is exact too), and the host and the device read the same stored mean either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 256  # slots per inner iteration
BLOCK_W = 1024  # mask slots per store of the last program


@triton.jit
def _tile_logits(score_row, bias_row, slots, g_mask, num_slots, scale, stride_sn, stride_un):
    """The logits `[BLOCK_G, BLOCK_N]` of a tile of slots: the uncached bias plus the scaled raw score, as the
    reference's fp32 add; -inf for a head past the group or a slot past the row."""
    n_mask = slots < num_slots
    mask = g_mask[:, None] & n_mask[None, :]
    score = tl.load(score_row + slots[None, :] * stride_sn, mask=mask, other=0.0).to(tl.float32)
    uncached = tl.load(bias_row + slots * stride_un, mask=n_mask, other=float("-inf"))
    return tl.where(mask, uncached[None, :] + scale * score, float("-inf"))


@triton.jit
def _speculate_count_kernel(
    scores_ptr, uncached_ptr, positions_ptr, ranked_ptr, mean_ptr, current_ptr, valid_ptr, bias_ptr, scratch_ptr,
    scale, alpha, capacity_f, num_heads_f, batch, num_slots, width,
    stride_sb, stride_sh, stride_sg, stride_sn,
    stride_ub, stride_un,
    stride_rb, stride_rh, stride_rn,
    stride_bb, stride_bw,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """One program = one (sequence, KV head) row; the last program to finish also writes the batch's outputs."""
    row = tl.program_id(0)
    batch_index = row // NUM_KV_HEADS
    kv_head = row % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    score_row = scores_ptr + batch_index * stride_sb + kv_head * stride_sh + offs_g[:, None] * stride_sg
    bias_row = uncached_ptr + batch_index * stride_ub
    ranked_row = ranked_ptr + batch_index * stride_rb + kv_head * stride_rh

    # pass 1: each head's max logit, and the group max of every slot
    head_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for start in range(0, num_slots, BLOCK_N):
        slots = start + offs_n
        logits = _tile_logits(score_row, bias_row, slots, g_mask, num_slots, scale, stride_sn, stride_un)
        head_max = tl.maximum(head_max, tl.max(logits, axis=1))
        tl.store(ranked_row + slots * stride_rn, tl.max(logits, axis=0), mask=slots < num_slots)

    # pass 2: each head's logits above its max minus alpha (a masked one is -inf: never above)
    threshold = head_max - alpha
    count = tl.zeros([BLOCK_G], dtype=tl.int64)
    for start in range(0, num_slots, BLOCK_N):
        slots = start + offs_n
        logits = _tile_logits(score_row, bias_row, slots, g_mask, num_slots, scale, stride_sn, stride_un)
        count += tl.sum((logits > threshold[:, None]).to(tl.int64), axis=1)

    tl.atomic_add(scratch_ptr, tl.sum(count, axis=0), sem="acq_rel", scope="gpu")
    ticket = tl.atomic_add(scratch_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if ticket == batch * NUM_KV_HEADS - 1:  # every row's count is in the total: the batch's outputs
        total = tl.atomic_xchg(scratch_ptr, 0, sem="acq_rel", scope="gpu")
        tl.atomic_xchg(scratch_ptr + 1, 0, sem="acq_rel", scope="gpu")
        mean = tl.math.div_rn(total.to(tl.float32), num_heads_f)
        tl.store(mean_ptr, mean)
        n = tl.minimum(tl.maximum(mean, 1.0), capacity_f).to(tl.int64)  # the floor: mean >= 1
        offs_b = tl.arange(0, BLOCK_B)
        offs_w = tl.arange(0, BLOCK_W)
        for b_start in range(0, batch, BLOCK_B):
            sequences = b_start + offs_b
            b_mask = sequences < batch
            current = tl.minimum(tl.load(positions_ptr + sequences, mask=b_mask, other=0), n)
            tl.store(current_ptr + sequences, current, mask=b_mask)
            tl.store(valid_ptr + sequences, current + 1, mask=b_mask)
            for w_start in range(0, width, BLOCK_W):
                slots = w_start + offs_w
                keep = slots[None, :] < (current + 1)[:, None]
                values = tl.where(keep, 0.0, float("-inf")).to(bias_ptr.dtype.element_ty)
                tl.store(bias_ptr + sequences[:, None] * stride_bb + slots[None, :] * stride_bw, values,
                         mask=b_mask[:, None] & (slots[None, :] < width))


def speculate_count_(scores: torch.Tensor, uncached: torch.Tensor, scale: float, alpha: float, capacity: int,
                     positions: torch.Tensor, ranked: torch.Tensor, mean_count: torch.Tensor, current: torch.Tensor,
                     valid_len: torch.Tensor, bias: torch.Tensor, scratch: torch.Tensor) -> None:
    """`fused_ops.speculate_count_` in one launch (its docstring has the contract). `positions`, `current`,
    `valid_len` and `scratch` must be contiguous; the other tensors may have any strides. The capacity and the
    number of query heads go in as fp32 (exact below 2^24), the values the mean is divided by and clamped to: an
    integer argument of 1 would arrive as a compile-time constant, which has no `.to`."""
    batch, num_kv_heads, group, num_slots = scores.shape
    width = bias.shape[-1]
    _speculate_count_kernel[(batch * num_kv_heads,)](
        scores, uncached, positions, ranked, mean_count, current, valid_len, bias, scratch,
        float(scale), float(alpha), float(capacity), float(batch * num_kv_heads * group), batch, num_slots, width,
        *scores.stride(),
        uncached.stride(0), uncached.stride(3),
        ranked.stride(0), ranked.stride(1), ranked.stride(3),
        bias.stride(0), bias.stride(3),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 2),
        BLOCK_N=BLOCK_N, BLOCK_B=min(max(triton.next_power_of_2(batch), 2), 16), BLOCK_W=BLOCK_W,
    )
