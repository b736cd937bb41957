"""What a run measures on its hardware, in one place for every runner and display.

On CUDA the "device" tier is GPU memory and the "host" tier is (pinned) CPU memory across PCIe, and the `idle`
stage (CUDA events around a host wait) is GPU idle time. On a CPU-only machine both tiers are the same CPU memory,
the "device" work and the CPU worker share the same cores, and `idle` is the main thread waiting for the worker:
a result must not call that GPU idle time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: `--help` and the sweep manifest must not import torch
    import torch


def tier_fields(device: torch.device) -> dict[str, Any]:
    """`tiers`: where a method's "device" and "host" KV live, and whether they are the same memory."""
    on_cuda = device.type == "cuda"
    return {"tiers": {"device": "cuda" if on_cuda else "cpu", "host": "cpu", "shared_memory": not on_cuda}}


def wait_fields(idle_ms: float, mean_step_ms: float, device_type: str) -> dict[str, float | None]:
    """`gpu_idle_frac` (CUDA only, else null) and `main_thread_wait_frac` (off CUDA, else null): the `idle`
    stage's share of the mean step under its honest name."""
    frac = idle_ms / mean_step_ms if mean_step_ms else 0.0
    on_cuda = device_type == "cuda"
    return {"gpu_idle_frac": frac if on_cuda else None, "main_thread_wait_frac": None if on_cuda else frac}


def wait_frac(result: dict[str, Any]) -> float | None:
    """The idle share a display shows: GPU idle on CUDA, the main thread's wait elsewhere (null if neither)."""
    gpu = result.get("gpu_idle_frac")
    return gpu if gpu is not None else result.get("main_thread_wait_frac")
