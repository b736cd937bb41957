"""CPU decode kernels at the memory limit: full and block-sparse attention (ScoutAttention's CPU part), bf16 and
fp32, and the digest scoring with its top-k that selects the sparse blocks, on each vector path of the CPU.

For each CPU backend (`native`: the compiled kernels of scoutbench/kernels/csrc, on each vector path this CPU runs,
`--isa`: an AVX-512 machine runs its AVX-512 path and the AVX2 one; `torch`: the fallback, torch's flash kernel after
a gather of the selected blocks, and torch's matmul and top-k) and dtype it measures, in the same run:
- the machine's read bandwidth (`sum` over 512 MiB on the kernels' threads, interleaved with the timed calls) and
  copy bandwidth (`copy_` of 256 MiB, bytes copied), in each row, so each fraction is against the bandwidth of its
  own moments. The `sum` measured as fast as a hand-written AVX-512 streaming read (four accumulators, same threads)
  over 256 or 512 MiB: a streaming read, not a weak reference, and like the full calls' KV (256 MiB bf16, 512 MiB
  fp32) far larger than the caches;
- full attention over `len` tokens (`partial_attention`, packed GQA) in KV bytes/s and as a fraction of read;
- sparse attention over `budget` of them in blocks of `block_size` per (sequence, KV head)
  (`block_sparse_attention` over a block-major host tier in a `HostArena`, the layout and allocation
  ScoutAttention's host tier uses), the same;
- the speed-up full / sparse (ideal len / budget: 32x for 2048 of 64k), from the medians and from the minimum times;
- digest scoring with the top-k of one sparse layer (`digest_native.top_blocks`: what `DigestTable.select` calls,
  `[max + min | max - min]` of every block of `--digest-len` tokens per KV head, the group's query heads
  max-aggregated, the best budget / block_size blocks kept), over bf16 and fp32 digests, in digest bytes/s and as a
  fraction of the read measured between its bursts, at the same thread count (torch's, what a decode step passes).
Full calls alternate with the read; sparse and digest calls come in bursts after it. Selections rotate over 16
random sets and digest calls over as many layers' tables as fill 128 MiB, so the data read is not cache-resident.
Times: median / min of the repeats; the min of N is the kernel time, the uncontended time on a shared machine, and
the fractions and the min speed-up use it. The last lines check each row against the targets of issue 49 (digest
>= 0.6, full >= 0.8, sparse >= 0.7 of read, sparse/full >= 28x from the minimum times: a target for the default
shape, 2048 of 64k, ideal 32x). OpenMP threads wait passively unless OMP_WAIT_POLICY says otherwise, as under the
`scoutbench` command.

    python benchmarks/bench_sparse_attention.py --backend native      # 64k, 2048, bf16 and fp32, every vector path
    python benchmarks/bench_sparse_attention.py --dtype bf16 --backend native --isa avx2 --len 32k
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

import torch  # noqa: E402

from scoutbench.kernels import cpu_attention, digest_native  # noqa: E402
from scoutbench.kernels.attention import block_sparse_attention, partial_attention  # noqa: E402
from scoutbench.kernels.digest import CandidateBlocks, rank_from_digests  # noqa: E402
from scoutbench.kernels.partial_state import PartialState  # noqa: E402
from scoutbench.runtime.offload import HostArena, device_zeros  # noqa: E402
from scoutbench.units import format_length, parse_length  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BACKENDS = ("native", "torch")
READ_BYTES = 512 * 1024**2
COPY_BYTES = 256 * 1024**2
DIGEST_TABLE_BYTES = 128 * 1024**2  # the layers' digest tables a digest burst rotates over: 4x this CPU's L3
# issue 49's targets: fractions of the read bandwidth, and the sparse/full speed-up from the minimum times
TARGETS = {"digest": 0.6, "full": 0.8, "sparse": 0.7}
TARGET_SPEEDUP = 28.0


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


@functools.cache
def read_source() -> torch.Tensor:
    """What the read bandwidth streams: READ_BYTES of fp32, allocated once."""
    return torch.ones(READ_BYTES // 4)


def read_bandwidth_ms() -> float:
    """One timed `sum` over READ_BYTES: the machine's streaming read on torch's threads."""
    return time_ms(read_source().sum, 1, warmup=0)[1]


def use_backend(name: str, isa: str | None = None) -> str:
    """Switch the CPU backend (SCOUTBENCH_CPU_ATTENTION) and, for `native`, its vector path (SCOUTBENCH_CPU_ISA; each
    path is its own build of the library) and return the name of the one that runs."""
    os.environ[cpu_attention.ENV_BACKEND] = name
    os.environ[cpu_attention.ENV_ISA] = isa or "best"
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
    read_ms, full_ms = [], []
    calls.full()
    for _ in range(max(5, repeats // 2)):
        read_ms.append(read_bandwidth_ms())
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


@dataclass
class DigestCalls:
    """One sparse layer's digest scoring and top-k (`digest_native.top_blocks`, or torch's form where the kernel is
    not built), each call over the next of `tables` (every layer's digests, so that they are not cache-resident)."""

    q: torch.Tensor
    tables: list[torch.Tensor]
    candidates: CandidateBlocks
    calls_made: int = 0

    def select(self) -> torch.Tensor:
        self.calls_made += 1
        digests = self.tables[self.calls_made % len(self.tables)]
        if digest_native.supports(self.q, digests):
            return digest_native.top_blocks(self.q, digests, self.candidates.blocked, self.candidates.k)[0]
        return self.candidates.top(rank_from_digests(self.q, digests))

    @property
    def table_bytes(self) -> int:
        return self.tables[0].numel() * self.tables[0].element_size()


def digest_calls(dtype: torch.dtype, length: int, budget: int, block_size: int, batch: int, heads: int, kv_heads: int,
                 head_dim: int) -> DigestCalls:
    """Digest tables `[B, Hkv, blocks, 2D]` of `length` tokens in `dtype`, allocated as `DigestTable` allocates them
    (`device_zeros`: huge pages), as many as fill DIGEST_TABLE_BYTES, and a query; every block selectable."""
    g = torch.Generator().manual_seed(1)
    num_blocks = length // block_size
    shape = (batch, kv_heads, num_blocks, 2 * head_dim)
    layers = max(4, DIGEST_TABLE_BYTES // (torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()))
    tables = device_zeros({layer: (shape, dtype) for layer in range(layers)}, torch.device("cpu"))
    for table in tables.values():
        table.copy_(torch.randn(shape, generator=g))
    q = torch.randn(batch, heads, head_dim, generator=g)
    candidates = CandidateBlocks.build(num_blocks, torch.full((batch,), num_blocks), budget // block_size, None,
                                       torch.device("cpu"))
    return DigestCalls(q, list(tables.values()), candidates)


def bench_digest(dtype: torch.dtype, length: int, budget: int, block_size: int, batch: int, heads: int,
                 kv_heads: int, head_dim: int, repeats: int) -> dict[str, float]:
    """Digest scoring with top-k per sparse layer: (median, min) ms over bursts of calls, each burst after a timed
    read, and the read bandwidth of those reads."""
    calls = digest_calls(dtype, length, budget, block_size, batch, heads, kv_heads, head_dim)
    reference = calls.candidates.top(rank_from_digests(calls.q, calls.tables[1]))
    assert torch.equal(calls.select(), reference) or dtype == torch.bfloat16  # bf16: torch rounds its sums to bf16
    read_ms, digest_ms = [], []
    burst = len(calls.tables)
    for _ in range(max(5, repeats // 4)):
        read_ms.append(read_bandwidth_ms())
        calls.select()  # the pool's helper awake again after the read
        for _ in range(burst):
            digest_ms.append(time_ms(calls.select, 1, warmup=0)[1])
    result = {"read_bytes_s": READ_BYTES / min(read_ms) * 1e3, "ms": statistics.median(digest_ms),
              "min_ms": min(digest_ms), "bytes": calls.table_bytes}
    result["bytes_s"] = calls.table_bytes / result["min_ms"] * 1e3
    return result


def vector_paths() -> list[str]:
    """The kernel's vector paths this CPU runs, widest first (not the portable loop: no target is set for it)."""
    return [path for path in cpu_attention.runnable_isa_paths() if path != "portable"] or ["portable"]


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
    parser.add_argument("--isa", action="append", choices=cpu_attention.runnable_isa_paths(),
                        help="the native backend's vector path (repeatable; default: every vector path this CPU runs)")
    parser.add_argument("--digest-len", default="32k,64k", help="comma-separated lengths of the digest rows ('' none)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length, budget = parse_length(args.len), parse_length(args.budget)
    digest_lengths = [parse_length(text) for text in args.digest_len.split(",") if text.strip()]
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    names = list(BACKENDS) if args.backend == "both" else [args.backend]
    runs = [(name, isa) for name in names for isa in ((args.isa or vector_paths()) if name == "native" else [None])]
    shape = (args.batch, args.heads, args.kv_heads, args.head_dim)
    print(f"CPU decode kernels, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}: full attention over "
          f"{length} tokens vs {budget} in blocks of {args.block_size}, batch {args.batch}, {args.heads} q heads / "
          f"{args.kv_heads} KV heads / head_dim {args.head_dim}; ms as median / min of {args.repeats} (full: "
          f"{max(5, args.repeats // 2)}), the min being the kernel time; GB/s and fractions of the row's read "
          f"bandwidth from the min")
    print(f"{'dtype':>5} {'backend':>18} {'read':>6} {'copy':>6} {'full ms':>13} {'GB/s':>5} {'/read':>6} "
          f"{'sparse ms':>11} {'GB/s':>5} {'/read':>6} {'speed-up med/min':>17} {'ideal':>6}")
    checks: dict[tuple[str, str], list[str]] = {}
    for name, isa in runs:
        backend = use_backend(name, isa)
        for dtype_name in dtypes:
            r = bench(DTYPES[dtype_name], length, budget, args.block_size, args.batch, args.heads, args.kv_heads,
                      args.head_dim, args.repeats)
            read = r["read_bytes_s"]
            speedup_min = f"{r['speedup_min']:.1f}x"
            print(f"{dtype_name:>5} {backend:>18} {read / 1e9:6.1f} {r['copy_bytes_s'] / 1e9:6.1f} "
                  f"{r['full_ms']:6.2f}/{r['full_min_ms']:<6.2f} {r['full_bytes_s'] / 1e9:5.1f} "
                  f"{r['full_bytes_s'] / read:6.2f} {r['sparse_ms']:5.2f}/{r['sparse_min_ms']:<5.2f} "
                  f"{r['sparse_bytes_s'] / 1e9:5.1f} {r['sparse_bytes_s'] / read:6.2f} "
                  f"{r['speedup']:9.1f}x/{speedup_min:<7} {r['ideal']:5.0f}x", flush=True)
            checks.setdefault((backend, dtype_name), []).extend([
                target_check("full", r["full_bytes_s"] / read, TARGETS["full"]),
                target_check("sparse", r["sparse_bytes_s"] / read, TARGETS["sparse"]),
                target_check("sparse/full", r["speedup_min"], TARGET_SPEEDUP, "x")])
    if digest_lengths:
        print(f"\ndigest scoring with top-{budget // args.block_size} of one sparse layer ([max + min | max - min] of "
              f"every {args.block_size}-token block, {args.kv_heads} KV heads x {args.heads // args.kv_heads} q heads, "
              f"head_dim {args.head_dim}); ms as median / min (kernel time) of the calls, GB/s of digests from the min")
        print(f"{'dtype':>5} {'backend':>18} {'len':>6} {'MiB':>5} {'read':>6} {'digest ms':>11} {'GB/s':>5} "
              f"{'/read':>6}")
    for name, isa in runs if digest_lengths else []:
        backend = use_backend(name, isa)
        for dtype_name in dtypes:
            for digest_len in digest_lengths:
                r = bench_digest(DTYPES[dtype_name], digest_len, budget, args.block_size, *shape, args.repeats)
                fraction = r["bytes_s"] / r["read_bytes_s"]
                print(f"{dtype_name:>5} {backend:>18} {format_length(digest_len):>6} {r['bytes'] / 2**20:5.1f} "
                      f"{r['read_bytes_s'] / 1e9:6.1f} {r['ms']:5.2f}/{r['min_ms']:<5.2f} {r['bytes_s'] / 1e9:5.1f} "
                      f"{fraction:6.2f}", flush=True)
                checks.setdefault((backend, dtype_name), []).append(
                    target_check(f"digest {format_length(digest_len)}", fraction, TARGETS["digest"]))
    print(f"\ntargets (issue 49): digest >= {TARGETS['digest']}, full >= {TARGETS['full']}, sparse >= "
          f"{TARGETS['sparse']} of read, sparse/full >= {TARGET_SPEEDUP:.0f}x from the minimum times; load "
          f"{os.getloadavg()[0]:.1f}")
    for (backend, dtype_name), results in checks.items():
        if backend.startswith("native"):
            print(f"{dtype_name:>5} {backend:>18}: {', '.join(results)}")


def target_check(what: str, value: float, target: float, unit: str = "") -> str:
    """`what value` and whether it meets `target` (a fraction of read, or a speed-up with `unit` x)."""
    shown = f"{value:.1f}{unit}" if unit else f"{value:.2f}"
    return f"{what} {shown} {'ok' if value >= target else 'BELOW'}"


if __name__ == "__main__":
    main()
