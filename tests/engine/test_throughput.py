"""The throughput run's checks (scoutbench/bench/throughput.py): memory need and free memory, and the prefill
`--prefill auto` picks."""

import dataclasses

import pytest

from scoutbench.errors import ScoutbenchError


def test_memory_need_is_the_planners_footprint(monkeypatch, tiny_qwen3):
    """What the check compares is exactly the planner's method footprint plus workspace, times the batch."""
    from scoutbench.bench.resolve import ThroughputConfig, check_memory, memory_need
    from scoutbench.methods import build_method
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import LoadedModel
    from scoutbench.planning import workspace_bytes_per_seq

    cfg = ThroughputConfig(method="scout", length=4096, steps=4, warmup=1)
    loaded = LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)
    method = build_method("scout", {})
    shape = ModelShape.from_config(tiny_qwen3.config)
    stored = 4096 + 1 + 4 + cfg.count_steps  # prompt, warm-up, timed and counted steps
    footprint = method.memory_footprint(shape, stored, 4)
    need = memory_need(cfg, method, loaded, batch=3)
    workspace = workspace_bytes_per_seq(shape, stored, 4, footprint.prefill_bytes_per_seq)
    assert need == {"device": 3 * (footprint.device_bytes_per_seq + workspace), "host": 3 * footprint.host_bytes_per_seq}
    total = need["device"] + need["host"]
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(total / 0.8) + 16)
    check_memory(cfg, method, loaded, 3)  # just fits (the planner's 20% host reserve kept)
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(total / 0.8) - 16)
    with pytest.raises(ScoutbenchError, match="needs about"):
        check_memory(cfg, method, loaded, 3)
    check_memory(dataclasses.replace(cfg, force=True), method, loaded, 3)  # --force


def test_an_explicit_host_mem_is_what_the_host_check_uses(monkeypatch, tiny_qwen3):
    """On CUDA (emulated) the host tier is checked against --host-mem where it is given: a VM whose RAM grows on
    demand reports less MemAvailable than it can have. Without --host-mem, MemAvailable is the budget."""
    from emulated import emulated_model

    from scoutbench.bench.resolve import ThroughputConfig, check_memory, memory_need
    from scoutbench.methods import build_method
    from scoutbench.models import LoadedModel
    from scoutbench.testing.emulated_cuda import emulated_cuda

    method = build_method("scout", {})
    with emulated_cuda():
        loaded = LoadedModel(emulated_model(tiny_qwen3), "tiny-qwen3", "preset", True)
        cfg = ThroughputConfig(method="scout", length=4096, steps=4, warmup=1, device="cuda")
        host = memory_need(cfg, method, loaded, batch=3)["host"]
        monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(host / 0.8) - 16)
        with pytest.raises(ScoutbenchError, match="of host memory .*free less the planner's reserve"):
            check_memory(cfg, method, loaded, 3)  # MemAvailable: too little now
        check_memory(dataclasses.replace(cfg, host_mem=int(host / 0.8) + 16), method, loaded, 3)
        with pytest.raises(ScoutbenchError, match=r"of host memory .*\(--host-mem less the planner's reserve\)"):
            check_memory(dataclasses.replace(cfg, host_mem=int(host / 0.8) - 16), method, loaded, 3)


def test_prefill_auto_is_synthetic_for_random_weights_and_real_otherwise(tiny_qwen3):
    from scoutbench.bench.throughput import resolve_prefill
    from scoutbench.models import LoadedModel

    assert resolve_prefill("auto", LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)) == "synthetic"
    assert resolve_prefill("auto", LoadedModel(tiny_qwen3, "some/model", "hub", False)) == "real"
    assert resolve_prefill("real", LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)) == "real"
