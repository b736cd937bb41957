"""Validation tables of docs/projection.md. Nothing here is fitted: the hardware profiles, their kernel efficiencies
included, are fixed in scoutbench/data/hardware/ before any of this runs, and no number below feeds back into them.

local: every run projected at its own shape on calibrated profiles of this machine, beside the measured median step
    (median over the repeats in RUNS, median of the profiles' projections):

    python benchmarks/projection_validation.py local --runs /tmp/val/run1 /tmp/val/run2 \\
        --profiles /tmp/val/local1.json /tmp/val/local2.json

paper: every quantitative claim of the ScoutAttention paper projected on the `paper` profile in the paper's setting
    (Qwen3-14B, bf16, budget 2048, block 32, a decode instance, no dense layers, one selection in the device pool):

    python benchmarks/projection_validation.py paper --counters paper --json            # (a), no runs needed
    python benchmarks/projection_validation.py paper --counters measured --runs results/real-text-sweep --json  # (b)
    python benchmarks/projection_validation.py paper --runs results/real-text-sweep     # both, as markdown

    (a) `--counters paper`: ScoutAttention's work from the counters the paper reports (CPU share 8.2% of the
        budget, recall interval 8.7 steps; section 3.4), the baselines' from their configuration. This tests the
        timeline where the paper states its inputs.
    (b) `--counters measured`: the same claims from the counters measured here (a real-text sweep,
        benchmarks/real_text_sweep.py, pool of one selection), each row naming the counters that differ from (a).
    With --json: one JSON object per line, one per claim: `claim`, `paper`, `projected`, `batch`, `fits`, and
    `error_pct` (a ratio), `error_pp` (a fraction, percentage points) or `holds` (a qualitative claim) where the
    paper states the batch; where it does not (or does not publish a baseline's setting), `open: true` and
    `solved`: the ScoutAttention batch, or the baseline's setting, at which the projection equals the paper's figure.

sensitivity: the paper-counter claims with each kernel efficiency at peak (1.0) and halved, and the hand-off at
    none and doubled (how much each headline figure owes to each assumed number):

    python benchmarks/projection_validation.py sensitivity

pool: the paper's setup, one row per ScoutAttention device pool, from a real-text sweep (every pool size with and
    without recall, the baselines beside it, median of the records' fractions):

    python benchmarks/projection_validation.py pool --runs results/real-text-sweep
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scoutbench.analysis.hardware import EFFICIENCIES, Hardware, load_hardware
from scoutbench.analysis.projection import (
    StepProjection,
    Target,
    median_work,
    project_results,
    project_work,
    with_dense_layers,
)
from scoutbench.analysis.work import MeasuredWork, Shape, measured_work, method_class, step_work
from scoutbench.methods import build_method
from scoutbench.methods.base import ModelShape
from scoutbench.models import model_config
from scoutbench.results import load_results
from scoutbench.units import format_length

K = 1024
# the paper's setting (section 5): Qwen3-14B, budget 2048 for every method, block 32; decode instances of
# prefill-decode disaggregation; no dense layers (the paper mentions none)
PAPER = Target(model="qwen3-14b", budget=2048, block_size=32, dtype="bf16", dense_layers=0, decode_instance=True)
# the counters the paper reports (section 3.4, Fig. 6(b)): ScoutAttention's average CPU share of the budget and its
# average recall interval. A recall copies the blocks the CPU attends at that step, once per interval: the mean
# share / the interval, per step (an assumption: the paper gives no recall volume).
PAPER_CPU_SHARE, PAPER_RECALL_INTERVAL = 0.082, 8.7
RATIO_TOLERANCE_PCT, FRACTION_TOLERANCE_PP = 25.0, 10.0

# the method variants the claims name: registered method, label, the config fields that make the variant
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "scout": ("scout", "ScoutAttention", {"pool_factor": 1.0}),
    "scout-pc": ("scout-pc", "ScoutAttention without recall (PC)", {"pool_factor": 1.0}),
    "scout-base": ("scout-base", "ScoutAttention without PC and recall", {"pool_factor": 1.0}),
    "fullkv": ("fullkv", "FullKV", {}),
    "hgca": ("hgca", "HGCA (score average of every host token read)", {"score_read": "all"}),
    "hgca-selected-read": ("hgca", "HGCA (score average of the selected tokens read)", {"score_read": "selected"}),
    "infinigen": ("infinigen", "InfiniGen (fixed fetch: budget - 1)", {}),
    "infinigen-dynamic": ("infinigen-dynamic", "InfiniGen (its accuracy code's count)", {}),
    "infinigen-speedup": ("infinigen-speedup", "InfiniGen (its speedup code's count)", {}),
}
HGCA_VARIANTS = ("hgca", "hgca-selected-read")
COUNTED = ("infinigen-dynamic", "infinigen-speedup")  # InfiniGen fetching its own count of tokens
INFINIGEN_VARIANTS = ("infinigen", *COUNTED)


def variant_config(variant: str, base: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The full config of a variant at the paper's budget and block size (over `base`, a measured run's config),
    or None when the method lacks a field the variant sets (a switch not implemented yet)."""
    from scoutbench.methods import METHODS

    name, _, fields = VARIANTS[variant]
    if name not in METHODS.names():
        return None
    defaults = method_class(name).defaults()
    if any(key not in defaults for key in fields):
        return None
    setting = {key: value for key, value in (("budget", PAPER.budget), ("block_size", PAPER.block_size))
               if key in defaults}
    return build_method(name, {**(base or {}), **setting, **fields}).config()


@dataclass
class Counters:
    """The work each variant is projected with: `works[variant]`, or `missing[variant]` saying why there is none."""

    name: str  # "paper" or "measured"
    works: dict[str, MeasuredWork] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


def pending_switch(variant: str) -> str:
    """Why a variant cannot be projected with this version of methods/: its registration or its switch is missing."""
    from scoutbench.methods import METHODS

    name, _, fields = VARIANTS[variant]
    if name not in METHODS.names():
        return f"pending: no method {name} is registered yet (methods/__init__.py)"
    family = method_class(name).name
    return f"pending: {family} has no {', '.join(fields)} switch yet (methods/{family}.py and its work model)"


def paper_counters() -> Counters:
    """(a): ScoutAttention from the paper's own counters; FullKV, HGCA and InfiniGen's fixed fetch follow from their
    configuration. The paper publishes no CPU share without recall (PC, PR) and no count of InfiniGen's own: their
    rows solve for them."""
    counters = Counters("paper")
    scout = {"cpu_budget_frac": PAPER_CPU_SHARE, "recall_budget_frac": PAPER_CPU_SHARE / PAPER_RECALL_INTERVAL,
             "attended_budget_frac": 1.0}
    for variant in ("scout", "fullkv", *HGCA_VARIANTS, "infinigen"):  # what a configuration sets
        config = variant_config(variant)
        if config is None:
            counters.missing[variant] = pending_switch(variant)
            continue
        name = VARIANTS[variant][0]
        counters.works[variant] = MeasuredWork(name, method_class(name).name, config,
                                               source="the paper", **(scout if variant == "scout" else {}))
    counters.missing["scout-pc"] = counters.missing["scout-base"] = (
        "the paper reports no CPU share without recall (Fig. 6(a) shows it rising with the steps)")
    for variant in COUNTED:
        counters.missing[variant] = (pending_switch(variant) if variant_config(variant) is None else
                                     "the paper does not report how many tokens InfiniGen's own count fetches")
    return counters


def sweep_label(work: MeasuredWork) -> str | None:
    """A real-text sweep point's name (what it ran, from its own config), None for the rest: ScoutAttention at
    blocks of 32 by pool and recall, InfiniGen by its count, FullKV and HGCA."""
    config, family = work.config, work.family
    if family == "scout":
        if config.get("block_size") != 32 or not config.get("pc", True) or config.get("recall_profile"):
            return None  # (a per-layer recall profile is not the pool's fixed-interval point)
        return f"scout-pool{config.get('pool_factor', 1):g}x-{'pr' if config.get('pr', True) else 'nopr'}"
    if family == "infinigen":
        if not config.get("dynamic_count"):
            return "infinigen"
        return "infinigen-speedup" if config.get("count_cap") is not None else "infinigen-dynamic"
    if family == "hgca":  # at its default window share; by what it reads of the score averages
        if config.get("window_share", 0.5) != 0.5:
            return None
        return "hgca-selected-read" if config.get("score_read") == "selected" else "hgca"
    return family if family == "fullkv" else None


def sweep_works(runs: list[str]) -> dict[str, MeasuredWork]:
    """Every labelled point of a real-text sweep, its records merged by the median of their fractions."""
    by_label: dict[str, list[MeasuredWork]] = defaultdict(list)
    for result in load_results(runs):
        if result.get("kind") == "throughput" and result.get("status", "ok") == "ok":
            work = measured_work(result)
            label = sweep_label(work)
            if label is not None:
                by_label[label].append(work)
    return {label: median_work(works) for label, works in by_label.items()}


def measured_counters(runs: list[str]) -> Counters:
    """(b): every variant from the sweep's pool of one selection: ScoutAttention with recall, and its share without
    recall for PC and PR (PC changes when the CPU part runs, not what it attends), the baselines as they ran."""
    sweep = sweep_works(runs)
    counters = Counters("measured")
    # each variant's sweep point; HGCA with a budget does what its configuration says, so without a point of its
    # own the selected-read variant is the default point's configuration with the switch set
    sources = {"scout": ("scout-pool1x-pr",), "scout-pc": ("scout-pool1x-nopr",),
               "scout-base": ("scout-pool1x-nopr",), "fullkv": ("fullkv",), "hgca": ("hgca",),
               "hgca-selected-read": ("hgca-selected-read", "hgca"), "infinigen": ("infinigen",),
               "infinigen-dynamic": ("infinigen-dynamic",), "infinigen-speedup": ("infinigen-speedup",)}
    for variant, labels in sources.items():
        measured = next((sweep[label] for label in labels if label in sweep), None)
        if measured is None:
            counters.missing[variant] = f"no {labels[0]} point in {', '.join(runs)}"
            continue
        config = variant_config(variant, measured.config)
        if config is None:
            counters.missing[variant] = pending_switch(variant)
            continue
        name = VARIANTS[variant][0]
        counters.works[variant] = MeasuredWork(name, method_class(name).name, config, source=measured.source,
                                               attended_max_budget_frac=measured.attended_max_budget_frac,
                                               **measured.fractions)
    return counters


class Projector:
    """Projects a variant's work at a length and batch on the `paper` profile (or a variant of it), caching steps."""

    def __init__(self, counters: Counters, hw: Hardware | None = None) -> None:
        self.counters = counters
        self.hw = hw or load_hardware("paper")
        self.model = ModelShape.from_config(model_config(PAPER.model))
        self._cache: dict[tuple[Any, ...], tuple[StepProjection, int, str, dict[str, float]]] = {}

    def work(self, variant: str, **fractions: float) -> MeasuredWork:
        work = self.counters.works[variant]
        return work.replace(**fractions) if fractions else work

    def _project(self, work: MeasuredWork, length: int,
                 batch: int | str) -> tuple[StepProjection, int, str, dict[str, float]]:
        key = (work.method, json.dumps(work.config, sort_keys=True), tuple(sorted(work.fractions.items())), length,
               batch)
        if key not in self._cache:
            shape = Shape(self.model, length, batch if isinstance(batch, int) else 1, 2)
            step, steps, fits, memory = project_work(work, shape, self.hw, replace(PAPER, length=length, batch=batch))
            self._cache[key] = (step, fits, memory, steps.totals())
        return self._cache[key]

    def step(self, work: MeasuredWork, length: int, batch: int | str) -> StepProjection:
        return self._project(work, length, batch)[0]

    def max_batch(self, work: MeasuredWork, length: int) -> int:
        return self._project(work, length, 1)[1]

    def limited_by(self, work: MeasuredWork, length: int) -> str:
        """What limits the variant's batch at `length`: device or host memory."""
        return self._project(work, length, 1)[2]

    def tok_s(self, work: MeasuredWork, length: int, batch: int | str) -> float:
        return self.step(work, length, batch).throughput_tok_s

    def why(self, work: MeasuredWork, length: int, batch: int | str) -> str:
        """What one projected step waits for, in the numbers that decide it."""
        step, _, _, totals = self._project(work, length, batch)
        device_ms = step.step_ms - step.stages_ms["idle"]
        values = self.hw.values
        return (f"at batch {step.batch} the step is {step.step_ms:.1f} ms for {device_ms:.1f} ms of device work, "
                f"bound by {step.bound_by}: the CPU works {step.cpu_ms:.1f} ms (it attends "
                f"{totals['host_kv_bytes_per_step'] / 1e9:.2f} GB at {values['host.attention_bytes_s'] / 1e9:.0f} "
                f"GB/s, and gathers what the bus takes), the bus carries {totals['h2d_bytes_per_step'] / 1e9:.2f} GB "
                f"to the device in {step.bus_h2d_ms:.1f} ms at {values['bus.bw_bytes_s'] / 1e9:.0f} GB/s")


def label(variant: str) -> str:
    return VARIANTS[variant][1]


def solve(name: str, f: Callable[[Any], float], target: float, candidates: list[Any]) -> dict[str, Any]:
    """`{name: the first candidate at which f reaches target}`, coming from the side of the first candidate (a
    crossing between two neighbours, refined by bisection when the candidates are integers); where it never does,
    `{name: None, name_range: [the least, the most f gives over the candidates]}`."""
    values = [f(c) for c in candidates]
    below = values[0] < target
    for i in range(1, len(candidates)):
        if (values[i] >= target) == below:  # crossed between candidates i-1 and i
            lo, hi = candidates[i - 1], candidates[i]
            while isinstance(lo, int) and hi - lo > 1:
                mid = (lo + hi) // 2
                if (f(mid) >= target) == below:
                    hi = mid
                else:
                    lo = mid
            return {name: hi}
    return {name: None, f"{name}_range": [round(min(values), 3), round(max(values), 3)]}


def batch_solved(name: str, f: Callable[[int], float], target: float, limit: int) -> dict[str, Any]:
    """`solve` over the batches that fit (1 to `limit`): a solved batch always fits the plan."""
    return {**solve(name, f, target, batch_grid(limit)), f"{name}_max": limit}


FETCH_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, PAPER.budget - 1]  # tokens per (seq, KV head, layer)
WINDOW_SHARES = [round(0.05 * i, 2) for i in range(1, 20)]
CPU_SHARES = [round(0.01 * i, 2) for i in range(101)]


def batch_grid(limit: int) -> list[int]:
    return sorted({1, *range(2, limit + 1, max(1, limit // 32)), limit})


def verdict(row: dict[str, Any], value: float, paper: float, kind: str, fits: bool, reason: str) -> dict[str, Any]:
    """The error of a row at a batch the paper states, whether it is within tolerance, and why not."""
    if kind == "fraction":
        row["error_pp"] = round(100 * (value - paper), 1)
        within = abs(row["error_pp"]) <= FRACTION_TOLERANCE_PP
    else:
        row["error_pct"] = round(100 * (value / paper - 1), 1)
        within = abs(row["error_pct"]) <= RATIO_TOLERANCE_PCT
    row["within_tolerance"] = within and fits
    if not within:
        row["reason"] = reason
    elif not fits:
        row["reason"] = "a batch it uses does not fit the plan"
    return row


def scaling(p: Projector, variant: str, batches: tuple[int, int], paper: float) -> dict[str, Any]:
    """A batch-scaling ratio at 32k at the batches the paper states (Figure 10)."""
    length = 32 * K
    row: dict[str, Any] = {"claim": f"{label(variant)} batch {batches[0]} -> {batches[1]}, 32k", "paper": paper,
                           "kind": "ratio", "batch": list(batches), "length": length, "stated_batch": True}
    if variant not in p.counters.works:
        return open_fetch_row(p, variant, row, lambda w: scaling_value(p, w, length, batches), paper)
    work = p.work(variant)
    value = scaling_value(p, work, length, batches)
    limit = p.max_batch(work, length)
    row.update(projected=round(value, 3), max_batch=limit, fits=max(batches) <= limit)
    reason = "; ".join(p.why(work, length, b) for b in batches)
    return verdict(row, value, paper, "ratio", row["fits"], reason)


def scaling_value(p: Projector, work: MeasuredWork, length: int, batches: tuple[int, int]) -> float:
    return p.tok_s(work, length, batches[1]) / p.tok_s(work, length, batches[0])


def idle(p: Projector, variant: str, batch: int, paper: float) -> dict[str, Any]:
    """A baseline's device idle at 32k at the batch the paper states (section 2.3: batch 40; length unstated)."""
    length = 32 * K
    row: dict[str, Any] = {"claim": f"{label(variant)} idle, batch {batch}, 32k", "paper": paper, "kind": "fraction",
                           "batch": batch, "length": length, "stated_batch": True}
    if variant not in p.counters.works:
        return open_fetch_row(p, variant, row, lambda w: p.step(w, length, batch).idle_frac, paper)
    work = p.work(variant)
    step = p.step(work, length, batch)
    limit = p.max_batch(work, length)
    row.update(projected=round(step.idle_frac, 3), max_batch=limit, fits=batch <= limit)
    if variant in HGCA_VARIANTS:  # the setting the paper does not publish, at which the idle would be its figure
        row["setting_solved"] = solve("hgca_window_share", lambda share: p.step(
            with_config(work, window_share=share), length, batch).idle_frac, paper, WINDOW_SHARES)
    return verdict(row, step.idle_frac, paper, "fraction", row["fits"], p.why(work, length, batch))


def open_fetch_row(p: Projector, variant: str, row: dict[str, Any], value: Callable[[MeasuredWork], float],
                   paper: float) -> dict[str, Any]:
    """A row whose variant has no work (a count the paper does not publish, or a switch not implemented): for
    InfiniGen's own count, the fetched tokens per (sequence, KV head, layer) at which the projection equals the
    paper's figure; otherwise the reason."""
    row["open"] = True
    row["unstated"] = p.counters.missing[variant]
    row["projected"] = None
    counted = counted_work(variant)
    if counted is None:
        return row
    length = row["length"]

    def at(tokens: float) -> float:
        return value(counted.replace(fetch_context_frac=tokens / length))

    row["solved"] = solve("fetched_tokens", at, paper, FETCH_COUNTS)
    return row


def counted_work(variant: str) -> MeasuredWork | None:
    """InfiniGen with its own count at the paper's budget, its count to be set (`fetch_context_frac`), or None for
    another variant or one this version of methods/ lacks."""
    config = variant_config(variant) if variant in COUNTED else None
    if config is None:
        return None
    name = VARIANTS[variant][0]
    return MeasuredWork(name, method_class(name).name, config)


def below_fullkv(p: Projector, variants: tuple[str, ...], length: int = 8 * K) -> dict[str, Any]:
    """Section 5: HGCA and InfiniGen run slower than FullKV at 8k (each at its largest batch, as Figure 8 compares)."""
    row: dict[str, Any] = {"claim": f"{' and '.join(label(v) for v in variants)} below FullKV, 8k, each at its max "
                           "batch", "paper": "below", "kind": "qualitative", "length": length, "stated_batch": True}
    present = [v for v in variants if v in p.counters.works]
    if len(present) < len(variants):
        row.update(projected=None, open=True,
                   unstated="; ".join(p.counters.missing[v] for v in variants if v not in present))
        return row
    steps = {v: p.step(p.work(v), length, "auto") for v in ("fullkv", *variants)}
    row.update(projected={v: round(s.throughput_tok_s, 1) for v, s in steps.items()},
               batch={v: s.batch for v, s in steps.items()}, fits=True,
               holds=all(steps[v].throughput_tok_s < steps["fullkv"].throughput_tok_s for v in variants))
    if not row["holds"]:
        row["reason"] = "; ".join(f"{v}: {p.why(p.work(v), length, 'auto')}" for v in steps)
    return row


def scout_over(p: Projector, baseline: str, paper: float, claim: str, length: int = 64 * K) -> dict[str, Any]:
    """ScoutAttention / a baseline at 64k (Figure 8), where the paper publishes neither ScoutAttention's batch nor
    the baselines' settings: today's projection (each at its max batch) and the ScoutAttention batch at which the
    ratio equals the paper's figure (the baseline at its max batch); for InfiniGen's own count the fetched tokens,
    for HGCA the window share, at which it does with ScoutAttention at its max batch."""
    row: dict[str, Any] = {"claim": claim, "paper": paper, "kind": "ratio", "length": length, "open": True,
                           "unstated": "ScoutAttention's batch at 64k and the baselines' settings"}
    scout = p.work("scout")
    limit = p.max_batch(scout, length)
    scout_top = p.tok_s(scout, length, "auto")
    solved: dict[str, Any] = {}
    if baseline in p.counters.works:
        base = p.work(baseline)
        base_tok_s = p.tok_s(base, length, "auto")
        row["projected"] = round(scout_top / base_tok_s, 3)
        row["batch"] = {"scout": limit, baseline: p.step(base, length, "auto").batch}
        solved.update(batch_solved("scout_batch", lambda b: p.tok_s(scout, length, b) / base_tok_s, paper, limit))
        if baseline.startswith("hgca"):
            solved.update(solve("hgca_window_share", lambda share: scout_top / p.tok_s(
                with_config(base, window_share=share), length, "auto"), paper, WINDOW_SHARES))
    else:
        row["projected"] = None
        row["unstated"] += f"; {p.counters.missing[baseline]}"
    counted = counted_work(baseline) if baseline not in p.counters.works else None
    if counted is not None:
        solved.update(solve("fetched_tokens", lambda t: scout_top / p.tok_s(
            counted.replace(fetch_context_frac=t / length), length, "auto"), paper, FETCH_COUNTS))
    row["solved"] = solved
    row["scout_batch_limited_by"] = p.limited_by(scout, length)
    return row


def with_config(work: MeasuredWork, **config: Any) -> MeasuredWork:
    """`work` with some config fields replaced (a baseline at another setting)."""
    return MeasuredWork(work.method, work.family, {**work.config, **config}, source=work.source,
                        attended_max_budget_frac=work.attended_max_budget_frac, **work.fractions)


def scout_idle(p: Projector, paper: float = 0.06, batch: int = 40, length: int = 32 * K) -> dict[str, Any]:
    """ScoutAttention's idle in the latency breakdown (section 5, Figure 12), whose batch the paper does not state:
    today's projection at batch 40 (the baselines' idle figures' batch), the smallest batch at which the idle
    reaches the paper's, and where no batch that fits reaches it, the CPU share that would at batch 40."""
    work = p.work("scout")
    limit = p.max_batch(work, length)
    row: dict[str, Any] = {"claim": "ScoutAttention idle, 32k", "paper": paper, "kind": "fraction", "open": True,
                           "unstated": "the batch of the latency breakdown", "length": length, "batch": batch,
                           "projected": round(p.step(work, length, batch).idle_frac, 3)}
    solved = batch_solved("scout_batch", lambda b: p.step(work, length, b).idle_frac, paper, limit)
    if solved["scout_batch"] is None:
        solved.update(solve(f"cpu_share_at_batch_{batch}", lambda share: p.step(
            work.replace(cpu_budget_frac=share), length, batch).idle_frac, paper, CPU_SHARES))
    row["solved"] = solved
    return row


def ablation(p: Projector, gain: str, paper: float, batch: int = 64, length: int = 32 * K) -> dict[str, Any]:
    """PC (ScoutAttention without recall / without PC and recall, 1.39x) or PR (ScoutAttention / without recall,
    1.20x), section 5's ablation, for which the paper states no batch or length (taken here: batch 64, 32k) and no
    CPU share without recall. With that share measured: the ratio at batch 64 and the batch at which it equals the
    paper's; with the paper's counters: the share without recall at which it does at batch 64."""
    faster, slower = ("scout-pc", "scout-base") if gain == "pc" else ("scout", "scout-pc")
    row: dict[str, Any] = {"claim": f"{gain.upper()}: {label(faster)} / {label(slower)}", "paper": paper,
                           "kind": "ratio", "open": True, "length": length, "batch": batch,
                           "unstated": "the ablation's batch and length (taken: batch 64, 32k)"}

    def ratio(fast: MeasuredWork, slow: MeasuredWork, b: int) -> float:
        return p.tok_s(fast, length, b) / p.tok_s(slow, length, b)

    if faster in p.counters.works and slower in p.counters.works:
        fast, slow = p.work(faster), p.work(slower)
        limit = min(p.max_batch(fast, length), p.max_batch(slow, length))
        row["projected"] = round(ratio(fast, slow, batch), 3)
        row["solved"] = batch_solved("scout_batch", lambda b: ratio(fast, slow, b), paper, limit)
        return row
    row["unstated"] += f"; {p.counters.missing.get(slower) or p.counters.missing.get(faster)}"
    row["projected"] = None
    scout = p.work("scout")
    without = {name: MeasuredWork(name, "scout", variant_config(name), source="the paper", attended_budget_frac=1.0)
               for name in ("scout-pc", "scout-base")}

    def at(share: float) -> float:
        drifted = {name: work.replace(cpu_budget_frac=share) for name, work in without.items()}
        return ratio(drifted["scout-pc"], drifted["scout-base"], batch) if gain == "pc" else \
            ratio(scout, drifted["scout-pc"], batch)

    row["solved"] = solve("cpu_share_without_recall", at, paper, CPU_SHARES)
    return row


def claims(p: Projector) -> list[dict[str, Any]]:
    """Every claim, in the order docs/projection.md lists them: those at a batch the paper states, then the open
    ones. Each row names the variants it projects (`methods`)."""
    rows = [(scaling(p, "scout", (16, 32), 1.78), ["scout"]), (scaling(p, "scout", (32, 64), 1.48), ["scout"])]
    rows += [(scaling(p, v, (16, 32), 1.31), [v]) for v in HGCA_VARIANTS]
    rows += [(scaling(p, v, (16, 32), 1.21), [v]) for v in INFINIGEN_VARIANTS]
    rows += [(idle(p, v, 40, 0.57), [v]) for v in HGCA_VARIANTS]
    rows += [(idle(p, v, 40, 0.61), [v]) for v in INFINIGEN_VARIANTS]
    rows += [(below_fullkv(p, ("hgca", "infinigen")), ["fullkv", "hgca", "infinigen"])]
    rows += [(below_fullkv(p, (v,)), ["fullkv", v]) for v in ("hgca-selected-read", *COUNTED)]
    rows += [(scout_over(p, "fullkv", 5.1, "ScoutAttention / FullKV, 64k"), ["scout", "fullkv"])]
    rows += [(scout_over(p, v, 2.1, f"ScoutAttention / {label(v)}, 64k (up to 2.1x)"), ["scout", v])
             for v in (*HGCA_VARIANTS, *INFINIGEN_VARIANTS)]
    rows += [(scout_idle(p), ["scout"]), (ablation(p, "pc", 1.39), ["scout-pc", "scout-base"]),
             (ablation(p, "pr", 1.20), ["scout", "scout-pc"])]
    out = []
    for row, methods in rows:
        out.append({**row, "counters": p.counters.name, "methods": methods})
    return out


def same_work(a: MeasuredWork, b: MeasuredWork, model: ModelShape) -> bool:
    """Whether two works read, move and attend the same in the paper's setting (a fraction a configuration ignores,
    such as InfiniGen's measured count under its fixed fetch, changes nothing)."""
    shape = Shape(model, 32 * K, 1, 2)
    totals = [step_work(with_dense_layers(w, PAPER.dense_layers), shape, PAPER.budget, PAPER.block_size).totals()
              for w in (a, b)]
    return all(math.isclose(totals[0][k], totals[1][k], rel_tol=1e-3) for k in totals[0])


def differences(methods: list[str], paper: Counters, measured: Counters, model: ModelShape) -> str:
    """What (b)'s counters change against (a)'s for the variants a claim projects: each fraction that differs,
    where the variant's work differs at all."""
    parts = []
    for variant in methods:
        mine = measured.works.get(variant)
        theirs = paper.works.get(variant)
        if mine is None:
            parts.append(f"{variant}: {measured.missing[variant]}")
        elif theirs is None:
            shown = ", ".join(f"{k} {v:.3g}" for k, v in mine.fractions.items())
            parts.append(f"{variant}: measured {shown or 'its configuration'}; (a) has none ({paper.missing[variant]})")
        elif same_work(mine, theirs, model):
            parts.append(f"{variant}: the same work (its configuration sets it)")
        else:
            changed = [f"{k} {mine.fractions[k]:.3g} (paper {theirs.fractions[k]:.3g})" for k in mine.fractions
                       if not math.isclose(mine.fractions[k], theirs.fractions[k], rel_tol=0.01, abs_tol=1e-4)]
            parts.append(f"{variant}: " + ", ".join(changed))
    return "; ".join(parts)


def explained(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], paper: Counters,
              measured: Counters) -> list[dict[str, Any]]:
    """(b)'s rows, each with the counters that differ from (a) and the change of its projected value."""
    model = ModelShape.from_config(model_config(PAPER.model))
    for a, b in zip(rows_a, rows_b, strict=True):
        b["differs_from_paper_counters"] = differences(b["methods"], paper, measured, model)
        if isinstance(a.get("projected"), float) and isinstance(b.get("projected"), float):
            b["change_from_paper_counters"] = round(b["projected"] - a["projected"], 3)
    return rows_b


def shown(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "qualitative":
        return ", ".join(f"{k} {v:.0f}" for k, v in value.items()) + " tok/s"
    return f"{100 * value:.0f}%" if kind == "fraction" else f"{value:.2f}x"


def error_cell(row: dict[str, Any]) -> str:
    if "holds" in row:
        return "holds" if row["holds"] else "does not hold"
    if "error_pct" in row:
        return f"{row['error_pct']:+.0f}%"
    if "error_pp" in row:
        return f"{row['error_pp']:+.0f} pp"
    return "-"


def solved_cell(row: dict[str, Any]) -> str:
    """A row's solved quantities: `name value`, or `name not reached (least-most over the range tried)`."""
    solved = row.get("solved") or {}
    if not solved:
        return row.get("unstated", "-")
    return solved_text(solved, row["kind"])


def solved_text(solved: dict[str, Any], kind: str) -> str:
    parts = []
    for key, value in solved.items():
        if key.endswith(("_range", "_max")):
            continue
        text = key.replace("_", " ")
        if value is None:
            low, high = solved[f"{key}_range"]
            parts.append(f"{text} not reached ({shown(low, kind)}-{shown(high, kind)})")
        else:
            parts.append(f"{text} {value}" + (f" (max {solved[key + '_max']})" if f"{key}_max" in solved else ""))
    return ", ".join(parts)


def paper_markdown(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]] | None) -> list[str]:
    """The two docs tables: claims at a batch the paper states, then the open ones (today's projection and the
    solved quantity), each with the paper-counter column (a) and, given runs, the measured column (b)."""
    pairs = list(zip(rows_a, rows_b or [None] * len(rows_a), strict=True))
    stated = [(a, b) for a, b in pairs if a.get("stated_batch")]
    head = "| claim | paper | (a) paper counters | error | fits |"
    lines = [head + (" (b) measured | error | fits | what (b) changes |" if rows_b else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if rows_b else "")]
    for a, b in stated:
        cells = f"| {a['claim']} | {shown(a['paper'], a['kind']) if a['kind'] != 'qualitative' else 'below'} | " \
                f"{stated_cells(a)} |"
        if b is not None:
            cells += f" {stated_cells(b)} | {b['differs_from_paper_counters']} |"
        lines.append(cells)
    lines += ["", "Outside tolerance, and why:", ""]
    for a, b in stated:
        for row, which in ((a, "(a)" if b is None or b.get("reason") != a.get("reason") else "(a) and (b)"),
                           (b, "(b)")):
            if row is None or not row.get("reason") or (row is b and which == "(b)" and b.get("reason") ==
                                                        a.get("reason")):
                continue
            setting = row.get("setting_solved")
            lines.append(f"- {which} {row['claim']}: {row['reason']}" + (
                f"; the setting for the paper's figure: {solved_text(setting, row['kind'])}" if setting else ""))
    lines += ["", "| open claim | paper | (a) today | (a) solved | " + ("(b) today | (b) solved |" if rows_b else ""),
              "|---|---|---|---|" + ("---|---|" if rows_b else "")]
    for a, b in pairs:
        if a.get("stated_batch"):
            continue
        paper = shown(a["paper"], a["kind"]) if a["kind"] != "qualitative" else "below"
        cells = f"| {a['claim']} | {paper} | {shown(a.get('projected'), a['kind'])} | {solved_cell(a)} |"
        if b is not None:
            cells += f" {shown(b.get('projected'), b['kind'])} | {solved_cell(b)} |"
        lines.append(cells)
    return lines


def stated_cells(row: dict[str, Any]) -> str:
    """Projected value, error and fit of a row at a batch the paper states; for a variant whose counter or switch
    is missing, what was solved instead (or why nothing was)."""
    if row.get("open"):
        return f"open: {solved_cell(row) if row.get('solved') else row['unstated']} | - | -"
    return f"{shown(row['projected'], row['kind'])} | {error_cell(row)} | {_fits(row)}"


def _fits(row: dict[str, Any]) -> str:
    if "fits" not in row:
        return "-"
    return "yes" if row["fits"] else f"no (max {row.get('max_batch')})"


SENSITIVITY = [(key, "peak", 1.0) for key in EFFICIENCIES if not key.endswith("_s")] + \
    [(key, "half", None) for key in EFFICIENCIES if not key.endswith("_s")] + \
    [("layer_handoff_s", "none", 0.0), ("layer_handoff_s", "double", None)]


def sensitivity_markdown() -> list[str]:
    """Each numeric claim of (a) with each kernel efficiency moved on its own: to peak (1.0) and to half its
    value; the hand-off to none and to double."""
    base_hw = load_hardware("paper")
    base = claims(Projector(paper_counters(), base_hw))
    columns = []
    for key, how, value in SENSITIVITY:
        assumed = base_hw.efficiency(key)
        moved = value if value is not None else (assumed / 2 if how == "half" else assumed * 2)
        hw = base_hw.with_values({f"efficiency.{key}": moved})
        columns.append((f"{key} {how}", claims(Projector(paper_counters(), hw))))
    lines = ["| claim | paper | assumed | " + " | ".join(name for name, _ in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for i, row in enumerate(base):
        if not isinstance(row.get("projected"), float):
            continue
        cells = [shown(rows[i]["projected"], row["kind"]) for _, rows in columns]
        lines.append(f"| {row['claim']} | {shown(row['paper'], row['kind'])} | {shown(row['projected'], row['kind'])}"
                     f" | " + " | ".join(cells) + " |")
    efficiencies = ", ".join(f"{key} {base_hw.efficiency(key):g}" for key in EFFICIENCIES)
    return lines + ["", f"Assumed on `paper` ({efficiencies})."]


# ---- local: projected vs measured on this machine -------------------------------------------------------------

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


# ---- pool: one row per ScoutAttention device pool -------------------------------------------------------------

POOL_COLUMNS = (  # (quantity, the paper's figure as printed, kind)
    ("scout / fullkv, 64k, max batch", "5.1x", "x"),
    ("scout / best baseline, 64k, max batch", "up to 2.1x", "x"),
    ("idle: scout, 32k, batch 40", "6%", "%"),
    ("PR: scout / no recall, 32k, max batch", "1.20x", "x"),
    ("scout batch 16 -> 32, 32k", "1.78x", "x"),
)
HARDWARE = ("paper", "a100-80gb-pcie", "h100-pcie", "h100-sxm", "h200", "gh200", "l40s")


def pool_projections(results: list[dict], hw: Hardware, length: int, batch: int | str) -> dict[str, Any]:
    out = {}
    for p in project_results(results, hw, replace(PAPER, length=length, batch=batch)):
        name = sweep_label(p.measured)
        if name is not None:
            out[name] = p
    return out


def pool_table(runs: list[str]) -> list[str]:
    """One row per ScoutAttention pool size: the CPU share it carries, its max batch at 64k and the paper's ratios,
    in the paper's setting (`PAPER`: a decode instance, no dense layers)."""
    results = load_results(runs)
    hw = load_hardware("paper")
    at64, at32, at40 = (pool_projections(results, hw, 64 * K, "auto"), pool_projections(results, hw, 32 * K, "auto"),
                        pool_projections(results, hw, 32 * K, 40))
    b16, b32 = pool_projections(results, hw, 32 * K, 16), pool_projections(results, hw, 32 * K, 32)

    def tok_s(p) -> float:
        return p.step.throughput_tok_s

    baselines = [name for name in (*INFINIGEN_VARIANTS, *HGCA_VARIANTS) if name in at64]
    pools = sorted({label.split("-")[1] for label in at64 if label.startswith("scout-")}, key=lambda x: float(x[4:-1]))
    header = ("| device pool | CPU share (recall every 8) | recalled / budget per step | scout batch at 64k | "
              + " | ".join(f"{name} (paper {printed})" for name, printed, _ in POOL_COLUMNS) + " |")
    lines = [header, "|---" * (4 + len(POOL_COLUMNS)) + "|"]
    for pool in pools:
        scout, without = f"scout-{pool}-pr", f"scout-{pool}-nopr"
        best = max(tok_s(at64[name]) for name in baselines)
        values = [tok_s(at64[scout]) / tok_s(at64["fullkv"]), tok_s(at64[scout]) / best,
                  at40[scout].step.idle_frac,
                  tok_s(at32[scout]) / tok_s(at32[without]) if without in at32 else None,
                  tok_s(b32[scout]) / tok_s(b16[scout])]
        cells = [f"{100 * v:.0f}%" if kind == "%" else f"{v:.2f}x" if v is not None else "-"
                 for v, (_, _, kind) in zip(values, POOL_COLUMNS, strict=True)]
        over = "" if at40[scout].fits_memory else f", > max {at40[scout].max_batch}"
        cells[2] += over  # idle at batch 40: flagged where 40 sequences do not fit
        measured = at64[scout].measured
        lines.append(f"| {pool[4:]} | {measured.cpu_budget_frac:.3f} | {measured.recall_budget_frac:.3f} | "
                     f"{at64[scout].batch} ({at64[scout].batch_limited_by}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Baselines at 64k, max batch: " + ", ".join(
        f"{name} {tok_s(at64[name]):.0f} tok/s at batch {at64[name].batch} ({100 * at64[name].step.idle_frac:.0f}% "
        "idle)" for name in ("fullkv", *baselines)) + ".")
    return lines + ["", *pool_by_profile(results, pools)]


def pool_by_profile(results: list[dict], pools: list[str]) -> list[str]:
    """ScoutAttention (recall every 8 steps) at its max batch per pool on every built-in profile, 32k and 64k:
    projected tok/s (batch, idle); the fastest pool of each row in bold."""
    lines = ["| profile | len | " + " | ".join(pool[4:] for pool in pools) + " |", "|---" * (2 + len(pools)) + "|"]
    for name in HARDWARE:
        hw = load_hardware(name)
        for length in (32 * K, 64 * K):
            by_label = pool_projections(results, hw, length, "auto")
            row = [by_label[f"scout-{pool}-pr"] for pool in pools]
            best = max(p.step.throughput_tok_s for p in row)
            cells = [(f"**{p.step.throughput_tok_s:.0f}**" if p.step.throughput_tok_s == best
                      else f"{p.step.throughput_tok_s:.0f}") + f" ({p.batch}, {100 * p.step.idle_frac:.0f}%)"
                     for p in row]
            lines.append(f"| {name} | {format_length(length)} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["local", "paper", "sensitivity", "pool"])
    parser.add_argument("--runs", nargs="+", default=[], help="result files or folders (local, pool; paper: the "
                        "measured counters, a real-text sweep)")
    parser.add_argument("--profiles", nargs="*", default=[], help="calibrated profiles (local)")
    parser.add_argument("--counters", choices=["paper", "measured", "both"], default="both",
                        help="paper: the paper's own counters (a); measured: the runs' (b); both: (a) beside (b)")
    parser.add_argument("--json", action="store_true", help="paper: one JSON object per claim and line")
    args = parser.parse_args()
    if args.which == "local":
        if not args.profiles or not args.runs:
            parser.error("local needs --runs and --profiles from `scoutbench calibrate -o`")
        lines = local_table(args.runs, args.profiles)
    elif args.which == "pool":
        if not args.runs:
            parser.error("pool needs --runs (a real-text sweep)")
        lines = pool_table(args.runs)
    elif args.which == "sensitivity":
        lines = sensitivity_markdown()
    else:
        if args.counters != "paper" and not args.runs:
            parser.error("--counters measured/both needs --runs (a real-text sweep: results/real-text-sweep)")
        paper = paper_counters()
        rows_a = claims(Projector(paper)) if args.counters != "measured" else None
        rows_b = None
        if args.counters != "paper":
            measured = measured_counters(args.runs)
            rows_b = claims(Projector(measured))
            rows_b = explained(rows_a or claims(Projector(paper)), rows_b, paper, measured)
        if args.json:
            lines = [json.dumps(row) for row in (rows_a or []) + (rows_b or [])]
        else:
            lines = paper_markdown(rows_a if rows_a is not None else rows_b, rows_b if rows_a is not None else None)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
