"""Triton kernels behind two fused ops of `fused_ops` on CUDA: a block-slot region's partial attention and the
exact LSE merge of two partial states, one launch each.

Why: on a GPU every torch call costs the host 5-20 us. The torch reference of the region attention is some fifteen
calls (the closed-token mask, two matmuls, the scaling, the fill, the logsumexp, the softmax, casts and views) and
the merge six (clamp, subtract, sigmoid, unsqueeze, lerp, cast); a sparse layer that issues them is launch-bound.
Here each is one launch, one torch call, one node of a CUDA graph, with its outputs allocated by `torch.empty`.

`region_attention`: q `[B, Hq, D]` against k/v `[B, Hkv, S * b, D]` (any strides) of S slots of b tokens, row
(sequence, KV head) attending the first `slot_tokens[b, h, s]` tokens of slot s. One program per row, the G query
heads of its group packed in one tile (GQA, as `triton_decode`), streaming the row's keys in tiles with an online
softmax in fp32; a closed token is masked out of the loads (no memory traffic) and of the softmax. The row is not
split over programs: a split would need a second launch to merge (the very calls this op removes).

`merged_output`: `o_a + sigmoid(lse_b - max(lse_a, fp32 min)) * (o_b - o_a)` in `torch.lerp`'s two-sided form
(`partial_state._interpolated`), so an empty part (lse -inf) gives the other part's output exactly and two empty
parts give o_a, never NaN; cast to the requested dtype on store.

Imported lazily (triton may be absent); with `TRITON_INTERPRET=1` set before triton is imported it runs on CPU
tensors, which is how tests/kernels/test_triton_region.py checks it against the torch references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scoutbench.kernels.triton_decode import online_softmax_result, online_softmax_step, tile_config

MIN_DOT = 16  # tl.dot needs every tile side >= 16
MERGE_TILE = 4096  # elements per program of the merge
FP32_MIN = tl.constexpr(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: the clamp of a's LSE


@triton.jit
def _region_kernel(
    q_ptr, k_ptr, v_ptr, tokens_ptr, o_ptr, lse_ptr,
    scale, num_keys,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_th, stride_ts,
    stride_ob, stride_oh,
    stride_lb,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLOT_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program = one (sequence, KV head) row; online softmax in fp32 over its open tokens."""
    row = tl.program_id(0)
    batch_index = row // NUM_KV_HEADS
    kv_head = row % NUM_KV_HEADS

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
    tokens_row = tokens_ptr + batch_index * stride_tb + kv_head * stride_th

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for block_start in range(0, num_keys, BLOCK_N):
        n = block_start + offs_n
        in_range = n < num_keys
        slot = n // SLOT_SIZE
        open_tokens = tl.load(tokens_row + slot * stride_ts, mask=in_range, other=0)
        valid = in_range & ((n - slot * SLOT_SIZE) < open_tokens)  # token t of slot s is open iff t < tokens[s]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_row + n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))  # a tile may close every token: the step shifts by 0
        v = tl.load(v_row + n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    # every row has an open token by contract; a row without one gets the empty state
    out, lse = online_softmax_result(m_i, l_i, acc)
    tl.store(o_ptr + batch_index * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + batch_index * stride_lb + heads, lse, mask=g_mask)


def region_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, slot_tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_ops.region_attention` on CUDA: (o fp32 `[B, Hq, D]`, natural-log lse fp32 `[B, Hq]`), one launch."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_slots = slot_tokens.shape[1:]
    num_keys = k.shape[2]
    tiles = tile_config(k.dtype)  # the decode kernel's: the same online softmax over tiles (a tile may span slots)
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)
    _region_kernel[(batch * num_kv_heads,)](
        q, k, v, slot_tokens, out, lse, scale, num_keys,
        *q.stride(), *k.stride(), *v.stride(), *slot_tokens.stride(), *out.stride()[:2], lse.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        SLOT_SIZE=num_keys // num_slots,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(num_heads // num_kv_heads)), BLOCK_N=tiles.block_n,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        # fp32 inputs: exact products, not the CUDA default TF32; bf16/fp16 products are exact on the default path.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, lse


@triton.jit
def _merge_kernel(
    o_a_ptr, lse_a_ptr, o_b_ptr, lse_b_ptr, out_ptr,
    num_rows,
    stride_oab, stride_oah, stride_oad,
    stride_lab, stride_lah,
    stride_obb, stride_obh, stride_obd,
    stride_lbb, stride_lbh,
    stride_outb, stride_outh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program = BLOCK_R (sequence, query head) rows of the merge."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    b = rows // NUM_HEADS
    h = rows % NUM_HEADS
    lse_a = tl.load(lse_a_ptr + b * stride_lab + h * stride_lah, mask=r_mask, other=0.0)
    lse_b = tl.load(lse_b_ptr + b * stride_lbb + h * stride_lbh, mask=r_mask, other=0.0)
    o_a = tl.load(o_a_ptr + b[:, None] * stride_oab + h[:, None] * stride_oah + offs_d[None, :] * stride_oad,
                  mask=mask, other=0.0)
    o_b = tl.load(o_b_ptr + b[:, None] * stride_obb + h[:, None] * stride_obh + offs_d[None, :] * stride_obd,
                  mask=mask, other=0.0)
    # b's share of the mass: 1 when a is empty (lse_a -inf, clamped), 0 when b is, and 0 when both are
    share_b = tl.sigmoid(lse_b - tl.maximum(lse_a, FP32_MIN))[:, None]
    diff = o_b - o_a
    # torch.lerp's two-sided form with fused multiply-adds, as torch computes it: exactly o_a at share 0 and
    # exactly o_b at share 1
    out = tl.where(share_b < 0.5, tl.fma(share_b, diff, o_a), tl.fma(-diff, 1.0 - share_b, o_b))
    tl.store(out_ptr + b[:, None] * stride_outb + h[:, None] * stride_outh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def merged_output(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """`fused_ops.merged_output` on CUDA: the merged output `[B, Hq, D]` of two fp32 partial states, in `dtype`."""
    batch, num_heads, head_dim = o_a.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype, device=o_a.device)
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, MERGE_TILE // block_d)
    num_rows = batch * num_heads
    _merge_kernel[(triton.cdiv(num_rows, block_r),)](
        o_a, lse_a, o_b, lse_b, out, num_rows,
        *o_a.stride(), *lse_a.stride(), *o_b.stride(), *lse_b.stride(), *out.stride()[:2],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=block_d,
    )
    return out
