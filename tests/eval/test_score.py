"""`scoutbench score`: one file or, like eval.py, a folder; official numbers and JSON form; never imports torch."""

import json
import math
import subprocess
import sys

from cli_runner import run_cli

ANSWERS = ["By conducting a survey among engineers", "Unanswerable"]
QASPER_LINES = [{"pred": "unanswerable", "answers": ANSWERS, "all_classes": None, "length": 100},
                {"pred": "They conducted a survey among engineers.", "answers": ANSWERS, "all_classes": None,
                 "length": 5000},
                {"pred": "no", "answers": ["yes"], "all_classes": None, "length": 6000}]


def _write(path, lines):
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def test_file_mode_prints_the_official_score(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path / "qasper.jsonl", QASPER_LINES)
    code, out, _ = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path), "--json")
    assert code == 0 and json.loads(out) == {"dataset": "qasper", "score": 53.33}
    code, out, _ = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path), "--e", "--json")
    result = json.loads(out)
    assert result["score"] == 53.33 and result["buckets"]["0-4k"] == 100.0 and result["buckets"]["4-8k"] == 30.0
    assert math.isnan(result["buckets"]["8k+"]) and '"8k+": NaN' in out  # the empty bucket as eval.py writes it
    code, out, _ = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path))
    assert code == 0 and out.strip() == "qasper: 53.33"


def test_file_mode_errors_are_one_line(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path / "p.jsonl", [{"pred": "x", "answers": ["x"]}, {"pred": "y"}])
    code, _, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path))
    assert code == 2 and "line 2: missing answers" in err
    code, _, err = run_cli(monkeypatch, capsys, "score", "--dataset", "all", str(path))
    assert code == 2 and err.strip() == ("error: --dataset all: pass the folder of <dataset>.jsonl files instead of "
                                         "a file to score them all")
    code, _, err = run_cli(monkeypatch, capsys, "score", str(path))
    assert code == 2 and "--dataset is required for a file" in err
    code, _, err = run_cli(monkeypatch, capsys, "score", "--dataset", "hotpot", str(path))
    assert code == 2 and "unknown dataset 'hotpot'; LongBench v1: narrativeqa" in err and "also" not in err


def test_folder_mode_is_eval_py(tmp_path, monkeypatch, capsys):
    """Every <dataset>.jsonl scored by its name (the part before the first "."), eval.py's result.json shape;
    `_e` files get buckets; files that are not LongBench datasets are skipped and named."""
    _write(tmp_path / "qasper.jsonl", QASPER_LINES)
    _write(tmp_path / "passage_count.jsonl", [{"pred": "3", "answers": ["3"], "all_classes": None, "length": 10}])
    _write(tmp_path / "trec.jsonl", [{"pred": "Entity\nx", "answers": ["Entity"], "all_classes": ["Entity", "City"],
                                      "length": 10}])
    _write(tmp_path / "qasper_e.jsonl", QASPER_LINES)
    _write(tmp_path / "passkey_4096.jsonl", [{"pred": "1", "answers": ["1"]}])
    (tmp_path / "result.json").write_text("{}")
    code, out, err = run_cli(monkeypatch, capsys, "score", str(tmp_path), "--json")
    assert code == 0 and "skipped: passkey_4096.jsonl (not a LongBench dataset name)" in err
    assert out.startswith('{\n    "passage_count": 100.0,')  # indent 4, file-name order
    result = json.loads(out)
    assert list(result) == ["passage_count", "qasper", "qasper_e", "trec"]
    assert result["qasper"] == 53.33 and result["trec"] == 100.0
    assert result["qasper_e"]["4-8k"] == 30.0 and math.isnan(result["qasper_e"]["8k+"])
    (tmp_path / "passkey_4096.jsonl").unlink()
    (tmp_path / "qasper_e.jsonl").unlink()
    code, out, _ = run_cli(monkeypatch, capsys, "score", str(tmp_path), "--e", "--json")  # eval.py --e: pred_e/
    assert code == 0 and json.loads(out)["qasper"]["0-4k"] == 100.0
    code, _, err = run_cli(monkeypatch, capsys, "score", str(tmp_path), "--dataset", "qasper")
    assert code == 2 and "drop --dataset" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "score", str(empty))
    assert code == 2 and "no <dataset>.jsonl prediction files" in err


def test_score_never_imports_torch(tmp_path):
    path = _write(tmp_path / "lcc.jsonl", [{"pred": "x = 1", "answers": ["x = 1"], "all_classes": None, "length": 3}])
    script = ("import sys\n"
              "class NoTorch:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch' or name.startswith('torch.'):\n"
              "            raise ImportError('torch blocked')\n"
              "sys.meta_path.insert(0, NoTorch())\n"
              f"sys.argv = ['scoutbench', 'score', {str(tmp_path)!r}, '--json']\n"
              "from scoutbench.cli import main\n"
              "main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"lcc": 100.0}
    assert path.exists()


def test_folder_mode_scores_an_accuracy_folder_with_its_fidelity_rows(tmp_path, monkeypatch, capsys):
    """`score` could not score scoutbench's own accuracy folder after `accuracy --fidelity-steps`: the
    `<task>.fidelity-N.jsonl` beside the predictions was read as predictions (exit 2)."""
    from types import SimpleNamespace

    from scoutbench.eval.accuracy import Config

    run = Config(spec=None, method={}, folder=tmp_path)  # where an accuracy run writes, named by its own code
    task = SimpleNamespace(name="qasper")
    _write(run.predictions_path(task), QASPER_LINES)
    _write(run.fidelity_path(task, 32), [{"index": 0, "_id": "a", "steps": 2, "top1": [1.0, 1.0], "kl": [0.0, 0.1],
                                          "cosine": [1.0, 0.99]}])
    code, out, err = run_cli(monkeypatch, capsys, "score", str(tmp_path), "--json")
    assert code == 0 and json.loads(out) == {"qasper": 53.33}, err
    assert "skipped: qasper.fidelity-32.jsonl (fidelity rows of `accuracy --fidelity-steps`, not predictions)" in err


def test_folder_mode_refuses_two_prediction_files_of_one_dataset(tmp_path, monkeypatch, capsys):
    """eval.py's rule (the dataset is the name before the first ".") gave qasper.jsonl and qasper.v2.jsonl one
    entry, whichever was listed last, silently."""
    _write(tmp_path / "qasper.jsonl", QASPER_LINES)
    _write(tmp_path / "qasper.v2.jsonl", QASPER_LINES[:1])
    code, out, err = run_cli(monkeypatch, capsys, "score", str(tmp_path))
    assert code == 2 and err.strip() == (f"error: {tmp_path}: qasper.jsonl and qasper.v2.jsonl are both predictions "
                                         "of qasper; keep one of them in the folder, or score each file with "
                                         "--dataset"), err


def test_a_prediction_file_with_a_byte_order_mark_scores(tmp_path, monkeypatch, capsys):
    """As LongBench data files: a UTF-8 byte-order mark (some editors save one) made line 1 'not valid JSON'."""
    path = tmp_path / "qasper.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(line) + "\n" for line in QASPER_LINES).encode())
    code, out, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path), "--json")
    assert code == 0 and json.loads(out)["score"] == 53.33, err
