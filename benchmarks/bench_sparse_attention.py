"""CPU decode attention at the memory limit: full and block-sparse (ScoutAttention's CPU part), bf16 and fp32.

For each dtype and CPU backend (`native`: the compiled kernel of scoutbench/kernels/cpu_attention.py; `torch`: the
fallback, torch's flash kernel after a gather of the selected blocks) it measures, in the same run:
- the machine's read bandwidth (`sum` over 512 MiB, interleaved with the full calls) and copy bandwidth (`copy_`
  of 256 MiB, bytes copied), in each row, so each fraction is against the bandwidth of its own moments. The `sum`
  runs on the kernel's threads (torch's count) and measured as fast as a hand-written AVX-512 streaming read (four
  accumulators, same threads) over 256 or 512 MiB: a streaming read, not a weak reference, and like the full calls'
  KV (256 MiB bf16, 512 MiB fp32) far larger than the caches;
- full attention over `len` tokens (`partial_attention`, packed GQA) in KV bytes/s and as a fraction of read;
- sparse attention over `budget` of them in blocks of `block_size` per (sequence, KV head)
  (`block_sparse_attention` over a block-major host tier in a `HostArena`, the layout and allocation
  ScoutAttention's host tier uses), the same;
- the speed-up full / sparse (ideal len / budget: 32x for 2048 of 64k).
Selections rotate over 16 random sets so the selected data is not cache-resident. Times: median / min of the
repeats (the min approximates the uncontended time on a shared machine); fractions use the min. OpenMP threads
wait passively unless OMP_WAIT_POLICY says otherwise, as under the `scoutbench` command.

    python benchmarks/bench_sparse_attention.py                        # 64k, 2048, bf16 and fp32, both backends
    python benchmarks/bench_sparse_attention.py --dtype bf16 --backend native --len 32k
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

import torch  # noqa: E402

from scoutbench.kernels import cpu_attention  # noqa: E402
from scoutbench.kernels.attention import block_sparse_attention, partial_attention  # noqa: E402
from scoutbench.kernels.partial_state import PartialState  # noqa: E402
from scoutbench.runtime.offload import HostArena, device_zeros  # noqa: E402
from scoutbench.units import parse_length  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BACKENDS = ("native", "torch")
READ_BYTES = 512 * 1024**2
COPY_BYTES = 256 * 1024**2


def time_ms(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(median, min) wall milliseconds of `fn`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes/s copied by the best of `repeats` `copy_` calls of COPY_BYTES."""
    a, b = torch.ones(COPY_BYTES // 4), torch.zeros(COPY_BYTES // 4)
    return COPY_BYTES / time_ms(lambda: b.copy_(a), repeats, warmup=1)[1] * 1e3


def use_backend(name: str) -> str:
    """Switch the CPU attention backend (SCOUTBENCH_CPU_ATTENTION) and return the name of the one that runs."""
    os.environ[cpu_attention.ENV_BACKEND] = name
    cpu_attention.library.cache_clear()
    return cpu_attention.backend_name()


@dataclass
class AttentionCalls:
    """The two measured calls over their data: `sparse()` (each call the next of the random selections, so the
    selected data is not cache-resident) and `full()`. benchmarks/ab_kernel_builds.py --calls times them too."""

    q: torch.Tensor
    full_k: torch.Tensor
    full_v: torch.Tensor
    blocks_k: torch.Tensor
    blocks_v: torch.Tensor
    selections: list[torch.Tensor]
    scale: float
    calls_made: int = 0

    def sparse(self) -> PartialState:
        self.calls_made += 1
        selection = self.selections[self.calls_made % len(self.selections)]
        return block_sparse_attention(self.q, self.blocks_k, self.blocks_v, selection, self.scale)

    def full(self) -> PartialState:
        return partial_attention(self.q, self.full_k, self.full_v, self.scale)


def attention_calls(dtype: torch.dtype, length: int, budget: int, block_size: int, batch: int, heads: int,
                    kv_heads: int, head_dim: int) -> AttentionCalls:
    g = torch.Generator().manual_seed(0)
    num_blocks = length // block_size
    rows = batch * kv_heads
    # host tier, block-major rows `block * rows + row` as in ScoutAttention, viewed as [B, Hkv, blocks, bs, D], in
    # the methods' own host arena (huge pages where Linux allows them); full attention's KV is head-major, allocated
    # as FullKV's cache is (`device_zeros`)
    tier_shape = (num_blocks * rows, block_size, head_dim)
    arena = HostArena({"k": (tier_shape, dtype), "v": (tier_shape, dtype)}, torch.device("cpu"))
    tier_k = arena["k"].copy_(torch.randn(tier_shape, generator=g))
    tier_v = arena["v"].copy_(torch.randn(tier_shape, generator=g))
    blocks_k = tier_k.view(num_blocks, batch, kv_heads, block_size, head_dim).permute(1, 2, 0, 3, 4)
    blocks_v = tier_v.view(num_blocks, batch, kv_heads, block_size, head_dim).permute(1, 2, 0, 3, 4)
    full_shape = (batch, kv_heads, length, head_dim)
    full_kv = device_zeros({"k": (full_shape, dtype), "v": (full_shape, dtype)}, torch.device("cpu"))
    full_k = full_kv["k"].copy_(blocks_k.reshape(full_shape))
    full_v = full_kv["v"].copy_(blocks_v.reshape(full_shape))
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    selected = budget // block_size
    selections = [torch.stack([torch.randperm(num_blocks, generator=g)[:selected] for _ in range(rows)])
                  .view(batch, kv_heads, selected) for _ in range(16)]
    return AttentionCalls(q, full_k, full_v, blocks_k, blocks_v, selections, head_dim ** -0.5)


def bench(dtype: torch.dtype, length: int, budget: int, block_size: int, batch: int, heads: int, kv_heads: int,
          head_dim: int, repeats: int) -> dict[str, float]:
    calls = attention_calls(dtype, length, budget, block_size, batch, heads, kv_heads, head_dim)
    rows, selected = batch * kv_heads, budget // block_size
    # correctness: the sparse call equals full attention restricted to the same tokens
    ids = calls.selections[1]
    tokens = (ids[..., None] * block_size + torch.arange(block_size)).reshape(batch, kv_heads, -1, 1)
    ref = partial_attention(calls.q, calls.full_k.gather(2, tokens.expand(-1, -1, -1, head_dim)),
                            calls.full_v.gather(2, tokens.expand(-1, -1, -1, head_dim)), calls.scale)
    got = calls.sparse()  # the first call reads selection 1
    assert torch.allclose(got.o, ref.o, atol=1e-2) and torch.allclose(got.lse, ref.lse, atol=1e-3)
    element = torch.tensor([], dtype=dtype).element_size()
    result = {"copy_bytes_s": copy_bandwidth(5)}
    # the read bandwidth interleaved with the full calls: both see the same moments of a shared machine
    src = torch.ones(READ_BYTES // 4)
    read_ms, full_ms = [], []
    calls.full()
    for _ in range(max(5, repeats // 2)):
        read_ms.append(time_ms(src.sum, 1, warmup=0)[1])
        full_ms.append(time_ms(calls.full, 1, warmup=0)[1])
    result["read_bytes_s"] = READ_BYTES / min(read_ms) * 1e3
    result["full_ms"], result["full_min_ms"] = statistics.median(full_ms), min(full_ms)
    result["sparse_ms"], result["sparse_min_ms"] = time_ms(calls.sparse, repeats)
    result["full_bytes_s"] = 2 * rows * length * head_dim * element / result["full_min_ms"] * 1e3
    result["sparse_bytes_s"] = 2 * rows * selected * block_size * head_dim * element / result["sparse_min_ms"] * 1e3
    result["speedup"] = result["full_ms"] / result["sparse_ms"]
    result["speedup_min"] = result["full_min_ms"] / result["sparse_min_ms"]
    result["ideal"] = length / (selected * block_size)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--len", default="64k")
    parser.add_argument("--budget", default="2048")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    parser.add_argument("--backend", choices=[*BACKENDS, "both"], default="both")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length, budget = parse_length(args.len), parse_length(args.budget)
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    names = list(BACKENDS) if args.backend == "both" else [args.backend]
    print(f"CPU decode attention: full {length} tokens vs {budget} in blocks of {args.block_size}, batch {args.batch}, "
          f"{args.heads} q heads / {args.kv_heads} KV heads / head_dim {args.head_dim}, {torch.get_num_threads()} "
          f"threads; ms as median / min of {args.repeats} (full: {max(5, args.repeats // 2)}); GB/s and fractions "
          f"of the row's read bandwidth, from the min")
    print(f"{'dtype':>5} {'backend':>18} {'read':>6} {'copy':>6} {'full ms':>13} {'GB/s':>5} {'/read':>6} "
          f"{'sparse ms':>11} {'GB/s':>5} {'/read':>6} {'speed-up med/min':>17} {'ideal':>6}")
    for dtype_name in dtypes:
        for name in names:
            backend = use_backend(name)
            r = bench(DTYPES[dtype_name], length, budget, args.block_size, args.batch, args.heads, args.kv_heads,
                      args.head_dim, args.repeats)
            read = r["read_bytes_s"]
            print(f"{dtype_name:>5} {backend:>18} {read / 1e9:6.1f} {r['copy_bytes_s'] / 1e9:6.1f} "
                  f"{r['full_ms']:6.2f}/{r['full_min_ms']:<6.2f} {r['full_bytes_s'] / 1e9:5.1f} "
                  f"{r['full_bytes_s'] / read:6.2f} {r['sparse_ms']:5.2f}/{r['sparse_min_ms']:<5.2f} "
                  f"{r['sparse_bytes_s'] / 1e9:5.1f} {r['sparse_bytes_s'] / read:6.2f} "
                  f"{r['speedup']:8.1f}x/{r['speedup_min']:<6.1f}x {r['ideal']:5.0f}x", flush=True)


if __name__ == "__main__":
    main()
