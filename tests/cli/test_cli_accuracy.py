"""`scoutbench accuracy` (scoutbench/cli/accuracy.py): where its result goes."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from result_factory import make_accuracy


def test_accuracy_prints_its_result_on_stdout(smollm2, tmp_path, monkeypatch, capsys):
    """The table went to stderr (stdout empty). The run itself is canned: what is tested is where the result goes."""
    def canned_run(tasks, loaded, spec, out_dir, *args, **kwargs):
        path = Path(out_dir) / "result.json"
        result = {**make_accuracy("fullkv", {}), "method_repr": "FullKV()",
                  "results": {tasks[0].name: {"metric": "passkey", "n": 1, "score": 100.0}}}
        path.write_text(json.dumps(result))
        return result, path

    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    monkeypatch.setattr("scoutbench.eval.accuracy.run_accuracy", canned_run)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--model", "smollm2-135m",
                             "--len", "256", "--limit", "1", "-o", tmp_path / "acc")
    assert code == 0, err
    assert "passkey" in out and "score" in out and "result:" in err
    from scoutbench.results import output_lock

    with output_lock(tmp_path / "acc"):  # released when the command ended: the next run into the folder may start
        pass
