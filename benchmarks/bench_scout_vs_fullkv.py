"""End-to-end decode step of ScoutAttention vs FullKV on an attention-dominated model (CPU by default).

Runs `scoutbench.bench.throughput.run_throughput` for each method, `--repeats` times interleaved (so that background load
hits every method alike), keeps each method's run with the lowest median step, and prints the step time, the ratio
to FullKV, the per-stage breakdown and ScoutAttention's CPU compute ratio, recall and idle statistics.

    python benchmarks/bench_scout_vs_fullkv.py    # bench-attn16 (16 layers, 2 dense), 32k, fp32, synthetic prefill
    python benchmarks/bench_scout_vs_fullkv.py --variant scout:dense_layers=0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

from scoutbench.bench.throughput import ThroughputConfig, run_throughput  # noqa: E402
from scoutbench.devices import resolve_device, resolve_dtype  # noqa: E402
from scoutbench.models import load_model  # noqa: E402
from scoutbench.units import parse_length  # noqa: E402
from scoutbench.workloads.synthetic_kv import SyntheticKVCache  # noqa: E402

STAGES = ("qkv_proj", "predict", "attn_device", "idle", "merge", "o_proj", "mlp", "other")


def parse_variant(text: str) -> tuple[str, str, dict[str, str]]:
    """`method[:key=value,key=value]` -> (label, method, args)."""
    method, _, rest = text.partition(":")
    args = dict(pair.split("=", 1) for pair in rest.split(",") if pair)
    return text, method, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-attn16")
    parser.add_argument("--len", default="32k")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variant", action="append", default=None,
                        help="method[:k=v,...] (repeatable); default: fullkv, scout, scout:dense_layers=0")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the kept results here")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in (args.variant or ["fullkv", "scout", "scout:dense_layers=0"])]
    device = resolve_device(args.device)
    # one model for every run, as the throughput command does (a model loaded inside each run kept that run's
    # frame, its KV storage included, alive until a full garbage collection: the next 32k FullKV run was refused)
    loaded = load_model(args.model, device, resolve_dtype(args.dtype, device))
    best: dict[str, dict] = {}
    shared_kv = SyntheticKVCache()  # one synthetic prefill for every run, drawn once
    for _ in range(args.repeats):
        for label, method, method_args in variants:
            cfg = ThroughputConfig(method=method, method_args=method_args, model=args.model,
                                   length=parse_length(args.len), batch=1, steps=args.steps, warmup=args.warmup,
                                   device=args.device, dtype=args.dtype, prefill="synthetic")
            result = run_throughput(cfg, loaded, shared_kv=shared_kv)
            if label not in best or result["decode_step_ms"]["median"] < best[label]["decode_step_ms"]["median"]:
                best[label] = result
    base = best.get("fullkv")
    import torch

    print(f"{args.model} {args.dtype} {args.device} ({torch.get_num_threads()} threads), len {args.len}, batch 1, "
          f"{args.steps} steps "
          f"(best of {args.repeats} interleaved runs; ms per step)")
    print(f"{'variant':>22} {'median':>8} {'min':>8} {'vs fullkv':>10} " + " ".join(f"{s:>11}" for s in STAGES))
    for label, result in best.items():
        step = result["decode_step_ms"]
        ratio = base["decode_step_ms"]["median"] / step["median"] if base else float("nan")
        stages = " ".join(f"{result['latency_breakdown_ms'][s]:11.2f}" for s in STAGES)
        print(f"{label:>22} {step['median']:8.2f} {step['min']:8.2f} {ratio:9.2f}x {stages}")
    for label, result in best.items():
        stats = result.get("method_stats") or {}
        if "cpu_compute_ratio" in stats:
            print(f"{label}: cpu_compute_ratio mean {stats['cpu_compute_ratio']['mean']:.3f} "
                  f"per layer {[None if r is None else round(r, 3) for r in stats['cpu_compute_ratio']['per_layer']]}, "
                  f"recalls {stats['recall']['issued']} ({stats['recall']['bytes'] / 2**20:.1f} MiB), "
                  f"CPU attention {stats['cpu_attention_ms_per_call']:.2f} ms/call, idle {stats['idle_ms']:.2f} ms total "
                  f"(warm-up steps included)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(best, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
