"""Two versions of the CPU kernel library (`scoutbench/kernels/csrc/`), compared on decode steps or calls.

A shared machine's speed moves severalfold between runs and by tens of percent within minutes, so two builds timed
in separate runs cannot be told apart at a few percent. Here both builds are loaded into one process (each its own shared object and
thread pool) and a method's decode steps alternate between them (A B B A ...), on one engine and one KV cache.
The library loaded second runs a few percent faster in A/A runs (the same sources twice; docs/platform.md), so each
comparison runs in both orders, in fresh processes, and reports the geometric mean of the two B/A ratios, which
cancels that bias.

`--calls sparse|full|digest` times single calls instead, those of benchmarks/bench_sparse_attention.py (64k
tokens, 2048 of them in blocks of 32 for the sparse call, 32 query / 8 KV heads, head_dim 128, `--dtype`; digest: one
sparse layer's digest scoring and top-64 at `--len`, its tables rotating), A B B A in the same way: a kernel change
shows there before it is diluted in a decode step. `--calls linear` times passes of the decode linear over
benchmarks/bench_decode_linear.py's copies of one weight (`--shape OUTxIN`, `--dtype`). Its processes set
`SCOUTBENCH_KERNEL_SPIN_US=0`: a build's helper kept awake after its call takes a core from the other build's next
one (docs/platform.md), so a change to the pool's waiting cannot be judged here.

    mkdir -p /tmp/old && git archive HEAD~1 scoutbench/kernels/csrc | tar -x -C /tmp/old
    python benchmarks/ab_kernel_builds.py /tmp/old/scoutbench/kernels/csrc scoutbench/kernels/csrc --method scout
    python benchmarks/ab_kernel_builds.py /tmp/old/scoutbench/kernels/csrc scoutbench/kernels/csrc --calls sparse
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
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

BURST = 24  # calls per burst with --awake (~7 ms of sparse calls: the other build's helpers fall asleep after 1 ms)
BURST_WARMUP = 4  # a burst's first calls, not timed: they wake its build's helpers


def alternate(builds: dict, current: list, fn: Callable[[], object], repeats: int, burst: int = 1
              ) -> dict[str, list[float]]:
    """Times (ms) of `repeats` calls of `fn` per build, the builds alternating A B B A (`current[0]` is the one the
    wrappers use) a burst of `burst` calls at a time, after 4 warm-up calls: both builds' threads started, caches
    touched. With bursts (`--awake`) each burst's first `BURST_WARMUP` calls are not timed: they wake its build's
    helpers, which then stay awake through the rest, as in a decode loop's back-to-back calls."""
    times: dict[str, list[float]] = {"first": [], "second": []}
    skip = BURST_WARMUP if burst > 1 else 0
    for index in range(repeats // max(burst - skip, 1) + 4):
        name = ("first", "second", "second", "first")[index % 4]
        current[0] = builds[name]
        for call in range(burst):
            start = time.perf_counter()
            fn()
            if index >= 4 and call >= skip:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def run_order(first: Path, second: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times (ms) per build of one process that loads `first`, then `second`."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.devices import resolve_device
    from scoutbench.kernels import cpu_attention
    from scoutbench.methods import build_method
    from scoutbench.models import load_model
    from scoutbench.units import parse_length

    builds = {}
    for name, source in (("first", first), ("second", second)):
        cpu_attention.SOURCE_DIR = source
        cpu_attention.library.cache_clear()
        builds[name] = cpu_attention.library()
        if builds[name] is None:
            raise SystemExit(f"{source}: the kernel library did not build here")
    current = [builds["first"]]
    cpu_attention.library = lambda: current[0]  # every wrapper looks the library up per call
    if args.calls:
        return time_calls(builds, current, args)
    length = parse_length(args.len)
    loaded = load_model(args.model, resolve_device("cpu"), torch.float32, 0)
    with DecodeEngine(loaded.model, build_method(args.method, {})) as engine:
        engine.start(1, length + args.steps + 8)
        engine.prefill_synthetic(torch.full((1,), length, dtype=torch.long), 0)
        tokens = [torch.zeros(1, dtype=torch.long)]

        def step() -> None:
            tokens[0] = engine.decode_step(tokens[0]).argmax(-1)

        return alternate(builds, current, step, args.steps)


def time_calls(builds: dict, current: list, args: argparse.Namespace) -> dict[str, list[float]]:
    """Call times (ms) per build of bench_sparse_attention's `--calls` call, alternating A B B A."""
    import bench_sparse_attention as bench  # beside this script, on sys.path as its folder
    import torch

    from scoutbench.units import parse_length

    if args.calls == "linear":
        import bench_decode_linear

        from scoutbench.kernels import cpu_decode

        out_features, in_features = (int(n) for n in args.shape.split("x"))
        passes = bench_decode_linear.LinearPasses.random(bench.DTYPES[args.dtype], out_features, in_features)
        outputs = []
        for name in ("first", "second"):  # both builds compute the same bits
            current[0] = builds[name]
            outputs.append(cpu_decode.linear(passes.x, passes.weights[0]))
        if not torch.equal(outputs[0], outputs[1]):
            raise SystemExit("the two builds' linear outputs differ")
        return alternate(builds, current, passes.run, args.steps, BURST if args.awake else 1)
    if args.calls == "digest":
        digests = bench.digest_calls(bench.DTYPES[args.dtype], parse_length(args.len), 2048, 32, 1, 32, 8, 128)
        outputs = []
        for name in ("first", "second"):  # both builds select the same blocks
            current[0] = builds[name]
            digests.calls_made = 0
            outputs.append(digests.select())
        if not torch.equal(outputs[0], outputs[1]):
            raise SystemExit("the two builds' digest selections differ")
        return alternate(builds, current, digests.select, args.steps * 8, BURST if args.awake else 1)
    calls = bench.attention_calls(bench.DTYPES[args.dtype], 65536, 2048, 32, 1, 32, 8, 128)
    call = calls.sparse if args.calls == "sparse" else calls.full
    outputs = []
    for name in ("first", "second"):  # both builds compute the same attention
        current[0] = builds[name]
        calls.calls_made = 0
        outputs.append(call())
    if not torch.allclose(outputs[0].o, outputs[1].o, atol=1e-4) or not torch.allclose(outputs[0].lse,
                                                                                          outputs[1].lse, atol=1e-4):
        raise SystemExit("the two builds' attention outputs differ")
    return alternate(builds, current, call, args.steps * (4 if args.calls == "sparse" else 1),
                     BURST if args.awake else 1)


def torch_threads() -> int:
    """torch's thread count here (what the runs use without --threads)."""
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="the baseline's source folder (a copy of scoutbench/kernels/csrc)")
    parser.add_argument("b", type=Path, help="the candidate's source folder")
    parser.add_argument("--method", default="scout")
    parser.add_argument("--model", default="bench-attn16")
    parser.add_argument("--len", default="32k")
    parser.add_argument("--steps", type=int, default=96, help="timed steps per process, half per build")
    parser.add_argument("--calls", choices=("sparse", "full", "digest", "linear"),
                        help="time kernel calls, not decode steps")
    parser.add_argument("--shape", default="4096x256", help="with --calls linear: W's OUTxIN (default: bench-attn16's "
                        "q_proj; bench_decode_linear.py lists the others)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="of --calls")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--awake", action="store_true",
                        help="with --calls: helpers keep their default spin, builds alternate in bursts")
    parser.add_argument("--order", choices=("ab", "ba"), help=argparse.SUPPRESS)  # one process of the pair
    args = parser.parse_args()
    if args.order:
        first, second = (args.a, args.b) if args.order == "ab" else (args.b, args.a)
        print(json.dumps(run_order(first.resolve(), second.resolve(), args)))
        return
    ratios = []
    for order in ("ab", "ba"):
        cmd = [sys.executable, __file__, str(args.a), str(args.b), "--method", args.method, "--model", args.model,
               "--len", args.len, "--steps", str(args.steps), "--dtype", args.dtype, "--order", order]
        if args.calls:
            cmd += ["--calls", args.calls, "--shape", args.shape] + (["--awake"] if args.awake else [])
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = dict(os.environ)
        if args.calls and not args.awake:  # each build's awake helper would take a core from the other's next call
            env["SCOUTBENCH_KERNEL_SPIN_US"] = "0"
        times = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                           .stdout.splitlines()[-1])
        a, b = (times["first"], times["second"]) if order == "ab" else (times["second"], times["first"])
        ratio = statistics.median(b) / statistics.median(a)
        ratios.append(ratio)
        unit = ("linear pass" if args.calls == "linear" else f"{args.calls} call") if args.calls else "step"
        print(f"{order}: A {statistics.median(a):.3f} ms, B {statistics.median(b):.3f} ms median {unit} "
              f"({len(a)} each), B/A {ratio:.3f}")
    if args.calls == "linear":
        what = f"linear {args.dtype} {args.shape} passes (bench_decode_linear's copies of W)"
    elif args.calls:
        what = f"{args.calls} {args.dtype} calls (bench_sparse_attention's)"
    else:
        what = f"{args.method} on {args.model} {args.len}"
    print(f"{what}: B/A {math.sqrt(ratios[0] * ratios[1]):.3f} "
          f"(geometric mean of both orders; {args.threads or torch_threads()} threads; load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
