"""ScoutAttention's device pool and block size against every baseline at its strongest, on real text.

One real LongBench record per dataset (the first whose official prompt, middle-truncated to `--len` tokens, is that
long; `--record DATASET:INDEX` names one), prefilled once by a real model (default qwen2.5-1.5b, bf16) and cached on
disk (`SharedPrefill.cached`: a 16k prefill costs ~14 minutes of this 2-core CPU). FullKV greedily decodes `--steps`
tokens from it (also cached); every configuration is then teacher-forced on FullKV's tokens from the same prefill
(`SharedPrefill.forced`), so step t of every configuration sees the same history:

- ScoutAttention with a device pool of 1, 2, 3 and 4 selections (`pool_factor`), with periodic recall (every 8
  steps, the default) and without, at blocks of 32 and 16, and at blocks of 32 with a pool of 2 and the per-layer
  recall intervals that `scoutbench profile-recall` measured on the same records (`RECALL_PROFILE`);
- Quest with 32- and 16-token pages, one selection per KV head and per query head (`per_query_head`, its own code);
- InfiniGen with its fixed fetch (budget - 1 tokens) and its authors' two counts (`dynamic_count`: alpha 4 capped
  at 400 tokens, `infinigen-speedup`; alpha 5 capped at 20% of the context, `infinigen-dynamic`);
- HGCA at window shares of 0.25, 0.5 and 0.75, with and without the score-average read (`score_read`);
- FullKV forced on its own tokens (top-1 1, KL 0: the harness's check).

All at `--budget` (2048) and `--dense-layers` (2). Each (configuration, record) is one result file of kind
`throughput` (what `scoutbench project` reads: the method's stats over the forced steps) with, beside them, what
this sweep measures: top-1 agreement and KL(FullKV || method) per step, and for ScoutAttention the selection churn
(the share of a step's selected blocks that the previous step did not select) and the CPU compute ratio, per step
and per layer, from the method's trace; `device_bytes_per_seq` is the planner's footprint at this context.

    python benchmarks/real_text_sweep.py --data-dir LONGBENCH_DIR --dataset gov_report \\
        --dataset qmsum --dataset narrativeqa --dataset samsum -o results/real-text-sweep
    python benchmarks/real_text_sweep.py --table results/real-text-sweep --figure docs/real_text_sweep.png

Resumable: a finished file is kept when it was made with the same settings (model, dtype, length, budget, dense
layers, steps, record, prompt and configuration) and refused otherwise; files are written atomically, so a kill
loses at most the configuration in progress. The cached prefill and reference live in `--cache` (default
`$SCOUTBENCH_CACHE/prefill`), keyed by the same settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

import torch  # noqa: E402
from real_model_work import result_document  # noqa: E402  (beside this script)

from scoutbench.analysis import bootstrap  # noqa: E402
from scoutbench.cache import cache_root  # noqa: E402
from scoutbench.eval.fidelity import fullkv_reference, step_agreement  # noqa: E402
from scoutbench.eval.generation import Generation, SharedPrefill, method_spec  # noqa: E402
from scoutbench.eval.tables import NOTE, interval_cell  # noqa: E402
from scoutbench.methods import METHODS, setting_text  # noqa: E402
from scoutbench.methods.base import ModelShape  # noqa: E402
from scoutbench.models import load_model  # noqa: E402
from scoutbench.results import write_json_atomic  # noqa: E402
from scoutbench.units import format_length, parse_length  # noqa: E402
from scoutbench.workloads import longbench  # noqa: E402


@dataclass(frozen=True)
class Config:
    """One configuration of the sweep: a registered method and its fields (budget and dense layers come from the
    sweep's flags)."""

    label: str
    method: str
    args: dict[str, Any] = field(default_factory=dict)


# the per-layer recall intervals of `scoutbench profile-recall` on the sweep's own records (docs/accuracy.md), for
# the model and length of the run; a model without a profile there skips that row
RECALL_PROFILE = "results/recall-profiles/{model}-{len}-pool2x.json"


def configurations() -> list[Config]:
    """The grid, most telling first (a run cut short still has block 32 of every method)."""
    configs = [Config("fullkv", "fullkv")]
    for block in (32, 16):
        for pool in (1, 2, 3, 4):
            for recall in (True, False):
                configs.append(Config(f"scout-b{block}-pool{pool}x-{'pr' if recall else 'nopr'}", "scout",
                                      {"block_size": block, "pool_factor": pool, "pr": recall}))
        if block == 32:
            configs.append(Config("scout-b32-pool2x-profile", "scout",
                                  {"block_size": 32, "pool_factor": 2, "pr": True, "recall_profile": RECALL_PROFILE}))
            configs += [Config("infinigen-fixed", "infinigen"), *defaults_grid_points()]
        configs += [Config(f"quest-p{block}-{rows}", "quest", {"block_size": block, "per_query_head": rows == "qhead"})
                    for rows in ("kv", "qhead")]
    return configs


def defaults_grid_points() -> list[Config]:
    """The grid points of the one rule for every method's defaults (docs/methods.md) that the configurations above
    do not already run: InfiniGen's authors' two counts, and HGCA's window shares with and without the
    score-average read (`benchmarks/tune_defaults.py` reads every point from its result's config)."""
    return [Config("infinigen-alpha4-cap400", "infinigen",
                   {"dynamic_count": True, "alpha": 4.0, "count_cap": 400, "count_cap_frac": None}),
            Config("infinigen-alpha5-cap20pct", "infinigen",
                   {"dynamic_count": True, "alpha": 5.0, "count_cap": None, "count_cap_frac": 0.2}),
            *(Config(f"hgca-w{share:g}-{read}", "hgca", {"window_share": share, "score_read": read})
              for share in (0.25, 0.5, 0.75) for read in ("all", "selected"))]


def pick_records(data_dir: str, datasets: list[str], named: list[str], tokenizer: Any, length: int
                 ) -> list[tuple[str, int, dict[str, Any], dict[str, Any], list[int]]]:
    """(dataset, index, record, data source, prompt ids of exactly `length` tokens) per dataset (its first record
    that long) and per named record."""
    wanted = [(d, None) for d in datasets] + [(d, int(i or 0)) for d, _, i in (r.partition(":") for r in named)]
    out = []
    for dataset, index in wanted:
        rows, source = longbench.load_task_data(dataset, data_dir)
        task = longbench.LongBenchTask(dataset, rows, tokenizer, length, source)
        candidates = range(len(rows)) if index is None else [index]
        for i in candidates:
            prompt = task.input_ids(rows[i])
            if len(prompt) >= length:
                out.append((dataset, i, rows[i], source, longbench.truncate_middle_ids(prompt, length)))
                break
        else:
            print(f"{dataset}: no record of {length} tokens: skipped", file=sys.stderr)
    return out


def cached_reference(shared: SharedPrefill, steps: int, path: Path, key: dict[str, Any]) -> Generation:
    """FullKV's greedy tokens and predictions (`fullkv_reference`), from `path` when made with `key`."""
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            return Generation(saved["token_ids"], saved["log_probs"], saved["hidden"])
    reference = fullkv_reference(shared, steps)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"key": key, "token_ids": reference.token_ids, "log_probs": reference.log_probs,
                    "hidden": reference.hidden}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return reference


def trace_selection(trace: list[dict[str, Any]], k_sel: int, block_size: int, budget: int) -> dict[str, Any]:
    """From a ScoutAttention trace: per step (mean over sparse layers and (sequence, KV head)) the selection churn
    (blocks selected now and not at the previous step, over k_sel) and the CPU compute ratio (selected blocks not
    read on the device, in tokens over the budget), and both per layer (mean over steps; churn from step 1)."""
    plans = sorted((r for r in trace if r["kind"] == "plan"), key=lambda r: (r["layer"], r["step"]))
    churn: dict[int, dict[int, float]] = {}
    ratio: dict[int, dict[int, float]] = {}
    previous: dict[int, list[list[set[int]]]] = {}
    for r in plans:
        rows = [(sel, dev) for srow, drow in zip(r["selected"], r["device"], strict=True)
                for sel, dev in zip(srow, drow, strict=True)]
        ratio.setdefault(r["layer"], {})[r["step"]] = statistics.fmean(len(s - d) * block_size / budget
                                                                       for s, d in rows)
        before = previous.get(r["layer"])
        if before is not None:
            old = [s for row in before for s in row]
            churn.setdefault(r["layer"], {})[r["step"]] = statistics.fmean(
                len(s - o) / k_sel for (s, _), o in zip(rows, old, strict=True))
        previous[r["layer"]] = r["selected"]

    def per_step(table: dict[int, dict[int, float]]) -> list[float]:
        steps = sorted({s for by_step in table.values() for s in by_step})
        return [statistics.fmean(by_step[s] for by_step in table.values() if s in by_step) for s in steps]

    def per_layer(table: dict[int, dict[int, float]]) -> dict[str, float]:
        return {str(layer): statistics.fmean(by_step.values()) for layer, by_step in sorted(table.items())}

    churn_steps = per_step(churn)
    return {"churn_per_step": churn_steps, "churn_mean": statistics.fmean(churn_steps) if churn_steps else None,
            "churn_per_layer": per_layer(churn), "cpu_compute_ratio_per_step": per_step(ratio),
            "cpu_compute_ratio_per_layer": per_layer(ratio)}


def run_record(loaded: Any, dtype: torch.dtype, args: argparse.Namespace, configs: list[Config], out: Path,
               cache: Path, dataset: str, index: int, record: dict[str, Any], source: dict[str, Any],
               prompt: list[int]) -> None:
    length, steps = len(prompt), args.steps
    prompt_sha = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    settings = {"model": args.model, "dtype": args.dtype, "len": length, "budget": args.budget,
                "dense_layers": args.dense_layers, "steps": steps, "record": f"{dataset}#{index}",
                "record_id": record.get("_id"), "prompt_sha256": prompt_sha}
    label = f"{dataset}#{index} {record.get('_id', '')}".strip()
    files = {c.label: out / f"{c.label}_{dataset}-{index}.json" for c in configs}
    todo = [c for c in configs if not finished(files[c.label], {**settings, "config": c.label, "args": c.args})]
    if not todo:
        print(f"{label}: done already", flush=True)
        return
    stem = f"{args.model}-{args.dtype}-{dataset}-{index}-{format_length(length)}"
    start = time.time()
    shared = SharedPrefill.cached(loaded.model, prompt, cache / f"{stem}.prefill.pt",
                                  {"model": args.model, "dtype": args.dtype})
    print(f"{label}: prefill of {length} tokens ready ({time.time() - start:.0f} s)", flush=True)
    start = time.time()
    reference = cached_reference(shared, steps, cache / f"{stem}.fullkv{steps}.pt", settings)
    print(f"{label}: FullKV's {steps} tokens ready ({time.time() - start:.0f} s)", flush=True)
    shape = ModelShape.from_config(loaded.model.config)
    for config in todo:
        start = time.time()
        method_args = {k: v.format(model=args.model, len=format_length(length)) if isinstance(v, str) else v
                       for k, v in config.args.items()}
        profile = method_args.get("recall_profile")
        if profile is not None and not Path(profile).is_file():
            print(f"  {config.label}: no {profile}: skipped (make it with scoutbench profile-recall)", flush=True)
            continue
        spec = method_spec(config.method, method_args, budget=None if config.method == "fullkv" else args.budget,
                           dense_layers=None if config.method == "fullkv" else args.dense_layers)
        built = spec.build()
        device_bytes = built.memory_footprint(shape, length + steps, dtype.itemsize).device_bytes_per_seq
        built.close()
        traced: list[Any] = []

        def observe(method: Any, traced: list[Any] = traced) -> None:
            if hasattr(method, "trace"):  # ScoutAttention: its per-step selections
                method.trace = []
                traced.append(method)

        ours = shared.forced(spec, reference.token_ids[:steps], observe)
        agreement = step_agreement(reference, ours)
        document = result_document(spec.describe(), ours.method_stats, ours.step_ms, loaded, dtype, length, 0, steps,
                                   label, source, sys.argv)
        document["kv_source"] = (f"longbench({label}, official prompt middle-truncated to {length} tokens, "
                                 f"{loaded.name} prefill; teacher-forced on FullKV's {steps} greedy tokens)")
        document["real_text_sweep"] = {
            "settings": {**settings, "config": config.label, "args": config.args},
            "top1_agreement": statistics.fmean(agreement["top1"]), "kl_mean": statistics.fmean(agreement["kl"]),
            "per_step": agreement, "device_bytes_per_seq": device_bytes,
            "selection": trace_selection(traced[0].trace, traced[0].k_sel, traced[0].block_size, traced[0].budget)
            if traced else None}
        write_json_atomic(files[config.label], document, overwrite=True)
        print(f"  {config.label}: top-1 {document['real_text_sweep']['top1_agreement']:.3f}, "
              f"KL {document['real_text_sweep']['kl_mean']:.3f} ({time.time() - start:.0f} s)", flush=True)


def finished(path: Path, settings: dict[str, Any]) -> bool:
    """Whether `path` holds this configuration's result made with `settings`; a file made with others is an error
    (a rerun resumes only what the same settings made)."""
    if not path.exists():
        return False
    made = json.loads(path.read_text(encoding="utf-8")).get("real_text_sweep", {}).get("settings")
    if made != settings:
        sys.exit(f"{path} was made with other settings ({made}); use another -o, or delete it to redo it")
    return True


# ---------------------------------------------------------------------------------------------- tables, figure
def load_sweep(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The finished results of a sweep folder: configuration label -> record -> result."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        sweep = result.get("real_text_sweep")
        if sweep:
            out.setdefault(sweep["settings"]["config"], {})[sweep["settings"]["record"]] = result
    order = [c.label for c in configurations()]
    return dict(sorted(out.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))


def _setting(result: dict[str, Any]) -> str:
    """What a row ran: the registered method and the fields that differ from its defaults (budget, dense layers
    and every other field are the sweep's), then its grid point with the paper's beside it (`setting_text`)."""
    config, method = result["method_config"], result["method"]
    defaults = METHODS.load(method).defaults()
    shown = {k: v for k, v in config.items() if k not in ("budget", "dense_layers") and defaults.get(k) != v}
    point = setting_text(method, config)
    return (f"`{method}` " + (", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults")
            + ("" if point is None else f": {point}"))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per configuration, means over the records (tokens attended per (sequence, KV head) in a
    sparse layer, both tiers; recalled MB over the forced steps); then top-1 / KL / CPU ratio per record."""
    records = sorted({record for by_record in runs.values() for record in by_record})
    lines = ["| configuration | setting | records | attended tokens / head | CPU compute ratio | "
             "selection churn / step | recalled MB | device MB / sequence | top-1 vs FullKV | KL vs FullKV |",
             "|---" * 10 + "|"]
    for label, by_record in runs.items():
        results = list(by_record.values())
        sweeps = [r["real_text_sweep"] for r in results]
        ratios = [((r["method_stats"].get("cpu_compute_ratio") or {}).get("mean")) for r in results]
        churn = [s["selection"]["churn_mean"] for s in sweeps if s["selection"]]
        recall = [(r["method_stats"].get("recall") or {}).get("recalled_bytes") for r in results]
        attended = [(r["method_stats"].get("attended_tokens_per_head") or {}).get("mean") for r in results]
        lines.append(
            f"| {label} | {_setting(results[0])} | {len(results)} | "
            f"{_fmt(statistics.fmean(attended) if None not in attended else None, 0)} | "
            f"{_fmt(statistics.fmean(ratios) if None not in ratios else None)} | "
            f"{_fmt(statistics.fmean(churn) if churn else None)} | "
            f"{_fmt(statistics.fmean(recall) / 1e6 if None not in recall else None, 1)} | "
            f"{_fmt(statistics.fmean(s['device_bytes_per_seq'] for s in sweeps) / 1e6, 0)} | "
            f"{interval_cell(bootstrap.mean_interval([s['top1_agreement'] for s in sweeps]), 3)} | "
            f"{interval_cell(bootstrap.mean_interval([s['kl_mean'] for s in sweeps]), 3)} |")
    lines += ["", f"top-1 and KL: mean over the records (every record has the same steps), {NOTE}.", "",
              "Per record: top-1 / KL (CPU compute ratio)", "",
              "| configuration | " + " | ".join(records) + " |", "|---" * (len(records) + 1) + "|"]
    for label, by_record in runs.items():
        cells = []
        for record in records:
            result = by_record.get(record)
            if result is None:
                cells.append("-")
                continue
            sweep = result["real_text_sweep"]
            ratio = (result["method_stats"].get("cpu_compute_ratio") or {}).get("mean")
            cells.append(f"{sweep['top1_agreement']:.3f} / {sweep['kl_mean']:.2f}"
                         + (f" ({ratio:.3f})" if ratio is not None else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(runs: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """ScoutAttention's CPU compute ratio per step and per layer (block 32, pools of 1-4 selections, with and
    without recall; mean over the records) and every configuration's top-1 agreement against its device bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_layer, accuracy) = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for pool in (1, 2, 3, 4):
        for recall, style in (("pr", "-"), ("nopr", ":")):
            by_record = runs.get(f"scout-b32-pool{pool}x-{recall}")
            if not by_record:
                continue
            selections = [r["real_text_sweep"]["selection"] for r in by_record.values()]
            steps = [statistics.fmean(v) for v in zip(*(s["cpu_compute_ratio_per_step"] for s in selections),
                                                      strict=False)]
            name = f"pool {pool}x{'' if recall == 'pr' else ', no recall'}"
            by_step.plot(range(len(steps)), steps, style, color=colors[pool - 1], label=name)
            if recall == "pr":
                layers = sorted(selections[0]["cpu_compute_ratio_per_layer"], key=int)
                by_layer.plot([int(x) for x in layers], [statistics.fmean(s["cpu_compute_ratio_per_layer"][x]
                                                                          for s in selections) for x in layers],
                              "o-", color=colors[pool - 1], label=name, markersize=3)
    by_step.axhline(0.082, color="gray", lw=0.8, ls="--", label="paper: 8.2%")
    by_step.set(xlabel="decode step", ylabel="CPU compute ratio", title="ScoutAttention, block 32, per step")
    by_layer.set(xlabel="layer", ylabel="CPU compute ratio", title="per layer, recall every 8 steps")
    for label, by_record in runs.items():
        sweeps = [r["real_text_sweep"] for r in by_record.values()]
        x = statistics.fmean(s["device_bytes_per_seq"] for s in sweeps) / 1e6
        interval = bootstrap.mean_interval([s["top1_agreement"] for s in sweeps])
        y = interval.value
        accuracy.errorbar(x, y, yerr=[[y - interval.low], [interval.high - y]], fmt="o", markersize=3,
                          elinewidth=0.6, color=colors[["scout", "quest", "infinigen", "hgca", "fullkv"].index(
                              label.split("-")[0])])
        accuracy.annotate(label, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    accuracy.set(xscale="log", xlabel="device MB per sequence (log)", ylabel="top-1 agreement with FullKV",
                 title="every configuration, mean over records (95% bootstrap interval)")
    for axis in (by_step, by_layer):
        axis.legend(fontsize=7)
        axis.set_ylim(bottom=0)
    fig.suptitle("qwen2.5-1.5b, real LongBench records at 16k, budget 2048, teacher-forced on FullKV's tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the records (`pick_records`): this sweep's options, which benchmarks/selection_churn.py takes
    too so that both read the same records."""
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--data-dir", help="folder of official LongBench <name>.jsonl files")
    parser.add_argument("--dataset", action="append", default=[], help="a dataset (repeatable): its first record "
                        "of --len tokens")
    parser.add_argument("--record", action="append", default=[], metavar="DATASET:INDEX", help="a named record")
    parser.add_argument("--len", dest="length", default="16k", help="prompt tokens, exactly (default 16k)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_record_arguments(parser)
    parser.add_argument("--budget", default="2048")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=96, help="teacher-forced decode steps (default 96)")
    parser.add_argument("--config", action="append", help="configuration labels to run (default: all)")
    parser.add_argument("--cache", help="prefill cache folder (default $SCOUTBENCH_CACHE/prefill)")
    parser.add_argument("-o", "--output", default="results/real-text-sweep")
    parser.add_argument("--table", metavar="FOLDER", help="print the markdown tables of a sweep folder, run nothing")
    parser.add_argument("--figure", metavar="PNG", help="with --table: also draw the figure")
    args = parser.parse_args()
    if args.table:
        runs = load_sweep(Path(args.table))
        print(tables(runs))
        if args.figure:
            figure(runs, Path(args.figure))
        return
    args.budget = parse_length(args.budget, "--budget")
    configs = [c for c in configurations() if not args.config or c.label in args.config]
    unknown = set(args.config or ()) - {c.label for c in configs}
    if unknown or not (args.dataset or args.record) or not args.data_dir:
        sys.exit(f"unknown --config {sorted(unknown)}" if unknown else "give --data-dir and --dataset or --record")
    for name in {c.method for c in configs}:  # every method's code now: a long run is not changed by later edits
        METHODS.load(name)
    cache = Path(args.cache or cache_root() / "prefill")
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    loaded = load_model(args.model, "cpu", dtype)
    length = parse_length(args.length)
    for picked in pick_records(args.data_dir, args.dataset, args.record, loaded.tokenizer, length):
        run_record(loaded, dtype, args, configs, out, cache, *picked)


if __name__ == "__main__":
    main()
