"""Invariants of the shared kernels (M1-M5 for the merge, Q1-Q4 for the digests, each named by its test): partial
attention and the exact LSE merge, Quest digests, upper-bound scores and top-k selection; plus ScoutAttention's block
table."""

import contextlib
import math

import pytest
import torch

from scoutbench.kernels.attention import decode_attention, partial_attention, region_attention
from scoutbench.kernels.digest import block_digests, select_top_blocks, upper_bound_scores
from scoutbench.kernels.partial_state import (
    PartialState,
    empty_state,
    lse_base2_to_natural,
    lse_natural_to_base2,
    merge_states,
)
from scoutbench.runtime.block_table import BlockTable

ATOL = 1e-5


def _qkv(batch=2, heads=8, kv_heads=2, n=50, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, n, dim, generator=g)
    v = torch.randn(batch, kv_heads, n, dim, generator=g)
    return q, k, v


def _logits(q, k, scale):
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    q4 = q.view(batch, kv_heads, heads // kv_heads, dim)
    return (q4 @ k.transpose(-1, -2)).reshape(batch, heads, -1) * scale  # [B, Hq, N]


def _random_partition(n, parts, g):
    labels = torch.randint(0, parts, (n,), generator=g)
    return [torch.nonzero(labels == p).flatten() for p in range(parts)]


# ---------------------------------------------------------------------------------------------- merge: M1-M5
@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
def test_m1_two_part_merge_equals_dense(cpu_backend):
    """Two parts (a method's device and CPU parts: the compiled merge on the native backend) merge to dense."""
    q, k, v = _qkv(seed=11, batch=2)
    parts = [partial_attention(q, k[:, :, s], v[:, :, s], 0.25) for s in (slice(0, 23), slice(23, None))]
    merged = merge_states(*parts)
    torch.testing.assert_close(merged.o, decode_attention(q, k, v, 0.25).float(), atol=ATOL, rtol=0)
    stacked = torch.logsumexp(torch.stack([p.lse for p in parts]), dim=0)
    torch.testing.assert_close(merged.lse, stacked, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_m1_merge_over_random_partition_equals_dense(seed):
    q, k, v = _qkv(seed=seed)
    scale = 0.25
    g = torch.Generator().manual_seed(100 + seed)
    parts = int(torch.randint(2, 9, (1,), generator=g))
    index_sets = _random_partition(k.shape[2], parts, g)
    index_sets.append(torch.zeros(0, dtype=torch.long))  # always at least one empty part
    states = [partial_attention(q, k[:, :, idx], v[:, :, idx], scale) for idx in index_sets]
    merged = merge_states(*states)
    dense = decode_attention(q, k, v, scale)
    torch.testing.assert_close(merged.o, dense.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
def test_m1_ragged_valid_len_parts_with_empty_rows(cpu_backend):
    """valid_len rows (some with zero valid keys) merge exactly; an all-invalid row is the empty state."""
    q, k, v = _qkv(batch=2, n=40)
    scale = 0.3
    valid = torch.tensor([[10, 0], [25, 7]])  # [B, Hkv]
    first = partial_attention(q, k[:, :, :30], v[:, :, :30], scale, valid)
    rest = [partial_attention(q, k[:, :, 30:], v[:, :, 30:], scale)]
    # reference: keys [0, valid) of each row plus keys [30, 40)
    for b in range(2):
        for h in range(2):
            keep = torch.cat([torch.arange(int(valid[b, h])), torch.arange(30, 40)])
            qs = q[b:b + 1, h * 4:(h + 1) * 4]
            ref = decode_attention(qs, k[b:b + 1, h:h + 1, keep], v[b:b + 1, h:h + 1, keep], scale)
            merged = merge_states(PartialState(first.o[b:b + 1, h * 4:(h + 1) * 4],
                                               first.lse[b:b + 1, h * 4:(h + 1) * 4]),
                                  PartialState(rest[0].o[b:b + 1, h * 4:(h + 1) * 4],
                                               rest[0].lse[b:b + 1, h * 4:(h + 1) * 4]))
            torch.testing.assert_close(merged.o, ref, atol=ATOL, rtol=0)
    empty_row = first.lse[0, 4:8]
    assert torch.isinf(empty_row).all() and (empty_row < 0).all()
    assert (first.o[0, 4:8] == 0).all()


@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
def test_m2_merge_is_order_independent_and_associative(cpu_backend):
    q, k, v = _qkv(n=60)
    scale = 0.2
    a, b, c = (partial_attention(q, k[:, :, s], v[:, :, s], scale)
               for s in (slice(0, 13), slice(13, 41), slice(41, 60)))
    flat = merge_states(a, b, c)
    for other in (merge_states(c, a, b), merge_states(merge_states(a, b), c), merge_states(a, merge_states(b, c)),
                  merge_states(merge_states(c, b), a)):
        torch.testing.assert_close(other.o, flat.o, atol=ATOL, rtol=0)
        torch.testing.assert_close(other.lse, flat.lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
def test_m3_empty_parts(cpu_backend):
    q, k, v = _qkv()
    state = partial_attention(q, k, v, 0.3)
    empty = empty_state(*q.shape, q.device)
    merged = merge_states(state, empty)
    torch.testing.assert_close(merged.o, state.o, atol=0, rtol=0)
    torch.testing.assert_close(merged.lse, state.lse, atol=0, rtol=0)
    none = merge_states(empty, empty_state(*q.shape, q.device))
    assert not torch.isnan(none.o).any() and not torch.isnan(none.lse).any()
    assert (none.o == 0).all() and torch.isneginf(none.lse).all()
    # a zero-key partial attention is the empty state too
    zero = partial_attention(q, k[:, :, :0], v[:, :, :0], 0.3)
    assert (zero.o == 0).all() and torch.isneginf(zero.lse).all()


def _merge_base2(states_base2):
    """FlashInfer's merge: LSEs in base 2, weights with exp2 (reference implementation for M4)."""
    lses = torch.stack([s for _, s in states_base2])
    top = lses.max(dim=0).values
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp2(lses - safe)
    total = weights.sum(0)
    out = sum(w.unsqueeze(-1) * o for w, (o, _) in zip(weights, states_base2, strict=False)) / total.clamp(min=1e-30).unsqueeze(-1)
    return out, safe + torch.log2(total)


def test_m4_base2_natural_round_trip():
    q, k, v = _qkv(n=45)
    parts = [partial_attention(q, k[:, :, s], v[:, :, s], 0.27) for s in (slice(0, 20), slice(20, 45))]
    natural = merge_states(*parts)
    out2, lse2 = _merge_base2([(p.o, lse_natural_to_base2(p.lse)) for p in parts])
    torch.testing.assert_close(out2, natural.o, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse_base2_to_natural(lse2), natural.lse, atol=ATOL, rtol=0)
    x = torch.randn(100) * 30
    torch.testing.assert_close(lse_base2_to_natural(lse_natural_to_base2(x)), x, atol=1e-5, rtol=1e-6)
    assert lse_natural_to_base2(torch.tensor(1.0)).item() == pytest.approx(1 / math.log(2))


@pytest.mark.parametrize("where", ["native", "torch", "emulated-cuda"])
def test_m3_two_part_merge_with_empty_parts_on_every_path(where, monkeypatch):
    """Two parts, the first or the second or both empty, on the compiled merge, torch's CPU path and (emulated) CUDA:
    `merge_states` and `merged_output` (the output alone) give the non-empty part exactly, and the empty state for
    two empty parts; with none empty they equal the general merge of more parts."""
    from scoutbench.kernels import cpu_attention
    from scoutbench.kernels.partial_state import merged_output
    from scoutbench.testing.emulated_cuda import emulated_cuda

    if where == "emulated-cuda" and torch.cuda.is_available():
        pytest.skip("a real CUDA device is present")
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "torch" if where == "torch" else "native")
    cpu_attention.library.cache_clear()
    q, k, v = _qkv(n=40)
    a, b = (partial_attention(q, k[:, :, s], v[:, :, s], 0.3) for s in (slice(0, 15), slice(15, 40)))
    general = merge_states(a, b, empty_state(*q.shape, q.device))  # three parts: the general form
    device = "cuda" if where == "emulated-cuda" else "cpu"
    try:
        with emulated_cuda() if device == "cuda" else contextlib.nullcontext():
            a, b = (PartialState(s.o.to(device), s.lse.to(device)) for s in (a, b))
            empty = empty_state(*q.shape, device)
            cases = {"both": (a, b), "first empty": (empty, b), "second empty": (a, empty), "none": (empty, empty)}
            got = {name: (merge_states(*parts), merged_output(*parts)) for name, parts in cases.items()}
            got = {name: (PartialState(m.o.cpu(), m.lse.cpu()), o.cpu()) for name, (m, o) in got.items()}
            a, b = (PartialState(s.o.cpu(), s.lse.cpu()) for s in (a, b))
    finally:
        cpu_attention.library.cache_clear()
    for name, exact in (("first empty", b), ("second empty", a)):
        merged, output = got[name]
        assert torch.equal(merged.o, exact.o) and torch.equal(output, exact.o) and torch.equal(merged.lse, exact.lse)
    merged, output = got["none"]
    assert (merged.o == 0).all() and (output == 0).all() and torch.isneginf(merged.lse).all()
    merged, output = got["both"]
    torch.testing.assert_close(merged.o, general.o, atol=ATOL, rtol=0)
    torch.testing.assert_close(output, merged.o, atol=0, rtol=0)
    torch.testing.assert_close(merged.lse, general.lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("where", ["native", "torch", "emulated-cuda"])
@pytest.mark.parametrize("with_host", [True, False])
@pytest.mark.parametrize("lengths", [[37, 0, 50], [21, 21, 21]])  # ragged with an empty row; uniform (exact span)
def test_partial_attention_reads_a_steps_lengths(where, with_host, lengths, monkeypatch):
    """`partial_attention` over a whole preallocated cache with a step's StepLengths (device lengths, the torch
    path's mask, host lengths where kept) equals the call with `valid_len`, on the compiled CPU kernel, torch's CPU
    kernel and (emulated) CUDA's torch path; a row without a valid key is the empty state."""
    from scoutbench.kernels import cpu_attention
    from scoutbench.kernels.attention import StepLengths
    from scoutbench.testing.emulated_cuda import emulated_cuda

    if where == "emulated-cuda" and torch.cuda.is_available():
        pytest.skip("a real CUDA device is present")
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "torch" if where == "torch" else "native")
    cpu_attention.library.cache_clear()
    q, k, v = _qkv(batch=3, n=64, seed=5)
    valid = torch.tensor(lengths)
    expected = partial_attention(q, k, v, 0.3, valid)
    device = torch.device("cuda" if where == "emulated-cuda" else "cpu")
    try:
        with emulated_cuda() if device.type == "cuda" else contextlib.nullcontext():
            step = StepLengths(3, 64, q.dtype, device, with_host=with_host)
            step.update(valid.to(device), lengths)
            got = partial_attention(q.to(device), k.to(device), v.to(device), 0.3, lengths=step)
            o, lse = got.o.cpu(), got.lse.cpu()
    finally:
        cpu_attention.library.cache_clear()
    torch.testing.assert_close(o, expected.o, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, expected.lse, atol=ATOL, rtol=0)
    if 0 in lengths:
        assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_m5_merged_lse_is_logsumexp_of_all_logits():
    q, k, v = _qkv(n=70)
    scale = 0.31
    parts = [partial_attention(q, k[:, :, s], v[:, :, s], scale) for s in (slice(0, 5), slice(5, 50), slice(50, 70))]
    merged = merge_states(*parts)
    torch.testing.assert_close(merged.lse, torch.logsumexp(_logits(q, k, scale), dim=-1), atol=ATOL, rtol=0)


def test_region_attention_matches_partial_over_the_open_tokens(cpu_backend):
    """The device-region kernel (a prefix of each slot open, at most one slot per row partly) equals
    partial_attention over the open keys, on both CPU backends (the kernel reads the open slots by id, torch masks
    the whole region)."""
    block, slots = 4, 8
    q, k, v = _qkv(batch=2, n=block * slots)
    g = torch.Generator().manual_seed(3)
    slot_tokens = torch.where(torch.rand(2, 2, slots, generator=g) < 0.4, block, 0)
    slot_tokens[..., 5] = torch.tensor([[1, 3], [0, 2]])  # the partly open slot (row (1, 0): none)
    slot_tokens[1, 0, 2] = block  # every row attends something
    state = region_attention(q, k, v, 0.25, slot_tokens)
    for b in range(2):
        for h in range(2):
            idx = torch.cat([torch.arange(s * block, s * block + int(n)) for s, n in enumerate(slot_tokens[b, h])])
            ref = partial_attention(q[b:b + 1, h * 4:(h + 1) * 4], k[b:b + 1, h:h + 1, idx], v[b:b + 1, h:h + 1, idx],
                                    0.25)
            torch.testing.assert_close(state.o[b:b + 1, h * 4:(h + 1) * 4], ref.o, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.lse[b:b + 1, h * 4:(h + 1) * 4], ref.lse, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- digests: Q1-Q4
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_digest_kernel_matches_torch_scoring(monkeypatch, group, q_dtype):
    """The compiled digest scoring (digest_native) equals torch's matmul form on a prefix of a digest table, at GQA
    group 4 (its one-pass path) and others (the generic loop); where it is not built the test has nothing to
    compare."""
    from scoutbench.kernels import cpu_attention, digest_native
    from scoutbench.kernels.digest import bound_from_digests

    g = torch.Generator().manual_seed(group)
    table = torch.randn(2, 3, 70, 2 * 32, generator=g)
    digests, q = table[:, :, :61], torch.randn(2, 3 * group, 32, generator=g).to(q_dtype)
    if not digest_native.supports(q, digests):
        pytest.skip("the digest scoring kernel is not built here")
    native = bound_from_digests(q, digests)
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "torch")
    cpu_attention.library.cache_clear()
    try:
        assert not digest_native.supports(q, digests)
        torch.testing.assert_close(native, bound_from_digests(q, digests), atol=1e-5, rtol=1e-6)
    finally:
        cpu_attention.library.cache_clear()


@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
@pytest.mark.parametrize("heads_blocked", [1, 3])
@pytest.mark.parametrize("k", [5, 40, 70])
def test_digest_table_select_is_the_masked_top_k(cpu_backend, heads_blocked, k):
    """`DigestTable.select` (one kernel call on the native backend) returns the scores and, up to each row's count of
    selectable blocks, exactly the ids of `CandidateBlocks.top` over them: descending score, none blocked; the
    blocked mask broadcast over heads (Scout's sinks and positions) or per head, k below, near and above the count."""
    from scoutbench.kernels import digest_native
    from scoutbench.kernels.digest import CandidateBlocks, bound_from_digests
    from scoutbench.runtime.digest_table import DigestTable

    g = torch.Generator().manual_seed(k + heads_blocked)
    table = DigestTable(range(1), (2, 3, 70, 32), torch.float32, torch.device("cpu"))
    table.digests[0].copy_(torch.randn(2, 3, 70, 64, generator=g))
    q = torch.randn(2, 12, 32, generator=g)
    excluded = torch.rand(1, heads_blocked, 61, generator=g) < 0.2
    candidates = CandidateBlocks.build(61, torch.tensor([61, 37]), k, excluded, torch.device("cpu"))
    assert digest_native.supports(q, table.digests[0][:, :, :61]) == (cpu_backend == "native")
    ids, scores = table.select(0, q, candidates)
    ref_scores = bound_from_digests(q, table.digests[0][:, :, :61])
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-6)
    ref_ids = candidates.top(ref_scores)
    count = candidates.count.expand(2, 3)
    assert ids.shape == ref_ids.shape == (2, 3, min(k, 61))
    blocked = candidates.blocked.expand(2, 3, 61)
    for b in range(2):
        for h in range(3):
            n = int(count[b, h])
            assert n == min(k, int((~blocked[b, h]).sum()))
            assert ids[b, h, :n].tolist() == ref_ids[b, h, :n].tolist()
            assert not blocked[b, h, ids[b, h, :n]].any()


@pytest.mark.parametrize("channels", [7, 16, 26, 40])
@pytest.mark.parametrize("n", [1, 50, 300])
def test_top_tokens_kernel_is_the_masked_top_n(channels, n):
    """InfiniGen's speculation kernel: per row, the n tokens below the sequence's length with the highest max-over-
    group partial score (the set torch's matmul, mask, group max and topk pick), ascending, valid ones first when a
    sequence is shorter than n, at channel counts below, at and between the vector width."""
    from scoutbench.kernels import cpu_attention

    g = torch.Generator().manual_seed(channels * 1000 + n)
    keys = torch.randn(2, 3, 260, channels, generator=g)
    keys[1, 2] = 0.0  # every score 0: a tie of the whole row, broken by the lower index
    q = torch.randn(2, 3, 4, channels, generator=g)
    lengths = torch.tensor([260, 123])
    ids = cpu_attention.top_tokens(q, keys, lengths, n)
    if ids is None:
        pytest.skip("the CPU kernel is not built here")
    scores = torch.matmul(q, keys.transpose(-1, -2)).amax(dim=2)  # [B, Hkv, N]
    for b in range(2):
        for h in range(3):
            valid = int(lengths[b])
            take = min(n, valid)
            row = ids[b, h].tolist()
            assert row[:take] == sorted(row[:take]) and all(t < valid for t in row[:take])
            if (b, h) == (1, 2):
                assert row[:take] == list(range(take))
            else:
                assert set(row[:take]) == set(torch.topk(scores[b, h, :valid], take).indices.tolist())
            assert row[take:] == [0] * (n - take)


@pytest.mark.parametrize("block_size", [1, 4, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_q1_upper_bound_holds_for_every_key(block_size, group):
    g = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads, dim, blocks = 2, 16, 6
    keys = torch.randn(3, kv_heads, blocks * block_size, dim, generator=g) * 3
    q = torch.randn(3, kv_heads * group, dim, generator=g) * 2
    kmax, kmin = block_digests(keys, block_size)
    scores = upper_bound_scores(q, kmax, kmin)  # [B, Hkv, nB], group max
    logits = (q.view(3, kv_heads, group, dim) @ keys.transpose(-1, -2))  # [B, Hkv, G, N]
    per_block = logits.view(3, kv_heads, group, blocks, block_size).amax(dim=-1).amax(dim=2)
    assert (scores >= per_block - 1e-4).all()
    # the group max is the max of the per-head bounds (to fp32 rounding: a one-column matmul may sum in another order)
    per_head = torch.stack([upper_bound_scores(q.view(3, kv_heads, group, dim)[:, :, i], kmax, kmin)
                            for i in range(group)])
    torch.testing.assert_close(scores, per_head.amax(0), atol=1e-5, rtol=1e-6)


def test_q1_partial_block_digest_is_an_upper_bound():
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 5, 8, generator=g)  # a partial block of 5 tokens (block size 8)
    q = torch.randn(1, 4, 8, generator=g)
    kmax, kmin = block_digests(keys, 5)
    score = upper_bound_scores(q, kmax, kmin)
    logits = (q.view(1, 2, 2, 8) @ keys.transpose(-1, -2)).amax(-1).amax(-1)
    assert (score[..., 0] >= logits - 1e-5).all()


def test_q2_incremental_digest_equals_recomputed():
    g = torch.Generator().manual_seed(1)
    block_size = 8
    keys = torch.randn(2, 3, 4 * block_size, 16, generator=g)
    kmax, kmin = block_digests(keys, block_size)
    for j in range(4):
        run_max = keys[:, :, j * block_size].clone()
        run_min = run_max.clone()
        for t in range(1, block_size):
            new = keys[:, :, j * block_size + t]
            run_max = torch.maximum(run_max, new)
            run_min = torch.minimum(run_min, new)
        assert torch.equal(run_max, kmax[:, :, j]) and torch.equal(run_min, kmin[:, :, j])


def test_q3_single_token_block_score_is_the_dot_product():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 2, 7, 16, generator=g)
    q = torch.randn(2, 2, 16, generator=g)  # group 1: no aggregation
    kmax, kmin = block_digests(keys, 1)
    scores = upper_bound_scores(q, kmax, kmin)
    dots = torch.einsum("bhd,bhnd->bhn", q, keys)
    torch.testing.assert_close(scores, dots, atol=1e-5, rtol=1e-6)


def test_q4_padding_never_leaks_into_digests_or_selection():
    g = torch.Generator().manual_seed(4)
    block_size, valid_tokens = 4, 10  # two complete blocks and a partial one
    keys = torch.randn(1, 2, 16, 8, generator=g)
    padded = keys.clone()
    padded[:, :, valid_tokens:] = 1e6  # garbage after the valid tokens
    kmax_ref, kmin_ref = block_digests(keys[:, :, :valid_tokens], block_size)
    kmax, kmin = block_digests(padded[:, :, :valid_tokens], block_size)
    assert kmax.shape[2] == valid_tokens // block_size  # no digest for the partial block
    assert torch.equal(kmax, kmax_ref) and torch.equal(kmin, kmin_ref)
    # blocks at or beyond num_valid_blocks, or excluded, are never selected even with the largest scores
    full_max, full_min = block_digests(padded, block_size)
    q = torch.ones(1, 2, 8)
    scores = upper_bound_scores(q, full_max, full_min)
    excluded = torch.tensor([True, False, False, False])[None, None, :]
    ids, count = select_top_blocks(scores, torch.tensor([2]), 3, excluded)
    assert count.expand(1, 2).tolist() == [[1, 1]]
    assert (ids[..., :1] == 1).all()


def test_select_top_blocks_orders_by_score():
    scores = torch.tensor([[[0.1, 5.0, 3.0, 4.0, -1.0]]])
    ids, count = select_top_blocks(scores, torch.tensor([5]), 3)
    assert ids.tolist() == [[[1, 3, 2]]] and count.tolist() == [[3]]


# ---------------------------------------------------------------------------------------------- block table
def test_block_table_split_victims_and_readiness():
    table = BlockTable(batch=1, num_kv_heads=1, num_slots=3, max_blocks=10, device="cpu")
    table.assign(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([4, 7]))
    ids = torch.tensor([[[7, 2, 5]]])
    valid = torch.tensor([[[True, True, False]]])
    on_dev, pending, slot = table.split(ids, valid)
    assert on_dev.tolist() == [[[True, False, False]]] and not pending.any()
    assert slot[0, 0, 0] == 1
    scores = torch.arange(10.0)[None, None, :]
    order, available = table.victims(ids, valid, scores)
    # free slot 2 first, then block 4 (not selected); slot 1 holds the selected block 7
    assert order[0, 0, :2].tolist() == [2, 0] and available.item() == 2

    class Pending:
        done = False

        def query(self):
            return self.done

    event = Pending()
    table.assign(torch.tensor([0]), torch.tensor([2]), torch.tensor([2]), event)
    on_dev, pending, _ = table.split(ids, valid)
    assert on_dev.tolist() == [[[True, False, False]]] and pending.tolist() == [[[False, True, False]]]
    _, available = table.victims(ids, valid, scores)
    assert available.item() == 1  # the in-flight slot is not evictable
    table.poll()
    assert table.pending_copies == 1
    event.done = True
    table.poll()
    on_dev, pending, _ = table.split(ids, valid)
    assert on_dev.tolist() == [[[True, True, False]]] and not pending.any()
    # evicting block 4 from slot 0 makes it host-only
    table.assign(torch.tensor([0]), torch.tensor([0]), torch.tensor([9]))
    assert table.block_slot[0, 0, 4] == -1 and table.block_slot[0, 0, 9] == 0
    assert table.resident_sets() == [[{7, 2, 9}]]


@pytest.mark.parametrize("seed", range(4))
def test_block_table_split_selected_equals_the_torch_split(seed):
    """The one-call split of the CPU kernel library (`split_selected`) gives ScoutAttention's torch path bit for
    bit: `split`, the stable CPU-first order, `SplitPlan.pack` and `slot_mask`, on a table with resident, in-flight
    and host-only blocks, invalid selections and duplicate padding ids."""
    from scoutbench.runtime.block_store import SplitPlan

    g = torch.Generator().manual_seed(seed)
    batch, heads, slots, max_blocks, k = 2, 3, 6, 40, 6
    table = BlockTable(batch=batch, num_kv_heads=heads, num_slots=slots, max_blocks=max_blocks, device="cpu")

    class InFlight:
        def query(self):
            return False

    for row in range(batch * heads):
        blocks = torch.randperm(max_blocks, generator=g)[:5]
        table.assign(torch.full((4,), row), torch.arange(4), blocks[:4])
        table.assign(torch.tensor([row]), torch.tensor([4]), blocks[4:5], InFlight())  # slot 4: copy in flight
    ids = torch.randint(0, max_blocks, (batch, heads, k), generator=g)
    ids[..., -1] = 0  # padding
    ids[..., 1] = table.slot_block[..., 0]  # resident and ready
    ids[..., 3] = table.slot_block[..., 4]  # resident, its copy in flight
    valid = torch.rand(batch, heads, k, generator=g) < 0.8
    valid[..., 1] = valid[..., 3] = True
    victims = torch.randint(0, slots, (batch, heads, k), generator=g)
    available = torch.randint(0, slots, (batch, heads), generator=g)
    fused = table.split_selected(ids, valid, victims, available)
    if fused is None:
        pytest.skip("the CPU kernel is not built here")
    on_dev, pending, slot = table.split(ids, valid)
    on_cpu = valid & ~on_dev
    order = torch.argsort(on_cpu.to(torch.uint8), dim=-1, descending=True, stable=True)
    ref = SplitPlan.pack(ids.gather(-1, order), pending.gather(-1, order), victims, on_cpu.sum(-1), valid.sum(-1),
                         available, table.resident_count())
    assert torch.equal(fused[0], ref.data)
    assert torch.equal(fused[1], table.slot_mask(on_dev, slot))
    assert pending.any() and on_dev.any() and on_cpu.any()  # every case occurred


def test_digest_table_scores_equal_the_bound_kernel():
    """The CPU path's cached fp32 center/radius give the scores of the direct kernel (to fp32 rounding: the BLAS
    may sum differently for differently aligned operands)."""
    from scoutbench.runtime.digest_table import DigestTable

    torch.manual_seed(3)
    keys = torch.randn(2, 2, 40, 8, dtype=torch.bfloat16)
    kmax, kmin = block_digests(keys, 4)
    table = DigestTable(range(1, 3), (2, 2, 16, 8), torch.bfloat16, torch.device("cpu"))
    table.write(2, (slice(None), slice(None), slice(0, 10)), kmax, kmin)
    q = torch.randn(2, 6, 8, dtype=torch.bfloat16)
    assert 2 in table and 0 not in table
    torch.testing.assert_close(table.scores(2, q, 10), upper_bound_scores(q, kmax, kmin), atol=1e-5, rtol=1e-6)
    assert table.device_bytes() == 2 * 2 * (2 * 2 * 16 * 8 * 2)


def test_digest_score_dtype_is_the_kv_dtype_on_cuda_only():
    from scoutbench.runtime.digest_table import digest_score_dtype

    assert digest_score_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert digest_score_dtype(torch.float16, "cuda") == torch.float16
    assert digest_score_dtype(torch.float32, "cuda") == torch.float32
    assert digest_score_dtype(torch.bfloat16, "cpu") == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_center_radius_still_bound_every_key(dtype):
    """The CUDA digest form: center and radius stored in the KV dtype (rounded, radius widened) keep the Quest
    score an upper bound of q . k for every key of every block; plain rounding of both does not."""
    from scoutbench.kernels.digest import center_radius

    torch.manual_seed(5)
    # tight blocks, where the bound is attained: two keys per block, the first the channel-wise max, and positive
    # queries, so the bound equals the first key's logit and any rounding below it shows
    top = torch.randn(4, 2, 2048, 1, 16) * torch.exp(torch.randn(4, 2, 2048, 1, 1))
    keys = torch.cat([top, top - torch.rand(4, 2, 2048, 1, 16)], dim=3).reshape(4, 2, 4096, 16).to(dtype)
    q = torch.rand(4, 6, 16).to(dtype)
    kmax, kmin = block_digests(keys, 2)
    exact_dot = torch.einsum("bhgd,bhnd->bhgn", q.double().view(4, 2, 3, 16), keys.double())
    best = exact_dot.view(4, 2, 3, 2048, 2).amax(-1).amax(2)  # max over the block's keys and the group's heads

    def bound(center, radius):  # evaluated exactly, to isolate the storage rounding
        q4 = q.double().view(4, 2, 3, 16)
        return (0.5 * (q4 @ center.double().transpose(-1, -2) + q4.abs() @ radius.double().transpose(-1, -2))).amax(2)

    center, radius = center_radius(kmax, kmin, dtype)
    assert center.dtype == radius.dtype == dtype
    stored = bound(center, radius)
    assert (stored >= best).all()
    exact_center, exact_radius = center_radius(kmax, kmin, torch.float32)
    magnitude = bound(exact_center.abs(), exact_radius).clamp(min=1e-3)  # |q| . (|c| + r) / 2, q >= 0 here
    assert ((stored - bound(exact_center, exact_radius)) / magnitude).max() < 4 * torch.finfo(dtype).eps  # tight
    plain = bound((kmax.float() + kmin.float()).to(dtype), (kmax.float() - kmin.float()).to(dtype))
    assert (plain < best).any()
