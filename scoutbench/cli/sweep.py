"""`scoutbench sweep`, `scoutbench report` and `scoutbench gate`: grids of throughput points, the paper's figures
from their results, and regression gates for CI. Heavy imports stay inside the commands."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from scoutbench.bench.sweep_grid import PRESETS  # light: no torch at import time
from scoutbench.cli.options import DTYPE, SEED, STEPS, WARMUP, revision_option, rich_console
from scoutbench.method_args import BLOCK_SIZE, BUDGET, DENSE_LAYERS


def _split(values: tuple[str, ...]) -> list[str]:
    """Repeated or comma-separated: `--len 4k --len 8k` == `--len 4k,8k`."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _ints(values: tuple[str, ...], flag: str, auto: bool = False) -> list[int | str]:
    from scoutbench.errors import UsageError
    from scoutbench.units import INT64_MAX

    out: list[int | str] = []
    for value in _split(values):
        if auto and value.lower() == "auto":
            out.append("auto")
        elif value.isdigit() and 1 <= int(value) <= INT64_MAX:
            out.append(int(value))
        else:
            raise UsageError(f"bad {flag} {value!r}: use positive integers{' or auto' if auto else ''}, "
                             "repeated or comma-separated")
    return out


def _load_config(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """`--config grid.yaml|toml`: its keys are the flags' long names (`len`, `method`, `method_arg`, ...), and they
    become the command's defaults, so a flag given on the command line still wins (click's default_map)."""
    if path is None:
        return None
    from scoutbench.bench.sweep_grid import config_defaults, read_config

    by_flag = {opt.lstrip("-").replace("-", "_"): (p.name, bool(getattr(p, "multiple", False)))
               for p in ctx.command.params for opt in p.opts if opt.startswith("--") and p.name not in ("config", "as_json")}
    ctx.default_map = {**(ctx.default_map or {}), **config_defaults(read_config(path), by_flag)}
    return path


@click.command(name="sweep")
@revision_option
@click.option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True, expose_value=False,
              callback=_load_config,
              help="A YAML or TOML file of these options by their long names (len: [4k, 8k], method: [fullkv, "
                   "scout], method_arg: {recall_interval: [4, 8]}, ...); flags given here override it. The resolved "
                   "grid is saved as sweep_config.yaml in the sweep folder (itself a valid --config).")
@click.option("--preset", type=click.Choice(list(PRESETS)), default=None,
              help="The axes of a paper figure: lengths (Fig. 8), batch (Fig. 9), block-size (Fig. 10), breakdown "
                   "(Fig. 11), ablation (Fig. 12); at --scale cpu a CPU-only measurement, not the paper's figure. "
                   "Any axis flag below overrides the preset's.")
@click.option("--scale", type=click.Choice(["paper", "cpu"]), default=None,
              help="Preset sizes: paper (Qwen3-14B, 8k-64k, GPU) or cpu (bench-attn16, 4k-32k, minutes on 2 cores). "
                   "Default: paper on CUDA, cpu otherwise.")
@click.option("--method", "methods", multiple=True, metavar="NAME", help="Method (repeatable or a,b), or 'all'.")
@click.option("--len", "lengths", multiple=True, metavar="N", help="Prompt tokens (repeatable or 4k,8k; k = 1024).")
@click.option("--batch", "batches", multiple=True, metavar="N",
              help="Batch size (repeatable or 1,2), or 'auto': each method's largest batch that fits --gpu-mem.")
@click.option("--gpu-mem", default=None, help="Device memory for --batch auto, e.g. 80GiB (required on CPU).")
@click.option("--host-mem", default=None, help="Host memory for offloaded KV with --batch auto, e.g. 96GiB.")
@click.option("--budget", "budgets", multiple=True, metavar="N", help=f"{BUDGET.help} Repeatable or 1k,2k.")
@click.option("--block-size", "block_sizes", multiple=True, metavar="N", help=f"{BLOCK_SIZE.help} Repeatable or 16,32.")
@click.option("--dense-layers", default=None, type=click.IntRange(min=0), help=DENSE_LAYERS.help)
@click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
              help="A method field (repeatable; repeating a key sweeps its values).")
@click.option("--model", default=None, help="Model (default: the preset's, else tiny-qwen3).")
@click.option("--steps", default=None, type=STEPS, help="Timed decode steps per point (default 32, whole cycles of 32-token blocks; the block-size preset 64).")
@click.option("--warmup", default=None, type=WARMUP, help="Untimed decode steps first (default 3; cpu presets 2).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--dtype", default=None, type=DTYPE, help="Default fp32 on CPU, bf16 on CUDA.")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--prefill", type=click.Choice(["auto", "real", "synthetic"]), default="auto", show_default=True,
              help="As throughput's: real runs the model on the prompt; synthetic fills the KV cache with random K/V "
                   "(decode only); auto: synthetic for random-weight presets, real for real models (the sweep's "
                   "settings and every point record which).")
@click.option("-o", "--output", required=True, help="Sweep folder: one JSON per point and sweep.json.")
@click.option("--retry-failed", is_flag=True, help="Run points recorded as failed again (ok points are kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Run points here, one after another, or each as a Ray task (pip install 'scoutbench[ray]').")
@click.option("--address", default=None, help="Ray cluster to join, e.g. 10.0.0.1:6379 (default: a local instance).")
@click.option("--cpus-per-point", default=None, type=click.FloatRange(min=0.0, min_open=True),
              help="CPUs each Ray task asks for (default 1; points sharing a node share its cores and bandwidth).")
def command(preset, scale, methods, lengths, batches, gpu_mem, host_mem, budgets, block_sizes, dense_layers,
            method_args, model, steps, warmup, device, dtype, seed, prefill, output, retry_failed, as_json, executor,
            address, cpus_per_point):
    """Run a grid of throughput points (methods x lengths x batches x budgets x block sizes x method args) into
    one folder. Resumable: a rerun skips finished points. A failing point is recorded and the sweep goes on."""
    from dataclasses import replace

    from scoutbench.bench.executors import make_executor
    from scoutbench.bench.resolve import resolve_prefill
    from scoutbench.bench.sweep import run_sweep
    from scoutbench.bench.sweep_grid import Grid, Settings, expand
    from scoutbench.cli.options import expand_methods, parse_method_args
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.errors import ScoutbenchError, UsageError
    from scoutbench.method_args import check_methods_fit
    from scoutbench.methods import build_method
    from scoutbench.results import check_writable, json_text
    from scoutbench.units import parse_bytes, parse_length
    from scoutbench.workloads.synthetic import SyntheticWorkload

    resolved = resolve_device(device)
    resolve_dtype(dtype, resolved)
    if cpus_per_point is not None and executor != "ray":
        raise UsageError("--cpus-per-point is for --executor ray")
    if cpus_per_point is not None and not math.isfinite(cpus_per_point):
        raise UsageError(f"bad --cpus-per-point {cpus_per_point}: use a positive number, e.g. 1 or 0.5")
    point_executor = make_executor(executor, address, device, cpus_per_point)
    if scale and not preset:
        raise UsageError("--scale chooses a preset's sizes: add --preset NAME, or set --len/--batch directly")
    if preset:
        grid, settings = PRESETS[preset].grid_and_settings(scale or ("paper" if resolved.type == "cuda" else "cpu"))
    else:
        grid, settings = Grid(tuple(expand_methods(())), (4096,), (1,)), Settings()
    common: dict[str, tuple[str, ...]] = {}
    for pair in method_args:  # a repeated key sweeps its values
        for key, value in parse_method_args([pair]).items():
            common[key] = (*common.get(key, ()), value)
    grid = replace(
        grid,
        methods=tuple(expand_methods(_split(methods))) if methods else grid.methods,
        lengths=tuple(parse_length(v) for v in _split(lengths)) or grid.lengths,
        batches=tuple(_ints(batches, "--batch", auto=True)) or grid.batches,
        budgets=tuple(parse_length(v, "--budget") for v in _split(budgets)) or grid.budgets,
        block_sizes=tuple(parse_length(v, "--block-size") for v in _split(block_sizes)) or grid.block_sizes,
        method_args=common, dense_layers=dense_layers)
    settings = replace(settings, device=device, dtype=dtype, seed=seed,
                       gpu_mem=parse_bytes(gpu_mem) if gpu_mem else None,
                       host_mem=parse_bytes(host_mem) if host_mem else None,
                       **{k: v for k, v in dict(model=model, steps=steps, warmup=warmup).items() if v is not None})
    settings = replace(settings, prefill=resolve_prefill(prefill, settings.model))
    if "auto" in grid.batches and settings.gpu_mem is None and resolved.type != "cuda":
        raise UsageError("--batch auto needs --gpu-mem when the device is not CUDA (e.g. --gpu-mem 2GiB)")
    points = expand(grid, defaults=frozenset(flag for flag, given in ((BUDGET, budgets), (BLOCK_SIZE, block_sizes))
                                             if not given))  # a preset's sizes
    # every usage error before the first point runs, each distinct workload and method checked once, against the
    # model's shape (its layers: dense layers, a recall profile's) from its config
    for length, batch in dict.fromkeys((p.length, p.batch) for p in points):
        SyntheticWorkload(length, 1 if batch == "auto" else batch, settings.steps, settings.warmup, settings.seed,
                          settings.prefill)
    check_methods_fit([build_method(name, dict(args)) for name, args in dict.fromkeys((p.method, p.method_args)
                                                                                        for p in points)],
                      settings.model)
    check_writable(output, single_file=False)  # before the first line of output: an unwritable -o is the whole message
    err = rich_console(stderr=True)
    title = f"preset {preset} ({PRESETS[preset].figure})" if preset else "sweep"
    err.print(f"{title}: {len(points)} points on {settings.model} into {output}", highlight=False)
    resolved_config = {"preset": preset, "scale": scale, "method": list(grid.methods), "len": list(grid.lengths),
                       "batch": list(grid.batches), "budget": [b for b in grid.budgets if b is not None],
                       "block_size": [b for b in grid.block_sizes if b is not None],
                       "method_arg": {k: list(v) for k, v in grid.method_args.items()}, "model": settings.model,
                       "steps": settings.steps, "warmup": settings.warmup, "device": settings.device,
                       "dtype": settings.dtype, "seed": settings.seed, "prefill": settings.prefill,
                       "gpu_mem": settings.gpu_mem, "host_mem": settings.host_mem, "executor": executor}
    try:
        outcome = run_sweep(points, settings, output, preset=preset, command=["scoutbench", *sys.argv[1:]],
                            retry_failed=retry_failed, log=lambda line: err.print(line, highlight=False),
                            executor=point_executor, recall_profiles=preset is not None, config=resolved_config)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every finished point has its file
        err.print(f"kept the finished points in {output}; rerun the same command to resume", highlight=False)
        raise
    if as_json:
        click.echo(json_text({**outcome.manifest, "ran": outcome.ran, "skipped": outcome.skipped}))
    else:
        rich_console().print(_sweep_table(outcome.manifest))
        noisy = [p["id"] for p in outcome.manifest["points"] if p.get("step_spread_warning")]
        if noisy:
            err.print(f"warning: {len(noisy)} point(s) too noisy to trust a ratio (step_spread_warning in their "
                      f"files): {', '.join(noisy)}", highlight=False, soft_wrap=True)
        err.print(f"ran {outcome.ran}, skipped {outcome.skipped} (already done); results in {output}")
    if outcome.failed:
        raise ScoutbenchError(f"{len(outcome.failed)} of {len(outcome.manifest['points'])} points failed "
                              f"(recorded in {output}); fix the cause and rerun with --retry-failed")


def _sweep_table(manifest: dict):
    """One row per point. tok/s is tokens over the total timed time, then the median step; idle % is
    GPU idle on CUDA and the main thread's wait off it (tiers.wait_frac); `vs fullkv` as in the report."""
    from rich.table import Table

    from scoutbench.analysis.report import speedup_text
    from scoutbench.cli.options import settings_note, table_caption
    from scoutbench.methods import artefact_fields, is_reference, method_class
    from scoutbench.methods import resolved_method_config as resolved
    from scoutbench.tiers import wait_frac
    from scoutbench.units import format_length

    settings = manifest["settings"]
    # each point's method as its args resolve it: what its setting names (the paper's beside it)
    setting_caption = settings_note({"method": p["method"], "method_config": resolved(p["method"], p["method_args"])}
                                    for p in manifest["points"] if method_class(p["method"]) is not None)
    table = Table(title=f"sweep on {settings['model']} ({settings['prefill']} prefill, {settings['steps']} steps)",
                  caption=table_caption(
                      "tok/s: tokens over the total timed decode time (batch x timed steps / their summed time); "
                      "median step ms: the median step; idle/wait %: GPU idle on CUDA, the main thread's wait for the "
                      "CPU worker off it; vs fullkv: tok/s over FullKV's at the same len and batch (x/seq: per "
                      "sequence, where the batches differ)", setting_caption))
    for name in ("method", "args", "len", "batch", "status", "tok/s", "median step ms", "idle/wait %", "vs fullkv"):
        table.add_column(name, justify="right" if name not in ("method", "args", "status") else "left")
    fullkv = {(p["len"], p["batch"]): p for p in manifest["points"]
              if is_reference(p["method"]) and p["status"] == "ok"}
    for p in manifest["points"]:
        tok_s = p.get("decode_throughput_tok_s")
        base = fullkv.get((p["len"], p["batch"]))
        ok = p["status"] == "ok" and isinstance(tok_s, (int, float))
        status = p["status"] if p["status"] != "failed" else f"failed: {p.get('error')}"
        used = p.get("batch_used")
        batch = f"auto ({used})" if p["batch"] == "auto" and isinstance(used, int) else str(p["batch"])
        speedup = "-"
        if ok and base is not None and isinstance(base.get("decode_throughput_tok_s"), (int, float)):
            speedup = speedup_text(tok_s, used if isinstance(used, int) else 1, base["decode_throughput_tok_s"],
                                   base.get("batch_used") if isinstance(base.get("batch_used"), int) else 1)
        idle = wait_frac(p)
        artefacts = artefact_fields(p["method"])  # a per-point file by its name: its folder is the sweep's
        table.add_row(p["method"], " ".join(f"{k}={Path(str(v)).name if k in artefacts else v}"
                                            for k, v in p["method_args"].items()),
                      format_length(p["len"]), batch, status, f"{tok_s:.2f}" if ok else "-",
                      f"{p['decode_step_ms_median']:.1f}" if ok else "-",
                      f"{100 * idle:.1f}" if ok and idle is not None else "-", speedup)
    return table


@click.command(name="report")
@click.argument("results", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Folder for the figures and summary.md.")
@click.option("--figure-format", "figure_format", default="png,pdf", show_default=True, metavar="FORMATS",
              help="Comma-separated figure formats: png (300 dpi), pdf and svg (vector, fonts embedded as text).")
@click.option("--overwrite", is_flag=True,
              help="Replace the report already in the output folder (its figures and summary.md, as a whole).")
def report_command(results, output, figure_format, overwrite):
    """Figures for a paper (throughput vs length, batch scaling, block size, latency breakdown, ablation, accuracy
    vs budget; PNG and vector) and a markdown summary from result files or folders of any runs. Lists what it
    skipped and why."""
    from scoutbench.analysis.figures import parse_formats
    from scoutbench.analysis.report import build_report

    report = build_report(results, output, overwrite=overwrite, formats=parse_formats(figure_format))
    console = rich_console()
    for title, files in report.figures:  # markup=False: a label's "[...]" is text, not a rich style
        console.print(f"figure  {', '.join(str(f) for f in files)}  ({title})", highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"summary {report.summary}", highlight=False, markup=False)
    for what, why in report.skipped:
        console.print(f"skipped {what}: {why}", highlight=False, markup=False, soft_wrap=True)
    if report.merged:
        console.print(f"merged {len(report.merged)} repeat runs into the medians of their points (listed in the "
                      "summary)", highlight=False)


@click.command(name="gate")
@click.option("--baseline", "baseline", multiple=True, metavar="FILE_OR_DIR",
              help="Baseline results (repeatable). Without it only --ratio gates run.")
@click.option("--current", "current", multiple=True, required=True, metavar="FILE_OR_DIR",
              help="Results of the run under test (repeatable).")
@click.option("--tolerance", "tolerances", multiple=True, metavar="[METRIC=]FRACTION",
              help="Allowed regression: 5% (default for every metric) or METRIC=10% (repeatable).")
@click.option("--metric", "metrics", multiple=True, metavar="NAME",
              help="Gate only these metrics (repeatable; default all: decode_throughput_tok_s, decode_step_ms, "
                   "accuracy scores).")
@click.option("--ratio", "ratios", multiple=True, metavar="[METRIC:]A/B>=X",
              help="Speed-up between two methods of the current run, e.g. scout/fullkv>=3 (repeatable).")
@click.option("--force", is_flag=True, help="Compare results from different hardware anyway.")
@click.option("--allow-missing", is_flag=True, help="Baseline points absent from the current run do not fail.")
@click.option("--counters", is_flag=True,
              help="Gate the work counters (KV bytes per tier, bus bytes, attended tokens) against the baseline "
                   "instead of timings: deterministic and hardware-independent (default tolerance 1%).")
def gate_command(baseline, current, tolerances, metrics, ratios, force, allow_missing, counters):
    """Exit 1 when a metric regresses beyond tolerance against the baseline or a --ratio gate fails; 0 when all
    pass; 2 on a usage error, unreadable input or mismatched hardware (without --force)."""
    from scoutbench.analysis.gate import (
        fail_if_regressed,
        load_side,
        parse_ratio,
        parse_tolerances,
        passed_message,
        run_gate,
    )

    if counters:
        if ratios or metrics or force:
            from scoutbench.errors import UsageError

            raise UsageError("--counters gates work counters only: drop --ratio/--metric/--force, or run the "
                             "timing gate separately")
        _counter_gate(baseline, current, tolerances, allow_missing)
        return
    tol = parse_tolerances(tolerances)
    ratio_gates = [parse_ratio(spec) for spec in ratios]
    console = rich_console()
    skipped: list[tuple[str, str]] = []

    def on_skip(path, why: str) -> None:
        skipped.append((str(path), why))

    baseline_results = load_side(baseline, "baseline", on_skip) if baseline else None
    current_results = load_side(current, "current", on_skip)
    report = run_gate(baseline_results, current_results, tol, ratio_gates, set(metrics) or None, force,
                      allow_missing)
    for path, why in skipped:  # listed, never silently dropped: a skipped baseline file gates nothing
        console.print(f"skipped {path}: {why}", highlight=False, soft_wrap=True)
    if report.rows:
        console.print(_gate_table(report.rows, "against the baseline", ratio_column=True))
    if report.ratio_rows:
        title = "ratio gates on the current run" + ("; the baseline's ratio for reference" if baseline else "")
        console.print(_gate_table(report.ratio_rows, title, ratio_column=False))
    for warning in report.warnings:
        console.print(f"warning: {warning}", highlight=False)
    fail_if_regressed(report)
    console.print(passed_message(report))


def _counter_gate(baseline, current, tolerances, allow_missing) -> None:
    from scoutbench.analysis.counter_gate import DEFAULT_COUNTER_TOLERANCE, counter_gate
    from scoutbench.analysis.gate import fail_if_regressed, load_side, parse_tolerances, passed_message
    from scoutbench.errors import UsageError

    if not baseline:
        raise UsageError("--counters compares with a baseline: add --baseline FILE_OR_DIR")
    tolerance = parse_tolerances(tolerances, default=f"{DEFAULT_COUNTER_TOLERANCE}").default
    report = counter_gate(load_side(baseline, "baseline"), load_side(current, "current"), tolerance, allow_missing)
    console = rich_console()
    console.print(_gate_table(report.rows, "work counters against the baseline", ratio_column=True))
    for warning in report.warnings:
        console.print(f"warning: {warning}", highlight=False)
    fail_if_regressed(report, "counter gate")
    console.print(passed_message(report, "counter gate"))


def _gate_table(rows, title: str, ratio_column: bool):
    from rich.table import Table

    from scoutbench.analysis.gate import FAILING

    table = Table(title=title)
    for name in ("point", "metric", "baseline", "current", *(["ratio", "tolerance"] if ratio_column else []),
                 "verdict", "note"):
        table.add_column(name, justify="right" if name in ("baseline", "current", "ratio", "tolerance") else "left")
    style = {**{verdict: "bold red" for verdict in FAILING}, "improved": "green"}
    for row in rows:
        cells = [row.point, row.metric, _fmt(row.baseline), _fmt(row.current)]
        if ratio_column:
            cells += [_fmt(row.ratio, ".3f"), "-" if row.tolerance is None else f"{100 * row.tolerance:.0f}%"]
        table.add_row(*cells, f"[{style[row.verdict]}]{row.verdict}[/]" if row.verdict in style else row.verdict,
                      row.note)
    return table


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)
