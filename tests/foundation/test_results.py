"""Result files (scoutbench/results.py): output paths, atomic unique names, the output lock, and what a
malformed result is called."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli
from result_factory import make_result

from scoutbench.errors import UsageError

TINY_1K = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


def test_symlink_loops_and_broken_links_are_named(tmp_path, monkeypatch, capsys):
    """A symlink loop or a broken symlink as -o is named as such, not reported as "File exists"."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    for output, message in (("loop", "is a symlink loop"), ("loop/x.json", "is a symlink loop"),
                            ("broken", "is a broken symlink")):
        code, _, err = run_cli(monkeypatch, capsys, "throughput", *TINY_1K, "--method", "fullkv", "-o",
                               tmp_path / output)
        assert code == 1 and message in err and "File exists" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, "report", tmp_path / "loop", "-o", tmp_path / "out")
    assert code == 2 and "is a symlink loop" in err, err


def test_messages_are_not_garbled(tmp_path):
    """"expected number or number" (a number field's type) and "config.json.. Pass" (a model folder)."""
    from scoutbench.errors import UsageError
    from scoutbench.models import load_model
    from scoutbench.result_schema import result_problem

    problem = result_problem({**make_result("fullkv", 1.0), "decode_throughput_tok_s": [1]})
    assert problem.endswith("expected number") and "number or number" not in problem
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as caught:
        load_model(str(tmp_path / "empty"))
    assert ".." not in str(caught.value) and ". Pass a local folder" in str(caught.value)


def test_accuracy_takes_its_lock_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A second accuracy run into a folder another run is writing is refused before its model loads."""
    from scoutbench.results import output_lock

    monkeypatch.setattr("scoutbench.models.load_model", _never)
    with output_lock(tmp_path / "acc"):
        code, _, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--model", "smollm2-135m",
                               "--len", "256", "--limit", "1", "-o", tmp_path / "acc")
    assert code == 1 and "another scoutbench run is writing" in err, err


def test_result_names_are_claimed_atomically(tmp_path):
    """Concurrent writers of one name each get their own file (no check-then-rename race), and a no-overwrite
    write loses to an existing file instead of replacing it."""
    import threading

    from scoutbench.results import write_json_atomic, write_json_unique

    barrier = threading.Barrier(8)
    written: list = []

    def writer(index):
        barrier.wait()
        for round_ in range(5):
            written.append(write_json_unique(tmp_path / "r.json", {"writer": index, "round": round_}))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(written)) == 40 and sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    contents = {(d["writer"], d["round"]) for d in (json.loads(p.read_text()) for p in written)}
    assert len(contents) == 40  # every write survived
    before = (tmp_path / "r.json").read_text()
    with pytest.raises(UsageError, match="exists"):
        write_json_atomic(tmp_path / "r.json", {"late": True})
    assert (tmp_path / "r.json").read_text() == before and not list(tmp_path.glob(".*.tmp"))
