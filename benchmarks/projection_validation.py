"""Validation tables of docs/projection.md, from runs already made (nothing here is fitted to anything).

(a) this machine: every run projected at its own shape on calibrated profiles of this machine, beside the
    measured median step (median over the repeats in RUNS, median of the profiles' projections):

    python benchmarks/projection_validation.py local --runs /tmp/val/run1 /tmp/val/run2 \
        --profiles /tmp/val/local1.json /tmp/val/local2.json

(b) the paper's setup: the runs' measured work projected on the `paper` profile at Qwen3-14B, budget 2048,
    block 32, bf16, next to the ratios the ScoutAttention paper reports:

    python benchmarks/projection_validation.py paper --runs synthetic=results/projection/bench-attn16-32k-b2048 \
        real=results/projection/qwen2.5-0.5b-longbench-8k-b512 [--fetch-granularity token]

    Each LABEL=PATH[,PATH] is one column (bare paths: one column), with its distance to the paper's figure.

(c) the paper's setup, one row per ScoutAttention device pool: a real-text sweep (benchmarks/real_text_sweep.py:
    every pool size with and without recall, the baselines beside it, median of the records' fractions) projected
    as in (b). The pool moves ScoutAttention's batch (device memory per sequence) and its CPU share together:

    python benchmarks/projection_validation.py pool --runs results/real-text-sweep
"""

from __future__ import annotations

import argparse
import statistics

from scoutbench.analysis.hardware import load_hardware
from scoutbench.analysis.projection import Target, project_results
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


PAPER_ROWS = (  # (quantity, the paper's figure as printed, as a number, kind: x = a ratio, % = a fraction)
    ("scout / fullkv, 64k, each at its max batch", "5.1x", 5.1, "x"),
    ("scout / best of infinigen, hgca, 64k, max batch", "up to 2.1x", 2.1, "x"),
    ("scout / infinigen, 64k, max batch", "up to 2.1x", 2.1, "x"),
    ("scout / hgca, 64k, max batch", "up to 2.1x", 2.1, "x"),
    ("idle: scout, 32k, batch 40", "6%", 0.06, "%"),
    ("idle: hgca, 32k, batch 40", "57%", 0.57, "%"),
    ("idle: infinigen, 32k, batch 40", "61%", 0.61, "%"),
    ("PC: scout-pc / scout-base, 32k, max batch", "1.39x", 1.39, "x"),
    ("PR: scout / scout-pc, 32k, max batch", "1.20x", 1.20, "x"),
    ("scout batch 16 -> 32, 32k", "1.78x", 1.78, "x"),
    ("hgca batch 16 -> 32, 32k", "1.31x", 1.31, "x"),
    ("infinigen batch 16 -> 32, 32k", "1.21x", 1.21, "x"),
)


def paper_values(runs: list[str], fetch_granularity: str) -> tuple[list[float], str]:
    """The projected value of every PAPER_ROWS quantity from the runs' measured work, and the 64k max batches."""
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
    values = [
        tok_s(at64["scout"]) / tok_s(at64["fullkv"]),
        tok_s(at64["scout"]) / max(tok_s(at64["infinigen"]), tok_s(at64["hgca"])),
        tok_s(at64["scout"]) / tok_s(at64["infinigen"]),
        tok_s(at64["scout"]) / tok_s(at64["hgca"]),
        at40["scout"].step.idle_frac, at40["hgca"].step.idle_frac, at40["infinigen"].step.idle_frac,
        tok_s(at32["scout-pc"]) / tok_s(at32["scout-base"]),
        tok_s(at32["scout"]) / tok_s(at32["scout-pc"]),
        tok_s(b32["scout"]) / tok_s(b16["scout"]),
        tok_s(b32["hgca"]) / tok_s(b16["hgca"]),
        tok_s(b32["infinigen"]) / tok_s(b16["infinigen"]),
    ]
    batches = ", ".join(f"{m} {p.batch} ({p.batch_limited_by})" for m, p in sorted(at64.items()))
    return values, batches


def distance(value: float, paper: float, kind: str) -> str:
    """How far a projected figure is from the paper's: a factor for ratios, percentage points for idle."""
    if kind == "%":
        return f"{100 * (value - paper):+.0f} pp"
    return f"{value / paper:.2f}x paper"


def paper_table(sources: dict[str, list[str]], fetch_granularity: str) -> list[str]:
    """One projected column (and its distance to the paper) per labelled set of runs."""
    columns = {label: paper_values(runs, fetch_granularity) for label, runs in sources.items()}
    header = "| quantity | paper |" + "".join(f" {label} | {label} vs paper |" for label in columns)
    lines = [header, "|---|---|" + "---|---|" * len(columns)]
    for row, (name, shown, paper, kind) in enumerate(PAPER_ROWS):
        cells = ""
        for values, _ in columns.values():
            value = values[row]
            cells += f" {100 * value:.0f}% |" if kind == "%" else f" {value:.2f}x |"
            cells += f" {distance(value, paper, kind)} |"
        lines.append(f"| {name} | {shown} |{cells}")
    lines.append("")
    lines += [f"Max batches at 64k ({label}): {batches}." for label, (_, batches) in columns.items()]
    return lines


POOL_COLUMNS = (  # (quantity, the paper's figure as printed, as a number, kind)
    ("scout / fullkv, 64k, max batch", "5.1x", 5.1, "x"),
    ("scout / best baseline, 64k, max batch", "up to 2.1x", 2.1, "x"),
    ("idle: scout, 32k, batch 40", "6%", 0.06, "%"),
    ("PR: scout / no recall, 32k, max batch", "1.20x", 1.20, "x"),
    ("scout batch 16 -> 32, 32k", "1.78x", 1.78, "x"),
)


def sweep_label(projection) -> str | None:
    """A real-text sweep point's name in the pool table (what it ran, from its own config), None for the rest:
    ScoutAttention at blocks of 32 by pool and recall, InfiniGen by fetch, FullKV and HGCA."""
    config, method = projection.measured.config, projection.measured.family
    if method == "scout":
        if config.get("block_size") != 32 or not config.get("pc", True):
            return None
        return f"scout-pool{config.get('pool_factor', 1):g}x-{'pr' if config.get('pr', True) else 'nopr'}"
    if method == "infinigen":
        return "infinigen-dynamic" if config.get("dynamic_count") else "infinigen"
    return method if method in ("fullkv", "hgca") else None


def pool_table(runs: list[str], fetch_granularity: str) -> list[str]:
    """One row per ScoutAttention pool size: the CPU share it carries, its max batch at 64k and the paper's ratios."""
    results = load_results(runs)
    hw = load_hardware("paper")

    def project(length: int, batch: int | str) -> dict[str, object]:
        target = Target(length=length, batch=batch, fetch_granularity=fetch_granularity, **PAPER)
        out = {}
        for p in project_results(results, hw, target):
            label = sweep_label(p)
            if label is not None:
                out[label] = p
        return out

    def tok_s(p) -> float:
        return p.step.throughput_tok_s

    k = 1024
    at64, at32, at40 = project(64 * k, "auto"), project(32 * k, "auto"), project(32 * k, 40)
    b16, b32 = project(32 * k, 16), project(32 * k, 32)
    baselines = [name for name in ("infinigen", "infinigen-dynamic", "hgca") if name in at64]
    pools = sorted({label.split("-")[1] for label in at64 if label.startswith("scout-")}, key=lambda x: float(x[4:-1]))
    header = ("| device pool | CPU share (recall every 8) | recalled / budget per step | scout batch at 64k | "
              + " | ".join(f"{name} (paper {shown})" for name, shown, _, _ in POOL_COLUMNS) + " |")
    lines = [header, "|---" * (4 + len(POOL_COLUMNS)) + "|"]
    for pool in pools:
        scout, without = f"scout-{pool}-pr", f"scout-{pool}-nopr"
        best = max(tok_s(at64[name]) for name in baselines)
        values = [tok_s(at64[scout]) / tok_s(at64["fullkv"]), tok_s(at64[scout]) / best,
                  at40[scout].step.idle_frac,
                  tok_s(at32[scout]) / tok_s(at32[without]) if without in at32 else None,
                  tok_s(b32[scout]) / tok_s(b16[scout])]
        cells = [f"{100 * v:.0f}%" if kind == "%" else f"{v:.2f}x" if v is not None else "-"
                 for v, (_, _, _, kind) in zip(values, POOL_COLUMNS, strict=True)]
        measured = at64[scout].measured
        lines.append(f"| {pool[4:]} | {measured.cpu_budget_frac:.3f} | {measured.recall_budget_frac:.3f} | "
                     f"{at64[scout].batch} ({at64[scout].batch_limited_by}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Baselines at 64k, max batch: " + ", ".join(
        f"{name} {tok_s(at64[name]):.0f} tok/s at batch {at64[name].batch} ({100 * at64[name].step.idle_frac:.0f}% "
        "idle)" for name in ("fullkv", *baselines)) + ".")
    return lines + ["", *pool_by_profile(results, pools, fetch_granularity)]


HARDWARE = ("paper", "a100-80gb-pcie", "h100-pcie", "h100-sxm", "h200", "gh200", "l40s")


def pool_by_profile(results: list[dict], pools: list[str], fetch_granularity: str) -> list[str]:
    """ScoutAttention (recall every 8 steps) at its max batch per pool on every built-in profile, 32k and 64k:
    projected tok/s (batch, idle); the fastest pool of each row in bold."""
    lines = ["| profile | len | " + " | ".join(pool[4:] for pool in pools) + " |", "|---" * (2 + len(pools)) + "|"]
    for name in HARDWARE:
        hw = load_hardware(name)
        for length in (32 * 1024, 64 * 1024):
            target = Target(length=length, batch="auto", fetch_granularity=fetch_granularity, **PAPER)
            by_label = {sweep_label(p): p for p in project_results(results, hw, target)}
            row = [by_label[f"scout-{pool}-pr"] for pool in pools]
            best = max(p.step.throughput_tok_s for p in row)
            cells = [(f"**{p.step.throughput_tok_s:.0f}**" if p.step.throughput_tok_s == best
                      else f"{p.step.throughput_tok_s:.0f}") + f" ({p.batch}, {100 * p.step.idle_frac:.0f}%)"
                     for p in row]
            lines.append(f"| {name} | {format_length(length)} | " + " | ".join(cells) + " |")
    return lines


def parse_sources(items: list[str]) -> dict[str, list[str]]:
    """`LABEL=PATH[,PATH...]` items (one projected column each); bare paths form one column, `projected`."""
    sources: dict[str, list[str]] = {}
    for item in items:
        label, sep, paths = item.partition("=")
        if not sep:
            label, paths = "projected", item
        sources.setdefault(label, []).extend(p for p in paths.split(",") if p)
    return sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["local", "paper", "pool"])
    parser.add_argument("--runs", nargs="+", required=True,
                        help="result files or folders; paper: LABEL=PATH[,PATH] items give one column each")
    parser.add_argument("--profiles", nargs="*", default=[], help="calibrated profiles (local)")
    parser.add_argument("--fetch-granularity", choices=["gathered", "token"], default="gathered")
    args = parser.parse_args()
    if args.which == "local":
        if not args.profiles:
            parser.error("local needs --profiles from `scoutbench calibrate -o`")
        lines = local_table(args.runs, args.profiles)
    elif args.which == "pool":
        lines = pool_table(args.runs, args.fetch_granularity)
    else:
        lines = paper_table(parse_sources(args.runs), args.fetch_granularity)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
