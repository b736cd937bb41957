"""The comparison tables of an accuracy run: the method configurations side by side, for the terminal and for
markdown alike (`scoutbench accuracy`, `--markdown`). Every figure carries its 95% interval from the per-sample
values of the results (`analysis/bootstrap.py`: one bootstrap for every accuracy output); a mean row is over the
tasks every configuration has, resampling each task's records on their own."""

from __future__ import annotations

from typing import Any

from scoutbench.analysis import bootstrap
from scoutbench.analysis.bootstrap import Interval
from scoutbench.methods import setting_text
from scoutbench.methods.fullkv import FullKV
from scoutbench.resampling import RESAMPLES, SEED

FEW = "†"  # a cell over fewer than bootstrap.MIN_RECORDS records
UNRESOLVED = "n.r."  # a difference whose interval contains 0, or over a task of too few records (`Interval.resolved`)
NOTE = (f"95% interval over records (percentile bootstrap, {RESAMPLES} resamples, seed {SEED}); "
        f"{FEW} fewer than {bootstrap.MIN_RECORDS} records")


def _entry(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
    return (result or {}).get("results", {}).get(name) or {}


def _fmt(value: float | None, digits: int = 2, signed: bool = False) -> str:
    return "-" if value is None else f"{value:{'+' if signed else ''}.{digits}f}"


def interval_cell(interval: Interval | None, digits: int = 2, value: float | None = None, signed: bool = False,
                  difference: bool = False) -> str:
    """`30.77 [15.38, 46.15]`, marked FEW under MIN_RECORDS records and, for a `difference`, UNRESOLVED when its
    interval contains 0 or it is FEW; `value` replaces the interval's own estimate (the official, rounded score)."""
    if interval is None:
        return _fmt(value, digits, signed)
    shown = interval.value if value is None else value
    text = f"{_fmt(shown, digits, signed)} [{_fmt(interval.low, digits, signed)}, {_fmt(interval.high, digits, signed)}]"
    if difference and not interval.resolved:
        text += f" {UNRESOLVED}"
    return text + (f" {FEW}" if interval.few else "")


# the per-sample values a statistic resamples, per task: None when the result has none (an older file)
def _scores(result: dict[str, Any] | None, name: str, n: int | None = None) -> list[float] | None:
    samples = _entry(result, name).get("samples")
    return None if samples is None else [s["score"] for s in samples[:n]]


def _vs_samples(result: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    return (_entry(result, name).get("vs_fullkv") or {}).get("samples")


def _fidelity_samples(result: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    samples = (_entry(result, name).get("fidelity") or {}).get("samples")
    return [s for s in samples if s["steps"]] if samples is not None else None


def _mean_interval(per_task: list[list[float] | None]) -> Interval | None:
    """The mean over tasks of per-task means, each task's records resampled on their own."""
    if not per_task or any(not values for values in per_task):
        return None
    return bootstrap.bootstrap([len(v) for v in per_task], bootstrap.mean_over_strata(per_task))


def _change_interval(ours: list[list[float] | None], theirs: list[list[float] | None]) -> Interval | None:
    """The relative change (%) of the mean over tasks, paired record by record."""
    if not ours or any(not v for v in ours) or any(not v for v in theirs):
        return None
    return bootstrap.bootstrap([len(v) for v in ours], bootstrap.change_pct(ours, theirs))


def _pooled_interval(samples: list[list[dict[str, Any]] | None], key: str, scale: float) -> Interval | None:
    """A per-step mean over every compared (record, step) of the tasks, records resampled within each task."""
    if not samples or any(not s for s in samples):
        return None
    numerators = [[scale * s[key] * s["steps"] for s in task] for task in samples]
    steps = [[s["steps"] for s in task] for task in samples]
    return bootstrap.bootstrap([len(s) for s in samples], bootstrap.pooled(numerators, steps))


def comparison_tables(results: list[dict[str, Any]], task_names: list[str]) -> list[tuple[str, list[str],
                                                                                      list[list[str]]]]:
    """The method configurations side by side, one row per task plus the mean over the tasks every configuration
    has: (title, header, rows) for each configuration's setting, the official score, its change relative to FullKV
    (paired), the agreement with FullKV's own predictions (exact match; the task's metric with FullKV's prediction
    as the reference), the teacher-forced fidelity (top-1 agreement; KL) when measured, each with its 95% interval,
    and the CPU seconds per record. Plain strings, for the terminal and for markdown alike."""
    reference = next((r for r in results if r["method_repr"] == repr(FullKV())), None)
    compared = [r for r in results if r is not reference]

    def n_of(name: str) -> str:
        return "/".join(str(c) for c in sorted({_entry(r, name).get("n") for r in results} - {None}))

    done = [t for t in task_names if all(_entry(r, t) for r in results)]
    partial = "" if len(done) == len(task_names) else f" ({len(done)} of {len(task_names)} tasks)"
    mean_label = "mean" + partial
    # what each column ran: its method's point on the grid of the one rule for defaults, the paper's beside it
    tables = [("each column's setting: its method's grid point (docs/methods.md, one rule for every method's "
               "defaults) and the paper-literal point beside it",
               ["column", "method", "setting"],
               [[r["label"], r.get("method") or "-", setting_text(r.get("method"), r.get("method_config") or {}) or "-"]
                for r in results])]

    # the official score
    def score_cell(result: dict[str, Any], names: list[str]) -> str:
        if len(names) == 1:
            entry = _entry(result, names[0])
            scores = _scores(result, names[0])
            return interval_cell(bootstrap.mean_interval(scores) if scores else None, value=entry.get("score"))
        official = [_entry(result, t).get("score") for t in names]
        value = None if not names or None in official else sum(official) / len(official)
        return interval_cell(_mean_interval([_scores(result, t) for t in names]), value=value)

    rows = [[name, next((_entry(r, name)["metric"] for r in results if _entry(r, name)), ""), n_of(name),
             *(score_cell(r, [name]) if _entry(r, name) else "-" for r in results)] for name in task_names]
    rows.append([mean_label, "", "", *(score_cell(r, done) if done else "-" for r in results)])
    tables.append((f"official score ({NOTE})", ["task", "metric", "n", *(r["label"] for r in results)], rows))
    header = ["task", "n", *(r["label"] for r in compared)]

    # its change relative to FullKV, paired over the records both have
    def change_cell(result: dict[str, Any], names: list[str]) -> str:
        ours, theirs = [], []
        for name in names:
            vs = _vs_samples(result, name)
            if vs is None:
                return "-"
            ours.append(_scores(result, name, len(vs)))
            theirs.append([s["fullkv_score"] for s in vs])
        if theirs and all(not any(values) for values in theirs):
            return "FullKV 0"  # a change relative to a score of 0 is undefined
        return interval_cell(_change_interval(ours, theirs), 1, signed=True, difference=True)

    if reference is not None and any(_vs_samples(r, t) for r in compared for t in task_names):
        rows = [[name, n_of(name), *(change_cell(r, [name]) for r in compared)] for name in task_names]
        rows.append([mean_label, "", *(change_cell(r, done) if done else "-" for r in compared)])
        tables.append(("change of the official score vs FullKV on the same records, % of FullKV's (paired; "
                       f"{UNRESOLVED}: not resolved, the interval contains 0 or a task has fewer than "
                       f"{bootstrap.MIN_RECORDS} records; {NOTE})", header, rows))

    # the agreement with FullKV's own prediction
    def agreement_cell(result: dict[str, Any], names: list[str], key: str) -> str:
        per_task = []
        for name in names:
            vs = _vs_samples(result, name)
            if vs is None:
                return "-"
            per_task.append([s[key] for s in vs if s[key] is not None])
        return interval_cell(_mean_interval(per_task), 1)

    if any(_vs_samples(r, t) for r in compared for t in task_names):
        for key, title in (("exact_match", "exact match with FullKV's prediction, %"),
                           ("metric_vs_fullkv_pred", "the task's metric with FullKV's prediction as the reference")):
            rows = [[name, n_of(name), *(agreement_cell(r, [name], key) for r in compared)] for name in task_names]
            rows.append([mean_label, "", *(agreement_cell(r, done, key) if done else "-" for r in compared)])
            tables.append((f"{title} ({NOTE})", header, rows))

    # the teacher-forced fidelity
    def fidelity_cell(result: dict[str, Any], names: list[str], key: str, scale: float, digits: int) -> str:
        samples = [_fidelity_samples(result, name) for name in names]
        if not names or any(s is None for s in samples):
            return "-"
        return interval_cell(_pooled_interval(samples, key, scale), digits)

    steps = next((_entry(r, t)["fidelity"]["steps"] for r in compared for t in task_names
                  if _entry(r, t).get("fidelity")), None)
    if steps:
        for key, title, scale, digits in (("top1_agreement", "top-1 agreement %", 1, 1),
                                          ("kl_mean", "KL(FullKV || method), nats", 1, 3)):
            rows = [[name, n_of(name), *(fidelity_cell(r, [name], key, scale, digits) for r in compared)]
                    for name in task_names]
            rows.append(["all steps" + partial, "", *(fidelity_cell(r, done, key, scale, digits) for r in compared)])
            tables.append((f"teacher-forced fidelity over FullKV's first {steps} generated tokens: {title}, every "
                           f"compared step weighing the same ({NOTE})", header, rows))

    def cpu(result: dict[str, Any], name: str) -> str:
        own, fid = _entry(result, name).get("cpu_s_per_record"), (_entry(result, name).get("fidelity") or {})
        extra = fid.get("cpu_s_per_record")
        return _fmt(own, 0) + ("" if extra is None else f" + {extra:.0f}")

    if any(_entry(r, t).get("cpu_s_per_record") is not None for r in results for t in task_names):
        rows = [[name, n_of(name), _fmt(max((_entry(r, name)["shared_prefill_cpu_s_per_record"] for r in results
                                             if "shared_prefill_cpu_s_per_record" in _entry(r, name)), default=None), 0),
                 *(cpu(r, name) for r in results)] for name in task_names]
        tables.append(("CPU seconds per record: the shared dense prefill, then each configuration's decode "
                       "(+ its teacher-forced fidelity)", ["task", "n", "prefill", *(r["label"] for r in results)],
                       rows))
    return tables


def tables_markdown(tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    parts = []
    for title, header, rows in tables:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"
