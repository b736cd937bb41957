"""The "which method when" table of docs/methods.md (benchmarks/which_method_when.py): it was made with the current
defaults (this test fails when a default moves: rerun the command), its rule picks what the numbers say, and the
command refuses runs made with other settings."""

from __future__ import annotations

import json
import sys

import pytest
from repo_paths import REPO_ROOT
from result_factory import make_result

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))
import which_method_when as wmw  # noqa: E402

RERUN = "rerun `python benchmarks/which_method_when.py --measure DIR --write docs/methods.md`"


def test_the_table_in_docs_was_made_with_the_current_defaults():
    recorded = wmw.recorded_settings(ROOT / "docs" / "methods.md")
    assert recorded is not None, f"docs/methods.md has no which-method-when table: {RERUN}"
    defaults = json.loads(json.dumps(wmw.current_defaults()))
    for part in ("run", "methods", "projection"):
        assert recorded[part] == defaults[part], f"the table's {part} settings are not today's defaults: {RERUN}"


def _default_runs(tmp_path) -> list[dict]:
    defaults = wmw.current_defaults()
    run = defaults["run"]
    speeds = {"fullkv": 10.0, "quest": 14.0, "infinigen": 8.0, "infinigen-dynamic": 12.0, "hgca": 15.0, "scout": 20.0}
    results = []
    for method, config in defaults["methods"].items():
        result = make_result(method, speeds[method], length=run["len"], config=config, model=run["model"],
                             steps=run["steps"], warmup=run["warmup"], prefill=run["prefill"], spread=0.1)
        results.append({**result, "_path": str(tmp_path / f"{method}.json")})
    return results


def test_the_rule_keeps_what_no_other_method_beats_on_speed_and_agreement():
    speed = {"fullkv": 1.0, "quest": 1.5, "hgca": 2.0, "scout": 3.0, "infinigen": 1.2}
    top1 = {"quest": 97.0, "hgca": 90.0, "scout": 95.0, "infinigen": 99.0}
    picks = {m: wmw.pick_when(m, speed, top1, "fullkv") for m in speed}
    assert picks["fullkv"].startswith("exact attention")
    assert picks["scout"] == "the most throughput on the paper's machine"
    assert picks["hgca"].startswith("not at these settings: scout")  # slower and further from FullKV than scout
    assert picks["quest"] == "closer to FullKV (97.0% top-1) than every faster method"
    assert picks["infinigen"] == "closer to FullKV (99.0% top-1) than every faster method"
    assert wmw.pick_when("quest", speed, {}, "fullkv").startswith("speed only")
    del top1["scout"]  # the fastest has no quality: nothing is claimed about it
    assert wmw.pick_when("hgca", speed, top1, "fullkv") == ("the most throughput among the methods with a measured "
                                                            "quality (scout: faster, unmeasured)")
    assert wmw.pick_when("quest", speed, top1, "fullkv") == ("closer to FullKV (97.0% top-1) than every faster method "
                                                             "with a measured quality (scout: faster, unmeasured)")


def test_the_table_from_default_runs_records_its_settings_and_replaces_its_section(tmp_path):
    defaults = wmw.current_defaults()
    runs = wmw.check_runs(_default_runs(tmp_path), defaults)
    cpu = wmw.cpu_speed(runs)
    assert cpu["scout"][:2] == (20.0, 2.0) and cpu["scout"][2][0] < 2.0 < cpu["scout"][2][1]
    projected = {m: (100.0 * cpu[m][1], 8) for m in defaults["methods"]}
    lines = wmw.table(defaults, cpu, projected, {"scout": 95.0}, "paper GPU", "Test CPU (2 threads)", "test", "1.0")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split("|")[1].strip() for row in rows] == list(defaults["methods"])
    scout = next(row for row in rows if row.startswith("| scout |"))
    assert "| 20.0 | 2.00x (" in scout and "| 200 (8) | 2.00x | 95.0% | the most throughput" in scout
    assert "| pool 3 (paper: pool 1) |" in scout and "| fullkv | - | - |" in rows[0]  # its grid point, the paper's
    doc = tmp_path / "methods.md"
    doc.write_text("# Methods\n\ntext\n")
    wmw.write_section(doc, lines)
    wmw.write_section(doc, lines)  # a rerun replaces the section, never adds a second
    text = doc.read_text()
    assert text.count(wmw.START) == 1 and text.startswith("# Methods\n\ntext\n\n## Which method when\n")
    assert wmw.recorded_settings(doc)["methods"] == json.loads(json.dumps(defaults["methods"]))


def test_runs_made_with_other_settings_are_refused(tmp_path):
    defaults = wmw.current_defaults()
    results = _default_runs(tmp_path)
    results[-1] = {**results[-1], "method_config": {**results[-1]["method_config"], "budget": 1024}}
    with pytest.raises(SystemExit, match="is not the default run"):
        wmw.check_runs(results, defaults)
    with pytest.raises(SystemExit, match="no ok result of"):
        wmw.check_runs(results[:-1], defaults)


def test_a_sweep_point_recorded_with_an_integral_number_matches_the_default_it_equals(tmp_path):
    """The real-text sweep records `pool_factor=3` where ScoutAttention's default is 3.0: one setting, one quality
    (the table read 'no quality measured' for ScoutAttention's default pool of three)."""
    defaults = wmw.current_defaults()
    config = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in defaults["methods"]["scout"].items()}
    assert isinstance(config["pool_factor"], int) and isinstance(defaults["methods"]["scout"]["pool_factor"], float)
    result = make_result("scout", 1.0, config=config)
    result["real_text_sweep"] = {"top1_agreement": 0.855}
    (tmp_path / "scout.json").write_text(json.dumps(result))
    top1, _ = wmw.quality(tmp_path, defaults)
    assert top1 == {"scout": pytest.approx(85.5)}
