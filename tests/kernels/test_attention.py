"""Partial attention (kernels/attention.py) against its references: a step's lengths read from `StepLengths` on every
path, and the device-region kernel over the open tokens of its slots."""

import contextlib

import pytest
import torch
from kernel_inputs import ATOL, qkv

from scoutbench.kernels.attention import partial_attention, region_attention


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
    q, k, v = qkv(batch=3, n=64, seed=5)
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


def test_region_attention_matches_partial_over_the_open_tokens(cpu_backend):
    """The device-region kernel (a prefix of each slot open, at most one slot per row partly) equals
    partial_attention over the open keys, on both CPU backends (the kernel reads the open slots by id, torch masks
    the whole region)."""
    block, slots = 4, 8
    q, k, v = qkv(batch=2, n=block * slots)
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
