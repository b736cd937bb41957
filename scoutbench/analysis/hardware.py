"""Hardware profiles for the projection: device memory, bandwidth and peak FLOPs, bus bandwidth and per-copy
latency, host CPU attention rate, and the device's efficiency per kernel class, every number with its source (the
built-in scoutbench/data/hardware/*.json, or a file from `scoutbench calibrate`), read and validated here;
`analysis/projection.py` times a step's work on them.

The kernel efficiencies say how much of the memory bandwidth each kind of device attention kernel reaches (a short
block-sparse row does not stream like one long dense row) and what a layer's hand-off between device and host costs.
Each is marked `measured` (by `calibrate` on the device) or `assumed` (with its basis in its source), and is fixed
in the profile before any projection is compared with anything."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scoutbench.errors import UsageError

if TYPE_CHECKING:
    from scoutbench.analysis.work import Transfer

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "data" / "hardware"
_REQUIRED = {"device": ("memory_bytes", "memory_bw_bytes_s", "peak_flops"),
             "bus": ("bw_bytes_s", "transfer_overhead_s"),
             "host": ("cores", "memory_bytes", "memory_bw_bytes_s", "attention_bytes_s")}
_OPTIONAL = {"device": ("layer_overhead_s", "cores"), "bus": (),
             "host": ("task_overhead_s", "launch_s", "graph_replay_s")}
# the device's efficiency per kernel class (fractions of device.memory_bw_bytes_s) and the fixed cost of a layer's
# device-host hand-off (seconds); every profile has all of them, each with its basis
EFFICIENCIES = ("dense_attention", "digest_topk", "block_sparse_16", "block_sparse_32", "layer_handoff_s")
BASES = ("measured", "assumed")


@dataclass(frozen=True)
class Hardware:
    """A hardware profile: numbers (SI units, per second, per direction for the bus) and where each comes from."""

    name: str
    description: str
    values: dict[str, float]  # "device.memory_bw_bytes_s" -> value
    sources: dict[str, str]
    labels: dict[str, str]  # device.name, bus.generation, host.cpu
    shares_device: bool = False  # host and device are the same CPU (a calibrated CPU-only profile)
    path: str = ""
    bases: dict[str, str] = field(default_factory=dict)  # "efficiency.dense_attention" -> measured | assumed

    def get(self, key: str, default: float | None = None) -> float:
        if key in self.values:
            return self.values[key]
        if default is None:
            raise KeyError(key)
        return default

    def efficiency(self, name: str) -> float:
        return self.values[f"efficiency.{name}"]

    def attention_bytes_s(self, page_tokens: int) -> float:
        """The rate device attention reads KV at: contiguous KV (`page_tokens` 0) at the dense kernel's efficiency,
        selected pages at the block-sparse one of their size (pages of at most 16 tokens at the 16-token figure,
        larger ones at the 32-token figure)."""
        if page_tokens <= 0:
            kernel = "dense_attention"
        else:
            kernel = "block_sparse_16" if page_tokens <= 16 else "block_sparse_32"
        return self.values["device.memory_bw_bytes_s"] * self.efficiency(kernel)

    @property
    def select_bytes_s(self) -> float:
        """The rate block selection reads digests (or speculation keys) at, top-k included."""
        return self.values["device.memory_bw_bytes_s"] * self.efficiency("digest_topk")

    @property
    def layer_handoff_s(self) -> float:
        return self.efficiency("layer_handoff_s")

    def with_values(self, values: dict[str, float]) -> Hardware:
        """The same profile with some numbers replaced (`{"efficiency.dense_attention": 1.0}`), each marked as set
        by hand: what a sensitivity study varies."""
        changed = {key: float(value) for key, value in values.items()}
        unknown = sorted(set(changed) - set(self.values))
        if unknown:
            raise KeyError(unknown[0])
        return replace(self, values={**self.values, **changed},
                       sources={**self.sources, **{key: "set by hand (sensitivity)" for key in changed}},
                       bases={**self.bases, **{key: "assumed" for key in changed if key in self.bases}})

    def transfer_s(self, transfer: Transfer) -> float:
        if transfer.bytes <= 0:
            return 0.0
        return transfer.copies * self.values["bus.transfer_overhead_s"] + transfer.bytes / self.values["bus.bw_bytes_s"]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "path": self.path, "labels": self.labels,
                "shares_device": self.shares_device,
                "values": {k: {"value": v, "source": self.sources[k], **({"basis": self.bases[k]} if k in self.bases
                                                                         else {})}
                           for k, v in self.values.items()}}


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name, or a profile file (from `scoutbench calibrate` or written by hand)."""
    path = Path(name_or_path)
    if not path.suffix == ".json" or not path.exists():
        path = HARDWARE_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise UsageError(f"unknown hardware {name_or_path!r}: use one of {', '.join(hardware_names())} "
                         "or a profile file from `scoutbench calibrate -o FILE`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read hardware profile {path}: {exc}") from None
    return parse_hardware(data, str(path))


def _positive_number(value: Any) -> bool:
    """A finite number above 0: JSON's `true` is no number of bytes, and `Infinity` (which Python's json reads) no
    rate: either would make every projection from it meaningless, and --json print non-JSON."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def parse_hardware(data: Any, path: str = "") -> Hardware:
    """Validate a profile: a JSON object whose every required number is present, finite, positive, and has a
    non-empty `source`."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    where = path or "hardware profile"
    if not isinstance(data, dict):
        raise UsageError(f"{where}: a hardware profile is a JSON object of sections (device, bus, host), not "
                         f"{type(data).__name__}; start from a built-in one or `scoutbench calibrate -o FILE`")
    for section, required in _REQUIRED.items():
        body = data.get(section)
        if not isinstance(body, dict):
            raise UsageError(f"{where}: missing section {section!r}")
        for key in (*required, *_OPTIONAL[section]):
            entry = body.get(key)
            if entry is None and key not in required:
                continue
            if not (isinstance(entry, dict) and _positive_number(entry.get("value"))):
                got = json.dumps(entry.get("value") if isinstance(entry, dict) else entry)
                raise UsageError(f"{where}: {section}.{key} needs {{\"value\": a positive finite number, "
                                 f"\"source\": ...}}, got {got}")
            if not str(entry.get("source", "")).strip():
                raise UsageError(f"{where}: {section}.{key} has no source; say where the number comes from")
            values[f"{section}.{key}"] = float(entry["value"])
            sources[f"{section}.{key}"] = str(entry["source"])
    bases = _parse_efficiency(data.get("efficiency"), where, values, sources)
    labels = {"device": str(data["device"].get("name", "")), "bus": str(data["bus"].get("generation", "")),
              "host": str(data["host"].get("cpu", ""))}
    return Hardware(str(data.get("name", Path(path).stem)), str(data.get("description", "")), values, sources,
                    labels, bool(data["host"].get("shares_device", False)), path, bases)


def _parse_efficiency(body: Any, where: str, values: dict[str, float], sources: dict[str, str]) -> dict[str, str]:
    """The `efficiency` section: every kernel class of EFFICIENCIES with a positive value, a source and a basis
    (measured or assumed); returns the bases."""
    if not isinstance(body, dict):
        raise UsageError(f"{where}: missing section 'efficiency' (the device's efficiency per kernel class: "
                         f"{', '.join(EFFICIENCIES)}; docs/projection.md); run `scoutbench calibrate` again or add it")
    bases = {}
    for key in EFFICIENCIES:
        entry = body.get(key)
        if not (isinstance(entry, dict) and _positive_number(entry.get("value"))):
            got = json.dumps(entry.get("value") if isinstance(entry, dict) else entry)
            raise UsageError(f"{where}: efficiency.{key} needs {{\"value\": a positive finite number, \"basis\": "
                             f"measured or assumed, \"source\": ...}}, got {got}")
        if entry.get("basis") not in BASES:
            raise UsageError(f"{where}: efficiency.{key} needs a basis, measured or assumed "
                             f"(got {json.dumps(entry.get('basis'))})")
        if not str(entry.get("source", "")).strip():
            raise UsageError(f"{where}: efficiency.{key} has no source; say where the number comes from")
        values[f"efficiency.{key}"] = float(entry["value"])
        sources[f"efficiency.{key}"] = str(entry["source"])
        bases[f"efficiency.{key}"] = entry["basis"]
    return bases
