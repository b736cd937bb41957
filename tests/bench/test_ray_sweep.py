"""`sweep --executor ray`: a 4-point sweep on a local Ray instance gives the same points as the local executor
(ids, statuses, configs and the deterministic work counters), and resumes like it (the driver writes the files)."""

from __future__ import annotations

import json

import pytest

from scoutbench.analysis.counter_gate import work_counters
from scoutbench.bench.executors import RayExecutor
from scoutbench.bench.sweep import MANIFEST, run_sweep
from scoutbench.bench.sweep_grid import Grid, Settings, expand
from scoutbench.results import load_results

ray = pytest.importorskip("ray")

SETTINGS = Settings(model="tiny-qwen3", steps=2, warmup=1, device="cpu", prefill="synthetic")
GRID = Grid(("fullkv", "scout"), (256, 512), (1,), (64,), (16,))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _by_id(folder) -> dict[str, dict]:
    return {r["_path"].rsplit("/", 1)[-1]: r for r in load_results([folder])}


def test_ray_sweep_matches_local_and_resumes(tmp_path, local_ray):
    points = expand(GRID)
    assert len(points) == 4
    local = run_sweep(points, SETTINGS, tmp_path / "local")
    lines: list[str] = []
    remote = run_sweep(points, SETTINGS, tmp_path / "ray", executor=RayExecutor(cpus_per_point=1, device="cpu"), log=lines.append)
    assert remote.ran == 4 and not remote.failed and any("submitted 4 points to Ray" in line for line in lines)
    manifest = json.loads((tmp_path / "ray" / MANIFEST).read_text())
    assert [p["id"] for p in manifest["points"]] == [p["id"] for p in local.manifest["points"]]
    assert {p["status"] for p in manifest["points"]} == {"ok"}
    local_results, ray_results = _by_id(tmp_path / "local"), _by_id(tmp_path / "ray")
    assert local_results.keys() == ray_results.keys()
    for name, result in ray_results.items():
        twin = local_results[name]
        assert result["method_config"] == twin["method_config"] and result["workload"] == twin["workload"]
        assert work_counters(result) == work_counters(twin)
    again = run_sweep(points, SETTINGS, tmp_path / "ray", executor=RayExecutor())
    assert again.ran == 0 and again.skipped == 4


def test_a_failing_point_is_recorded_by_the_driver(tmp_path, local_ray):
    # a field the method refuses is only found when the task builds the method (the CLI checks it earlier)
    points = expand(Grid(("scout",), (256,), (1,), (128,), method_args={"recall_interval": ("0",)}))
    outcome = run_sweep(points, SETTINGS, tmp_path, executor=RayExecutor())
    assert outcome.ran == 1 and len(outcome.failed) == 1
    assert "recall_interval must be >= 1" in outcome.failed[0]["error"]
    failed = json.loads((tmp_path / f"{outcome.failed[0]['id']}.json").read_text())
    assert failed["status"] == "failed" and failed["method_config"]["recall_interval"] == "0"
