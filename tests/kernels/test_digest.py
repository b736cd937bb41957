"""Quest digests, their upper-bound scores and top-k selection (kernels/digest.py, kernels/digest_native.py,
runtime/digest_table.py): Q1-Q4, each named by its test, the compiled scoring and selection against torch's, and
the CUDA digest form's rounding."""

import pytest
import torch
from kernel_inputs import native_paths

from scoutbench.kernels.digest import block_digests, select_top_blocks, upper_bound_scores


def _exact_bound(q, digests):
    """fp64 `0.5 * max over the group of [q | |q|] . digest`, q rounded to the digests' dtype first (as every scoring
    path casts it): `[B, Hkv, nB]`."""
    batch, heads, dim = q.shape
    q4 = q.to(digests.dtype).double().view(batch, digests.shape[1], heads // digests.shape[1], dim)
    return 0.5 * (digests.double() @ torch.cat([q4, q4.abs()], dim=-1).transpose(-1, -2)).amax(dim=-1)


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("digest_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "q16"])
@pytest.mark.parametrize("group,dim", [(1, 32), (3, 32), (4, 32), (4, 24), (4, 128)])
def test_digest_kernel_is_the_bound(cpu_backend, digest_dtype, q_dtype, group, dim):
    """The compiled digest scoring (digest_native) on a prefix of a digest table equals the bound computed exactly,
    within fp32 summation: at GQA group 4 (the vector paths' four- and one-block passes, with the prefetch and
    without near a row's end; head_dim 24 keeps bf16 off them, its 48-element rows not whole lines) and others (the
    portable loop), on every vector path this CPU runs; its top-k is its own scores' top-k."""
    from scoutbench.kernels import digest_native
    from scoutbench.kernels.digest import bound_from_digests

    g = torch.Generator().manual_seed(group * 1000 + dim)
    table = torch.randn(2, 3, 70, 2 * dim, generator=g).to(digest_dtype)
    digests, q = table[:, :, :61], torch.randn(2, 3 * group, dim, generator=g).to(q_dtype)
    assert digest_native.supports(q, digests)
    scores = bound_from_digests(q, digests)
    exact = _exact_bound(q, digests)
    torch.testing.assert_close(scores.double(), exact, atol=2e-6 * exact.abs().max().item(), rtol=0)
    ids, top_scores = digest_native.top_blocks(q, digests, torch.zeros(1, 1, 61, dtype=torch.bool), 7)
    assert torch.equal(top_scores, scores) and torch.equal(ids, torch.topk(scores, 7, dim=-1).indices)


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("k", [1, 64, 300])
def test_digest_top_k_breaks_ties_by_the_lower_block(cpu_backend, k):
    """Equal scores (a row of equal digests; another with five distinct ones) go to the lower block (a stable sort
    of the masked scores; `torch.topk` leaves ties in any order), over 1000 blocks, k below and past the first cut
    of the kernel's kept candidates and past the candidates."""
    from scoutbench.kernels import digest_native
    from scoutbench.kernels.digest import CandidateBlocks

    g = torch.Generator().manual_seed(k)
    digests = torch.zeros(1, 2, 1000, 256)
    digests[0, 1] = torch.randint(0, 5, (1000, 1), generator=g).float() * torch.ones(256)  # five distinct scores
    q = torch.rand(1, 8, 128, generator=g)
    excluded = torch.rand(1, 1, 1000, generator=g) < 0.1
    candidates = CandidateBlocks.build(1000, torch.tensor([900]), k, excluded, torch.device("cpu"))
    ids, scores = digest_native.top_blocks(q, digests, candidates.blocked, candidates.k)
    count = int(candidates.count[0, 0])
    stable = torch.sort(scores.masked_fill(candidates.blocked, float("-inf")), descending=True, stable=True).indices
    assert torch.equal(ids[..., :count], stable[..., :count])
    allowed = torch.arange(900)[~excluded[0, 0, :900]]
    assert ids[0, 0, :count].tolist() == allowed[:count].tolist()


@pytest.mark.parametrize("cpu_backend", [*native_paths(), "torch"], indirect=True)
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
