"""CPU block-sparse decode attention (ScoutAttention's CPU part) vs full attention.

Selects `budget` of `len` tokens in blocks of `block_size` per (sequence, KV head), gathers them with one flat
`index_select(out=)` into preallocated buffers (the layout ScoutAttention's host tier uses) and runs
`partial_attention` (packed-GQA SDPA with LSE) over them; compares with `partial_attention` over all `len` tokens.
The ideal speed-up is len / budget (32x for 2048 of 64k). The selections rotate over 16 random sets so the gathered
data is not cache-resident. Reports medians.

    python benchmarks/bench_sparse_attention.py                 # 64k context, 2048 budget, bf16 and fp32
    python benchmarks/bench_sparse_attention.py --dtype bf16 --len 32k --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scoutbench.kernels.attention import partial_attention
from scoutbench.units import parse_length

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def time_ms(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(median, min) wall ms. On a shared machine the min approximates the uncontended time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def bench(dtype: torch.dtype, length: int, budget: int, block_size: int, batch: int, heads: int, kv_heads: int,
          head_dim: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    blocks = length // block_size
    rows = batch * kv_heads
    # host tier, block-major rows `block * rows + row` as in ScoutAttention
    cache_k = torch.randn(blocks * rows, block_size, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(blocks * rows, block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    k_sel = budget // block_size
    selections = []
    for _ in range(16):
        ids = torch.stack([torch.randperm(blocks, generator=g)[:k_sel] for _ in range(rows)]).view(batch, kv_heads, k_sel)
        selections.append((ids * rows + torch.arange(rows).view(batch, kv_heads, 1)).reshape(-1))
    gather_k = torch.empty(rows * k_sel, block_size, head_dim, dtype=dtype)
    gather_v = torch.empty_like(gather_k)
    full_k = cache_k.view(blocks, batch, kv_heads, block_size, head_dim).permute(1, 2, 0, 3, 4) \
        .reshape(batch, kv_heads, length, head_dim).contiguous()
    full_v = cache_v.view(blocks, batch, kv_heads, block_size, head_dim).permute(1, 2, 0, 3, 4) \
        .reshape(batch, kv_heads, length, head_dim).contiguous()
    counter = [0]

    def gather():
        flat = selections[counter[0] % len(selections)]
        counter[0] += 1
        torch.index_select(cache_k, 0, flat, out=gather_k)
        torch.index_select(cache_v, 0, flat, out=gather_v)

    def attend():
        partial_attention(q, gather_k.view(batch, kv_heads, k_sel * block_size, head_dim),
                          gather_v.view(batch, kv_heads, k_sel * block_size, head_dim), scale)

    def sparse():
        gather()
        attend()

    def full():
        partial_attention(q, full_k, full_v, scale)

    # correctness: the sparse path equals full attention restricted to the same tokens
    gather()
    ref_ids = selections[(counter[0] - 1) % len(selections)]
    out = partial_attention(q, gather_k.view(batch, kv_heads, -1, head_dim), gather_v.view(batch, kv_heads, -1, head_dim),
                            scale)
    assert torch.isfinite(out.o).all() and ref_ids.numel() == rows * k_sel
    result = {}
    for name, fn, n in (("full", full, max(5, repeats // 3)), ("sparse", sparse, repeats), ("gather", gather, repeats),
                        ("attend", attend, repeats)):
        result[f"{name}_ms"], result[f"{name}_min_ms"] = time_ms(fn, n)
    result["speedup"] = result["full_ms"] / result["sparse_ms"]
    result["speedup_min"] = result["full_min_ms"] / result["sparse_min_ms"]
    result["ideal"] = length / budget
    selected_bytes = 2 * rows * k_sel * block_size * head_dim * torch.tensor([], dtype=dtype).element_size()
    result["gather_gbs"] = selected_bytes / result["gather_min_ms"] / 1e6
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
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length, budget = parse_length(args.len), parse_length(args.budget)
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    print(f"CPU sparse attention: {budget} of {length} tokens in blocks of {args.block_size}, batch {args.batch}, "
          f"{args.heads} q heads / {args.kv_heads} KV heads / head_dim {args.head_dim}, "
          f"{torch.get_num_threads()} threads; times in ms as median / min over {args.repeats} runs")
    print(f"{'dtype':>6} {'full':>15} {'sparse':>15} {'gather':>15} {'attend':>15} {'gather GB/s':>12} "
          f"{'speed-up med/min':>17} {'ideal':>6} {'of ideal':>9}")
    for name in dtypes:
        r = bench(DTYPES[name], length, budget, args.block_size, args.batch, args.heads, args.kv_heads, args.head_dim,
                  args.repeats)
        cells = " ".join(f"{r[f'{k}_ms']:7.2f}/{r[f'{k}_min_ms']:<7.2f}" for k in ("full", "sparse", "gather", "attend"))
        print(f"{name:>6} {cells} {r['gather_gbs']:12.1f} {r['speedup']:8.1f}x/{r['speedup_min']:<6.1f}x "
              f"{r['ideal']:5.0f}x {r['speedup_min'] / r['ideal']:8.0%}")


if __name__ == "__main__":
    main()
