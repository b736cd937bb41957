"""Validation tables of docs/projection.md, from runs already made (nothing here is fitted to anything).

(a) this machine: every run projected at its own shape on calibrated profiles of this machine, beside the
    measured median step (median over the repeats in RUNS, median of the profiles' projections):

    python benchmarks/projection_validation.py local --runs /tmp/val/run1 /tmp/val/run2 \
        --profiles /tmp/val/local1.json /tmp/val/local2.json

(b) the paper's setup: the runs' measured work projected on the `paper` profile at Qwen3-14B, budget 2048,
    block 32, bf16, next to the ratios the ScoutAttention paper reports:

    python benchmarks/projection_validation.py paper --runs /tmp/val/run1/*len32k* [--fetch-granularity token]
"""

from __future__ import annotations

import argparse
import statistics

from scoutbench.projection import Target, load_hardware, project_results
from scoutbench.results import load_results
from scoutbench.units import format_length

PAPER = dict(model="qwen3-14b", budget=2048, block_size=32, dtype="bf16")


def local_table(runs: list[str], profiles: list[str]) -> list[str]:
    results = load_results(runs)
    per_profile = [{(p.method, p.length): p for p in project_results(results, load_hardware(f), Target())}
                   for f in profiles]
    lines = ["| method | len | projected ms (median of profiles) | measured ms (median, min-max of runs) | "
             "projected / measured |", "|---|---|---|---|---|"]
    for key in sorted(per_profile[0], key=lambda k: (k[1], k[0])):
        projected = statistics.median(p[key].step.step_ms for p in per_profile)
        measured = sorted((r.get("decode_step_ms") or {})["median"] for r in results
                          if r["method"] == key[0] and _context(r) == key[1])
        median = statistics.median(measured)
        lines.append(f"| {key[0]} | {format_length(key[1] - key[1] % 1024)} | {projected:.1f} | {median:.1f} "
                     f"({measured[0]:.1f}-{measured[-1]:.1f}, n={len(measured)}) | {projected / median:.2f} |")
    return lines


def _context(result: dict) -> int:
    w = result["workload"]
    return w["len"] + w["warmup"] + w["steps"] // 2


def paper_table(runs: list[str], fetch_granularity: str) -> list[str]:
    results = load_results(runs)
    hw = load_hardware("paper")

    def project(length: int, batch: int | str) -> dict[str, object]:
        target = Target(length=length, batch=batch, fetch_granularity=fetch_granularity, **PAPER)
        return {p.method: p for p in project_results(results, hw, target)}

    def tok_s(p) -> float:
        return p.step.throughput_tok_s

    k = 1024
    at64, at32, at40 = project(64 * k, "auto"), project(32 * k, "auto"), project(32 * k, 40)
    b16, b32 = project(32 * k, 16), project(32 * k, 32)
    rows = [
        ("scout / fullkv, 64k, each at its max batch", "5.1x", tok_s(at64["scout"]) / tok_s(at64["fullkv"])),
        ("scout / infinigen, 64k, max batch", "up to 2.1x", tok_s(at64["scout"]) / tok_s(at64["infinigen"])),
        ("scout / hgca, 64k, max batch", "up to 2.1x", tok_s(at64["scout"]) / tok_s(at64["hgca"])),
        ("idle: scout, 32k, batch 40", "6%", at40["scout"].step.idle_frac),
        ("idle: hgca, 32k, batch 40", "57%", at40["hgca"].step.idle_frac),
        ("idle: infinigen, 32k, batch 40", "61%", at40["infinigen"].step.idle_frac),
        ("PC: scout-pc / scout-base, 32k, max batch", "1.39x", tok_s(at32["scout-pc"]) / tok_s(at32["scout-base"])),
        ("PR: scout / scout-pc, 32k, max batch", "1.20x", tok_s(at32["scout"]) / tok_s(at32["scout-pc"])),
        ("scout batch 16 -> 32, 32k", "1.78x", tok_s(b32["scout"]) / tok_s(b16["scout"])),
        ("hgca batch 16 -> 32, 32k", "1.31x", tok_s(b32["hgca"]) / tok_s(b16["hgca"])),
        ("infinigen batch 16 -> 32, 32k", "1.21x", tok_s(b32["infinigen"]) / tok_s(b16["infinigen"])),
    ]
    lines = ["| quantity | paper | projected |", "|---|---|---|"]
    for name, paper, value in rows:
        shown = f"{100 * value:.0f}%" if name.startswith("idle") else f"{value:.2f}x"
        lines.append(f"| {name} | {paper} | {shown} |")
    batches = ", ".join(f"{m} {p.batch} ({p.batch_limited_by})" for m, p in sorted(at64.items()))
    lines += ["", f"Max batches at 64k: {batches}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["local", "paper"])
    parser.add_argument("--runs", nargs="+", required=True, help="result files or folders")
    parser.add_argument("--profiles", nargs="*", default=[], help="calibrated profiles (local)")
    parser.add_argument("--fetch-granularity", choices=["gathered", "token"], default="gathered")
    args = parser.parse_args()
    if args.which == "local":
        if not args.profiles:
            parser.error("local needs --profiles from `scoutbench calibrate -o`")
        lines = local_table(args.runs, args.profiles)
    else:
        lines = paper_table(args.runs, args.fetch_granularity)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
