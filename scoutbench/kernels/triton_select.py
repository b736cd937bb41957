"""Triton select-and-split: `torch.ops.scoutbench.select_split`'s CUDA kernel, one launch per call.

Same contract as `fused_ops.select_and_split` (the op's docstring; `fused_ops.select_and_split_reference` in torch ops):
digest scores, the top k of the selectable blocks in descending score order, the split of the selection between
the device pool and the CPU and, with `with_victims`, a recall's eviction order, for every (sequence, KV head) row
of a layer, written into the layer's plan (`data` `[B, Hkv, 3k + 4]` int64, `pool_use` `[B, Hkv, S]` bool).

Why a kernel: the composite is some twenty small torch calls per layer (matmul, amax, masked_fill, topk, gathers,
an argsort, a scatter, the counts), and ScoutAttention selects in every sparse layer of every decode step, so on a
GPU the step is launch-bound (issue 34). Here one program handles one row, in four passes:

1. scores: the digests are read once, in tiles of TILE_BLOCKS blocks; each tile is scored against the G query
   heads of the group (both = cat([q, |q|]) / 2 with q cast to the digests' dtype, as `rank_from_digests` does),
   products and sums in fp32 (no `tl.dot`: G is small, and triton's interpreter computes bf16 dots wrongly), the
   group max rounded to the digests' dtype (to nearest: bf16 by hand, see `_rounded`) and stored;
2. top k: the stored row is read back whole (BLOCK_NB = next_power_of_2(nB) lanes, at most MAX_BLOCKS), each
   score turned into an order-preserving int32 key (masked blocks get the key of -inf, as the reference's
   masked_fill), and k rounds of max-and-retire pick the selections in descending order: the row's largest key,
   then the lowest lane holding it (equal scores: lower block id first, one of the orders torch.topk may give).
   Two int32 reductions a round rather than one over (key, lane) packed in an int64: the row's keys are what the
   program holds in registers, and 16384 int64 lanes spilled on sm_90 with triton 3.6 (docs/gpu.md). k rounds of
   a row-wide reduction suit the small k of a decode step (k <= nB; k is not otherwise limited, but the cost grows
   as k * nB);
3. split: the selections' slots, residency and readiness are gathered from the block table, and a stable
   CPU-first order is computed with two cumulative sums and stored as a scatter within the row (a permutation of
   0..k-1, so no two lanes write one entry);
4. pool use and n_resident: for each tile of SLOT_TILE slots, a [SLOT_TILE, K_PAD] comparison with the
   selections on the device (no scatter, so no races), and the resident slots counted;
5. with_victims: `eviction.eviction_order` over the row's S slots (S_PAD lanes; whether a slot holds a selected
   block is k comparisons of the S_PAD lanes with one selection each: the [S_PAD, K_PAD] comparison at once
   spilled registers on sm_90), its first k by k rounds of min-and-retire over packed (key, slot) lanes
   (equal keys: the lower slot first, as the reference's stable argsort), and min(available, k); else zeros.

Entries past n_selected are padding (unspecified in the contract); the kernel writes them like the rest. Imported
lazily (triton may be absent); with `TRITON_INTERPRET=1` set before triton is imported it runs on CPU tensors,
which is how tests/kernels/test_triton_select.py checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_COUNTS = 4  # n_cpu, n_selected, n_available, n_resident (fused_ops.NUM_COUNTS)
MAX_BLOCKS = 16384  # blocks per row that step 2 holds in registers (BLOCK_NB lanes of int64)
TILE_ELEMENTS = 8192  # elements of a digest tile [TILE_BLOCKS, BLOCK_2D]
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM (sm_80 to sm_90); a thread may use at most 255
SLOT_TILE_ELEMENTS = 2048  # elements of a slot tile [SLOT_TILE, K_PAD] (int64 pairs: 8192 spilled at k = 253)
RETIRED: tl.constexpr = tl.constexpr(-(2**31))  # key of a lane selected or past nB: below any finite or -inf score
EVICTED: tl.constexpr = tl.constexpr(2**63 - 1)  # packed key of a slot ordered already or past S: above any slot


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """fp32 `x` rounded to DTYPE (to nearest, ties to even), still in fp32. bf16 by hand: triton's interpreter
    truncates an fp32 -> bf16 cast (3.9, whatever the rounding asked), a GPU rounds it to nearest."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000: the bf16 part of the fp32 word
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _select_split_kernel(
    q_ptr, digests_ptr, blocked_ptr, count_ptr, block_slot_ptr, slot_ready_ptr, slot_block_ptr,
    data_ptr, pool_use_ptr, scores_ptr,
    k, num_blocks, max_blocks, num_slots,
    stride_qb, stride_qh, stride_qd,
    stride_db, stride_dh, stride_dn, stride_dd,
    stride_xb, stride_xh, stride_xn,
    stride_cb, stride_ch,
    stride_tb, stride_th, stride_tn,
    stride_rb, stride_rh, stride_rs,
    stride_sb, stride_sh, stride_ss,
    stride_ob, stride_oh,
    stride_pb, stride_ph,
    stride_gb, stride_gh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_2D: tl.constexpr, TILE_BLOCKS: tl.constexpr, BLOCK_NB: tl.constexpr, K_PAD: tl.constexpr,
    SLOT_TILE: tl.constexpr, WITH_VICTIMS: tl.constexpr, S_PAD: tl.constexpr,
):
    """One program = one (sequence, KV head) row."""
    row = tl.program_id(0)
    b = row // NUM_KV_HEADS
    h = row % NUM_KV_HEADS
    score_dtype = scores_ptr.dtype.element_ty

    # ---- 1. scores, tile by tile: the group max of digests . both, in fp32, stored in the digests' dtype
    offs_e = tl.arange(0, BLOCK_2D)  # digest entry: [0, D) the q half, [D, 2D) the |q| half
    e_mask = offs_e < 2 * HEAD_DIM
    q_d = tl.where(offs_e < HEAD_DIM, offs_e, offs_e - HEAD_DIM)
    digests_row = digests_ptr + b * stride_db + h * stride_dh
    scores_row = scores_ptr + b * stride_gb + h * stride_gh
    offs_t = tl.arange(0, TILE_BLOCKS)
    for tile_start in range(0, num_blocks, TILE_BLOCKS):
        n = tile_start + offs_t
        n_mask = n < num_blocks
        tile = tl.load(digests_row + n[:, None] * stride_dn + offs_e[None, :] * stride_dd,
                       mask=n_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)
        best = tl.full([TILE_BLOCKS], float("-inf"), tl.float32)
        for g in tl.static_range(GROUP):
            q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g) * stride_qh + q_d * stride_qd, mask=e_mask, other=0.0)
            q = _rounded(q.to(tl.float32), score_dtype)  # the reference casts q to the digests' dtype
            both = tl.where(offs_e < HEAD_DIM, q, tl.abs(q)) * 0.5
            best = tl.maximum(best, tl.sum(tile * both[None, :], axis=1))
        tl.store(scores_row + n, _rounded(best, score_dtype).to(score_dtype), mask=n_mask)
    tl.debug_barrier()  # the row is read back below by other threads of this program

    # ---- 2. top k: k rounds of max-and-retire over the packed (score key, lane) of the whole row
    offs_n = tl.arange(0, BLOCK_NB)
    n_mask = offs_n < num_blocks
    score = tl.load(scores_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    blocked = tl.load(blocked_ptr + b * stride_xb + h * stride_xh + offs_n * stride_xn, mask=n_mask, other=1)
    score = tl.where(blocked != 0, float("-inf"), score)
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order = float order (-0.0 just below +0.0)
    key = tl.where(n_mask, key, RETIRED)
    offs_k = tl.arange(0, K_PAD)
    k_mask = offs_k < k
    ids = tl.zeros([K_PAD], tl.int64)
    for i in range(k):
        top = tl.max(key, axis=0)
        lane = tl.min(tl.where(key == top, offs_n, BLOCK_NB), axis=0)  # ties: the lower lane wins
        ids = tl.where(offs_k == i, lane.to(tl.int64), ids)
        key = tl.where(offs_n == lane, RETIRED, key)

    # ---- 3. the split: residency and readiness of each selection, CPU first (stable), pending, victims, counts
    count = tl.load(count_ptr + b * stride_cb + h * stride_ch)
    valid = k_mask & (offs_k < count)
    slot = tl.load(block_slot_ptr + b * stride_tb + h * stride_th + tl.minimum(ids, max_blocks) * stride_tn,
                   mask=k_mask, other=-1)
    resident = valid & (slot >= 0)
    ready = tl.load(slot_ready_ptr + b * stride_rb + h * stride_rh + tl.where(resident, slot, num_slots) * stride_rs,
                    mask=k_mask, other=0) != 0
    on_device = resident & ready
    pending = resident & ~ready
    on_cpu = valid & ~on_device
    cpu = on_cpu.to(tl.int32)
    device = (k_mask & ~on_cpu).to(tl.int32)
    n_cpu = tl.sum(cpu, axis=0)
    position = tl.where(on_cpu, tl.cumsum(cpu, axis=0) - cpu, n_cpu + tl.cumsum(device, axis=0) - device)
    data_row = data_ptr + b * stride_ob + h * stride_oh
    tl.store(data_row + position, ids, mask=k_mask)
    tl.store(data_row + k + position, pending.to(tl.int64), mask=k_mask)

    # ---- 4. pool use (a comparison of each slot with the selections on the device) and n_resident
    device_slot = tl.where(on_device, slot, -1)
    offs_s = tl.arange(0, SLOT_TILE)
    pool_row = pool_use_ptr + b * stride_pb + h * stride_ph
    slot_block_row = slot_block_ptr + b * stride_sb + h * stride_sh
    n_resident = tl.zeros([SLOT_TILE], tl.int64)
    for slot_start in range(0, num_slots, SLOT_TILE):
        s = slot_start + offs_s
        s_mask = s < num_slots
        used = tl.max((device_slot[None, :] == s[:, None]).to(tl.int8), axis=1)
        tl.store(pool_row + s, used, mask=s_mask)
        holder = tl.load(slot_block_row + s * stride_ss, mask=s_mask, other=-1)
        n_resident += (holder >= 0).to(tl.int64)

    # ---- 5. the recall's eviction order (`eviction.eviction_order`): free slots first, then the resident blocks
    # not selected whose copy has landed, lowest score first, ties to the lower slot; its first k and how many of
    # them a recall may fill
    victims = tl.zeros([K_PAD], tl.int64)
    n_available = tl.sum(victims, axis=0)  # 0
    if WITH_VICTIMS:
        offs_v = tl.arange(0, S_PAD)
        v_mask = offs_v < num_slots
        holder = tl.load(slot_block_row + offs_v * stride_ss, mask=v_mask, other=-1)
        held = holder >= 0
        slot_ready_row = slot_ready_ptr + b * stride_rb + h * stride_rh
        landed = tl.load(slot_ready_row + offs_v * stride_rs, mask=v_mask, other=0) != 0
        selected_ids = tl.where(valid, ids, -1)
        # a slot holds a selected block: one selection at a time (a [S_PAD, K_PAD] comparison spilled on sm_90)
        in_selection = offs_v < 0
        for i in range(k):
            selected = tl.sum(tl.where(offs_k == i, selected_ids, 0), axis=0)
            in_selection = in_selection | (holder == selected)
        evictable = held & ~in_selection & landed
        held_score = tl.load(scores_row + tl.maximum(tl.minimum(holder, num_blocks - 1), 0), mask=held,
                             other=0.0).to(tl.float32)
        order_key = tl.where(held, tl.where(evictable, held_score, float("inf")), float("-inf"))
        n_available = tl.minimum(tl.sum((v_mask & (order_key < float("inf"))).to(tl.int64), axis=0), k)
        bits = order_key.to(tl.int32, bitcast=True)
        order_bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        packed_slots = tl.where(v_mask, (order_bits.to(tl.int64) << 32) | offs_v.to(tl.int64), EVICTED)
        for i in range(k):  # k rounds of min-and-retire: ascending key, ties to the lower slot
            low = tl.min(packed_slots, axis=0)
            victim = low & 0x7FFFFFFF
            victims = tl.where(offs_k == i, victim, victims)
            packed_slots = tl.where(offs_v == victim, EVICTED, packed_slots)
    tl.store(data_row + 2 * k + offs_k, victims, mask=k_mask)

    counts = tl.where(offs_k == 0, n_cpu.to(tl.int64), 0)
    counts = tl.where(offs_k == 1, tl.sum(valid.to(tl.int64), axis=0), counts)
    counts = tl.where(offs_k == 2, n_available, counts)
    counts = tl.where(offs_k == 3, tl.sum(n_resident, axis=0), counts)
    tl.store(data_row + 3 * k + offs_k, counts, mask=offs_k < 4)


def select_and_split(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor, count: torch.Tensor,
                     block_slot: torch.Tensor, slot_ready: torch.Tensor, slot_block: torch.Tensor, with_victims: bool,
                     data: torch.Tensor, pool_use: torch.Tensor) -> torch.Tensor:
    """`torch.ops.scoutbench.select_split` in one launch (see the module docstring and the op's contract), into
    `data` and `pool_use`. Returns the scores it computed `[B, Hkv, nB]` (its scratch; the tests read it)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks = digests.shape[1], digests.shape[2]
    num_slots, max_blocks = slot_ready.shape[-1] - 1, block_slot.shape[-1] - 1
    k = (data.shape[-1] - NUM_COUNTS) // 3
    if digests.shape[-1] != 2 * head_dim or num_heads % num_kv_heads:
        raise ValueError(f"select_and_split: digests {tuple(digests.shape)} do not fit q {tuple(q.shape)}")
    if not 0 <= k <= num_blocks:
        raise ValueError(f"select_and_split: k={k} must be in [0, {num_blocks}] (the row's blocks)")
    if with_victims and k > num_slots:
        raise ValueError(f"select_and_split: an eviction order of k={k} slots needs a pool of at least k (S={num_slots})")
    if num_blocks > MAX_BLOCKS:
        raise ValueError(f"select_and_split: {num_blocks} blocks per row; the Triton kernel holds at most {MAX_BLOCKS}")
    if data.stride(-1) != 1 or pool_use.stride(-1) != 1:
        raise ValueError("select_and_split: data and pool_use must be contiguous in their last dimension")
    with_victims = with_victims and k > 0  # (an order of 0 slots and n_available 0 are what is written anyway)
    scores = torch.empty((batch, num_kv_heads, num_blocks), dtype=digests.dtype, device=q.device)
    if batch * num_kv_heads == 0:
        return scores
    block_2d = triton.next_power_of_2(2 * head_dim)
    block_nb = triton.next_power_of_2(max(num_blocks, 1))
    k_pad = max(NUM_COUNTS, triton.next_power_of_2(max(k, 1)))
    # one program per row, its row held in registers: as many warps as the row needs, and every register of the
    # SM for them where 8 or more share it (ptxas otherwise kept 8 warps to 128 registers each and spilled, triton
    # 3.9 at a budget of 4096; docs/gpu.md)
    num_warps = 4 if block_nb <= 2048 else 8 if block_nb <= 8192 else 16
    # a head dim of 1 broadcasts (CandidateBlocks' shared mask and count): stride 0
    blocked_strides = (blocked.stride(0), blocked.stride(1) if blocked.shape[1] > 1 else 0, blocked.stride(2))
    count_strides = (count.stride(0), count.stride(1) if count.shape[1] > 1 else 0)
    _select_split_kernel[(batch * num_kv_heads,)](
        q, digests, blocked.view(torch.uint8), count, block_slot, slot_ready.view(torch.uint8), slot_block,
        data, pool_use.view(torch.uint8), scores,
        k, num_blocks, max_blocks, num_slots,
        *q.stride(), *digests.stride(), *blocked_strides, *count_strides,
        *block_slot.stride(), *slot_ready.stride(), *slot_block.stride(),
        *data.stride()[:2], *pool_use.stride()[:2], *scores.stride()[:2],
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_2D=block_2d, TILE_BLOCKS=max(1, TILE_ELEMENTS // block_2d), BLOCK_NB=block_nb, K_PAD=k_pad,
        SLOT_TILE=max(1, min(triton.next_power_of_2(max(num_slots, 1)), SLOT_TILE_ELEMENTS // k_pad)),
        WITH_VICTIMS=with_victims, S_PAD=triton.next_power_of_2(max(num_slots, 1)),
        num_warps=num_warps, maxnreg=min(255, REGISTERS_PER_SM // (32 * num_warps)) if num_warps >= 8 else None,
    )
    return scores
