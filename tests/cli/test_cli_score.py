"""`scoutbench score` (scoutbench/cli/score.py): non-finite lengths, LongBench-E buckets in the table, and
random prediction files."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from cli_runner import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from random_results import ODD_VALUES, PROPERTY_SETTINGS, run_main


def test_score_refuses_a_nan_length(tmp_path, monkeypatch, capsys):
    """`"length": NaN` is refused, not put in a LongBench-E bucket."""
    path = tmp_path / "qasper_e.jsonl"
    path.write_text('{"pred": "a", "answers": ["a"], "length": NaN}\n')
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper_e", path, "--json")
    assert code == 2 and "length must be a finite number" in err, out + err


def test_score_prints_a_longbench_e_files_buckets(tmp_path, monkeypatch, capsys):
    """The table form of `score --dataset qasper_e` prints the buckets (the --json form has them too)."""
    path = tmp_path / "qasper_e.jsonl"
    path.write_text('{"pred": "Paris", "answers": ["Paris"], "length": 100}\n')
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper_e", path)
    assert code == 0 and out.splitlines() == ["qasper_e:", "  0-4k: 100.0", "  4-8k: nan", "  8k+: nan"], out + err


PREDICTION_VALUES = st.one_of(ODD_VALUES, st.text(max_size=8), st.lists(st.text(max_size=5), max_size=3))


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(rows=st.lists(st.fixed_dictionaries({}, optional={"pred": PREDICTION_VALUES, "answers": PREDICTION_VALUES,
                                                         "length": PREDICTION_VALUES,
                                                         "all_classes": PREDICTION_VALUES}), max_size=4),
       dataset=st.sampled_from(["qasper", "qasper_e", "trec", "passage_count", "lcc"]))
def test_score_never_crashes_and_buckets_only_finite_lengths(rows, dataset):
    from scoutbench.errors import UsageError
    from scoutbench.eval import score

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{dataset}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        code, out, err = run_main("score", "--dataset", dataset, path)
        assert code in (0, 2) and "Traceback" not in err, err
        try:
            buckets = score.score_file(dataset, path, longbench_e=True)
        except UsageError:
            return
    lengths = [row["length"] for row in rows]
    assert all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 for n in lengths)
    counts = {"0-4k": sum(n < 4000 for n in lengths), "4-8k": sum(4000 <= n < 8000 for n in lengths),
              "8k+": sum(n >= 8000 for n in lengths)}
    assert {k for k, v in buckets.items() if not math.isnan(v)} == {k for k, n in counts.items() if n}
