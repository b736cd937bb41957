"""Measurement quality: spread and a confidence interval of the step time, the spread warning,
`throughput --profile` (a Chrome/Perfetto trace of extra, untimed steps) and NVTX ranges per stage."""

import gzip
import json
import math
import random
import statistics

import pytest
import torch
from cli_runner import run_cli

from scoutbench.step_stats import median_ci_ranks, spread_warning, step_summary
from scoutbench.timing import STAGES, StageTimer


@pytest.mark.parametrize("n,ranks", [(6, (1, 6)), (10, (2, 9)), (16, (4, 13)), (20, (6, 15)), (30, (10, 21))])
def test_median_interval_ranks_match_the_binomial_table(n, ranks):
    """The published order-statistic ranks of a 95% interval for the median (e.g. Conover, table A3)."""
    j, k, coverage = median_ci_ranks(n)
    assert (j, k) == ranks
    exact = sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2**n  # P(x_(j) <= median < x_(n+1-j))
    assert coverage == pytest.approx(exact) and coverage >= 0.95
    assert median_ci_ranks(n, confidence=coverage + 1e-9) is None or median_ci_ranks(n, coverage + 1e-9)[0] < j


def test_no_interval_below_six_steps():
    assert median_ci_ranks(5) is None  # best possible coverage 1 - 2/32 = 0.9375
    summary = step_summary([1.0, 1.1, 0.9, 1.0, 1.05])
    assert summary["ci95_low"] is None and summary["ci95_coverage"] is None
    assert "only 5 timed steps" in spread_warning(summary)


def test_step_summary_against_torch_and_statistics():
    values = [random.Random(3).lognormvariate(0, 0.3) for _ in range(25)]
    summary = step_summary(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    assert summary["std"] == pytest.approx(statistics.stdev(values))
    assert summary["p25"] == pytest.approx(torch.quantile(tensor, 0.25).item())
    assert summary["p75"] == pytest.approx(torch.quantile(tensor, 0.75).item())
    assert summary["iqr"] == pytest.approx(summary["p75"] - summary["p25"])
    assert summary["median"] == statistics.median(values) and summary["n"] == 25
    ordered = sorted(values)
    assert (summary["ci95_low"], summary["ci95_high"]) == (ordered[7], ordered[17])  # ranks 8 and 18 for n = 25
    assert summary["ci95_low"] <= summary["median"] <= summary["ci95_high"]


def test_spread_warning_only_when_the_interval_is_wide():
    steady = [10.0 + 0.01 * i for i in range(20)]
    assert spread_warning(step_summary(steady)) is None
    noisy = [10.0, 30.0, 5.0, 12.0, 50.0, 8.0, 20.0, 3.0, 40.0, 11.0]
    assert "too noisy to trust a ratio" in spread_warning(step_summary(noisy))


def test_nvtx_range_per_stage(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    timer = StageTimer("cpu")
    timer.begin_step()
    with timer.stage("attn_device"):
        pass  # off by default: no range
    timer.nvtx = True
    with timer.stage("predict"), timer.stage("idle"):
        pass
    record = timer.end_step()
    assert calls == [("push", "predict"), ("push", "idle"), ("pop",), ("pop",)]
    assert set(record) == {*STAGES, "total"}


def test_throughput_profile_writes_a_perfetto_trace_of_untimed_steps(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--model", "tiny-qwen3",
                             "--len", "512", "--budget", "192", "--steps", "3", "--warmup", "1", "--device", "cpu",
                             "--profile", tmp_path / "prof", "--profile-steps", "2", "-o", tmp_path / "r.json", "--json")
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert len(result["step_ms"]) == 3 and result["decode_step_ms"]["n"] == 3  # the profiled steps are not timed
    assert "only 3 timed steps" in result["step_spread_warning"]
    assert "warning: scout: only 3 timed steps" not in err  # --json prints no table and no warning lines
    profile = result["profile"]
    assert profile["steps"] == 2 and profile["activities"] == ["cpu"] and profile["timed"] is False
    trace_file = tmp_path / "prof" / "throughput_scout_tiny-qwen3_len512_b1.trace.json.gz"
    assert profile["trace"] == str(trace_file)
    trace = json.loads(gzip.decompress(trace_file.read_bytes()))
    events = trace["traceEvents"]
    # what Perfetto's JSON importer needs of a complete event: phase, name, timestamp, duration, pid, tid
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in complete)
    names = {e["name"] for e in complete}
    assert {"decode_step#0", "decode_step#1", "qkv_proj", "predict", "attn_device", "o_proj", "mlp"} <= names
    assert "decode_step#2" not in names
    steps = [e for e in complete if e["name"].startswith("decode_step#")]
    assert len(steps) == 2
    stage = next(e for e in complete if e["name"] == "attn_device")
    assert any(s["ts"] <= stage["ts"] and stage["ts"] + stage["dur"] <= s["ts"] + s["dur"] for s in steps)


def test_throughput_table_shows_the_interval_and_the_warning(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--model", "tiny-qwen3",
                             "--len", "64", "--steps", "2", "--warmup", "0", "--device", "cpu", "-o", tmp_path)
    assert code == 0, err
    assert "±95%" in out and "- !" in out
    assert "warning: fullkv: only 2 timed steps" in err
