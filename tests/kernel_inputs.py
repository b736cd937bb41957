"""Inputs shared by the kernel tests (tests/test_partial_state.py, tests/test_attention.py)."""

import torch

ATOL = 1e-5


def qkv(batch=2, heads=8, kv_heads=2, n=50, dim=16, seed=0):
    """Random q `[B, H, D]` and k, v `[B, Hkv, n, D]`, fp32, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, n, dim, generator=g)
    v = torch.randn(batch, kv_heads, n, dim, generator=g)
    return q, k, v
