"""Inputs shared by the kernel tests (tests/kernels/test_partial_state.py, tests/kernels/test_attention.py), and the CPU kernel
library's vector paths that its parity tests run on."""

import torch

from scoutbench.kernels import cpu_attention

ATOL = 1e-5


def qkv(batch=2, heads=8, kv_heads=2, n=50, dim=16, seed=0):
    """Random q `[B, H, D]` and k, v `[B, Hkv, n, D]`, fp32, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, n, dim, generator=g)
    v = torch.randn(batch, kv_heads, n, dim, generator=g)
    return q, k, v


def native_paths() -> list[str]:
    """`cpu_backend` params of the compiled kernel on every vector path this CPU runs: `native` (the widest, as a run
    builds it), then `native:<path>` for each narrower one (an AVX-512 machine also runs the AVX2 path and the
    portable loop), so that a path no CI machine takes by itself is still checked against the references."""
    return ["native", *(f"native:{path}" for path in cpu_attention.runnable_isa_paths()[1:])]
