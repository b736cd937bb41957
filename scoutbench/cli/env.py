"""`scoutbench env` and `scoutbench methods`."""

from __future__ import annotations

import dataclasses

import click


@click.command(name="env")
@click.option("--json", "as_json", is_flag=True)
def command(as_json: bool) -> None:
    """Print torch/transformers versions, CUDA, NVML and flashinfer availability, CPU model and threads."""
    from scoutbench.results import env_info, json_text
    from scoutbench.telemetry import NvmlSampler

    info = env_info()
    with NvmlSampler(interval_ms=50) as probe:
        pass
    info["nvml"] = "available" if probe.error is None else f"unavailable ({probe.error.splitlines()[0][:120]})"
    if as_json:
        click.echo(json_text(info))
        return
    summary = info.pop("torch_env_summary")
    width = max(map(len, info))
    for key, value in info.items():
        click.echo(f"{key:<{width}}  {value}")
    click.echo(f"\ntorch_env_summary (torch.utils.collect_env, recorded in every result):\n{summary}")


@click.command(name="methods")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per method: name, class, summary, fields (default, type) and preset values.")
def methods_command(as_json: bool) -> None:
    """List the registered attention methods with their fields and defaults."""
    from scoutbench.methods import METHODS

    listing = []
    for name in METHODS.names():
        try:
            cls = METHODS.load(name)
        except ImportError as exc:
            listing.append({"name": name, "available": False, "error": str(exc)})
            continue
        preset = METHODS.preset(name)
        fields = {f.name: {"default": preset.get(f.name, _default(f)), "type": _type_name(f.type)}
                  for f in dataclasses.fields(cls)}
        listing.append({"name": name, "available": True, "class": f"{cls.__module__}:{cls.__qualname__}",
                        "summary": (cls.__doc__ or "").strip().splitlines()[0], "fields": fields,
                        "preset": dict(preset)})
    if as_json:
        from scoutbench.results import json_text

        click.echo(json_text(listing))
        return
    for entry in listing:
        if not entry["available"]:
            click.echo(f"{entry['name']:<11} unavailable ({entry['error']})")
            continue
        fields = ", ".join(f"{k}={v['default']!r}" for k, v in entry["fields"].items())
        click.echo(f"{entry['name']:<11} {entry['summary']}\n{'':<11} {fields or '(no fields)'}")


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None  # required: no default


def _type_name(annotation) -> str:
    """A field's annotation as text (dataclass fields hold strings under `from __future__ import annotations`)."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
