"""benchmarks/real_text_sweep.py's own arithmetic: the churn and CPU compute ratio it reads from a ScoutAttention
trace, and its resume rule (a file made with other settings is refused, never silently kept)."""

from __future__ import annotations

import json
import sys

import pytest
from repo_paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import real_text_sweep as sweep  # noqa: E402


def _plan(layer: int, step: int, selected: list[set[int]], device: list[set[int]]) -> dict:
    return {"kind": "plan", "layer": layer, "step": step, "selected": [selected], "device": [device]}


def test_churn_and_cpu_ratio_from_a_trace():
    """Two KV heads, k_sel 4, blocks of 8, budget 64: step 1 replaces 1 of 4 blocks in head 0 and 2 in head 1
    (churn (1/4 + 2/4) / 2); the CPU part is the selected blocks not read on the device."""
    trace = [
        _plan(2, 0, [{0, 1, 2, 3}, {4, 5, 6, 7}], [{0, 1, 2, 3}, {4, 5}]),
        {"kind": "recall", "layer": 2, "step": 0},
        _plan(2, 1, [{0, 1, 2, 9}, {4, 5, 10, 11}], [{0, 1}, {4, 5, 10, 11}]),
        _plan(3, 0, [{0, 1, 2, 3}, {0, 1, 2, 3}], [{0, 1, 2, 3}, {0, 1, 2, 3}]),
        _plan(3, 1, [{0, 1, 2, 3}, {0, 1, 2, 3}], [{0, 1, 2, 3}, {0, 1, 2, 3}]),
    ]
    out = sweep.trace_selection(trace, k_sel=4, block_size=8, budget=64)
    assert out["churn_per_layer"] == {"2": pytest.approx(0.375), "3": 0.0}
    assert out["churn_per_step"] == [pytest.approx(0.1875)] and out["churn_mean"] == pytest.approx(0.1875)
    # layer 2: step 0 (0 + 2 blocks) / 2 heads * 8 / 64; step 1 (2 + 0) / 2 * 8 / 64; layer 3: none
    assert out["cpu_compute_ratio_per_layer"] == {"2": pytest.approx(0.125), "3": 0.0}
    assert out["cpu_compute_ratio_per_step"] == [pytest.approx(0.0625), pytest.approx(0.0625)]


def test_a_result_made_with_other_settings_is_refused(tmp_path):
    settings = {"model": "qwen2.5-1.5b", "steps": 64, "config": "scout-b32-pool2x-pr"}
    path = tmp_path / "scout-b32-pool2x-pr_gov_report-5.json"
    assert not sweep.finished(path, settings)
    path.write_text(json.dumps({"real_text_sweep": {"settings": settings}}))
    assert sweep.finished(path, settings)
    with pytest.raises(SystemExit, match="made with other settings"):
        sweep.finished(path, {**settings, "steps": 96})


def test_the_grid_has_every_configuration_of_the_issue():
    labels = [c.label for c in sweep.configurations()]
    assert len(labels) == len(set(labels)) == 1 + 16 + 1 + 4 + 3 + 6
    scout = [c for c in sweep.configurations() if c.method == "scout" and "recall_profile" not in c.args]
    assert {(c.args["block_size"], c.args["pool_factor"], c.args["pr"]) for c in scout} == {
        (b, p, r) for b in (16, 32) for p in (1, 2, 3, 4) for r in (True, False)}
    # the per-layer recall intervals profiled on the sweep's own records, at a pool of two selections
    (profiled,) = [c for c in sweep.configurations() if "recall_profile" in c.args]
    assert profiled.args == {"block_size": 32, "pool_factor": 2, "pr": True,
                             "recall_profile": "results/recall-profiles/{model}-{len}-pool2x.json"}
    quest = {(c.args["block_size"], c.args["per_query_head"]) for c in sweep.configurations() if c.method == "quest"}
    assert quest == {(b, q) for b in (16, 32) for q in (False, True)}


def test_the_grid_runs_every_point_each_method_declares_for_its_defaults():
    """Every `settings_grid` point of every method (the one rule's grid, docs/methods.md) is a configuration of the
    sweep: benchmarks/tune_defaults.py finds a run of each."""
    from scoutbench.methods import METHODS

    configs = sweep.configurations()
    for name in METHODS.names():
        cls = METHODS.load(name)
        defaults = cls.defaults()
        for label, fields in cls.settings_grid.items():
            assert any(c.method == cls.name and fields.items() <= {**defaults, **c.args}.items() for c in configs), \
                (name, label)


def test_a_rows_setting_names_its_fields_and_its_grid_point_with_the_papers():
    """The table's setting column: the fields that differ from the method's defaults, then its grid point with the
    paper-literal point beside it (FullKV has no grid)."""
    from scoutbench.methods import resolved_method_config

    def result(method: str, **fields) -> dict:
        return {"method": method, "method_config": resolved_method_config(method, fields)}

    assert sweep._setting(result("scout", pool_factor=1.0, pr=False)) == \
        "`scout` pr=False, pool_factor=1.0: pool 1 (the paper's)"
    assert sweep._setting(result("hgca")) == "`hgca` defaults: window 0.5, selected read (paper: window 0.25, all read)"
    assert sweep._setting(result("fullkv")) == "`fullkv` defaults"
