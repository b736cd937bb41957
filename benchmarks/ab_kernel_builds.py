"""Two versions of the CPU kernel library (`scoutbench/kernels/cpu_attention.cpp`), compared on whole decode steps.

This machine's speed moves 2-5x between runs and by 10-25% within minutes, so two builds timed in separate runs
cannot be told apart at a few percent. Here both builds are loaded into one process (each its own shared object and
thread pool) and a method's decode steps alternate between them (A B B A ...), on one engine and one KV cache.
The library loaded second came out 3-9% faster in A/A runs (the same source twice), so each comparison runs in
both orders, in fresh processes, and reports the geometric mean of the two B/A ratios, which cancels that bias.

    git show HEAD~1:scoutbench/kernels/cpu_attention.cpp > /tmp/old.cpp
    python benchmarks/ab_kernel_builds.py /tmp/old.cpp scoutbench/kernels/cpu_attention.cpp --method scout
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch


def run_order(first: Path, second: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times (ms) per build of one process that loads `first`, then `second`."""
    import torch

    from scoutbench.devices import resolve_device
    from scoutbench.engine import DecodeEngine
    from scoutbench.kernels import cpu_attention
    from scoutbench.methods import build_method
    from scoutbench.models import load_model
    from scoutbench.units import parse_length

    builds = {}
    for name, source in (("first", first), ("second", second)):
        cpu_attention.SOURCE = source
        cpu_attention.library.cache_clear()
        builds[name] = cpu_attention.library()
        if builds[name] is None:
            raise SystemExit(f"{source}: the kernel library did not build here")
    current = [builds["first"]]
    cpu_attention.library = lambda: current[0]  # every wrapper looks the library up per call
    length = parse_length(args.len)
    loaded = load_model(args.model, resolve_device("cpu"), torch.float32, 0)
    engine = DecodeEngine(loaded.model, build_method(args.method, {}))
    engine.start(1, length + args.steps + 8)
    engine.prefill_synthetic(torch.full((1,), length, dtype=torch.long), 0)
    tokens = torch.zeros(1, dtype=torch.long)
    times: dict[str, list[float]] = {"first": [], "second": []}
    for index in range(args.steps + 4):
        name = ("first", "second", "second", "first")[index % 4]
        current[0] = builds[name]
        start = time.perf_counter()
        tokens = engine.decode_step(tokens).argmax(-1)
        if index >= 4:  # warm-up: both builds' threads started, caches touched
            times[name].append((time.perf_counter() - start) * 1e3)
    engine.method.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="baseline cpu_attention.cpp")
    parser.add_argument("b", type=Path, help="candidate cpu_attention.cpp")
    parser.add_argument("--method", default="scout")
    parser.add_argument("--model", default="bench-attn16")
    parser.add_argument("--len", default="32k")
    parser.add_argument("--steps", type=int, default=96, help="timed steps per process, half per build")
    parser.add_argument("--order", choices=("ab", "ba"), help=argparse.SUPPRESS)  # one process of the pair
    args = parser.parse_args()
    if args.order:
        first, second = (args.a, args.b) if args.order == "ab" else (args.b, args.a)
        print(json.dumps(run_order(first.resolve(), second.resolve(), args)))
        return
    ratios = []
    for order in ("ab", "ba"):
        cmd = [sys.executable, __file__, str(args.a), str(args.b), "--method", args.method, "--model", args.model,
               "--len", args.len, "--steps", str(args.steps), "--order", order]
        times = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        a, b = (times["first"], times["second"]) if order == "ab" else (times["second"], times["first"])
        ratio = statistics.median(b) / statistics.median(a)
        ratios.append(ratio)
        print(f"{order}: A {statistics.median(a):.2f} ms, B {statistics.median(b):.2f} ms median step "
              f"({len(a)} steps each), B/A {ratio:.3f}")
    print(f"{args.method} on {args.model} {args.len}: B/A {math.sqrt(ratios[0] * ratios[1]):.3f} "
          f"(geometric mean of both orders; load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
