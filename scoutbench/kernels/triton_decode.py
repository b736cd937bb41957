"""Triton decode partial attention with a natural-log LSE: the CUDA fast path when flashinfer is not installed.

Same contract as `scoutbench.kernels.attention.partial_attention`: q `[B, Hq, D]` against gathered keys/values
`[B, Hkv, N, D]` (any strides), the first `valid_len` keys of each (sequence, KV head) row valid, returning
`PartialState(o fp32 [B, Hq, D], lse fp32 [B, Hq])` with the empty state for rows without keys.

Why a kernel: the torch fallback materialises fp32 logits and probabilities for every row and launches four
kernels per call; this one streams K/V once. The G query heads of a KV group are packed into one tile (GQA), so
each K/V block is read once per group. Long rows are split over several programs (flash-decoding) and the splits
are merged with the shared exact LSE merge. Imported lazily (triton may be absent); with `TRITON_INTERPRET=1` set
before triton is imported it runs on CPU tensors, which is how tests/kernels/test_triton.py checks it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from scoutbench.kernels.partial_state import PartialState, merge_states, row_lengths

MIN_KEYS_PER_SPLIT = 256  # below this, splitting a row costs more in merging than it gains in parallelism
MIN_DOT = 16  # tl.dot needs every tile side >= 16


@dataclass(frozen=True)
class TileConfig:
    """How an attention kernel streams its keys: keys per inner iteration, warps, software-pipelining stages."""

    block_n: int
    num_warps: int
    num_stages: int


# Per KV dtype, the same on every target (scripts/triton_aot.py compiles each for sm_80/86/89/90; docs/gpu.md lists
# registers, spills and shared memory). bf16/fp16: 64-key tiles in triton's default 4 warps and 3 stages (70 KiB of
# shared memory at head_dim 128, no spill). fp32 tiles are twice the bytes: those 64-key tiles in 3 stages took
# 143 KiB of shared memory (over the 99 KiB of sm_86/sm_89: the kernel would not load there) and 255 registers
# with a spill on sm_90 (fp32 products are FMAs, not tensor-core MMAs, and 4 warps held a head_dim of operands per
# thread); 32-key tiles over 8 warps in 2 stages take 42 KiB and 69 registers, without a spill.
HALF_TILES = TileConfig(block_n=64, num_warps=4, num_stages=3)
FP32_TILES = TileConfig(block_n=32, num_warps=8, num_stages=2)


def tile_config(dtype: torch.dtype) -> TileConfig:
    return FP32_TILES if dtype == torch.float32 else HALF_TILES


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """One key tile of an online softmax in fp32: `scores` `[G, N]` (scaled; -inf where a key is masked) and the
    values `v` `[N, D]` into the running max `m_i`, sum `l_i` and output `acc`; returns the three. A tile of masked
    keys before any valid one leaves the max at -inf: the shift is then 0, so alpha and p are exp(-inf) = 0, not
    exp(NaN). Shared by this module's kernel and the region kernel (triton_region)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def online_softmax_result(m_i, l_i, acc):
    """(output `[G, D]`, natural-log LSE `[G]`) of a finished online softmax: the empty state (0, -inf) for a row
    without keys."""
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))  # acc is 0 without keys


@triton.jit
def _partial_decode_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, o_ptr, lse_ptr,
    scale, keys_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_os, stride_ob, stride_oh,
    stride_ls, stride_lb,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program = one (sequence, KV head) row x one split of its keys; online softmax in fp32."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    batch_index = row // NUM_KV_HEADS
    kv_head = row % NUM_KV_HEADS
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, tl.load(valid_ptr + row))

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + batch_index * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    k_row = k_ptr + batch_index * stride_kb + kv_head * stride_kh
    v_row = v_ptr + batch_index * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every block visited starts below `end`, so it holds at least one valid key and the max stays finite.
    for block_start in range(start, end, BLOCK_N):
        n = block_start + offs_n
        kv_mask = (n < end)[:, None] & d_mask[None, :]
        k = tl.load(k_row + n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where((n < end)[None, :], scores, float("-inf"))
        v = tl.load(v_row + n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    out, lse = online_softmax_result(m_i, l_i, acc)
    tl.store(o_ptr + split * stride_os + batch_index * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + split * stride_ls + batch_index * stride_lb + heads, lse, mask=g_mask)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(rows: int, num_keys: int, device: torch.device) -> int:
    """Enough programs for two waves over the GPU's multiprocessors, never splits shorter than MIN_KEYS_PER_SPLIT."""
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * _multiprocessors(device.index or 0), rows)
    return max(1, min(wanted, triton.cdiv(num_keys, MIN_KEYS_PER_SPLIT)))


def triton_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             valid_len: torch.Tensor | None = None, num_splits: int | None = None) -> PartialState:
    """Partial attention of `q` over the leading `valid_len` keys of each row (see the module docstring).

    `num_splits` forces the number of key splits per row (tests use it to exercise the merge); by default it is
    chosen from the GPU's size.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    valid = row_lengths(valid_len, batch, num_kv_heads, num_keys, q.device)
    tiles = tile_config(k.dtype)
    splits = num_splits or _default_splits(rows, num_keys, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(num_keys, splits), tiles.block_n) * tiles.block_n
    splits = triton.cdiv(num_keys, keys_per_split)
    out = torch.empty(splits, batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, batch, num_heads, dtype=torch.float32, device=q.device)
    _partial_decode_kernel[(rows, splits)](
        q, k, v, valid, out, lse, scale, keys_per_split,
        *q.stride(), *k.stride(), *v.stride(), *out.stride()[:3], *lse.stride()[:2],
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        # fp32 inputs: exact products, not the CUDA default TF32; bf16/fp16 products are exact on the default path.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if splits == 1:
        return PartialState(out[0], lse[0])
    return merge_states(*map(PartialState, out.unbind(0), lse.unbind(0)))
