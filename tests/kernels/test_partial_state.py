"""Invariants of the exact LSE merge of partial attention states (kernels/partial_state.py), M1-M5, each named by its
test: a merge of parts equals dense attention, in any order and grouping, with empty parts, in base 2 and natural
log, on the compiled merge, torch's CPU path and (emulated) CUDA."""

import contextlib
import math

import pytest
import torch
from kernel_inputs import ATOL, qkv

from scoutbench.kernels.attention import decode_attention, partial_attention
from scoutbench.kernels.partial_state import (
    PartialState,
    empty_state,
    lse_base2_to_natural,
    lse_natural_to_base2,
    merge_states,
)


def _logits(q, k, scale):
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    q4 = q.view(batch, kv_heads, heads // kv_heads, dim)
    return (q4 @ k.transpose(-1, -2)).reshape(batch, heads, -1) * scale  # [B, Hq, N]


def _random_partition(n, parts, g):
    labels = torch.randint(0, parts, (n,), generator=g)
    return [torch.nonzero(labels == p).flatten() for p in range(parts)]


@pytest.mark.parametrize("cpu_backend", ["native", "torch"], indirect=True)
def test_m1_two_part_merge_equals_dense(cpu_backend):
    """Two parts (a method's device and CPU parts: the compiled merge on the native backend) merge to dense."""
    q, k, v = qkv(seed=11, batch=2)
    parts = [partial_attention(q, k[:, :, s], v[:, :, s], 0.25) for s in (slice(0, 23), slice(23, None))]
    merged = merge_states(*parts)
    torch.testing.assert_close(merged.o, decode_attention(q, k, v, 0.25).float(), atol=ATOL, rtol=0)
    stacked = torch.logsumexp(torch.stack([p.lse for p in parts]), dim=0)
    torch.testing.assert_close(merged.lse, stacked, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_m1_merge_over_random_partition_equals_dense(seed):
    q, k, v = qkv(seed=seed)
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
    q, k, v = qkv(batch=2, n=40)
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
    q, k, v = qkv(n=60)
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
    q, k, v = qkv()
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
    q, k, v = qkv(n=45)
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
    q, k, v = qkv(n=40)
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


def test_m5_merged_lse_is_logsumexp_of_all_logits():
    q, k, v = qkv(n=70)
    scale = 0.31
    parts = [partial_attention(q, k[:, :, s], v[:, :, s], scale) for s in (slice(0, 5), slice(5, 50), slice(50, 70))]
    merged = merge_states(*parts)
    torch.testing.assert_close(merged.lse, torch.logsumexp(_logits(q, k, scale), dim=-1), atol=ATOL, rtol=0)
