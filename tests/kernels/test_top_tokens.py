"""InfiniGen's token speculation through the kernel library (kernels/cpu_attention.py's `top_tokens`,
csrc/top_tokens.cpp) against torch's matmul, mask, group max and topk."""

import pytest
import torch
from kernel_inputs import native_paths


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("channels", [7, 16, 26, 40])
@pytest.mark.parametrize("n", [1, 50, 300])
def test_top_tokens_kernel_is_the_masked_top_n(channels, n, cpu_backend):
    """InfiniGen's speculation kernel: per row, the n tokens below the sequence's length with the highest max-over-
    group partial score (the set torch's matmul, mask, group max and topk pick), ascending, valid ones first when a
    sequence is shorter than n, at channel counts below, at and between the vector width, on every vector path this
    CPU runs."""
    from scoutbench.kernels import cpu_attention

    g = torch.Generator().manual_seed(channels * 1000 + n)
    keys = torch.randn(2, 3, 260, channels, generator=g)
    keys[1, 2] = 0.0  # every score 0: a tie of the whole row, broken by the lower index
    q = torch.randn(2, 3, 4, channels, generator=g)
    lengths = torch.tensor([260, 123])
    assert cpu_attention.takes_top_tokens(q, keys)
    ids = cpu_attention.top_tokens(q, keys, lengths, n)
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
