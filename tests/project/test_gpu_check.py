"""The GPU check (scripts/gpu_check.sh, scripts/gpu_check.py) on a CPU: a lent GPU runs it once, so every phase must
already work here. The dry run (`SCOUTBENCH_GPU_CHECK_CPU=1`: emulated CUDA, a tiny model, 2k) runs with fresh host
memory filling no faster than on the lent machine (`SCOUTBENCH_HOST_FILL_GIBS=0.2`, a VM whose RAM grows on
demand), where every offloading method's first touch of its host tier had cut the phases. Its preflight once
demanded `tomli`, which pyproject requires only below Python 3.11, and failed on every newer Python."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from repo_paths import REPO_ROOT
from result_factory import make_result, write_results

ROOT = REPO_ROOT
PHASES = ["preflight", "host", "plan", "profile", "setup", "max_batch", "equal_batch", "tests", "table"]
METHODS = ("scout", "hgca", "infinigen", "quest", "fullkv")
GIB = 1024**3


def _check_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_limits() -> dict[str, int]:
    """The phase limits of the lent GPU's run, as scripts/gpu_check.sh sets them (its second LIMITS: the first
    is the CPU dry run's)."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text(encoding="utf-8")
    line = [line for line in text.splitlines() if line.strip().startswith("LIMITS=(")][1]
    return {name: int(limit) for name, limit in re.findall(r"(\w+)=(\d+)", line)}


def _dry_run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SCOUTBENCH_GPU_CHECK_CPU": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=900)


def _table_rows(tmp_path) -> list[str]:
    table = (tmp_path / "out" / "gpu_check_table.txt").read_text(encoding="utf-8")
    return [line for line in table.splitlines() if line.split()[:1] and line.split()[0] in METHODS]


def test_every_phase_of_the_cpu_dry_run_passes_within_its_limit(tmp_path):
    done = _dry_run(tmp_path, SCOUTBENCH_HOST_FILL_GIBS="0.2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = (tmp_path / "out" / "gpu_check_phases.txt").read_text(encoding="utf-8").splitlines()
    phases = {line.split()[0]: line.split()[2] for line in lines}
    assert phases == {name: "0" for name in PHASES}, lines
    for line in lines:  # "name exit 0 12s (limit 300s)"
        took, limit = re.search(r"(\d+)s \(limit (\d+)s\)", line).groups()
        assert int(took) <= int(limit), line
    table = (tmp_path / "out" / "gpu_check_table.txt").read_text(encoding="utf-8")
    rows = _table_rows(tmp_path)
    assert len(rows) == 2 * len(METHODS) and not any("failed" in row or "not run" in row for row in rows), table
    # no recall profile of the synthetic prefill: ScoutAttention's rows say they ran its fixed interval
    assert "scout (fixed interval)" in table
    # equal_batch runs only what max_batch did not run at the equal batch
    results = json.loads((tmp_path / "out" / "gpu_check_results.json").read_text(encoding="utf-8"))
    equal = int(re.search(r"equal batch (\d+)", table).group(1))
    at_equal = {r["method"] for r in results if r["run"] == "max_batch" and r["workload"]["batch"] == equal}
    rerun = {json.loads(path.read_text())["method"] for path in (tmp_path / "out" / "raw" / "equal_batch").glob("*.json")}
    assert at_equal and rerun == set(METHODS) - at_equal
    assert {r["method"] for r in results if r.get("same_run_as_max_batch")} == at_equal
    host = json.loads((tmp_path / "out" / "gpu_check_host.json").read_text(encoding="utf-8"))
    assert 0 < host["fill_gib_s"] <= 0.2 * 1.01 and host["fill_env"] == 0.2


def test_the_gpu_phases_fit_six_minutes_of_device_time():
    """15 minutes of device time hold the machine's start, the check and a second try of it."""
    assert sum(_gpu_limits().values()) <= 360


@pytest.mark.parametrize("fill_gib_s", [0.13, 0.2, 0.3, "fallback"])
def test_the_sized_host_cap_fits_setup_and_every_offloading_method(fill_gib_s, monkeypatch):
    """At the lent machine's shape (qwen3-14b, 64k, 64 GiB asked) and its fill rates, the sized cap's kept buffer
    fills and registers within its share of the setup phase's limit, and still holds one sequence of every
    offloading method (each needs ~9.5 GiB of host tier at 64k). Touching 64 GiB at these rates takes 3.5-8 min.
    When the host phase measures nothing, the cap falls back to the one sized at the slowest documented rates."""
    from scoutbench.methods import build_method
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import preset_config
    from scoutbench.planning import plan_method

    check = _check_script()
    setup_s = _gpu_limits()["setup"]
    monkeypatch.delenv("SCOUTBENCH_HOST_FILL_GIBS", raising=False)
    if fill_gib_s == "fallback":
        cap = check.fallback_host_cap(64 * GIB, setup_s)
        fill_gib_s = check.SLOWEST_FILL_GIB_S
        assert (cap, check.SLOWEST_REGISTER_GIB_S) == (check.sized_host_cap(64 * GIB, 0.13, 10.0, setup_s)[0], 10.0)
    cap, expected_s = check.sized_host_cap(64 * GIB, fill_gib_s, 10.0, setup_s)
    kept = check.kept_bytes(cap)
    assert expected_s == pytest.approx(kept / GIB * (1 / fill_gib_s + 1 / 10.0))
    assert expected_s <= check.SETUP_HOST_SHARE * setup_s + 1e-6 and cap < 64 * GIB
    shape = ModelShape.from_config(preset_config("qwen3-14b"))
    for name in ("scout", "hgca", "infinigen"):
        plan = plan_method(build_method(name, {}), shape, 64 * 1024 + 8, 2, 139 * GIB, cap)
        assert plan.max_batch >= 1 and plan.host_bytes_per_seq * plan.max_batch <= kept, (name, plan)
    fast_cap, _ = check.sized_host_cap(64 * GIB, 50.0, 50.0, setup_s)  # a machine that fills fast keeps the ask
    assert fast_cap == 64 * GIB


def _nvml(low_confidence: bool) -> dict:
    return {"duration_s": 0.6 if low_confidence else 3.0, "low_confidence": low_confidence,
            "gpu_util_pct": {"mean": 87.0}, "energy_j_per_token": 0.25}


def test_the_table_reuses_max_runs_at_the_equal_batch_marks_short_telemetry_and_failures(tmp_path):
    """An equal-batch row is the max_batch run where that ran at the equal batch; GPU utilisation and J/token from
    a window under 2 s (`low_confidence`) are marked, not printed as measurements; a failed method's row says why."""
    check = _check_script()
    scout = {**make_result("scout", 50.0, batch=5), "nvml": _nvml(True)}
    fullkv = {**make_result("fullkv", 90.0, batch=9), "nvml": _nvml(False)}
    hgca = make_result("hgca", status="failed", error="pinned host memory: registering 47.60 GiB failed")
    write_results(tmp_path / "max_batch", [scout, fullkv, hgca])
    write_results(tmp_path / "equal_batch", [{**make_result("fullkv", 60.0, batch=5), "nvml": _nvml(False)}])
    rows, results = check.table_rows(str(tmp_path), ["scout", "hgca", "fullkv"], "64k", 5, {})
    by_run = {(row[1].split()[0], row[0].split()[0]): row for row in rows}
    assert by_run["equal_batch", "scout"][1] == "equal_batch (= max)" and by_run["equal_batch", "scout"][3] == "5"
    assert by_run["equal_batch", "fullkv"][3] == "5" and by_run["max_batch", "fullkv"][3] == "9"
    assert by_run["max_batch", "scout"][-3:-1] == ["~87", "~0.250"]  # util, J/token from a 0.6 s window
    assert by_run["max_batch", "fullkv"][-3:-1] == ["87", "0.250"]
    assert by_run["max_batch", "hgca"][-1].startswith("failed: pinned host memory")
    assert {(r["run"], r["status"]) for r in results if r["method"] == "hgca"} == {("max_batch", "failed"),
                                                                                   ("equal_batch", "missing")}


def test_a_cut_phase_records_the_methods_it_cut_and_the_next_phase_runs(tmp_path, monkeypatch):
    """The running method and those after it get a failed result saying the phase was cut; its line says 124; the
    process goes on with the next phase under that one's own limit."""
    import scoutbench.bench.throughput as throughput
    from scoutbench.bench.throughput import ThroughputConfig

    check = _check_script()

    def first_then_hang(configs, loaded, log, raise_if_all_refused):
        yield configs[0], make_result(configs[0].method, 10.0)
        time.sleep(30)

    monkeypatch.setattr(throughput, "run_methods", first_then_hang)
    loaded = type("Loaded", (), {"model": torch.nn.Linear(1, 1)})()
    configs = [ThroughputConfig(method=name, model="tiny-qwen3", length=64, command=["test"]) for name in METHODS[:3]]
    phases = check.Phases(str(tmp_path / "phases.txt"), {"max_batch": 0.5, "equal_batch": 5})
    with phases.run("max_batch") as outcome:
        check.run_phase_methods(configs, loaded, tmp_path / "max_batch")
    with phases.run("equal_batch"):
        pass
    lines = (tmp_path / "phases.txt").read_text().splitlines()
    assert lines[0].split()[:3] == ["max_batch", "exit", "124"] and outcome["rc"] == 124
    assert lines[1].split()[:3] == ["equal_batch", "exit", "0"]
    written = {r["method"]: r for r in map(json.loads, (p.read_text() for p in (tmp_path / "max_batch").glob("*")))}
    assert written["scout"]["status"] == "ok"
    assert written["hgca"]["error"] == "cut at the phase's limit while it ran"
    assert written["infinigen"]["error"] == "not run: the phase reached its limit"


def test_a_multi_line_error_is_one_line_of_the_table(tmp_path):
    """A traceback's lines in a failed result's error would split the table's rows: the row holds it as one line,
    cut to 120 characters (the whole error stays in gpu_check_results.json)."""
    check = _check_script()
    error = "RuntimeError: CUDA error: an illegal memory access\nCUDA kernel errors might be asynchronously " \
            "reported\n  at line 3\n" + "x" * 200
    write_results(tmp_path / "max_batch", [make_result("scout", status="failed", error=error)])
    rows, results = check.table_rows(str(tmp_path), ["scout"], "64k", 5, {})
    note = rows[0][-1]
    assert "\n" not in note and len(note) <= 120
    assert note.startswith("failed: RuntimeError: CUDA error: an illegal memory access CUDA kernel errors")
    assert results[0]["error"] == error


def test_a_phase_whose_methods_have_no_budget_runs_them_without_it():
    """The check's `--budget` is its own setting, for the methods that have a token budget: FullKV alone at the
    equal batch (GPU_CHECK_METHODS="fullkv scout") was a UsageError ("no selected method has a token budget")."""
    check = _check_script()
    args = check.main.__globals__["argparse"].Namespace(
        budget="256", model="tiny-qwen3", len="2k", gpu_mem=None, host_mem="24MiB", steps=2, warmup=1, count_steps=8,
        dtype="fp32")
    fullkv, = check.configs_for(args, ["fullkv"], 4)
    assert fullkv.method == "fullkv" and "budget" not in fullkv.method_args
    scout, fullkv = check.configs_for(args, ["scout", "fullkv"], "auto")
    assert scout.method_args["budget"] == 256 and "budget" not in fullkv.method_args


def test_a_subset_of_methods_with_a_cut_host_phase_still_fills_every_row(tmp_path):
    """GPU_CHECK_METHODS="fullkv scout" runs every phase, and a host phase that measures nothing (cut at 1 s)
    leaves the cap at the one that fills in time at the slowest rate, not at the request: at the lent machine's
    proportions (SCOUTBENCH_HOST_FILL_GIBS=0.0001: the dry run's tiers take as long as 47.6 GiB at 0.2 GiB/s) a
    kept buffer of the 24 MiB asked would not fill within setup's limit, and every row would read "not run"."""
    done = _dry_run(tmp_path, SCOUTBENCH_HOST_FILL_GIBS="0.0001", GPU_CHECK_METHODS="fullkv scout",
                    GPU_CHECK_LIMITS="host=1")
    lines = (tmp_path / "out" / "gpu_check_phases.txt").read_text(encoding="utf-8").splitlines()
    phases = {line.split()[0]: line.split()[2] for line in lines}
    assert phases == {**{name: "0" for name in PHASES}, "host": "124"}, done.stdout[-3000:] + done.stderr[-2000:]
    assert "the cap falls back to" in done.stdout
    rows = _table_rows(tmp_path)
    assert len(rows) == 4 and not any("failed" in row or "not run" in row for row in rows), rows
