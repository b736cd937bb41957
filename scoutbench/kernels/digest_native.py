"""Quest digest scoring and top-k on a CPU (fp32 or bf16 digests) through the compiled kernel (`sb_digest_scores` of
`csrc/digest.cpp`, built and cached with the rest of the kernel library).

Why: ScoutAttention scores every complete block of a sparse layer once per layer and step (1024 blocks x 8 KV heads
x 2 x 128 fp32 = 8 MB at 32k on bench-attn16). torch's batched matmul with 4 query heads per KV head, then a
group max and a scale, reads it well below the memory rate; the kernel reads each digest once for the group's four
query heads and writes the group max, one row per pool task (a free core takes half the rows), near the memory's
read rate (docs/platform.md; `benchmarks/bench_sparse_attention.py` measures it). Its sums run in another order
than the matmul's, so scores differ in the last bits (within 1e-5 of ~30 here); the selection is the same but on
such near-ties. bf16 digests are scored against q rounded to bf16, as torch's path and the CUDA kernel score them
(q cast to the digests' dtype), with fp32 sums.

`top_blocks` also selects in the same call (`DigestTable.select`), where torch's masked top-k of 64 of 1024 blocks
per row is a pass of its own: the kernel keeps each row's best k in a heap as the scores come.

It serves the CPU where `cpu_attention` does (`SCOUTBENCH_CPU_ATTENTION` other than `torch`, a compiler at hand);
elsewhere, or when the build fails, `digest.bound_from_digests` and `CandidateBlocks.top` use torch.
"""

from __future__ import annotations

import torch

from scoutbench.kernels import cpu_attention


def supports(q: torch.Tensor, digests: torch.Tensor) -> bool:
    """CPU query (fp32 or bf16) and fp32 or bf16 digests `[B, Hkv, nB, 2D]` whose blocks are contiguous rows and
    whose (sequence, KV head) rows are evenly strided (a prefix of `DigestTable`'s), and the kernel built."""
    return (q.device.type == "cpu" and digests.device.type == "cpu" and digests.dtype in cpu_attention.DTYPE_CODES
            and q.dtype in (torch.float32, torch.bfloat16)
            and digests.stride(-1) == 1 and digests.stride(-2) == digests.shape[-1]
            and digests.stride(0) == digests.shape[1] * digests.stride(1) and cpu_attention.library() is not None)


def _scores(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor | None, k: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks = digests.shape[1], digests.shape[2]
    q = q.float().contiguous()
    scores = torch.empty((batch, num_kv_heads, num_blocks), dtype=torch.float32)
    ids = torch.empty((batch, num_kv_heads, k), dtype=torch.int64) if blocked is not None else None
    blocked_b = blocked_h = 0
    if blocked is not None:
        if blocked.stride(-1) != 1:
            blocked = blocked.contiguous()
        blocked_h = blocked.stride(1) if blocked.shape[1] > 1 else 0
        blocked_b = blocked.stride(0) if blocked.shape[0] > 1 else 0
    code = cpu_attention.library().sb_digest_scores(
        cpu_attention.DTYPE_CODES[digests.dtype], batch * num_kv_heads, num_kv_heads, num_heads // num_kv_heads,
        head_dim, num_blocks, digests.data_ptr(),
        digests.stride(1), q.data_ptr(), cpu_attention.pointer(blocked), blocked_b, blocked_h, k,
        scores.data_ptr(), cpu_attention.pointer(ids), torch.get_num_threads())
    cpu_attention.check_call(code, "digest scoring", q=q, digests=digests)
    return scores, ids


def bound_scores(q: torch.Tensor, digests: torch.Tensor) -> torch.Tensor:
    """`digest.bound_from_digests` through the kernel (`supports()` is true): q `[B, Hq, D]` -> `[B, Hkv, nB]`."""
    return _scores(q, digests, None, 0)[0]


def top_blocks(q: torch.Tensor, digests: torch.Tensor, blocked: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`bound_scores`, then the top `k` unblocked blocks of each row, as `CandidateBlocks.top` (`supports()` is
    true; blocked: bool `[B, 1 or Hkv, nB]`, unit stride on blocks). Returns (ids `[B, Hkv, k]` int64: the
    selectable ones by descending score, ties by lower id, then 0; scores `[B, Hkv, nB]`)."""
    scores, ids = _scores(q, digests, blocked, k)
    return ids, scores
