"""`scoutbench plan`: per-method bytes per sequence (device and host) and the maximum batch, from the config alone."""

from __future__ import annotations

import click

from scoutbench.cli.options import (
    DTYPE,
    LENGTH,
    expand_methods,
    parse_method_args,
    revision_option,
    rich_console,
)
from scoutbench.method_args import BLOCK_SIZE, BUDGET, DENSE_LAYERS
from scoutbench.units import format_length, parse_bytes

DECODE_INSTANCE_HELP = ("Plan a decode instance of prefill-decode disaggregation (the ScoutAttention paper's "
                        "setting): sequences arrive prefilled, so no prefill transient is planned for.")


@click.command(name="plan")
@revision_option
@click.option("--model", required=True, help="Built-in name (qwen3-8b, qwen3-14b, qwen2.5-1.5b, ...), a local folder "
              "with config.json or a Hugging Face id (config.json only is read).")
@click.option("--len", "length", required=True, type=LENGTH, help="Tokens each sequence holds: 8k, 32k, 64k, 131072.")
@click.option("--gpu-mem", default=None, help="Device memory to plan for, e.g. 80GiB (default: the free memory of "
              "the CUDA device; required without CUDA).")
@click.option("--host-mem", default=None, help="Host memory for offloaded KV, e.g. 512GiB (default: not limited).")
@click.option("--method", "methods", multiple=True, metavar="NAME", help="Method (repeatable) or 'all' (default).")
@click.option("--budget", default=None, type=LENGTH, help=BUDGET.help)
@click.option("--block-size", default=None, type=LENGTH, help=BLOCK_SIZE.help)
@click.option("--dense-layers", default=None, type=click.IntRange(min=0), help=DENSE_LAYERS.help)
@click.option("--method-arg", "method_args", multiple=True, metavar="KEY=VALUE", help="Set a method field (repeatable).")
@click.option("--dtype", default="bf16", show_default=True, type=DTYPE, help="KV and weight dtype: bf16, fp16 or fp32.")
@click.option("--decode-instance", is_flag=True, help=DECODE_INSTANCE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per method.")
def command(model, length, gpu_mem, host_mem, methods, budget, block_size, dense_layers, method_args, dtype,
            decode_instance, as_json):
    """Memory per sequence and maximum batch of each method, without building the model (see scoutbench/planning.py
    for what is counted and the safety margin)."""

    from scoutbench.devices import resolve_device
    from scoutbench.method_args import MethodSettings, resolve_method_args
    from scoutbench.methods import build_method
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import model_config, parse_dtype
    from scoutbench.planning import device_free_bytes, plan_method
    from scoutbench.results import json_text

    context_len = length  # tokens (LENGTH)
    elem_bytes = parse_dtype(dtype).itemsize
    gpu_mem_bytes = _positive_bytes(gpu_mem, "--gpu-mem") if gpu_mem is not None else None
    host_mem_bytes = _positive_bytes(host_mem, "--host-mem") if host_mem is not None else None
    names = expand_methods(methods)
    per_method = resolve_method_args(names, MethodSettings.of(parse_method_args(method_args), budget=budget,
                                                              block_size=block_size, dense_layers=dense_layers))
    built = {name: build_method(name, args) for name, args in per_method.items()}
    config = model_config(model)
    if gpu_mem_bytes is None:
        gpu_mem_bytes = device_free_bytes(resolve_device("auto"))
    shape = ModelShape.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # keyed by the name asked for (scout-pc, not the class's scout)
    plans = [{**plan_method(method, shape, context_len, elem_bytes, gpu_mem_bytes, host_mem_bytes, tied,
                            decode_instance).to_dict(), "method": name, "method_config": method.config(), "model": model}
             for name, method in built.items()]
    if as_json:
        click.echo(json_text(plans))
        return
    _print_table(model, dtype, context_len, plans)


def _positive_bytes(text: str, flag: str) -> int:
    from scoutbench.errors import UsageError

    value = parse_bytes(text)
    if value <= 0:
        raise UsageError(f"bad {flag} {text!r}: must be more than 0 bytes, e.g. 80GiB")
    return value


def _print_table(model, dtype, context_len, plans):
    from rich import box
    from rich.table import Table

    from scoutbench.cli.options import settings_note
    from scoutbench.planning import format_bytes

    first = plans[0]
    host = "unlimited" if first["host_mem_bytes"] is None else format_bytes(first["host_mem_bytes"])
    workspace = "workspace/seq (decode instance)" if first["decode_instance"] else "workspace/seq"
    table = Table(title=f"{model} ({dtype}), len {format_length(context_len)}: device {format_bytes(first['gpu_mem_bytes'])}"
                        f" = weights {format_bytes(first['weights_bytes'])} + reserve "
                        f"{format_bytes(first['reserved_bytes'])} + batch x per-seq; host {host}",
                  caption=settings_note(plans), box=box.SIMPLE_HEAD)
    for header in ("method", "device/seq", workspace, "host/seq", "max batch", "limited by"):
        table.add_column(header, justify="left" if header in ("method", "limited by") else "right")
    for p in plans:
        table.add_row(p["method"], format_bytes(p["device_bytes_per_seq"]), format_bytes(p["workspace_bytes_per_seq"]),
                      format_bytes(p["host_bytes_per_seq"]), str(p["max_batch"]), p["limited_by"])
    rich_console().print(table)
    if first["limited_by"] == "weights":
        click.echo("the weights and the reserve alone do not fit: no batch is possible at this --gpu-mem")
