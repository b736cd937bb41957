"""A throughput run is resolved once (scoutbench.bench.resolve.ResolvedRun): device, dtype, method and budget plan,
batch and memory plan are decided at the edge and the run executes them; the free-memory check runs once per
method, before the first method starts."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli

TINY = ("--model", "tiny-qwen3", "--len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu")


@pytest.mark.parametrize("batch", [["--batch", "2"], ["--batch", "auto", "--gpu-mem", "1.15GiB"]])
def test_the_memory_check_runs_once_per_method_and_before_the_first_run(batch, monkeypatch, capsys, tmp_path):
    import scoutbench.bench.resolve as resolve
    import scoutbench.bench.throughput as throughput

    events = []
    real_check, real_run = resolve.check_memory, throughput._run_at_batch

    def check(cfg, *args, **kwargs):
        events.append(("check", cfg.method))
        return real_check(cfg, *args, **kwargs)

    def run_at_batch(run, *args, **kwargs):
        events.append(("run", run.method))
        return real_run(run, *args, **kwargs)

    monkeypatch.setattr(resolve, "check_memory", check)
    monkeypatch.setattr(throughput, "_run_at_batch", run_at_batch)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "quest", *TINY,
                             *batch, "-o", tmp_path, "--json")
    assert code == 0, err
    assert events == [("check", "fullkv"), ("check", "quest"), ("run", "fullkv"), ("run", "quest")]
    assert all(s["batch"] >= 1 for s in json.loads(out))


def test_a_resolved_run_holds_the_dense_fallback_and_the_batch(tiny_qwen3):
    from scoutbench.bench.throughput import ThroughputConfig, resolve_run, run_throughput
    from scoutbench.models import LoadedModel

    loaded = LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)
    cfg = ThroughputConfig(method="quest", method_args={"budget": 4096}, model="tiny-qwen3", length=64, batch=2,
                           steps=1, warmup=0, device="cpu", prefill="synthetic")
    run = resolve_run(cfg, loaded)
    assert (run.batch, run.auto_plan, run.device.type) == (2, None, "cpu")
    assert not run.budget_plan.sparse and run.budget_plan.effective_budget == 65  # the budget covers 64 + 1 tokens
    requested, decoding = run.build()
    assert requested.name == "quest" and decoding.name == "fullkv"
    result = run_throughput(run)
    assert result["sparse"] is False and result["workload"]["batch"] == 2 and result["method"] == "quest"
