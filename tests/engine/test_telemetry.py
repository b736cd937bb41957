"""NVML telemetry with a fake `pynvml` (no GPU here): the sampled GPU is the one CUDA runs on, matched by UUID when
CUDA_VISIBLE_DEVICES holds UUIDs or MIG ids or torch reports the device's UUID; energy per generated token."""

from __future__ import annotations

import sys
import types

import pytest

from scoutbench.telemetry import NvmlSampler, nvml_device

GPU_A, GPU_B, MIG_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000", \
    "MIG-cccccccc-0000-0000-0000-000000000000"


def fake_nvml(energy_step_mj: int = 5000) -> types.ModuleType:
    """Two physical GPUs (A = index 0, B = index 1) and a MIG instance on B; each energy read adds energy_step_mj."""
    nvml = types.ModuleType("pynvml")
    handles = {GPU_A: ("gpu", 0), GPU_B: ("gpu", 1), MIG_B: ("mig", 1)}
    energy = {0: 0, 1: 10_000_000}

    def by_uuid(uuid):
        if uuid not in handles:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return handles[uuid]

    def total_energy(handle):
        assert handle[0] == "gpu", "a MIG handle has no energy counter"
        energy[handle[1]] += energy_step_mj
        return energy[handle[1]]

    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceIsMigDeviceHandle = lambda handle: handle[0] == "mig"
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda handle: ("gpu", handle[1])
    nvml.nvmlDeviceGetTotalEnergyConsumption = total_energy
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=50.0 + handle[1], memory=10.0)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=1024)
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 300_000
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: 1980
    nvml.NVML_CLOCK_SM = 1
    return nvml


@pytest.mark.parametrize("visible,cuda_index,expected,mig", [
    (GPU_B, 0, 1, False),  # CUDA's device 0 is physical GPU 1: the ordinal would sample GPU 0
    (f"{GPU_B},{GPU_A}", 1, 0, False),
    ("1,0", 0, 1, False),
    (MIG_B, 0, 1, True),  # a MIG instance: its parent GPU is sampled, and the summary says so
    (None, 0, 0, False),
])
def test_nvml_samples_the_gpu_cuda_runs_on(monkeypatch, visible, cuda_index, expected, mig):
    nvml = fake_nvml()
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    handle, info = nvml_device(nvml, cuda_index)
    assert handle == ("gpu", expected) and info.get("mig", False) is mig
    with NvmlSampler(cuda_index, interval_ms=1) as sampler:
        pass
    summary = sampler.summary(tokens=10)
    assert summary["gpu_util_pct"]["mean"] == 50.0 + expected
    assert summary["device"] == info


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="emulated CUDA: needs a machine without CUDA")
def test_nvml_matches_the_uuid_torch_reports(monkeypatch):
    """On emulated CUDA with a device UUID (as torch's get_device_properties(i).uuid gives it, without a prefix),
    the UUID wins over a CUDA_VISIBLE_DEVICES ordinal that NVML numbers differently."""
    from scoutbench.testing.emulated_cuda import emulated_cuda

    nvml = fake_nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with emulated_cuda() as runtime:
        runtime.properties.uuid = GPU_B.removeprefix("GPU-")
        handle, info = nvml_device(nvml, 0)
    assert handle == ("gpu", 1) and info["matched_by"] == "cuda uuid"


def test_unknown_visible_device_is_an_error_not_the_wrong_gpu(monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffffffff-0000-0000-0000-000000000000")
    with pytest.raises(RuntimeError, match="matches no NVML device"):
        nvml_device(nvml, 0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with NvmlSampler(0) as sampler:  # the sampler reports it and measures nothing, rather than another GPU
        pass
    assert sampler.summary() is None and "matches no NVML device" in sampler.error


def test_energy_per_generated_token(monkeypatch):
    """The energy counter's difference over the sampled window, per generated token (batch x timed steps)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(energy_step_mj=5000))
    with NvmlSampler(0, interval_ms=1) as sampler:
        pass
    summary = sampler.summary(tokens=8)
    assert summary["energy_j"] == pytest.approx(5.0)  # one read at the start, one at the end: 5000 mJ apart
    assert summary["energy_j_per_token"] == pytest.approx(5.0 / 8)
    assert "energy_j_per_token" not in sampler.summary()
