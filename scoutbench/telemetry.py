"""NVML telemetry sampled on a background thread during the timed decode region.

`nvidia-ml-py` provides the `pynvml` module; it is imported lazily and any failure (no driver, no GPU, CPU-only
machine) means "no GPU telemetry" (`null` in the result), never a crash. NVML's utilization is the fraction of
time *any* kernel ran in the driver's sample window (1/6 s to 1 s), not SM occupancy: runs shorter than about
2 s are flagged `low_confidence`. Energy comes from the energy counter difference, not integrated power; divided
by the tokens generated in the window it is the energy per generated token.

Which GPU: NVML numbers devices physically and ignores `CUDA_VISIBLE_DEVICES`, whose entries may be ordinals,
GPU UUIDs or MIG ids, so CUDA ordinal i is matched by UUID: the device's own (torch's
`get_device_properties(i).uuid`), else the i-th `CUDA_VISIBLE_DEVICES` entry, else (no NVML UUID lookup) the
ordinal. A MIG instance has no utilization or energy counters of its own: its parent GPU is sampled and the
summary says `mig: true` (the numbers then cover the whole GPU).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any


def _visible_entry(cuda_index: int) -> str | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return None
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return entries[cuda_index] if cuda_index < len(entries) else None


def _torch_uuid(cuda_index: int) -> str | None:
    """The CUDA device's UUID as torch reports it (no "GPU-"/"MIG-" prefix), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
        return str(uuid) if uuid else None
    except Exception:  # noqa: BLE001 - no CUDA, or a torch without the property
        return None


def nvml_device(nvml: Any, cuda_index: int) -> tuple[Any, dict[str, Any]]:
    """(NVML handle to sample, how it was found) for CUDA ordinal `cuda_index` (see the module docstring)."""
    candidates = []
    uuid = _torch_uuid(cuda_index)
    if uuid:
        bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
        candidates += [("cuda uuid", f"GPU-{bare}"), ("cuda uuid", f"MIG-{bare}")]
    entry = _visible_entry(cuda_index)
    if entry and not entry.isdigit():
        candidates.append(("CUDA_VISIBLE_DEVICES", entry))
    for source, key in candidates:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(key)
        except Exception:  # noqa: BLE001 - not this form of the id
            continue
        return _parent_of_mig(nvml, handle, {"matched_by": source, "uuid": key})
    if entry and entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry)), {"matched_by": "CUDA_VISIBLE_DEVICES", "index": int(entry)}
    if entry:
        raise RuntimeError(f"CUDA_VISIBLE_DEVICES entry {entry!r} (CUDA device {cuda_index}) matches no NVML device")
    return nvml.nvmlDeviceGetHandleByIndex(cuda_index), {"matched_by": "ordinal", "index": cuda_index}


def _parent_of_mig(nvml: Any, handle: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    try:
        is_mig = bool(nvml.nvmlDeviceIsMigDeviceHandle(handle))
    except Exception:  # noqa: BLE001 - an NVML without MIG support
        is_mig = False
    if not is_mig:
        return handle, {**info, "mig": False}
    return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle), {**info, "mig": True}


class NvmlSampler:
    """Context manager: samples utilization, memory, power and SM clock every `interval_ms`."""

    def __init__(self, cuda_index: int = 0, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.cuda_index = cuda_index
        self.samples: list[dict[str, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._energy_start_mj: int | None = None
        self.device_info: dict[str, Any] = {}
        self._t0 = self._t1 = 0.0

    def __enter__(self) -> NvmlSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle, self.device_info = nvml_device(pynvml, self.cuda_index)
        except Exception as exc:  # noqa: BLE001 - no NVML = no telemetry
            self.error = f"{type(exc).__name__}: {exc}"
            self._nvml = None
            return self
        self._energy_start_mj = self._energy_mj()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="scoutbench-nvml", daemon=True)
        self._thread.start()
        return self

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 - pre-Volta or counter unsupported
            return None

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        sample = {"t_s": time.perf_counter() - self._t0, "gpu_util_pct": float(util.gpu),
                  "mem_util_pct": float(util.memory), "mem_used_bytes": float(memory.used)}
        try:
            sample["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            sample["sm_clock_mhz"] = float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001
            pass
        self.samples.append(sample)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # noqa: BLE001
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self._stop.wait(self.interval_ms / 1000.0)

    def __exit__(self, *exc: Any) -> None:
        if self._nvml is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._t1 = time.perf_counter()
        self._energy_end_mj = self._energy_mj()
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def summary(self, tokens: int | None = None) -> dict[str, Any] | None:
        """Mean/p50/max per metric, energy (and per generated token, given the `tokens` the window generated),
        the sampling parameters and how the GPU was matched; None when NVML was unavailable."""
        if self._nvml is None or not self.samples:
            return None
        duration_s = self._t1 - self._t0
        out: dict[str, Any] = {"interval_ms": self.interval_ms, "num_samples": len(self.samples),
                               "duration_s": duration_s, "low_confidence": duration_s < 2.0,
                               "device": dict(self.device_info)}
        for key in ("gpu_util_pct", "mem_util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz"):
            values = [s[key] for s in self.samples if key in s]
            if values:
                out[key] = {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}
        if self._energy_start_mj is not None and self._energy_end_mj is not None \
                and self._energy_end_mj >= self._energy_start_mj:
            out["energy_j"] = (self._energy_end_mj - self._energy_start_mj) / 1000.0
            if tokens:
                out["energy_j_per_token"] = out["energy_j"] / tokens
        if self.error:
            out["error"] = self.error
        return out


# nvmlClocksEventReasons bits (nvml.h; the older name is "clocks throttle reasons"), decoded here because the
# Python constant names changed between nvidia-ml-py releases while the bits did not.
CLOCK_EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                       0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                       0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def nvml_device_info(cuda_index: int = 0) -> dict[str, Any] | None:
    """Provenance of the GPU a result ran on, read once: NVIDIA driver, GPU UUID, enforced power limit and the
    reasons its clocks are held down right now (a thermally or power-capped GPU measures slower). None without
    NVML; a field NVML refuses on this GPU is null."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML = no provenance, never a failed run
        return None
    try:
        handle, found = nvml_device(pynvml, cuda_index)  # the GPU CUDA runs on, matched by UUID as the sampler does

        def read(call: str, *args: Any) -> Any:
            try:
                value = getattr(pynvml, call)(*args)
            except Exception:  # noqa: BLE001 - unsupported on this GPU or driver
                return None
            return value.decode() if isinstance(value, bytes) else value

        power_mw = read("nvmlDeviceGetEnforcedPowerLimit", handle)
        reasons = read("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:
            reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return {"driver_version": read("nvmlSystemGetDriverVersion"), "uuid": read("nvmlDeviceGetUUID", handle),
                "matched_by": found,
                "power_limit_w": None if power_mw is None else power_mw / 1000.0,
                "clock_event_reasons": None if reasons is None else
                [name for bit, name in CLOCK_EVENT_REASONS.items() if int(reasons) & bit]}
    except Exception:  # noqa: BLE001 - no handle for this index
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
