"""`scoutbench env` and `scoutbench methods`."""

from __future__ import annotations

import dataclasses
import shutil
import textwrap

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
              help="A JSON list with one object per method: name, class, display name, family, summary (the first "
                   "sentence of its docstring), fields (default, type), preset values and setting (its defaults' "
                   "point on its grid, the paper-literal one beside it; null without a grid).")
def methods_command(as_json: bool) -> None:
    """List the registered attention methods with their fields and defaults."""
    from scoutbench.methods import METHODS, method_family, setting_text

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
        defaults = {field: spec["default"] for field, spec in fields.items()}
        listing.append({"name": name, "available": True, "class": f"{cls.__module__}:{cls.__qualname__}",
                        "display_name": cls.display_name or cls.name, "family": method_family(name),
                        "summary": first_sentence(cls.__doc__ or ""), "fields": fields, "preset": dict(preset),
                        "setting": setting_text(name, defaults)})
    if as_json:
        from scoutbench.results import json_text

        click.echo(json_text(listing))
        return
    click.echo(methods_text(listing, shutil.get_terminal_size((100, 24)).columns))


def methods_text(listing: list[dict], width: int) -> str:
    """The listing for a terminal: each method's name in a column as wide as the longest, its display name (and
    for a preset, the family and the values it sets) and the whole first sentence of its docstring, then its
    fields, each wrapped under the column, never cut."""
    column = max(len(entry["name"]) for entry in listing) + 2
    width = max(column + 40, min(width, 120))
    indent = " " * column
    lines = []
    for entry in listing:
        if not entry["available"]:
            lines.append(f"{entry['name']:<{column}}unavailable ({entry['error']})")
            continue
        preset = entry["preset"]
        title = entry["display_name"] + (f" (preset of {entry['family']}: "
                                         + ", ".join(f"{k}={v!r}" for k, v in preset.items()) + ")" if preset else "")
        about = textwrap.wrap(f"{title}. {entry['summary']}", width - column) or [""]
        fields = ", ".join(f"{k}={v['default']!r}" for k, v in entry["fields"].items()) or "(no fields)"
        lines.append(f"{entry['name']:<{column}}{about[0]}")
        lines += [indent + line for line in about[1:]]
        # then its defaults' point on its grid (docs/methods.md), the paper's beside it, where it has a grid
        for label, text in (("fields", fields), ("setting", entry.get("setting"))):
            if text:
                lines += textwrap.wrap(f"{label}: {text}", width, initial_indent=indent,
                                       subsequent_indent=indent + "  ")
    return "\n".join(lines)


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, whole: up to the first full stop outside parentheses and backticks that
    ends a word (a summary cut at its first line ended mid-sentence)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    depth, code = 0, False
    for index, char in enumerate(text):
        if char == "`":
            code = not code
        elif not code and char == "(":
            depth += 1
        elif not code and char == ")":
            depth = max(0, depth - 1)
        elif char == "." and not code and depth == 0 and (index + 1 == len(text) or text[index + 1] == " "):
            return text[:index + 1]
    return text


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None  # required: no default


def _type_name(annotation) -> str:
    """A field's annotation as text (dataclass fields hold strings under `from __future__ import annotations`)."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
