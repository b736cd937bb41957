"""The compiled Quest digest scoring of `digest_scores.cpp` (CPU, fp32), built and cached like `cpu_attention`.

Why: ScoutAttention scores every complete block of a sparse layer once per layer and step (1024 blocks x 8 KV heads
x 2 x 128 fp32 = 8 MB at 32k on bench-attn16). torch's batched matmul with 4 query heads per KV head, then a
group max and a scale, read it at about 0.42 ms per layer on our 2-core machines (0.3 ms is the read itself);
this kernel reads each digest once for the group's four query heads and writes the group max: 0.21-0.35 ms, and one
call where torch made nine. Its sums run in another order than the matmul's, so scores differ in the last bits
(within 1e-5 of ~30 here); the selection is the same but on such near-ties.

It serves the CPU where `cpu_attention` does (`SCOUTBENCH_CPU_ATTENTION` other than `torch`, a compiler at hand);
elsewhere, or when the build fails, `digest.bound_from_digests` uses torch.

`top_blocks` also selects in the same call (`DigestTable.select`): torch's masked top-k of 64 of 1024 blocks per row
took 0.15 ms per layer here, a partial sort of each row's selectable blocks a few microseconds.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import torch

from scoutbench.kernels import cpu_attention

SOURCE = Path(__file__).with_name("digest_scores.cpp")
ABI_VERSION = 2


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (torch forced, or no build: torch then scores, silently, at its own speed).
    Tests clear this cache after changing `SCOUTBENCH_CPU_ATTENTION`."""
    if cpu_attention.requested_backend() == "torch":
        return None
    try:
        lib = cpu_attention.load_kernel(SOURCE)
    except (cpu_attention.NativeUnavailable, OSError, subprocess.SubprocessError):
        return None
    lib.sb_digest_abi_version.restype = ctypes.c_int
    if lib.sb_digest_abi_version() != ABI_VERSION:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sb_digest_scores.restype = ctypes.c_int
    lib.sb_digest_scores.argtypes = [i64, i64, i64, i64, ptr, i64, ptr, ptr]
    lib.sb_digest_top.restype = ctypes.c_int
    lib.sb_digest_top.argtypes = [i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr]
    return lib


def supports(q: torch.Tensor, digests: torch.Tensor) -> bool:
    """CPU fp32 query and digests `[B, Hkv, nB, 2D]` whose blocks are contiguous rows and whose (sequence, KV
    head) rows are evenly strided (a prefix of `DigestTable`'s), and the kernel built."""
    return (q.device.type == "cpu" and digests.device.type == "cpu" and q.dtype == digests.dtype == torch.float32
            and digests.stride(-1) == 1 and digests.stride(-2) == digests.shape[-1]
            and digests.stride(0) == digests.shape[1] * digests.stride(1) and library() is not None)


def bound_scores(q: torch.Tensor, digests: torch.Tensor) -> torch.Tensor:
    """`digest.bound_from_digests` through the kernel (`supports()` is true): q `[B, Hq, D]` -> `[B, Hkv, nB]`."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks = digests.shape[1], digests.shape[2]
    q = q.contiguous()
    out = torch.empty((batch, num_kv_heads, num_blocks), dtype=torch.float32)
    code = library().sb_digest_scores(batch * num_kv_heads, num_heads // num_kv_heads, head_dim, num_blocks,
                                      digests.data_ptr(), digests.stride(1), q.data_ptr(), out.data_ptr())
    if code != 0:
        raise ValueError(f"digest scoring kernel rejected the call (code {code}): q {tuple(q.shape)}, "
                         f"digests {tuple(digests.shape)}")
    return out


def top_blocks(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`bound_scores`, then the top `k` unblocked blocks of each row, as `CandidateBlocks.top` (`supports()` is
    true; blocked: bool `[B, 1 or Hkv, nB]`, unit stride on blocks). Returns (ids `[B, Hkv, k]` int64: the
    selectable ones by descending score, ties by lower id, then 0; scores `[B, Hkv, nB]`)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks = digests.shape[1], digests.shape[2]
    q = q.contiguous()
    if blocked.stride(-1) != 1:
        blocked = blocked.contiguous()
    scores = torch.empty((batch, num_kv_heads, num_blocks), dtype=torch.float32)
    ids = torch.empty((batch, num_kv_heads, k), dtype=torch.int64)
    blocked_h = blocked.stride(1) if blocked.shape[1] > 1 else 0
    blocked_b = blocked.stride(0) if blocked.shape[0] > 1 else 0
    code = library().sb_digest_top(batch * num_kv_heads, num_kv_heads, num_heads // num_kv_heads, head_dim,
                                   num_blocks, digests.data_ptr(), digests.stride(1), q.data_ptr(),
                                   blocked.data_ptr(), blocked_b, blocked_h, k, scores.data_ptr(), ids.data_ptr())
    if code != 0:
        raise ValueError(f"digest top-k kernel rejected the call (code {code}): q {tuple(q.shape)}, "
                         f"digests {tuple(digests.shape)}, k {k}")
    return ids, scores
