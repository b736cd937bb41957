"""The Triton select-and-split kernel (`triton_select`, `torch.ops.scoutbench.select_split` on CUDA) against the
torch reference `fused_ops.select_and_split_reference`, run on CPU through the Triton interpreter. Skipped when
triton is not installed; `SCOUTBENCH_REQUIRE_TRITON=1` (`nox -s triton`) makes a missing triton a failure.

How the checks run in the interpreter (a child pytest): tests/triton_interpreter.py. The kernel has no `tl.dot`
(the interpreter's bf16 dot is wrong), so bf16 digests are checked here too, with checks that ties allow.

The contract leaves some entries unspecified, and the checks compare only what it specifies: per row, the first
n_selected ids and pending flags (in order: the scores of the selectable blocks are distinct), the victims (0, or
the eviction order where asked), the counts, the pool slots in use and the scores.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import child_run_test, interpreted, kernel_module

from scoutbench.kernels.digest import rank_from_digests
from scoutbench.kernels.fused_ops import NUM_COUNTS, select_and_split_reference

triton_select = kernel_module("scoutbench.kernels.triton_select")


test_kernel_checks_in_triton_interpreter = child_run_test(__file__)


def _candidates(batch, num_kv_heads, num_blocks, k, sink, valid_blocks, per_head, generator):
    """CandidateBlocks' form: blocked = the sink prefix, the blocks past each sequence's valid count and (per
    head) a few random exclusions; count = min(k, selectable blocks), so short rows have count < k."""
    index = torch.arange(num_blocks)
    blocked = (index < sink) | (index >= torch.tensor(valid_blocks)[:, None, None])  # [B, 1, nB]
    if per_head:
        blocked = blocked | (torch.rand(batch, num_kv_heads, num_blocks, generator=generator) < 0.2)
    count = (num_blocks - blocked.sum(-1)).clamp(max=k)
    return blocked, count


def _table(batch, num_kv_heads, num_blocks, table_blocks, num_slots, resident, generator):
    """A BlockTable's tensors: up to `resident` random blocks of each row in random slots (the other slots free),
    each slot ready or in flight at random; the trash columns -1 / not ready."""
    block_slot = torch.full((batch, num_kv_heads, table_blocks + 1), -1, dtype=torch.long)
    slot_block = torch.full((batch, num_kv_heads, num_slots + 1), -1, dtype=torch.long)
    slot_ready = torch.zeros((batch, num_kv_heads, num_slots + 1), dtype=torch.bool)
    for b in range(batch):
        for h in range(num_kv_heads):
            held = min(resident, num_slots, table_blocks)
            blocks = torch.randperm(table_blocks, generator=generator)[:held]
            slots = torch.randperm(num_slots, generator=generator)[:held]
            block_slot[b, h, blocks] = slots
            slot_block[b, h, slots] = blocks
            slot_ready[b, h, slots] = torch.rand(held, generator=generator) < 0.6
    return block_slot, slot_ready, slot_block


def _inputs(batch, group, num_kv_heads, head_dim, num_blocks, k, *, sink=1, valid_blocks=None, per_head=False,
            table_blocks=None, num_slots=16, resident=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    # strided views: q a slice of its head dim, digests a slice of a longer table, the block table's columns
    q = torch.randn(batch, num_heads, head_dim + 3, generator=generator)[..., :head_dim]
    digests = torch.randn(batch, num_kv_heads, num_blocks + 5, 2 * head_dim, generator=generator)[:, :, :num_blocks]
    valid_blocks = valid_blocks or [num_blocks] * batch
    blocked, count = _candidates(batch, num_kv_heads, num_blocks, k, sink, valid_blocks, per_head, generator)
    table_blocks = num_blocks if table_blocks is None else table_blocks
    table = _table(batch, num_kv_heads, num_blocks, table_blocks, num_slots, resident, generator)
    return q, digests, blocked, count, k, *table


def _reference(inputs, with_victims=False):
    """(data, pool_use, scores) of the torch reference for `_inputs`' inputs."""
    return (*select_and_split_reference(*inputs, with_victims), rank_from_digests(inputs[0], inputs[1]))


def _kernel(inputs, with_victims=False):
    """(data, pool_use, scores) of the kernel, into fresh plan buffers (filled with a poison it must overwrite)."""
    q, digests, _, _, k, block_slot, slot_ready, slot_block = inputs
    batch, num_kv_heads = digests.shape[:2]
    data = torch.full((batch, num_kv_heads, 3 * k + NUM_COUNTS), -7, dtype=torch.long)
    pool_use = torch.ones((batch, num_kv_heads, slot_ready.shape[-1] - 1), dtype=torch.bool)
    scores = triton_select.select_and_split(q, digests, inputs[2], inputs[3], block_slot, slot_ready, slot_block,
                                            with_victims, data, pool_use)
    return data, pool_use, scores


def _assert_matches(out, reference, k, score_atol=1e-5, with_victims=False):
    data, pool_use, scores = out
    want_data, want_pool, want_scores = reference
    assert data.shape == want_data.shape and data.dtype == torch.long
    assert pool_use.shape == want_pool.shape and pool_use.dtype == torch.bool
    assert scores.shape == want_scores.shape and scores.dtype == want_scores.dtype
    torch.testing.assert_close(scores, want_scores, atol=score_atol, rtol=0)
    assert torch.equal(data[..., 3 * k:], want_data[..., 3 * k:]), (data[..., 3 * k:], want_data[..., 3 * k:])
    if with_victims:  # the eviction order, whole: free slots, then the evictable by score, then the rest
        assert torch.equal(data[..., 2 * k:3 * k], want_data[..., 2 * k:3 * k])
    else:
        assert not data[..., 2 * k:3 * k].any()  # no victims
    assert torch.equal(pool_use, want_pool)
    for b in range(data.shape[0]):
        for h in range(data.shape[1]):
            n = int(want_data[b, h, 3 * k + 1])
            assert torch.equal(data[b, h, :n], want_data[b, h, :n]), (b, h, data[b, h, :n], want_data[b, h, :n])
            assert torch.equal(data[b, h, k:k + n], want_data[b, h, k:k + n]), (b, h)


def _check(inputs, score_atol=1e-5, with_victims=False):
    k = inputs[4]
    reference = _reference(inputs, with_victims)
    out = _kernel(inputs, with_victims)
    _assert_matches(out, reference, k, score_atol, with_victims)
    return out, reference


CASES = {
    # name: (batch, group, num_kv_heads, head_dim, num_blocks, k, keyword arguments)
    "mha_one_row": (1, 1, 1, 16, 37, 1, {}),
    "gqa2_batch3_ragged": (3, 2, 2, 16, 53, 9, {"valid_blocks": [53, 20, 6], "sink": 2}),
    "group5_per_head_mask": (1, 5, 2, 40, 70, 23, {"per_head": True}),
    "large_k_pool_full": (3, 2, 2, 8, 97, 60, {"valid_blocks": [97, 50, 61], "num_slots": 24, "resident": 24}),
    "several_tiles": (2, 2, 2, 64, 150, 40, {"valid_blocks": [150, 99], "num_slots": 200, "resident": 120}),
    "table_shorter_than_row": (2, 2, 2, 16, 45, 12, {"table_blocks": 30, "resident": 20}),
    "table_longer_than_row": (2, 1, 3, 16, 45, 12, {"table_blocks": 64, "resident": 40}),
    "empty_pool": (2, 2, 2, 16, 33, 8, {"resident": 0}),
    "no_pool_slots": (1, 2, 2, 16, 33, 8, {"num_slots": 0, "resident": 0}),
}


@interpreted
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_fp32(name):
    batch, group, num_kv_heads, head_dim, num_blocks, k, kwargs = CASES[name]
    inputs = _inputs(batch, group, num_kv_heads, head_dim, num_blocks, k, **kwargs)
    (data, _, _), (want, want_pool, _) = _check(inputs)
    if name == "gqa2_batch3_ragged":  # the inputs reach what they are for
        counts = want[..., 3 * k:]
        assert (counts[..., 1] < k).any() and (counts[..., 0] < counts[..., 1]).any()  # padding; on device
        assert want[..., k:2 * k].any() and want_pool.any()  # pending; pool use


@interpreted
@pytest.mark.parametrize("name", [name for name, case in CASES.items()  # a pool of at least k slots, and a table
                                  if case[6].get("num_slots", 16) >= case[5]  # over every block (the store's)
                                  and case[6].get("table_blocks", case[4]) >= case[4]])
def test_kernel_eviction_order_matches_reference(name):
    """with_victims: the recall's eviction order (free slots first, then the resident blocks not selected whose copy
    has landed, lowest score first, ties to the lower slot) and how many a recall may fill, as the reference."""
    batch, group, num_kv_heads, head_dim, num_blocks, k, kwargs = CASES[name]
    inputs = _inputs(batch, group, num_kv_heads, head_dim, num_blocks, k, **{**kwargs, "seed": 3})
    (data, _, _), _ = _check(inputs, with_victims=True)
    if name == "several_tiles":  # the inputs reach what they are for: free and evictable slots, a partial order
        assert (data[..., 3 * k + 2] > 0).all() and (data[..., 3 * k + 2] <= k).all()


@interpreted
def test_kernel_counts_and_split_cover_every_kind():
    """One row with selections of all three kinds: resident and ready (device), resident and in flight (pending,
    on the CPU), not resident (CPU); the CPU ones first in score order, then the device ones."""
    inputs = list(_inputs(1, 2, 1, 8, 20, 6, sink=0, num_slots=8, resident=0, seed=4))
    scores = rank_from_digests(inputs[0], inputs[1])
    top = scores[0, 0].argsort(descending=True)[:6]
    block_slot, slot_ready, slot_block = inputs[5:]
    for slot, (block, ready) in enumerate(zip(top[[0, 2, 3, 5]].tolist(), [True, False, True, False], strict=True)):
        block_slot[0, 0, block], slot_block[0, 0, slot], slot_ready[0, 0, slot] = slot, block, ready
    data, pool_use, _ = _check(inputs)[0]
    assert data[0, 0, :6].tolist() == top[[1, 2, 4, 5, 0, 3]].tolist()  # CPU: 1, 4 not resident, 2, 5 pending
    assert data[0, 0, 6:12].tolist() == [0, 1, 0, 1, 0, 0]
    assert data[0, 0, 18:].tolist() == [4, 6, 0, 4]
    assert pool_use[0, 0].tolist() == [True, False, True, False, False, False, False, False]


@interpreted
def test_kernel_zero_k_and_broadcast_count():
    inputs = _inputs(2, 2, 2, 16, 10, 0)
    data, pool_use, _ = _check(inputs)[0]
    assert data.shape == (2, 2, NUM_COUNTS)


def _assert_valid_selection(out, reference, inputs):
    """Tie-proof checks for bf16, whose rounded scores tie: each row's first n_selected ids are a top n of the
    kernel's own masked scores, CPU ones first, split by the block table; pool use and counts follow."""
    data, pool_use, scores = out
    _, blocked, count, k, block_slot, slot_ready, _ = inputs[1:]
    assert torch.equal(data[..., 3 * k + 1:], reference[0][..., 3 * k + 1:])  # n_cpu depends on the ties
    assert not data[..., 2 * k:3 * k].any()
    masked = scores.float().masked_fill(blocked, float("-inf"))
    num_slots = pool_use.shape[-1]
    for b in range(data.shape[0]):
        for h in range(data.shape[1]):
            n_cpu, n = int(data[b, h, 3 * k]), int(data[b, h, 3 * k + 1])
            assert n == int(count[b, min(h, count.shape[1] - 1)])
            ids = data[b, h, :n]
            assert ids.unique().numel() == n
            want = masked[b, h].topk(n).values
            assert torch.equal(masked[b, h, ids].sort(descending=True).values, want)
            for group in (ids[:n_cpu], ids[n_cpu:]):  # each group in descending score order
                assert torch.equal(masked[b, h, group], masked[b, h, group].sort(descending=True).values)
            slot = block_slot[b, h, ids.clamp(max=block_slot.shape[-1] - 1)]
            ready = (slot >= 0) & slot_ready[b, h, slot.clamp(min=0)]
            assert not ready[:n_cpu].any() and ready[n_cpu:].all()
            assert torch.equal(data[b, h, k:k + n].bool(), (slot >= 0) & ~ready)
            used = torch.zeros(num_slots + 1, dtype=torch.bool).index_fill_(0, slot[n_cpu:], True)[:num_slots]
            assert torch.equal(pool_use[b, h], used)


@interpreted
@pytest.mark.parametrize(("q_dtype", "digest_dtype"), [(torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.bfloat16),
                                                       (torch.float32, torch.float16)])
def test_kernel_half_precision_digests(q_dtype, digest_dtype):
    """bf16 digests (CUDA's case; q is cast to them): the scores are the fp32 sums rounded once to nearest, as a
    GPU matmul's (the CPU's bf16 matmul rounds on the way, a few ulps off), and the selection and split are right
    for the kernel's own scores."""
    inputs = list(_inputs(2, 4, 2, 16, 50, 10, valid_blocks=[50, 30], num_slots=8, resident=8, seed=7))
    inputs[0], inputs[1] = inputs[0].to(q_dtype), inputs[1].to(digest_dtype)
    reference = _reference(inputs)
    out = _kernel(inputs)
    assert out[2].dtype == digest_dtype
    q_rounded = inputs[0].to(digest_dtype).float()
    fp32_sums = rank_from_digests(q_rounded, inputs[1].float()).to(digest_dtype)
    torch.testing.assert_close(out[2].float(), fp32_sums.float(), atol=1e-5, rtol=2**-7)  # an ulp: sum order
    torch.testing.assert_close(out[2].float(), reference[2].float(), atol=2**-4, rtol=2**-6)
    _assert_valid_selection(out, reference, inputs)


@interpreted
def test_too_many_blocks_is_a_clear_error():
    inputs = _inputs(1, 1, 1, 4, triton_select.MAX_BLOCKS + 1, 4, resident=0)
    with pytest.raises(ValueError, match="blocks per row"):
        _kernel(inputs)
    with pytest.raises(ValueError, match="a pool of at least k"):
        _kernel(_inputs(1, 1, 1, 4, 40, 20, num_slots=8, resident=0), with_victims=True)
