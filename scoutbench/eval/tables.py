"""The comparison tables of an accuracy run: the method configurations side by side, for the terminal and for
markdown alike (`scoutbench accuracy`, `--markdown`)."""

from __future__ import annotations

from typing import Any

from scoutbench.methods.fullkv import FullKV


def comparison_tables(results: list[dict[str, Any]], task_names: list[str]) -> list[tuple[str, list[str],
                                                                                      list[list[str]]]]:
    """The method configurations side by side, one row per task plus the mean over tasks: (title, header, rows)
    for the official score with its change relative to FullKV, the agreement with FullKV's own predictions, the
    teacher-forced fidelity (when measured) and the CPU seconds per record. Plain strings, for the terminal and
    for markdown alike."""
    reference = next((r for r in results if r["method_repr"] == repr(FullKV())), None)
    compared = [r for r in results if r is not reference]

    def entry(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
        return (result or {}).get("results", {}).get(name) or {}

    def n_of(name: str) -> str:
        return "/".join(str(c) for c in sorted({entry(r, name).get("n") for r in results} - {None}))

    def mean(values: list[float | None]) -> float | None:
        return None if not values or any(v is None for v in values) else sum(values) / len(values)

    def fmt(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def change(score: float | None, base: float | None) -> str:
        return "" if score is None or not base else f" ({100 * (score - base) / base:+.1f}%)"

    # the mean over the tasks that every configuration has (all of them once a run has finished)
    done = [t for t in task_names if all(entry(r, t) for r in results)]
    partial = "" if len(done) == len(task_names) else f" ({len(done)} of {len(task_names)} tasks)"
    mean_label = "mean" + partial
    rows = []
    for name in [*task_names, "mean"]:
        if name == "mean":
            scores = [mean([entry(r, t).get("score") for t in done]) for r in results]
            base = mean([entry(reference, t).get("score") for t in done]) if reference else None
            first = [mean_label, "", ""]
        else:
            scores = [entry(r, name).get("score") for r in results]
            base = entry(reference, name).get("score")
            first = [name, next((entry(r, name)["metric"] for r in results if entry(r, name)), ""), n_of(name)]
        rows.append([*first, *(fmt(score) + ("" if r is reference else change(score, base))
                               for score, r in zip(scores, results, strict=True))])
    tables = [("official score (change vs FullKV)", ["task", "metric", "n", *(r["label"] for r in results)], rows)]
    header = ["task", "n", *(r["label"] for r in compared)]

    def agreement(result: dict[str, Any], names: list[str]) -> str:
        vs = [entry(result, name).get("vs_fullkv") for name in names]
        if not all(vs):
            return "-"
        return (f"{fmt(mean([v['exact_match'] for v in vs]), 1)} / "
                f"{fmt(mean([v['metric_vs_fullkv_pred'] for v in vs]), 1)}")

    if any(entry(r, t).get("vs_fullkv") for r in compared for t in task_names):
        rows = [[name, n_of(name), *(agreement(r, [name]) for r in compared)] for name in task_names]
        rows.append([mean_label, "", *(agreement(r, done) for r in compared)])
        tables.append(("agreement with FullKV's prediction: exact match % / metric with FullKV's prediction as the "
                       "reference", header, rows))

    def fidelity(result: dict[str, Any], names: list[str]) -> str:
        fids = [entry(result, name).get("fidelity") for name in names]
        if not fids or not all(f and f["compared_steps"] for f in fids):
            return "-"
        steps = sum(f["compared_steps"] for f in fids)  # the mean over every compared (record, step)
        top1 = sum(f["top1_agreement"] * f["compared_steps"] for f in fids) / steps
        kl = sum(f["kl_mean"] * f["compared_steps"] for f in fids) / steps
        return f"{fmt(top1, 1)} / {kl:.3g}"

    steps = next((entry(r, t)["fidelity"]["steps"] for r in compared for t in task_names
                  if entry(r, t).get("fidelity")), None)
    if steps:
        rows = [[name, n_of(name), *(fidelity(r, [name]) for r in compared)] for name in task_names]
        rows.append(["all steps" + partial, "", *(fidelity(r, done) for r in compared)])
        tables.append((f"teacher-forced fidelity over FullKV's first {steps} generated tokens: top-1 agreement % / "
                       "KL(FullKV || method) nats", header, rows))

    def cpu(result: dict[str, Any], name: str) -> str:
        own, fid = entry(result, name).get("cpu_s_per_record"), (entry(result, name).get("fidelity") or {})
        extra = fid.get("cpu_s_per_record")
        return fmt(own, 0) + ("" if extra is None else f" + {extra:.0f}")

    if any(entry(r, t).get("cpu_s_per_record") is not None for r in results for t in task_names):
        rows = [[name, n_of(name), fmt(max((entry(r, name)["shared_prefill_cpu_s_per_record"] for r in results
                                            if "shared_prefill_cpu_s_per_record" in entry(r, name)), default=None), 0),
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
