"""The "which method when" table of docs/methods.md: each method at its current defaults, what it costs and what it
gives, from runs made with those defaults, and when to pick it.

    python benchmarks/which_method_when.py --measure results/which-method-when --write docs/methods.md

Three sources, one row per method of the default `scoutbench throughput` run (api.SPEED_METHODS):

- speed on this machine: the default run itself (`scoutbench throughput -o DIR`, no other flags: on a CPU
  bench-attn16 at 32k, synthetic prefill, every method at its default settings), tok/s and the speed-up over FullKV
  with its 95% interval (step_stats.speedup_interval); `--measure DIR` runs it, `--runs DIR` reads one made before;
- speed on the paper's machine: `scoutbench project DIR --hardware paper --model qwen3-14b --len 32k --dtype bf16
  --batch auto`, the projection of those runs to the paper's GPU, model and dtype (the CPU run's fp32 would halve
  every batch that fits), each method at its largest batch;
- quality: top-1 agreement with FullKV, teacher-forced, on the real-text sweep (`--quality`,
  results/real-text-sweep: qwen2.5-1.5b, real LongBench records) where it has a configuration equal to the
  method's defaults (analysis.figures.comparison.configuration); otherwise the row says it is not measured.

"Pick it when" follows from the table by one rule: a method is worth its place when no other method is both faster
on the paper's machine and at least as close to FullKV; such a method's row says how it trades off, a dominated
one names what dominates it. The table records every setting it was made with (a JSON comment above it);
tests/bench/test_which_method_when.py fails when they differ from the current defaults, and the fix is to rerun this
command. Runs made with other settings are refused, so the table is never made from stale runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

START = "<!-- which-method-when:start -->"
END = "<!-- which-method-when:end -->"
SETTINGS_PREFIX = "<!-- which-method-when settings: "
PAPER_HARDWARE, PAPER_MODEL, PAPER_LENGTH, PAPER_DTYPE = "paper", "qwen3-14b", "32k", "bf16"
LOAD_FILE = "load_average.txt"


def current_defaults() -> dict[str, Any]:
    """What the table must have been made with: the default CPU run's methods, shape and steps, and each method's
    default configuration."""
    from scoutbench.api import DEFAULT_LENGTH, DEFAULT_MODELS, DEFAULT_STEPS, whole_cycle_steps
    from scoutbench.methods import SPEED_METHODS, build_method

    least, warmup = DEFAULT_STEPS["cpu"]
    methods = {name: build_method(name, {}) for name in SPEED_METHODS}
    steps = whole_cycle_steps(least, [method.block_cycle() for method in methods.values()])  # as the run times them
    return {"run": {"model": DEFAULT_MODELS["cpu"], "len": DEFAULT_LENGTH, "batch": 1, "steps": steps,
                    "warmup": warmup, "prefill": "synthetic"},
            "methods": {name: method.config() for name, method in methods.items()},
            "projection": {"hardware": PAPER_HARDWARE, "model": PAPER_MODEL, "len": PAPER_LENGTH, "dtype": PAPER_DTYPE,
                           "batch": "auto"}}


def check_runs(results: list[dict[str, Any]], defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The default run's results by method; a run made with other settings than the current defaults is refused
    (the table would name settings it was not made with)."""
    by_method = {}
    for r in results:
        if r.get("kind") != "throughput" or r.get("status", "ok") != "ok":
            continue
        workload = r["workload"]
        shape = {"model": r["model"]["name"], "len": workload["len"], "batch": workload["batch"],
                 "steps": workload["steps"], "warmup": workload["warmup"], "prefill": workload["prefill"]}
        method = r["method"]
        if method not in defaults["methods"]:
            continue
        if shape != defaults["run"] or r["method_config"] != defaults["methods"][method]:
            sys.exit(f"error: {r.get('_path')} is not the default run ({shape}, {r['method_config']}); rerun "
                     "`scoutbench throughput -o DIR` with no other flags, or pass --measure DIR")
        by_method[method] = r
    missing = [m for m in defaults["methods"] if m not in by_method]
    if missing:
        sys.exit(f"error: no ok result of {', '.join(missing)} in the runs; rerun them (--measure DIR)")
    return by_method


def cpu_speed(runs: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float, tuple[float, float] | None]]:
    """method -> (tok/s, speed-up over FullKV, its 95% interval), tok/s as every table gives it."""
    from scoutbench.methods import is_reference
    from scoutbench.step_stats import speedup_interval

    reference = next(r for m, r in runs.items() if is_reference(m))
    base = [(reference["decode_throughput_tok_s"], reference["step_ms"])]
    out = {}
    for method, r in runs.items():
        tok_s = r["decode_throughput_tok_s"]
        interval = None if r is reference else speedup_interval([(tok_s, r["step_ms"])], base)
        out[method] = (tok_s, tok_s / reference["decode_throughput_tok_s"], interval)
    return out


def projected_speed(runs_dir: Path) -> tuple[dict[str, tuple[float, int]], str]:
    """method -> (projected tok/s, batch) on the paper's machine, by the `scoutbench project` command, and the
    profile's name."""
    command = [sys.executable, "-m", "scoutbench", "project", str(runs_dir), "--hardware", PAPER_HARDWARE,
               "--model", PAPER_MODEL, "--len", PAPER_LENGTH, "--dtype", PAPER_DTYPE, "--batch", "auto", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command[2:])} failed: {done.stderr.strip()}")
    document = json.loads(done.stdout)
    out = {p["method"]: (p["decode_throughput_tok_s"], p["batch"]) for p in document["projections"]}
    return out, f"{document['hardware']['name']} ({document['hardware']['labels']['device']})"


def quality(folder: Path, defaults: dict[str, Any]) -> tuple[dict[str, float], str]:
    """method -> top-1 agreement with FullKV (%, the mean over the records) from the real-text sweep's results whose
    configuration is the method's default one; and what they were measured on."""
    from scoutbench.analysis.figures.comparison import configuration
    from scoutbench.results import load_results

    wanted = {configuration(m, config): m for m, config in defaults["methods"].items()}
    found: dict[str, list[float]] = {}
    models = set()
    for r in load_results([folder]) if folder.exists() else []:
        section = r.get("real_text_sweep") if isinstance(r.get("real_text_sweep"), dict) else {}
        method = wanted.get(configuration(str(r.get("method")), r.get("method_config") or {}))
        if method is None or not isinstance(section.get("top1_agreement"), (int, float)):
            continue
        found.setdefault(method, []).append(100 * section["top1_agreement"])
        models.add(f"{r['model']['name']} {r['model'].get('dtype')}, {r['workload']['len']} tokens")
    records = max((len(v) for v in found.values()), default=0)
    source = f"real-text sweep ({'; '.join(sorted(models))}, {records} records)" if found else "none"
    return {m: statistics.fmean(v) for m, v in found.items()}, source


def pick_when(method: str, speed: dict[str, float], top1: dict[str, float], reference: str) -> str:
    """The rule: keep a method that no other beats on both projected speed and top-1 agreement (FullKV's is 100 by
    definition); say what a kept one trades, and name what beats a dropped one."""
    if method == reference:
        return "exact attention is required (the reference every other row is measured against)"
    if method not in top1:
        return "speed only: no quality measured at these settings"
    agree = {**top1, reference: 100.0}
    better = [m for m in speed if m != method and m in agree and speed[m] >= speed[method]
              and agree[m] >= agree[method]]
    if better:
        best = max(better, key=lambda m: (speed[m], agree[m]))
        return f"not at these settings: {best} is at least as fast and at least as close to FullKV"
    faster = [m for m in speed if speed[m] > speed[method]]
    unmeasured = [m for m in faster if m not in agree]
    if not faster:
        return "the most throughput on the paper's machine"
    if len(unmeasured) == len(faster):
        return f"the most throughput among the methods with a measured quality ({', '.join(unmeasured)}: faster, unmeasured)"
    return (f"closer to FullKV ({agree[method]:.1f}% top-1) than every faster method"
            + (f" with a measured quality ({', '.join(unmeasured)}: faster, unmeasured)" if unmeasured else ""))


def table(defaults: dict[str, Any], cpu: dict, projected: dict, top1: dict, machine: str, cpu_device: str,
          quality_source: str, load: str) -> list[str]:
    """The section's lines: its settings (as a JSON comment and in words), the table, and how it was made."""
    from scoutbench.methods import is_reference, setting_text

    reference = next(m for m in defaults["methods"] if is_reference(m))
    speed = {m: projected[m][0] / projected[reference][0] for m in projected}
    settings = {**defaults, "cpu_device": cpu_device, "quality": quality_source, "load": load}
    lines = [START, SETTINGS_PREFIX + json.dumps(settings, sort_keys=True) + " -->", "",
             f"Made by `python benchmarks/which_method_when.py --measure DIR --write docs/methods.md` from the default "
             f"`scoutbench throughput` run on {cpu_device} ({defaults['run']['model']}, "
             f"{defaults['run']['len'] // 1024}k, batch 1, {defaults['run']['prefill']} prefill, "
             f"{defaults['run']['steps']} timed steps; load average {load}), projected to {machine} at "
             f"{PAPER_MODEL}, {PAPER_LENGTH}, each method at its largest batch; top-1 agreement from the {quality_source}. "
             "Every method at its current defaults (the settings column; `setting` names its point on the method's "
             "grid, the one rule of the section above, and the paper-literal point beside it); tok/s is tokens over "
             "the total timed time, "
             "the speed-up's 95% interval the bootstrap over the timed steps. `tests/bench/test_which_method_when.py` fails "
             "when the defaults move away from these settings: rerun the command.", "",
             "| method | settings | setting | CPU tok/s | CPU vs FullKV (95% CI) | projected tok/s (batch) "
             "| projected vs FullKV | top-1 vs FullKV | pick it when |", "|---|---|---|---|---|---|---|---|---|"]
    for method, config in defaults["methods"].items():
        tok_s, ratio, interval = cpu[method]
        ci = "" if interval is None else f" ({interval[0]:.2f}-{interval[1]:.2f})"
        fields = ", ".join(f"{k}={v}" for k, v in config.items()) or "-"
        proj_tok_s, batch = projected.get(method, (None, None))
        lines.append(f"| {method} | {fields} | {setting_text(method, config) or '-'} | {tok_s:.1f} | {ratio:.2f}x{ci} "
                     f"| {'-' if proj_tok_s is None else f'{proj_tok_s:.0f} ({batch})'} "
                     f"| {'-' if method not in speed else f'{speed[method]:.2f}x'} "
                     f"| {'100 (reference)' if method == reference else f'{top1[method]:.1f}%' if method in top1 else '-'} "
                     f"| {pick_when(method, speed, top1, reference) if method in speed else 'no projection'} |")
    return [*lines, END]


def write_section(doc: Path, lines: list[str]) -> None:
    """Replace the section between the markers (or add it, as its own section at the end)."""
    text = doc.read_text(encoding="utf-8")
    block = "\n".join(lines)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Which method when\n\n" + block + "\n"
    doc.write_text(text, encoding="utf-8")


def recorded_settings(doc: Path) -> dict[str, Any] | None:
    """The settings the table in `doc` was made with (None when it has no table)."""
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith(SETTINGS_PREFIX):
            return json.loads(line[len(SETTINGS_PREFIX):].removesuffix(" -->"))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--measure", type=Path, help="run the default `scoutbench throughput` into this folder first")
    source.add_argument("--runs", type=Path, help="a folder with the default run's results, made before")
    parser.add_argument("--quality", type=Path, default=Path("results/real-text-sweep"))
    parser.add_argument("--write", type=Path, default=None, help="the doc to write the section into")
    args = parser.parse_args()
    from scoutbench.results import load_results

    folder = args.measure or args.runs
    load_file = folder / LOAD_FILE  # the load average the runs were measured beside, kept with them
    if args.measure is not None:
        folder.mkdir(parents=True, exist_ok=True)
        load_file.write_text("/".join(f"{v:.1f}" for v in os.getloadavg()) + "\n", encoding="utf-8")
        subprocess.run([sys.executable, "-m", "scoutbench", "throughput", "--device", "cpu", "-o", str(folder),
                        "--overwrite"], check=True)
    load = load_file.read_text(encoding="utf-8").strip() if load_file.exists() else "not recorded"
    defaults = current_defaults()
    runs = check_runs(load_results([folder]), defaults)
    projected, machine = projected_speed(folder)
    top1, quality_source = quality(args.quality, defaults)
    device = next(iter(runs.values()))["device"]
    cpu_device = f"{device.get('name')} ({device.get('threads')} threads)"
    lines = table(defaults, cpu_speed(runs), projected, top1, machine, cpu_device, quality_source, load)
    if args.write is not None:
        write_section(args.write, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
