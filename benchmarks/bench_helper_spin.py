"""How long the CPU kernel pool's helper threads stay awake after a job (`SCOUTBENCH_KERNEL_SPIN_US`), and what a
call gains from finding them awake.

Each setting runs in its own process (the kernel reads the variable once). A process times a decode-size linear (a
4 MB fp32 weight, one input row) with a busy gap of 0 to 2000 us before each call. That is how decode steps space
their calls, and a helper that slept took 30-70 us to start on our VMs (docs/platform.md). It also times
bench_sparse_attention's sparse bf16 call (2048 of 64k tokens). Medians; the settings alternate over `--rounds`, so
that a shared machine's spells hit each alike.

    python benchmarks/bench_helper_spin.py                 # 0 (sleep at once) against the default 1000 us
    python benchmarks/bench_helper_spin.py --spin-us 0 200 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

GAPS_US = (0, 100, 500, 2000)


def measure(calls: int) -> dict[str, float]:
    """Median us of the linear after each gap, and of the sparse call (this process's setting)."""
    import bench_sparse_attention as bench  # beside this script, on sys.path as its folder
    import torch

    from scoutbench.kernels import cpu_attention, cpu_decode

    if cpu_attention.library() is None:
        raise SystemExit("the CPU kernel did not build here: nothing to measure")
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4096, 256, generator=g), torch.randn(1, 256, generator=g)
    result: dict[str, float] = {"spin_us": cpu_attention.helper_spin_us()}
    for gap_us in GAPS_US:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            while (time.perf_counter() - start) * 1e6 < gap_us:
                pass
            start = time.perf_counter()
            cpu_decode.linear(x, weight)
            times.append((time.perf_counter() - start) * 1e6)
        result[f"linear_gap{gap_us}_us"] = statistics.median(times[calls // 8:])
    sparse = bench.attention_calls(torch.bfloat16, 65536, 2048, 32, 1, 32, 8, 128).sparse
    result["sparse_bf16_us"] = bench.time_ms(sparse, calls // 4)[0] * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spin-us", type=int, nargs="+", default=[0, 1000], help="settings to compare")
    parser.add_argument("--rounds", type=int, default=2, help="processes per setting, alternating")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per gap")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process's measurement
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.calls)))
        return
    runs: dict[int, list[dict[str, float]]] = {spin: [] for spin in args.spin_us}
    for _ in range(args.rounds):
        for spin in args.spin_us:
            env = {**os.environ, "SCOUTBENCH_KERNEL_SPIN_US": str(spin)}
            out = subprocess.run([sys.executable, __file__, "--measure", "--calls", str(args.calls)], env=env,
                                 check=True, capture_output=True, text=True).stdout
            runs[spin].append(json.loads(out.splitlines()[-1]))
    keys = [f"linear_gap{gap}_us" for gap in GAPS_US] + ["sparse_bf16_us"]
    print(f"median us per call over {args.rounds} process(es) per setting (load {os.getloadavg()[0]:.1f}); "
          "linear: 4 MB fp32 weight after a busy gap; sparse: 2048 of 64k tokens, bf16")
    print(f"{'spin_us':>8} " + " ".join(f"{k.removesuffix('_us'):>16}" for k in keys))
    base = args.spin_us[0]
    for spin, results in runs.items():
        values = [statistics.median(r[k] for r in results) for k in keys]
        ratios = [v / statistics.median(r[k] for r in runs[base]) for v, k in zip(values, keys, strict=True)]
        cells = " ".join(f"{v:9.1f} ({q:4.2f})" for v, q in zip(values, ratios, strict=True))
        print(f"{spin:>8} {cells}")
    print(f"(ratio to spin_us {base} in parentheses)")


if __name__ == "__main__":
    main()
