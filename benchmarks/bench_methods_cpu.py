"""One decode step of every compared method on CPU, same model and same context, with the per-stage breakdown.

Methods: FullKV, Quest, InfiniGen, HGCA and ScoutAttention (skipped if its module is not installed), each with its
defaults (budget 2048, block 32, 2 dense layers, ...). Model: the `bench-attn16` preset of the default
`scoutbench throughput` run (16 layers, 32 query heads, 8 KV heads, head_dim 128, hidden 256, attention-dominated),
fp32, batch 1, synthetic prefill (random K/V) at each length.
Each method runs through `scoutbench.bench.throughput.run_throughput`, so the numbers are those `scoutbench throughput`
reports: median step, mean ms per stage (StageTimer records), and the method's own statistics.

    python benchmarks/bench_methods_cpu.py --lens 8k,32k --steps 5 --warmup 2 [--threads 1] [--json out.json]

On a CPU-only machine "device" work and "CPU" work share the same cores, so offloading methods cannot win here
the way they do on a GPU box; the breakdown shows where each method spends its step and how much it waits.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

import torch  # noqa: E402

from scoutbench.bench.throughput import ThroughputConfig, run_throughput
from scoutbench.methods import ALL_METHODS, METHODS
from scoutbench.models import load_model
from scoutbench.timing import STAGES
from scoutbench.units import format_length, parse_length
from scoutbench.workloads.synthetic_kv import SyntheticKVCache

MODEL = "bench-attn16"


def available_methods() -> list[str]:
    names = []
    for name in ALL_METHODS:
        try:
            METHODS.load(name)
        except ModuleNotFoundError:
            print(f"skipping {name}: not installed yet")
            continue
        names.append(name)
    return names


def highlights(stats: dict) -> str:
    """The scalar statistics of a method, compactly (lists are per-layer detail, left to the JSON)."""
    return ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                     for key, value in stats.items() if isinstance(value, (int, float)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", default="8k,32k", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(MODEL, "cpu", torch.float32, seed=0)
    methods = available_methods()
    shared_kv = SyntheticKVCache()  # the methods at one length decode over one synthetic prefill, drawn once

    def run(name: str, length: int, steps: int) -> dict:
        cfg = ThroughputConfig(method=name, model=MODEL, length=length, batch=args.batch, steps=steps,
                               warmup=args.warmup, device="cpu", dtype="float32", prefill="synthetic",
                               command=["bench_methods_cpu"])
        return run_throughput(cfg, loaded, shared_kv=shared_kv)

    run("fullkv", 1024, steps=4)  # process warm-up: the first calls of each kernel are slower
    results = []
    for length in (parse_length(text) for text in args.lens.split(",")):
        rows = []
        for name in methods:
            result = run(name, length, args.steps)
            results.append(result)
            rows.append((name, result))
        reference = dict(rows).get("fullkv")
        print(f"\n{MODEL} fp32 cpu, {torch.get_num_threads()} threads, batch {args.batch}, "
              f"context {format_length(length)}: ms per decode step (median) and mean ms per stage")
        print(f"{'method':10} {'step':>8} {'vs full':>8} " + " ".join(f"{s:>11}" for s in STAGES))
        for name, result in rows:
            step = result["decode_step_ms"]["median"]
            ratio = reference["decode_step_ms"]["median"] / step if reference else float("nan")
            stages = " ".join(f"{result['latency_breakdown_ms'][s]:11.2f}" for s in STAGES)
            print(f"{name:10} {step:8.2f} {ratio:7.2f}x {stages}")
        for name, result in rows:
            print(f"  {name}: {highlights(result['method_stats'])}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
