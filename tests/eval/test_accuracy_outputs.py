"""Accuracy outputs at lm-eval's level: per-sample metric values and a standard error per task (the bootstrap of
scoutbench/analysis/bootstrap.py), run folders named by method, budget and hash that still resume the folders of
the earlier `<method>-<hash>` naming, and comparison tables whose every figure carries its interval."""

from __future__ import annotations

import json
import re

import pytest
from repo_paths import TEST_DATA

from scoutbench.analysis import bootstrap
from scoutbench.errors import ScoutbenchError
from scoutbench.eval.accuracy import run_accuracy
from scoutbench.eval.generation import MethodSpec
from scoutbench.eval.tables import comparison_tables
from scoutbench.methods.fullkv import FullKV
from scoutbench.workloads import longbench as lb

DATA = TEST_DATA / "longbench"
SCOUT = MethodSpec("scout", {"budget": 64, "block_size": 16})


def _answers(by_spec: dict[str, list[str]]):
    """A stand-in for the model (the runner's files are under test): each spec answers its list in record order."""
    calls: dict[str, int] = {}

    def generate(model, tokenizer, spec, prompt_ids, max_new_tokens, stop_ids, min_new_tokens):
        calls[spec.name] = calls.get(spec.name, -1) + 1
        return by_spec[spec.name][calls[spec.name] % len(by_spec[spec.name])]
    return generate


def _never(*args, **kwargs):
    raise AssertionError("a finished configuration must not generate again")


def _task(smollm2) -> lb.LongBenchTask:
    return lb.LongBenchTask("2wikimqa", lb.load_records("2wikimqa", DATA), smollm2.tokenizer, max_length=1500)


def test_run_folders_name_method_budget_and_hash_and_resume_the_earlier_naming(smollm2, tmp_path, monkeypatch):
    """A folder reads `<method>-budget<N>-<hash>` (FullKV, without a budget, `fullkv-<hash>`); a folder of the
    earlier naming `<method>-<hash>` (a long run began under it) is found and resumed where it is, never moved or
    duplicated; a configuration with both is an error naming them."""
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", _answers({"scout": [" Neumann"],
                                                                            "fullkv": [" Paris"]}))
    _, fullkv_path = run_accuracy([_task(smollm2)], smollm2, MethodSpec("fullkv"), tmp_path, 1500, seed=0, limit=None)
    assert re.fullmatch(r"fullkv-[0-9a-f]{8}", fullkv_path.parent.name)
    first, path = run_accuracy([_task(smollm2)], smollm2, SCOUT, tmp_path, 1500, seed=0, limit=None)
    readable = path.parent
    assert re.fullmatch(r"scout-budget64-[0-9a-f]{8}", readable.name) and first["results"]["2wikimqa"]["n"] == 3
    legacy = readable.with_name("scout-" + readable.name.rsplit("-", 1)[1])
    readable.rename(legacy)  # as the folder a run of the earlier naming left
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", _never)
    again, again_path = run_accuracy([_task(smollm2)], smollm2, SCOUT, tmp_path, 1500, seed=0, limit=None)
    assert again_path.parent == legacy and not readable.exists()
    assert again["results"]["2wikimqa"]["samples"] == first["results"]["2wikimqa"]["samples"]
    readable.mkdir()
    with pytest.raises(ScoutbenchError, match="both hold the files of one configuration") as both:
        run_accuracy([_task(smollm2)], smollm2, SCOUT, tmp_path, 1500, seed=0, limit=None)
    assert both.value.exit_code == 2 and str(legacy) in str(both.value)


def test_results_carry_per_sample_values_and_a_standard_error_per_task(smollm2, tmp_path, monkeypatch):
    """Per task: each record's metric value and the score's interval and standard error from exactly those values;
    beside FullKV, the per-record agreement values with their intervals and the paired change's."""
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", _answers({
        "fullkv": [" John von Neumann", " Austria", " Paris"], "scout": [" John von Neumann", " Germany", " Paris"]}))
    task = _task(smollm2)
    run_accuracy([task], smollm2, MethodSpec("fullkv"), tmp_path, 1500, seed=0, limit=None)
    result, path = run_accuracy([task], smollm2, SCOUT, tmp_path, 1500, seed=0, limit=None)
    entry = json.loads(path.read_text())["results"]["2wikimqa"]
    assert entry == result["results"]["2wikimqa"]
    assert [(s["index"], s["_id"], s["score"]) for s in entry["samples"]] == [
        (i, record["_id"], value) for i, (record, value) in enumerate(zip(task.records, [100.0, 0.0, 100.0],
                                                                          strict=True))]
    interval = bootstrap.mean_interval([100.0, 0.0, 100.0])
    assert entry["score"] == pytest.approx(interval.value, abs=0.01)
    assert entry["score_ci95"] == [round(interval.low, 2), round(interval.high, 2)]
    assert entry["score_stderr"] == round(interval.stderr, 4) > 0
    vs = entry["vs_fullkv"]
    assert [(s["exact_match"], s["fullkv_score"]) for s in vs["samples"]] == [(100.0, 100.0), (0.0, 100.0),
                                                                             (100.0, 100.0)]
    assert vs["exact_match_ci95"] == [round(v, 2) for v in (interval.low, interval.high)]  # the same 0/100 pattern
    change = bootstrap.bootstrap([3], bootstrap.change_pct([[100.0, 0.0, 100.0]], [[100.0] * 3]))
    assert vs["score_change_pct_ci95"] == [round(change.low, 2), round(change.high, 2)]
    assert vs["score_change_resolved"] is change.resolved is False  # one record of three: not resolved


def _result(label: str, method_repr: str, tasks: dict[str, list[float]], fullkv: dict[str, list[float]] | None = None,
            fidelity: dict[str, list[tuple[int, float, float]]] | None = None) -> dict:
    """A result as the runner writes it, from per-record scores (and FullKV's, and fidelity (steps, top-1 %, KL))."""
    results = {}
    for name, scores in tasks.items():
        entry = {"n": len(scores), "score": round(sum(scores) / len(scores), 2), "metric": "qa_f1",
                 "samples": [{"index": i, "_id": str(i), "score": s} for i, s in enumerate(scores)]}
        if fullkv is not None:
            entry["vs_fullkv"] = {"samples": [{"index": i, "exact_match": 100.0 * (a == b), "metric_vs_fullkv_pred":
                                               100.0 * (a == b), "fullkv_score": b}
                                              for i, (a, b) in enumerate(zip(scores, fullkv[name], strict=True))]}
        if fidelity is not None:
            entry["fidelity"] = {"steps": 4, "compared_steps": sum(s for s, _, _ in fidelity[name]),
                                 "samples": [{"index": i, "steps": s, "top1_agreement": t, "kl_mean": k}
                                             for i, (s, t, k) in enumerate(fidelity[name])]}
        results[name] = entry
    return {"label": label, "method_repr": method_repr, "results": results}


def test_every_table_figure_carries_its_interval_worked_out_by_hand():
    """Task a: FullKV 0 / 100 (two records: [0, 100], marked n < 5); the method equal to FullKV changes by exactly 0
    (not resolved). Task b exists for FullKV only, so the mean row is over task a alone. Fidelity pools every
    step: records of 4 steps at 50% and 4 at 100% give 75% with the interval [50, 100]."""
    fullkv = _result("fullkv", repr(FullKV()), {"a": [0.0, 100.0], "b": [50.0] * 6})
    scout = _result("scout@64", "ScoutAttention()", {"a": [0.0, 100.0]}, {"a": [0.0, 100.0]},
                    {"a": [(4, 50.0, 0.2), (4, 100.0, 0.0)]})
    tables = {title.split(" (")[0]: (header, rows) for title, header, rows in comparison_tables([fullkv, scout],
                                                                                                ["a", "b"])}
    header, rows = tables["official score"]
    assert header == ["task", "metric", "n", "fullkv", "scout@64"]
    assert rows[0] == ["a", "qa_f1", "2", "50.00 [0.00, 100.00] †", "50.00 [0.00, 100.00] †"]
    assert rows[1] == ["b", "qa_f1", "6", "50.00 [50.00, 50.00]", "-"]
    assert rows[2] == ["mean (1 of 2 tasks)", "", "", "50.00 [0.00, 100.00] †", "50.00 [0.00, 100.00] †"]
    _, rows = tables["change of the official score vs FullKV on the same records, % of FullKV's"]
    assert rows[0] == ["a", "2", "+0.0 [+0.0, +0.0] n.r. †"] and rows[-1][-1] == "+0.0 [+0.0, +0.0] n.r. †"
    zero = _result("scout@64", "ScoutAttention()", {"a": [50.0, 0.0]}, {"a": [0.0, 0.0]})
    (_, _, change), = [t for t in comparison_tables([fullkv, zero], ["a"]) if t[0].startswith("change")]
    assert change[0] == ["a", "2", "FullKV 0"]  # relative to a FullKV score of 0: undefined, said so
    _, rows = tables["exact match with FullKV's prediction, %"]
    assert rows[0] == ["a", "2", "100.0 [100.0, 100.0] †"]
    _, rows = tables["teacher-forced fidelity over FullKV's first 4 generated tokens: top-1 agreement %, every "
                     "compared step weighing the same"]
    assert rows[0] == ["a", "2", "75.0 [50.0, 100.0] †"] and rows[-1] == ["all steps (1 of 2 tasks)", "",
                                                                          "75.0 [50.0, 100.0] †"]
    _, rows = tables["teacher-forced fidelity over FullKV's first 4 generated tokens: KL(FullKV || method), nats, "
                     "every compared step weighing the same"]
    assert rows[0] == ["a", "2", "0.100 [0.000, 0.200] †"]


def test_each_column_names_its_setting_with_the_papers_beside_it():
    """The first table says what each column ran: its method's grid point and the paper-literal one (FullKV, with no
    grid, and a result without a method name show "-")."""
    fullkv = {**_result("fullkv", repr(FullKV()), {"a": [50.0]}), "method": "fullkv", "method_config": {}}
    scout = {**_result("scout@2048", "ScoutAttention()", {"a": [50.0]}), "method": "scout",
             "method_config": {"pool_factor": 2.0}}
    quest = {**_result("quest@2048", "Quest()", {"a": [50.0]}), "method": "quest", "method_config": {}}
    bare = _result("other", "Other()", {"a": [50.0]})
    title, header, rows = comparison_tables([fullkv, scout, quest, bare], ["a"])[0]
    assert title.startswith("each column's setting") and header == ["column", "method", "setting"]
    assert rows == [["fullkv", "fullkv", "-"], ["scout@2048", "scout", "pool 2 (paper: pool 1)"],
                    ["quest@2048", "quest", "pages 32, per KV head (paper: pages 16, per query head)"],
                    ["other", "-", "-"]]
