"""`scoutbench throughput`: decode throughput and per-stage latency breakdown of one or more methods."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from scoutbench.cli.options import SEED, check_all_used, expand_methods, method_args_for, parse_method_args
from scoutbench.tiers import wait_frac
from scoutbench.units import format_length, parse_bytes, parse_length
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW

DEFAULT_OUTPUT = "results/runs"
# The no-argument run, per device type. CUDA: the paper's setup (Qwen3-14B shape, bf16, every method's default
# budget 2048 and block 32). CPU: bench-attn16, the paper models' dense share (2 of 16 layers) and GQA group (4)
# with a small hidden size, so that attention dominates a step as at long context on a GPU; every method in about
# a minute on 2 cores. Both at 32k with a synthetic prefill (the weights are random), every method with the same
# dense layers.
DEFAULT_MODELS = {"cuda": "qwen3-14b", "cpu": "bench-attn16"}
DEFAULT_LEN = "32k"
# (timed, warm-up) decode steps: fewer on a CPU, where a 32k FullKV step of bench-attn16 takes half a second
DEFAULT_STEPS = {"cuda": (16, 3), "cpu": (8, 2)}
DEFAULT_METHODS = ("fullkv", "quest", "infinigen", "hgca", "scout")  # the compared methods; `--method all` adds ablations


@click.command(name="throughput")
@click.option("--method", "methods", multiple=True, metavar="NAME",
              help="Method to run (repeatable), or 'all' for every registered one, ablations included "
                   f"(default: {', '.join(DEFAULT_METHODS)}).")
@click.option("--model", default=None,
              help="Built-in name (tiny-qwen3, bench-attn16, qwen3-8b, qwen3-14b, ...), local folder or Hugging Face "
                   f"id (default: {DEFAULT_MODELS['cuda']} on CUDA, {DEFAULT_MODELS['cpu']} on CPU).")
@click.option("--len", "length", default=DEFAULT_LEN, show_default=True,
              help="Prompt tokens per sequence: 4096, 4k (=4096), 64k, 1m.")
@click.option("--batch", default="1", show_default=True,
              help="Sequences decoded together, or 'auto': each method's largest batch that fits --gpu-mem "
                   "(halved and retried on out-of-memory).")
@click.option("--gpu-mem", default=None, help="Device memory for --batch auto, e.g. 80GiB (default: the CUDA "
              "device's usable memory; required on CPU).")
@click.option("--host-mem", default=None, help="Host memory for offloaded KV with --batch auto, e.g. 96GiB "
              "(default: this machine's available memory).")
@click.option("--steps", default=None, type=int,
              help=f"Timed decode steps (default {DEFAULT_STEPS['cuda'][0]} on CUDA, {DEFAULT_STEPS['cpu'][0]} on CPU).")
@click.option("--warmup", default=None, type=int,
              help=f"Untimed decode steps first (default {DEFAULT_STEPS['cuda'][1]} on CUDA, "
                   f"{DEFAULT_STEPS['cpu'][1]} on CPU).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--dtype", default=None, help="float32|bfloat16|float16 (fp32/bf16/fp16); default fp32 on CPU, bf16 on CUDA.")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--prefill", type=click.Choice(["auto", "real", "synthetic"]), default="auto", show_default=True,
              help="real: run the model on the prompt; synthetic: fill the KV cache with random K/V (decode only); "
                   "auto: synthetic for random-weight presets, real for real models.")
@click.option("--kv-skew", default=DEFAULT_KV_SKEW, show_default=True, type=float,
              help="Synthetic prefill: heavy-hitter spread of key magnitudes (temporal locality); 0 = i.i.d. keys.")
@click.option("--budget", default=None, help="Sparse token budget for methods that have one (e.g. 2048, 2k).")
@click.option("--block-size", default=None, type=int, help="Block size for block-sparse methods.")
@click.option("--dense-layers", default=None, type=click.IntRange(min=0),
              help="First layers every selected sparse method keeps dense (default: the methods' shared default, 2).")
@click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE",
              help="Set a method field (repeatable); applies to the selected methods that have it.")
@click.option("-o", "--output", default=DEFAULT_OUTPUT, show_default=True,
              help="A .json file (single method) or a folder receiving one file per method.")
@click.option("--overwrite", is_flag=True, help="Replace an existing .json output instead of failing.")
@click.option("--force", is_flag=True, help="Run even when the planned memory exceeds the free memory.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
def command(methods, model, length, batch, gpu_mem, host_mem, steps, warmup, device, dtype, seed, prefill, kv_skew,
            budget, block_size, dense_layers, method_args, output, overwrite, force, as_json):
    """Decode throughput and latency breakdown. With no arguments: the compared methods at 32k with a synthetic
    prefill, on the paper's Qwen3-14B shape (bf16, 16 steps) on CUDA, or on a CPU on bench-attn16 (16 layers of
    which 2 dense, GQA group 4, attention-dominated; 8 steps; about a minute on two idle cores)."""
    from rich.console import Console

    from scoutbench.errors import UsageError
    from scoutbench.results import check_writable, output_lock
    from scoutbench.throughput import (
        ThroughputConfig,
        build_method,
        resolve_device,
        resolve_dtype,
    )
    from scoutbench.workloads.synthetic import SyntheticWorkload

    resolved = resolve_device(device)
    kind = "cuda" if resolved.type == "cuda" else "cpu"
    model = model or DEFAULT_MODELS[kind]
    steps = DEFAULT_STEPS[kind][0] if steps is None else steps
    warmup = DEFAULT_STEPS[kind][1] if warmup is None else warmup
    batch = _parse_batch(batch)
    if batch == "auto" and gpu_mem is None and resolved.type != "cuda":
        raise UsageError("--batch auto needs --gpu-mem when the device is not CUDA (e.g. --gpu-mem 2GiB)")
    gpu_mem_bytes = parse_bytes(gpu_mem) if gpu_mem is not None else None
    host_mem_bytes = parse_bytes(host_mem) if host_mem is not None else None
    resolve_dtype(dtype, resolved)
    length_tokens = parse_length(length)
    budget_tokens = parse_length(budget, "--budget") if budget is not None else None
    names = expand_methods(methods or DEFAULT_METHODS)
    common = parse_method_args(method_args)
    used: set[str] = set()
    per_method = {name: method_args_for(name, common, budget_tokens, block_size, used, dense_layers)
                  for name in names}
    check_all_used(common, used, names)
    out_path = Path(output)
    single_file = out_path.suffix == ".json"
    if single_file and len(names) > 1:
        raise UsageError(f"-o {output} is a single .json file but {len(names)} methods were selected; "
                         "pass a folder instead")
    configs = [ThroughputConfig(method=name, method_args=per_method[name], model=model, length=length_tokens,
                                batch=batch, gpu_mem=gpu_mem_bytes, host_mem=host_mem_bytes, steps=steps,
                                warmup=warmup, device=device, dtype=dtype, seed=seed, prefill=prefill,
                                kv_skew=kv_skew, force=force, command=["scoutbench", *sys.argv[1:]])
               for name in names]
    for cfg in configs:  # validate every method's fields before loading anything
        SyntheticWorkload(cfg.length, 1 if cfg.batch == "auto" else cfg.batch, cfg.steps, cfg.warmup, cfg.seed,
                          "real", cfg.kv_skew)
        build_method(cfg.method, cfg.method_args)
    check_writable(out_path, overwrite)
    err = Console(stderr=True)
    with output_lock(out_path.parent if single_file else out_path):
        results, paths = _run_all(configs, err, out_path if single_file else None, out_path, overwrite)
    if as_json:
        click.echo(json.dumps([_summary(r, p) for r, p in zip(results, paths, strict=True)], indent=2))
    else:
        Console().print(_table(results))
        err.print(f"results: {', '.join(paths)}", highlight=False)


def _parse_batch(text: str) -> int | str:
    from scoutbench.errors import UsageError

    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)  # the workload checks that it is at least 1
    except ValueError:
        raise UsageError(f"bad --batch {text!r}: use a positive integer or 'auto'") from None


def _run_all(configs, console, single_file: Path | None, folder: Path, overwrite: bool):
    """Run each method and write its result as soon as it finishes: an interruption or a later method's failure
    keeps every finished result. The memory check of every method runs before the first one starts."""
    from scoutbench.models import load_model
    from scoutbench.progress import PhaseProgress
    from scoutbench.results import write_json_atomic, write_json_unique
    from scoutbench.throughput import (
        build_method,
        check_memory,
        resolve_device,
        resolve_dtype,
        run_throughput,
    )

    first = configs[0]
    device = resolve_device(first.device)
    dtype = resolve_dtype(first.dtype, device)
    with console.status(f"loading {first.model} ..."):
        loaded = load_model(first.model, device, dtype, first.seed)
    for cfg in configs:
        if cfg.batch != "auto":
            check_memory(cfg, build_method(cfg.method, cfg.method_args), loaded, cfg.batch)
    results, paths = [], []
    try:
        with PhaseProgress(console) as progress:
            for index, cfg in enumerate(configs, 1):
                where = f"[{index}/{len(configs)}] {cfg.method}"
                result = run_throughput(cfg, loaded,
                                        lambda phase, done, total, where=where: progress.update(f"{where} {phase}",
                                                                                                done, total))
                if single_file is not None:
                    path = write_json_atomic(single_file, result, overwrite=overwrite)
                else:
                    name = (f"throughput_{result['method']}_{cfg.model.replace('/', '--')}_len"
                            f"{format_length(cfg.length)}_b{result['workload']['batch']}.json")
                    path = write_json_unique(folder / name, result)
                results.append(result)
                paths.append(str(path))
    except BaseException:
        if paths:
            console.print(f"kept {len(paths)} finished result(s): {', '.join(paths)}", highlight=False)
        raise
    return results, paths


def _summary(result, path):
    return {"method": result["method"], "model": result["model"]["name"], "len": result["workload"]["len"],
            "batch": result["workload"]["batch"], "decode_throughput_tok_s": result["decode_throughput_tok_s"],
            "dense_layers": result["dense_layers"],
            "decode_step_ms": result["decode_step_ms"], "gpu_idle_frac": result["gpu_idle_frac"],
            "main_thread_wait_frac": result["main_thread_wait_frac"], "tiers": result["tiers"],
            "latency_breakdown_ms": result["latency_breakdown_ms"], "path": path}


# Table columns: stage groups in ms/step (the JSON keeps every stage).
STAGE_GROUPS = {"attn": ("attn_device", "merge"), "idle": ("idle",), "proj": ("qkv_proj", "predict", "o_proj"),
                "mlp": ("mlp",), "other": ("other",)}


def _table(results):
    from rich import box
    from rich.table import Table

    first = results[0]
    dense = sorted({r.get("dense_layers") for r in results} - {None})  # FullKV has none: dense everywhere
    mixed_dense = len(dense) > 1  # methods compared with different dense layers: say so on every row
    table = Table(title=f"{first['model']['name']} {first['model']['dtype']} {first['device']['type']}, "
                        f"len {first['workload']['len']}, batch {first['workload']['batch']}"
                        + (f", dense layers {dense[0]}" if len(dense) == 1 else "") + " (ms/step)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("method", no_wrap=True)
    if mixed_dense:
        table.add_column("dense", justify="right", no_wrap=True)
    wait_header = "idle%" if first.get("gpu_idle_frac") is not None else "wait%"  # CPU: main thread waiting
    for header in ("tok/s", "step", "vs full", wait_header, *[g for g in STAGE_GROUPS if g != "idle"]):
        table.add_column(header, justify="right", no_wrap=True)
    base = next((r["decode_throughput_tok_s"] for r in results if r["method"] in ("fullkv", "full")), None)
    for r in results:
        speedup = f"{r['decode_throughput_tok_s'] / base:.2f}x" if base else "-"
        dense_cell = "-" if r.get("dense_layers") is None else str(r["dense_layers"])
        row = [r["method"], *([dense_cell] if mixed_dense else []),
               f"{r['decode_throughput_tok_s']:.1f}", f"{r['decode_step_ms']['median']:.2f}", speedup,
               f"{100 * (wait_frac(r) or 0.0):.1f}"]
        breakdown = r["latency_breakdown_ms"]
        row += [f"{sum(breakdown[s] for s in stages):.2f}" for g, stages in STAGE_GROUPS.items() if g != "idle"]
        table.add_row(*row)
    return table
