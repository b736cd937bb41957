"""The one rule for every method's defaults (docs/methods.md, "One rule for every method's defaults"), applied.

For each method with a grid of open settings (`settings_grid` in its file under methods/), every grid point's runs
of the real-text sweep (benchmarks/real_text_sweep.py) give its agreement, the mean over the records of the top-1
agreement with FullKV, and its projected speed on the paper's machine (profile `paper`, Qwen3-14B in bf16, budget
2048, each at its largest batch, the geometric mean of the tok/s at 32k and 64k). The default is the fastest point
whose agreement is at least the bound (0.85); a point within 1% of that speed and more accurate wins instead; with
no admissible point, the most accurate. Rerun it whenever the sweep or the projection changes:

    python benchmarks/tune_defaults.py --runs results/real-text-sweep            # the tables of docs/methods.md
    python benchmarks/tune_defaults.py --runs results/real-text-sweep --json     # every point, the winners
    python benchmarks/tune_defaults.py --runs results/real-text-sweep --bound 0.8  # how the winners move

Exit status 1 when a registered default is not its method's winner (tests/methods/test_tune_defaults.py runs the same check),
2 when a grid point has no runs on every record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from scoutbench.analysis.hardware import load_hardware
from scoutbench.analysis.projection import Target, project_results
from scoutbench.methods import METHODS, method_family
from scoutbench.results import load_results

BOUND = 0.85  # the least top-1 agreement with FullKV an admissible setting has
TIE = 0.01  # speeds within this share of the fastest admissible one count as equal: the more accurate wins
LENGTHS = (32 * 1024, 64 * 1024)
PAPER_MACHINE = {"model": "qwen3-14b", "budget": 2048, "dtype": "bf16"}  # each point keeps its own block size
SWEEP_FIELDS = ("budget", "dense_layers")  # set by the sweep for every configuration (its defaults: 2048 and 2)


@dataclass
class Point:
    """One grid point of one method: its runs on the sweep's records, agreement and projected speed."""

    label: str
    fields: dict[str, Any]
    runs: list[dict[str, Any]]
    agreement: float | None = None
    tok_s: dict[int, float] = dataclasses.field(default_factory=dict)
    batch: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def speed(self) -> float | None:
        """The geometric mean of the projected tok/s at the rule's lengths."""
        if len(self.tok_s) != len(LENGTHS):
            return None
        return math.exp(statistics.fmean(math.log(v) for v in self.tok_s.values()))


def searched_methods() -> list[Any]:
    """The method classes that declare a grid, once each (in registration order)."""
    classes = []
    for name in METHODS.names():
        cls = METHODS.load(name)
        if cls.settings_grid and cls not in classes:
            classes.append(cls)
    return classes


def matches(cls: Any, result: dict[str, Any], fields: dict[str, Any]) -> bool:
    """Whether a sweep result ran this grid point: the point's fields, and every field no grid point sets at the
    method's default (a result written before a field existed ran the value its method's `recorded_config` says)."""
    if method_family(result["method"]) != cls.name:
        return False
    config = cls.recorded_config(result["method_config"])
    searched = {key for point in cls.settings_grid.values() for key in point}
    defaults = cls.defaults()
    for key, value in config.items():
        if key in fields:
            if not _equal(value, fields[key]):
                return False
        elif key not in searched and key not in SWEEP_FIELDS and key in defaults and not _equal(value, defaults[key]):
            return False
    return all(key in config for key in fields)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def collect(results: list[dict[str, Any]]) -> tuple[dict[str, list[Point]], list[str]]:
    """Every searched method's grid points with their runs, and the records every point must have run (those of
    FullKV's runs)."""
    sweep_runs = [r for r in results if r.get("real_text_sweep")]
    records = sorted({r["real_text_sweep"]["settings"]["record"] for r in sweep_runs if r["method"] == "fullkv"})
    points = {}
    for cls in searched_methods():
        points[cls.name] = [Point(label, fields, [r for r in sweep_runs if matches(cls, r, fields)])
                            for label, fields in cls.settings_grid.items()]
    return points, records


def measure(points: dict[str, list[Point]], records: list[str]) -> list[str]:
    """Each complete point's agreement and projected speed; returns what is missing (point: records)."""
    hardware = load_hardware("paper")
    missing = []
    for method, grid in points.items():
        for point in grid:
            by_record = {r["real_text_sweep"]["settings"]["record"]: r for r in point.runs}
            absent = [record for record in records if record not in by_record]
            if absent or not records:
                missing.append(f"{method} {point.label}: {', '.join(absent) or 'no FullKV records'}")
                continue
            runs = [by_record[record] for record in records]
            point.agreement = statistics.fmean(r["real_text_sweep"]["top1_agreement"] for r in runs)
            for length in LENGTHS:
                projected = project_results(runs, hardware, Target(length=length, batch="auto", **PAPER_MACHINE))
                if len(projected) != 1:  # the records are repeats of one point: their fractions' median
                    raise SystemExit(f"{method} {point.label}: its runs project as {len(projected)} points, not one")
                point.tok_s[length] = projected[0].step.throughput_tok_s
                point.batch[length] = projected[0].batch
    return missing


def winner(grid: list[Point], bound: float) -> tuple[Point, bool]:
    """The rule: the fastest admissible point (a more accurate one within TIE of its speed instead); with none
    admissible, the most accurate. Returns (the point, whether any was admissible)."""
    admissible = [p for p in grid if p.agreement >= bound]
    if not admissible:
        return max(grid, key=lambda p: p.agreement), False
    fastest = max(p.speed for p in admissible)
    close = [p for p in admissible if p.speed >= (1 - TIE) * fastest]
    return max(close, key=lambda p: (p.agreement, p.speed)), True


def default_point(cls: Any) -> str | None:
    """The grid point the registered defaults are (its fields at the class defaults), or None."""
    defaults = cls.defaults()
    for label, fields in cls.settings_grid.items():
        if all(_equal(defaults[key], value) for key, value in fields.items()):
            return label
    return None


def search(folder: str, bound: float = BOUND) -> dict[str, Any]:
    """The whole search: per method its points, the winner, the registered default and the paper-literal point."""
    points, records = collect(load_results([folder]))
    missing = measure(points, records)
    out: dict[str, Any] = {"bound": bound, "tie": TIE, "lengths": list(LENGTHS), "records": records,
                           "missing": missing, "methods": {}}
    for cls in searched_methods():
        grid = points[cls.name]
        entry: dict[str, Any] = {
            "points": [{"label": p.label, "fields": p.fields, "agreement": p.agreement,
                        "tok_s": {str(k): v for k, v in p.tok_s.items()},
                        "batch": {str(k): v for k, v in p.batch.items()}, "speed": p.speed,
                        "runs": len(p.runs)} for p in grid],
            "default": default_point(cls), "paper": list(cls.paper_setting) if cls.paper_setting else None,
            "winner": None, "admissible": None}
        if all(p.agreement is not None for p in grid):
            best, admissible = winner(grid, bound)
            entry["winner"], entry["admissible"] = best.label, admissible
        out["methods"][cls.name] = entry
    return out


def markdown(found: dict[str, Any]) -> list[str]:
    """One table per method: every grid point's agreement, projected tok/s at 32k and 64k (batch), the speed, and
    which point is the winner, the default and the paper-literal setting."""
    lines = [f"Bound: top-1 agreement >= {found['bound']:.2f}; records: {', '.join(found['records'])}."]
    for name, entry in found["methods"].items():
        lines += ["", f"#### {METHODS.load(name).display_name or name}", "",
                  "| setting | fields | top-1 vs FullKV | tok/s 32k (batch) | tok/s 64k (batch) | speed | |",
                  "|---|---|---|---|---|---|---|"]
        for p in entry["points"]:
            marks = [m for m, on in (("**winner**", p["label"] == entry["winner"]),
                                     ("default", p["label"] == entry["default"]),
                                     ("paper-literal", entry["paper"] and p["label"] == entry["paper"][0])) if on]
            fields = ", ".join(f"{k}={v}" for k, v in p["fields"].items())
            if p["agreement"] is None:
                lines.append(f"| {p['label']} | {fields} | not run on every record | | | | {' '.join(marks)} |")
                continue
            cells = [f"{p['tok_s'][str(n)]:.0f} ({p['batch'][str(n)]})" for n in found["lengths"]]
            admitted = "" if p["agreement"] >= found["bound"] else " (below the bound)"
            lines.append(f"| {p['label']} | {fields} | {p['agreement']:.3f}{admitted} | {' | '.join(cells)} | "
                         f"{p['speed']:.0f} | {', '.join(marks)} |")
        if entry["winner"] is not None and not entry["admissible"]:
            lines.append(f"\nNo setting reaches the bound: the most accurate, {entry['winner']}, wins.")
        if entry["paper"]:
            lines.append(f"\nPaper-literal: {entry['paper'][0]} ({entry['paper'][1]}).")
    if found["missing"]:
        lines += ["", "Not run on every record: " + "; ".join(found["missing"]) + "."]
    return lines


def stale_defaults(found: dict[str, Any]) -> list[str]:
    """The methods whose registered default is not the winner (empty: the defaults follow the rule)."""
    return [f"{name}: the default is {entry['default']!r}, the rule chooses {entry['winner']!r}"
            for name, entry in found["methods"].items() if entry["winner"] != entry["default"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="results/real-text-sweep", help="the real-text sweep's result folder")
    parser.add_argument("--bound", type=float, default=BOUND, help=f"least top-1 agreement (default {BOUND})")
    parser.add_argument("--json", action="store_true", help="print the search as JSON")
    args = parser.parse_args()
    found = search(args.runs, args.bound)
    print(json.dumps(found, indent=1) if args.json else "\n".join(markdown(found)))
    if found["missing"]:
        sys.exit(2)
    stale = stale_defaults(found)
    if stale and args.bound == BOUND:
        print("\n".join(stale), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
