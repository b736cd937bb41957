"""Which device and dtype a run uses, and how results describe that device: the one resolution every command shares
(throughput, sweep, accuracy, plan, profile-recall), so `--device` and `--dtype` mean the same everywhere."""

from __future__ import annotations

import platform
from typing import Any

import torch

from scoutbench.errors import UsageError
from scoutbench.kernels.cpu_attention import cpuinfo_field
from scoutbench.models import parse_dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda requested but CUDA is not available here; use --device cpu or auto")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise UsageError(f"unknown --device {name!r}: use auto, cpu or cuda")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The named dtype; by default bfloat16 on CUDA (the paper's) and float32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def device_description(device: torch.device) -> dict[str, Any]:
    """The result's `device`: its `class` is what the gate matches baselines on (same GPU, or same CPU model, vector
    instruction set and threads). The instruction set is in the class because a VM's model name can hide it: Zen 3
    and Zen 4 guests both read "AMD EPYC", and the CPU kernels take different paths on them (AVX2 or AVX-512, docs/platform.md)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return {"type": "cuda", "name": name, "class": f"cuda:{name}", "index": device.index or 0}
    threads = torch.get_num_threads()
    name = cpu_model()
    isa = torch.backends.cpu.get_cpu_capability()
    return {"type": "cpu", "name": name, "class": f"cpu:{name}:{isa}:{threads}t", "threads": threads}
