"""`scoutbench throughput`: decode throughput and per-stage latency breakdown of one or more methods."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from scoutbench.api import DEFAULT_LENGTH, DEFAULT_MODELS, DEFAULT_STEPS
from scoutbench.cli.options import (
    BYTES,
    DTYPE,
    FORCE_HELP,
    LENGTH,
    SEED,
    STEPS,
    WARMUP,
    expand_methods,
    parse_method_args,
    revision_option,
    rich_console,
    settings_note,
    table_caption,
)
from scoutbench.method_args import BLOCK_SIZE, BUDGET, DENSE_LAYERS
from scoutbench.methods import SPEED_METHODS, is_reference
from scoutbench.step_stats import MAX_CI_HALF_WIDTH_FRAC
from scoutbench.tiers import wait_frac
from scoutbench.units import format_length
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW

DEFAULT_OUTPUT = "results/runs"
DEFAULT_METHODS = tuple(SPEED_METHODS)  # the algorithms (InfiniGen both ways); `--method all`: every registered one


@click.command(name="throughput")
@revision_option
@click.option("--method", "methods", multiple=True, metavar="NAME",
              help="Method to run (repeatable), or 'all' for every registered one, ablations included "
                   f"(default: {', '.join(DEFAULT_METHODS)}).")
@click.option("--model", default=None,
              help="Built-in name (tiny-qwen3, bench-attn16, qwen3-8b, qwen3-14b, ...), local folder or Hugging Face "
                   f"id (default: {DEFAULT_MODELS['cuda']} on CUDA, {DEFAULT_MODELS['cpu']} on CPU).")
@click.option("--len", "length", default=format_length(DEFAULT_LENGTH), show_default=True, type=LENGTH,
              help="Prompt tokens per sequence: 4096, 4k (=4096), 64k, 1m.")
@click.option("--batch", default="1", show_default=True,
              help="Sequences decoded together, or 'auto': each method's largest batch that fits --gpu-mem "
                   "(halved and retried on out-of-memory).")
@click.option("--gpu-mem", default=None, type=BYTES, help="Device memory for --batch auto, e.g. 80GiB (default: the CUDA "
              "device's usable memory; required on CPU).")
@click.option("--host-mem", default=None, type=BYTES, help="Host memory for offloaded KV with --batch auto, e.g. 96GiB "
              "(default: this machine's available memory).")
@click.option("--steps", default=None, type=STEPS,
              help="Timed decode steps (default: whole block cycles of the methods, at least "
                   f"{DEFAULT_STEPS['cuda'][0]} on CUDA, {DEFAULT_STEPS['cpu'][0]} on CPU: 32 with the defaults).")
@click.option("--amortise-blocks", is_flag=True,
              help="Where --steps is not whole block cycles: open the timed window on each method's next per-block "
                   "work (untimed steps first) and report the amortised step (result's block_window).")
@click.option("--warmup", default=None, type=WARMUP,
              help=f"Untimed decode steps first (default {DEFAULT_STEPS['cuda'][1]} on CUDA, "
                   f"{DEFAULT_STEPS['cpu'][1]} on CPU).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--dtype", default=None, type=DTYPE, help="Default fp32 on CPU, bf16 on CUDA.")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--prefill", type=click.Choice(["auto", "real", "synthetic"]), default="auto", show_default=True,
              help="real: run the model on the prompt; synthetic: fill the KV cache with random K/V (decode only); "
                   "auto: synthetic for random-weight presets, real for real models.")
@click.option("--kv-skew", default=DEFAULT_KV_SKEW, show_default=True, type=float,
              help="Synthetic prefill: heavy-hitter spread of key magnitudes (temporal locality); 0 = i.i.d. keys.")
@click.option("--budget", default=None, type=LENGTH, help=BUDGET.help)
@click.option("--block-size", default=None, type=LENGTH, help=BLOCK_SIZE.help)
@click.option("--dense-layers", default=None, type=click.IntRange(min=0), help=DENSE_LAYERS.help)
@click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
              help="Set a method field (repeatable); applies to the selected methods that have it.")
@click.option("-o", "--output", default=DEFAULT_OUTPUT, show_default=True,
              help="A .json file (single method) or a folder receiving one file per method.")
@click.option("--overwrite", is_flag=True,
              help="Replace existing results (the .json output, or this run's files in the -o folder) instead of "
                   "failing (exit 2).")
@click.option("--force", is_flag=True, help=FORCE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--profile", "profile_dir", default=None, type=click.Path(file_okay=False),
              help="Also write a torch.profiler trace of --profile-steps extra, untimed decode steps per method into "
                   "this folder (.trace.json.gz: open it in ui.perfetto.dev or chrome://tracing).")
@click.option("--profile-steps", default=4, show_default=True, type=STEPS, help="Decode steps in the --profile trace.")
@click.option("--nvtx", is_flag=True, help="NVTX range per stage on CUDA (for Nsight Systems; costs a little per stage).")
@click.option("--count-steps", default=8, show_default=True, type=click.IntRange(min=0),
              help="Extra, untimed decode steps after the timed ones in which the main thread's torch calls are "
                   "counted (the result's host.torch_calls_per_step); 0: not counted.")
@click.option("--cuda-graphs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Replay each decode step from piecewise CUDA graphs (its device work between host points, "
                   "captured once): auto = on where the device is CUDA.")
def command(methods, model, length, batch, gpu_mem, host_mem, steps, amortise_blocks, warmup, device, dtype, seed,
            prefill, kv_skew, budget, block_size, dense_layers, method_args, output, overwrite, force, as_json,
            profile_dir, profile_steps, nvtx, count_steps, cuda_graphs):
    """Decode throughput and latency breakdown. With no arguments: the compared methods at 32k with a synthetic
    prefill, on the paper's Qwen3-14B shape (bf16) on CUDA, or on a CPU on bench-attn16 (16 layers of which 2 dense,
    GQA group 4, attention-dominated; about a minute on two idle cores); 32 timed steps, whole block cycles."""
    from scoutbench.api import throughput_configs
    from scoutbench.errors import UsageError
    from scoutbench.results import check_writable, json_text, output_lock

    names = expand_methods(methods or DEFAULT_METHODS)
    out_path = Path(output)
    single_file = out_path.suffix == ".json"
    if single_file and len(names) > 1:
        raise UsageError(f"-o {output} is a single .json file but {len(names)} methods were selected; "
                         "pass a folder instead")
    configs = throughput_configs(names, model=model, length=length, batch=_parse_batch(batch), gpu_mem=gpu_mem,
                                 host_mem=host_mem, steps=steps, warmup=warmup, device=device, dtype=dtype, seed=seed,
                                 prefill=prefill, kv_skew=kv_skew, budget=budget, block_size=block_size,
                                 dense_layers=dense_layers, method_args=parse_method_args(method_args), force=force,
                                 profile_dir=profile_dir, profile_steps=profile_steps, nvtx=nvtx,
                                 count_steps=count_steps, cuda_graphs=cuda_graphs, amortise_blocks=amortise_blocks,
                                 command=["scoutbench", *sys.argv[1:]])
    check_writable(out_path, overwrite)
    taken = [] if single_file or overwrite else _taken_outputs(configs, out_path)
    if taken:  # as a single-file -o: an existing output without --overwrite is exit 2, before anything runs
        names = ", ".join(path.name for path in taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise UsageError(f"{out_path} already holds this run's results ({names}); pass --overwrite to replace them "
                         "or choose another -o")
    if profile_dir is not None:  # before the runs: a trace that cannot be written must not cost a finished run
        check_writable(profile_dir, single_file=False)
    err = rich_console(stderr=True)
    with output_lock(out_path.parent if single_file else out_path):
        results, paths = _run_all(configs, err, out_path if single_file else None, out_path, overwrite)
    finished = [(r, p) for r, p in zip(results, paths, strict=True) if r["status"] == "ok"]
    if as_json:
        click.echo(json_text([_summary(r, p) for r, p in zip(results, paths, strict=True)]))
    elif finished:
        rich_console().print(_table([r for r, _ in finished]))
        for result, _ in finished:
            if result.get("step_spread_warning"):
                err.print(f"warning: {result['method']}: {result['step_spread_warning']}", highlight=False)
            window = result["block_window"]
            if window["form"] == "partial":
                err.print(f"warning: {result['method']}: its {window['steps']} timed steps are not whole block cycles "
                          f"of {window['cycle_steps']} steps, so its per-block work is not at its real rate: use "
                          f"--steps {window['cycle_steps']} (a multiple) or --amortise-blocks", highlight=False)
    if not as_json:
        err.print(f"results: {', '.join(paths)}", highlight=False)
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        from scoutbench.errors import ScoutbenchError

        raise ScoutbenchError(f"{len(failed)} of {len(results)} methods failed ({', '.join(r['method'] for r in failed)}); "
                              "their result files hold each error, the others finished")


def _parse_batch(text: str) -> int | str:
    from scoutbench.errors import UsageError
    from scoutbench.units import INT64_MAX

    if text.strip().lower() == "auto":
        return "auto"
    try:
        batch = int(text)  # the workload checks that it is at least 1
    except ValueError:
        raise UsageError(f"bad --batch {text!r}: use a positive integer or 'auto'") from None
    if batch > INT64_MAX:
        raise UsageError(f"bad --batch {text!r}: at most {INT64_MAX}")
    return batch


def _taken_outputs(configs, folder: Path) -> list[Path]:
    """The result files in `folder` this run would write (bench.throughput.result_file_name; under --batch auto any
    batch of the method's, whose batch is not known before it runs)."""
    import glob

    from scoutbench.bench.throughput import result_file_name

    taken = []
    for cfg in configs:
        batch = "BATCH" if cfg.batch == "auto" else cfg.batch
        name = result_file_name(cfg, {"method": cfg.method, "workload": {"batch": batch}})
        taken += sorted(folder.glob(glob.escape(name).replace("BATCH", "*")))
    return taken


def _run_all(configs, console, single_file: Path | None, folder: Path, overwrite: bool):
    """Run each method (api.run_throughput_configs: a refused or failing method gets a failed result and the next
    one runs) and write its result as soon as it finishes: an interruption keeps every finished result."""
    from scoutbench.api import run_throughput_configs
    from scoutbench.bench.throughput import result_file_name
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import load_model
    from scoutbench.progress import PhaseProgress
    from scoutbench.results import write_json_atomic

    first = configs[0]
    device = resolve_device(first.device)
    with console.status(f"loading {first.model} ..."):
        loaded = load_model(first.model, device, resolve_dtype(first.dtype, device), first.seed)
    paths = []

    def write(cfg, result) -> None:
        path = write_json_atomic(single_file if single_file is not None else folder / result_file_name(cfg, result),
                                 result, overwrite=overwrite)
        paths.append(str(path))

    try:
        with PhaseProgress(console) as progress:
            results = run_throughput_configs(configs, loaded=loaded, on_result=write, on_progress=progress.update,
                                             on_status=lambda message: console.print(message, highlight=False))
    except BaseException:
        if paths:
            console.print(f"kept {len(paths)} finished result(s): {', '.join(paths)}", highlight=False)
        raise
    return results, paths


def _summary(result, path):
    if result["status"] != "ok":
        return {"method": result["method"], "status": result["status"], "error": result["error"],
                "model": result["model"]["name"], "len": result["workload"]["len"],
                "batch": result["workload"]["batch"], "path": path}
    return {"method": result["method"], "status": "ok", "model": result["model"]["name"],
            "len": result["workload"]["len"],
            "batch": result["workload"]["batch"], "decode_throughput_tok_s": result["decode_throughput_tok_s"],
            "decode_step_ms": result["decode_step_ms"], "step_spread_warning": result.get("step_spread_warning"),
            "dense_layers": result["dense_layers"], "gpu_idle_frac": result["gpu_idle_frac"],
            "main_thread_wait_frac": result["main_thread_wait_frac"], "tiers": result["tiers"],
            "latency_breakdown_ms": result["latency_breakdown_ms"], "host": result["host"],
            "launch_bound": result["launch_bound"], "path": path}


# Table columns: stage groups in ms/step (the JSON keeps every stage).
# attn: what the method does (its attention and merge, and its prediction and selection: Quest scores inside its
# attention stage, ScoutAttention and InfiniGen in `predict`), so the column compares methods alike; model: the
# model's projections and MLP, the same work for every method. Idle is the wait column; the rest of a step (`other`)
# stays in the result's breakdown, so that the default run's six methods fit an 80-column terminal.
STAGE_COLUMNS = {"attn": ("attn_device", "predict", "merge"), "model": ("qkv_proj", "o_proj", "mlp")}


TABLE_CAPTION = ("tok/s: batch x timed steps / timed decode time (the mean step); step: the median step; "
                 "±95%: half-width of the median's 95% interval, % of the median (!: over "
                 f"{MAX_CI_HALF_WIDTH_FRAC:.0%} or under 6 steps, too wide to quote a ratio); vs full: tok/s over "
                 "FullKV's (x/seq: per sequence, where the batches differ); idle% (CUDA): the GPU's idle share of a "
                 "step, wait% (CPU): the main thread's wait for the CPU worker; calls: torch calls and CUDA graph "
                 "replays per step issued by the main thread; attn, model: mean ms per step of the method's "
                 "attention with its selection, and of the model's projections and MLP")
LAUNCH_BOUND_MARK = "^"
LAUNCH_BOUND_NOTE = (f"{LAUNCH_BOUND_MARK}: launch-bound (the host's issue time fills at least "
                     "{frac:.0%} of the step: the row measures Python and launches, not the method)")


def _calls_cell(result) -> str:
    """Torch calls and CUDA graph replays the main thread issues per step."""
    host = result.get("host") or {}
    calls = host.get("torch_calls_per_step")
    return "-" if calls is None else f"{calls + (host.get('graph_replays_per_step') or 0):.0f}"


def method_cell(result) -> str:
    """The method's name, marked when its steps are launch-bound."""
    return result["method"] + (LAUNCH_BOUND_MARK if result.get("launch_bound") else "")


def _ci_cell(step_ms: dict) -> str:
    """Half-width of the median step's 95% interval in % of the median ('-' under 6 steps); '!' marks a warning."""
    if step_ms.get("ci95_low") is None or not step_ms["median"]:
        return "- !"
    frac = (step_ms["ci95_high"] - step_ms["ci95_low"]) / 2 / step_ms["median"]
    return f"{100 * frac:.0f}%" + (" !" if frac > MAX_CI_HALF_WIDTH_FRAC else "")


def _table(results):
    """One row per method. tok/s is batch x steps / decode time (the mean step), `step` the median step. With
    --batch auto the methods ran at different batches: the title says so, a batch column appears, and `vs full`
    gives the per-sequence ratio next to the total one (report.speedup_text)."""
    from rich import box
    from rich.table import Table

    from scoutbench.analysis.report import speedup_text

    first = results[0]
    batches = {r["workload"]["batch"] for r in results}
    batch = f"batch {first['workload']['batch']}" if len(batches) == 1 else "batch per method (--batch auto)"
    dense = sorted({r.get("dense_layers") for r in results} - {None})  # FullKV has none: dense everywhere
    mixed_dense = len(dense) > 1  # methods compared with different dense layers: say so on every row
    launch_bound = [r for r in results if r.get("launch_bound")]
    launch_note = LAUNCH_BOUND_NOTE.format(frac=launch_bound[0]["host"]["launch_bound_frac"]) if launch_bound else None
    # then each row's grid point (docs/methods.md, one rule), the paper's beside it
    caption = table_caption(TABLE_CAPTION, launch_note, settings_note(results))
    table = Table(title=f"{first['model']['name']} {first['model']['dtype']} {first['device']['type']}, "
                        f"len {first['workload']['len']}, {batch}"
                        + (f", dense layers {dense[0]}" if len(dense) == 1 else "") + " (ms/step)",
                  caption=caption,
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # the default run's fits 80 columns
    table.add_column("method", no_wrap=True)
    if mixed_dense:
        table.add_column("dense", justify="right", no_wrap=True)
    wait_header = "idle%" if first.get("gpu_idle_frac") is not None else "wait%"  # CPU: main thread waiting
    headers = ("batch",) * (len(batches) > 1) + ("tok/s", "step", "±95%", "vs full", wait_header, "calls")
    for header in (*headers, *STAGE_COLUMNS):
        table.add_column(header, justify="right", no_wrap=True)
    base = next((r for r in results if is_reference(r["method"])), None)
    for r in results:
        speedup = "-" if base is None else speedup_text(r["decode_throughput_tok_s"], r["workload"]["batch"],
                                                        base["decode_throughput_tok_s"], base["workload"]["batch"])
        dense_cell = "-" if r.get("dense_layers") is None else str(r["dense_layers"])
        row = [method_cell(r), *([dense_cell] if mixed_dense else []),
               *([str(r["workload"]["batch"])] if len(batches) > 1 else []),
               f"{r['decode_throughput_tok_s']:.1f}", f"{r['decode_step_ms']['median']:.2f}",
               _ci_cell(r["decode_step_ms"]), speedup, f"{100 * (wait_frac(r) or 0.0):.1f}", _calls_cell(r)]
        breakdown = r["latency_breakdown_ms"]
        row += [f"{sum(breakdown[s] for s in stages):.2f}" for stages in STAGE_COLUMNS.values()]
        table.add_row(*row)
    return table
