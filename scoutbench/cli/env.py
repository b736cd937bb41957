"""`scoutbench env` and `scoutbench methods`."""

from __future__ import annotations

import dataclasses
import json

import click


@click.command(name="env")
@click.option("--json", "as_json", is_flag=True)
def command(as_json: bool) -> None:
    """Print torch/transformers versions, CUDA, NVML and flashinfer availability, CPU model and threads."""
    from scoutbench.results import env_info
    from scoutbench.telemetry import NvmlSampler

    info = env_info()
    with NvmlSampler(interval_ms=50) as probe:
        pass
    info["nvml"] = "available" if probe.error is None else f"unavailable ({probe.error.splitlines()[0][:120]})"
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(map(len, info))
    for key, value in info.items():
        click.echo(f"{key:<{width}}  {value}")


@click.command(name="methods")
def methods_command() -> None:
    """List the registered attention methods with their fields and defaults."""
    from scoutbench.methods import METHODS

    for name in METHODS.names():
        try:
            cls = METHODS.load(name)
        except ImportError as exc:
            click.echo(f"{name:<11} unavailable ({exc})")
            continue
        preset = METHODS.preset(name)
        fields = ", ".join(f"{f.name}={preset.get(f.name, f.default)!r}" for f in dataclasses.fields(cls))
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        click.echo(f"{name:<11} {doc}\n{'':<11} {fields or '(no fields)'}")
