"""The decode linear (`cpu_decode.linear`: y = x W^T at decode's batch of one) as a read of W, against the machine's
streaming read on the same threads, on each vector path of the CPU.

A decode step's projections (q/k/v, o, the gated MLP, the layer-ahead query of ScoutAttention) are reads of their
weights: at a batch of one the linear does two flops per weight element, so its time is W's bytes over the rate
it reads them at. The shapes are those of the CPU default model (`bench-attn16`, fp32, hidden 256: q 4096 x 256,
k/v 1024 x 256, o 256 x 4096, gate/up 768 x 256, down 256 x 768) and of `qwen2.5-1.5b` (bf16, hidden 1536), whose
rows are shorter than a page (256 fp32 or 1536 bf16 elements) or a page and more. Each timed pass rotates over as many
copies of W as fill 96 MiB, so W comes from memory as it does in a step; one and two threads (a step's linear gets
one where ScoutAttention's worker holds the other core). `read` is a `sum` over 512 MiB on the same threads, the
minimum of its repeats, measured beside each row; `of read` is the linear's rate over it. A linear of less than
4 MiB runs on one thread whatever the count (below 2 MiB a thread, a helper costs what it saves: csrc/decode.cpp),
so its two-thread row sets a one-thread call against a two-thread read. Minimum times: kernel times.

    python benchmarks/bench_decode_linear.py               # every vector path this CPU runs
    python benchmarks/bench_decode_linear.py --isa avx2 --repeats 40
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

import torch  # noqa: E402
from bench_sparse_attention import READ_BYTES, read_bandwidth_ms, time_ms, use_backend, vector_paths  # noqa: E402

from scoutbench.kernels import cpu_decode  # noqa: E402

ROTATE_BYTES = 96 * 1024**2  # the copies of W a pass reads: 3x this CPU's L3
# (name, dtype, out_features, in_features)
SHAPES = [
    ("bench-attn16 q", torch.float32, 4096, 256),
    ("bench-attn16 k/v", torch.float32, 1024, 256),
    ("bench-attn16 o", torch.float32, 256, 4096),
    ("bench-attn16 gate/up", torch.float32, 768, 256),
    ("bench-attn16 down", torch.float32, 256, 768),
    ("qwen2.5-1.5b q/o", torch.bfloat16, 1536, 1536),
    ("qwen2.5-1.5b k/v", torch.bfloat16, 256, 1536),
    ("qwen2.5-1.5b gate/up", torch.bfloat16, 8960, 1536),
    ("qwen2.5-1.5b down", torch.bfloat16, 1536, 8960),
]


@dataclass
class LinearPasses:
    """Copies of a random W [out, in], as many as fill ROTATE_BYTES (at least two), and a row x [1, in]: a pass over
    the copies (`run`) reads W from memory, as a decode step does. benchmarks/ab_kernel_builds.py --calls linear
    times the passes too."""

    weights: list[torch.Tensor]
    x: torch.Tensor

    @classmethod
    def random(cls, dtype: torch.dtype, out_features: int, in_features: int) -> LinearPasses:
        g = torch.Generator().manual_seed(0)
        copies = max(2, ROTATE_BYTES // (out_features * in_features * dtype.itemsize))
        weights = [torch.randn(out_features, in_features, generator=g).to(dtype) for _ in range(copies)]
        return cls(weights, torch.randn(1, in_features, generator=g).to(dtype))

    def run(self) -> None:
        for w in self.weights:
            cpu_decode.linear(self.x, w)


def linear_row(name: str, dtype: torch.dtype, out_features: int, in_features: int, threads: int,
               repeats: int) -> str:
    """One table row: the linear's GB/s (minimum time of a pass over the copies, per copy) and its fraction of the
    read on the same threads."""
    passes = LinearPasses.random(dtype, out_features, in_features)
    torch.set_num_threads(threads)
    linear_ms = time_ms(passes.run, repeats)[1] / len(passes.weights)
    read_ms = min(read_bandwidth_ms() for _ in range(5))
    linear_gbs = passes.weights[0].nbytes / linear_ms / 1e6
    read_gbs = READ_BYTES / read_ms / 1e6
    row_bytes = in_features * dtype.itemsize
    return (f"| {name} | {str(dtype).removeprefix('torch.')} | {out_features} x {in_features} | {row_bytes} | "
            f"{threads} | {linear_ms * 1e3:.0f} | {linear_gbs:.1f} | {read_gbs:.1f} | {linear_gbs / read_gbs:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", action="append", help="vector path(s) of the native kernels (default: every one "
                        "this CPU runs)")
    parser.add_argument("--repeats", type=int, default=20, help="timed passes per row (minimum kept)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    for isa in args.isa or vector_paths():
        backend = use_backend("native", isa)
        print(f"\n{backend}, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}")
        print("| weight | dtype | shape | row bytes | threads | us | GB/s | read GB/s | of read |")
        print("|---|---|---|---|---|---|---|---|---|")
        for shape in SHAPES:
            for t in threads:
                print(linear_row(*shape, threads=t, repeats=args.repeats), flush=True)


if __name__ == "__main__":
    main()
