"""`scoutbench project` (measured work -> projected decode step on a hardware profile) and `scoutbench calibrate`
(this machine's profile). The model is scoutbench/analysis/projection.py; docs/projection.md explains it and its limits."""

from __future__ import annotations

import sys

import click

from scoutbench.cli.options import DTYPE, LENGTH, revision_option, rich_console
from scoutbench.cli.plan import DECODE_INSTANCE_HELP
from scoutbench.method_args import DENSE_LAYERS
from scoutbench.units import format_length


@click.command(name="project")
@revision_option
@click.argument("results", nargs=-1, required=True)
@click.option("--hardware", required=True, metavar="NAME|FILE",
              help="A built-in profile (a100-80gb-pcie, h100-sxm, h100-pcie, h200, l40s, gh200, paper) or a file "
                   "from `scoutbench calibrate -o`.")
@click.option("--model", default=None, help="Target model: a built-in name, a local folder or a Hugging Face id, "
              "whose config gives the shape (default: each result's own model).")
@click.option("--len", "length", default=None, help="Target context length, e.g. 64k (default: each result's).")
@click.option("--batch", default=None, help="Target batch, or 'auto': each method's largest batch that fits the "
              "profile's device and host memory (default: each result's).")
@click.option("--budget", default=None, type=LENGTH, help="Target sparse budget, e.g. 2k (default: each result's; "
              "required to carry a run with a budget to another --len).")
@click.option("--block-size", default=None, type=LENGTH, help="Target block size (default: each result's).")
@click.option("--dense-layers", default=None, type=click.IntRange(min=0), help=DENSE_LAYERS.help)
@click.option("--decode-instance", is_flag=True, help=DECODE_INSTANCE_HELP)
@click.option("--dtype", default=None, type=DTYPE, help="Target weight/KV dtype: bf16, fp16, fp32 (default: each result's).")
@click.option("--fetch-granularity", type=click.Choice(["gathered", "token"]), default="gathered", show_default=True,
              help="InfiniGen's copies: gathered (this tool's implementation) or token (one copy per token, as the "
                   "paper describes its baseline).")
@click.option("--cuda-graphs", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="The host issue of a step: replayed from CUDA graphs (as SGLang decodes), or eager launches.")
@click.option("-o", "--output", default=None, help="Write the projection JSON here (atomically; `report` reads it).")
@click.option("--overwrite", is_flag=True, help="Replace an existing -o file instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the projection JSON on stdout.")
def command(results, hardware, model, length, batch, budget, block_size, dense_layers, decode_instance, dtype,
            fetch_granularity, cuda_graphs, output, overwrite, as_json):
    """Project each method's decode step from measured runs (RESULTS: files or folders) onto a hardware profile,
    at the runs' shapes or at --model/--len/--batch: projected tok/s, step breakdown and device idle."""
    from scoutbench.analysis.hardware import load_hardware
    from scoutbench.analysis.projection import Target, projection_document
    from scoutbench.errors import UsageError
    from scoutbench.models import parse_dtype
    from scoutbench.results import check_writable, json_text, load_results, write_json_atomic
    from scoutbench.units import parse_length

    if batch is not None and batch != "auto" and not (batch.isdigit() and int(batch) >= 1):
        raise UsageError(f"bad --batch {batch!r}: use a positive integer or auto")
    if dtype is not None:
        parse_dtype(dtype)
    target = Target(model=model, length=parse_length(length) if length else None,
                    batch=None if batch is None else (batch if batch == "auto" else int(batch)),
                    budget=budget, block_size=block_size, dtype=dtype,
                    fetch_granularity=fetch_granularity, cuda_graphs=cuda_graphs == "on", dense_layers=dense_layers,
                    decode_instance=decode_instance)
    hw = load_hardware(hardware)
    if output:
        check_writable(output, overwrite, single_file=True)
    document = projection_document(load_results(results), hw, target, ["scoutbench", *sys.argv[1:]])
    for skipped in document["skipped"]:
        click.echo(f"skipped {skipped['file']}: {skipped['reason']}", err=True)
    if output:
        write_json_atomic(output, document, overwrite=overwrite)
    if as_json:
        click.echo(json_text(document))
        return
    _print_table(document)
    if output:
        click.echo(f"projection written to {output}")


# what each column of the projection table is (analysis/projection.py, docs/projection.md)
PROJECTION_CAPTION = ("batch: the batch projected and what limits it (device or host memory, or the weights); tok/s: "
                      "batch / the projected step; idle %: the device's wait in the step; attn, linear ms: the "
                      "device's attention, and its projections and MLP; cpu, h2d ms: the host CPU's work and the "
                      "bus's host-to-device copies a step, overlapped with the device's; host ms: the host's "
                      "launches of a step; bound by: what the step waits for most; measured ms (where shown): the "
                      "run's own step at that shape, then the projection's relative difference")


def _print_table(document: dict) -> None:
    """One row per projection; `len` is the prompt length (the measured run's, or --len). When two rows share
    method, model, len and batch (different measured points projected to one target), a `from` column names each
    row's source point."""
    from rich.table import Table

    from scoutbench.analysis.projection import budget_cell, needs_source_column
    from scoutbench.cli.options import settings_note, table_caption

    hw = document["hardware"]
    decode = ", decode instance" if document["target"].get("decode_instance") else ""
    table = Table(title=f"projected on {hw['name']} ({hw['labels']['device']}, {hw['labels']['bus']}, "
                        f"{hw['labels']['host']}{decode}); budget: the run's -> the projection's where they differ",
                  caption=table_caption(PROJECTION_CAPTION, settings_note(document["projections"])))
    with_source = needs_source_column(document["projections"])
    # the measured step only where some row was projected at its own run's shape and kind of machine
    with_measured = any(p.get("measured_step_ms") is not None for p in document["projections"])
    columns = ("method", "model", "len", "batch", "budget", "tok/s", "step ms", "idle %", "attn ms", "linear ms", "cpu ms",
               "h2d ms", "host ms", "bound by", *(["measured ms"] if with_measured else []),
               *(["from"] if with_source else []))
    for name in columns:
        table.add_column(name, justify="left" if name in ("method", "model", "bound by", "from") else "right")
    for p in document["projections"]:
        stages = p["latency_breakdown_ms"]
        batch = f"{p['batch']} ({p['batch_limited_by']})" if p["batch_limited_by"] else str(p["batch"])
        if not p["fits_memory"]:
            batch = f"{p['batch']} (> max {p['max_batch']})"
        measured = p.get("measured_step_ms")
        method = p["method"] + (" ^" if p.get("launch_bound") else "")
        host = p.get("host_issue_ms")
        table.add_row(method, p["model"], format_length(p["len"]), batch, budget_cell(p), f"{p['decode_throughput_tok_s']:.1f}",
                      f"{p['decode_step_ms']:.2f}", f"{100 * p['gpu_idle_frac']:.1f}", f"{stages['attn_device']:.2f}",
                      f"{stages['qkv_proj'] + stages['o_proj'] + stages['mlp']:.2f}", f"{p['cpu_ms_per_step']:.2f}",
                      f"{p['bus_h2d_ms_per_step']:.2f}", "-" if host is None else f"{host:.2f}", p["bound_by"],
                      *([("-" if measured is None else f"{measured:.2f} ({p['decode_step_ms'] / measured - 1:+.0%})")]
                        if with_measured else []),
                      *([p.get("source_point", "")] if with_source else []))
    rich_console().print(table)
    if any(p.get("launch_bound") for p in document["projections"]):
        click.echo("^: launch-bound (the host's launches take at least 90% of the step: with --cuda-graphs off, a "
                   "step measures Python and launches, not the method)")
    over = [p for p in document["projections"] if not p["fits_memory"]]
    if over:
        click.echo(f"warning: {len(over)} row(s) project a batch the profile's memory cannot hold (batch > max): a "
                   "step that cannot run there; lower --batch or pass --batch auto", err=True)


@click.command(name="calibrate")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Timed repeats per measurement (the median is kept).")
@click.option("-o", "--output", default=None, help="Write the profile JSON here (use it as `project --hardware FILE`).")
@click.option("--overwrite", is_flag=True, help="Replace an existing -o file instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile JSON on stdout.")
def calibrate_command(device, repeats, output, overwrite, as_json):
    """Measure this machine's profile: weight-streaming and attention rates, copy bandwidth and per-copy cost, the
    CPU worker's gather and attention rates, and the engine's per-layer overhead (about half a minute)."""
    from scoutbench.analysis.hardware import parse_hardware
    from scoutbench.bench.calibration import calibrate
    from scoutbench.devices import resolve_device
    from scoutbench.results import check_writable, json_text, write_json_atomic

    resolved = resolve_device(device)
    if output:  # before half a minute of measuring, as every other command checks its -o
        check_writable(output, overwrite, single_file=True)
    profile = calibrate(resolved, repeats, log=lambda line: click.echo(line, err=True))
    hardware = parse_hardware(profile, "calibrated profile")  # the same validation `project` applies
    if output:
        write_json_atomic(output, profile, overwrite=overwrite)
        click.echo(f"profile written to {output}", err=True)
    if as_json or not output:
        click.echo(json_text(profile))
        return
    for key, value in hardware.values.items():  # the result on stdout, as every command prints its own
        click.echo(f"{key:34s} {value:.4g}")
