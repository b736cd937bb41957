"""`scoutbench export`: a real sweep round-trips through CSV; SGLang, vLLM and PyTorch-benchmark
records carry the documented mapping; MLflow writes a local run offline; W&B writes an offline run."""

import copy
import importlib.util
import json
import re
import shutil
import statistics
import sys
from datetime import datetime
from pathlib import Path

import pytest
from cli_runner import run_cli

from scoutbench.analysis import export
from scoutbench.results import _jsonable, load_results

SGLANG_KEYS = ["run_name", "batch_size", "input_len", "output_len", "prefill_latency", "prefill_throughput",
               "median_decode_latency", "median_decode_throughput", "total_latency", "overall_throughput"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """A real two-method sweep on the tiny model (real prefill, 6 timed steps), run through the CLI."""
    import sys

    from scoutbench.cli import main

    out = tmp_path_factory.mktemp("sweep")
    argv = sys.argv
    sys.argv = ["scoutbench", "sweep", "--method", "fullkv,scout", "--model", "tiny-qwen3", "--len", "512",
                "--budget", "192", "--steps", "6", "--warmup", "1", "--device", "cpu", "--prefill", "real", "-o", str(out)]
    try:
        main()
    except SystemExit as exc:
        assert not exc.code, exc.code
    finally:
        sys.argv = argv
    return out


def _results(folder):
    return sorted(load_results([folder]), key=lambda r: r["method"])


def test_csv_round_trips_a_sweep(sweep_dir, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--format", "csv", "-o", tmp_path / "s.csv")
    assert code == 0, err
    rows = {row["source_file"]: row for row in export.read_csv(tmp_path / "s.csv")}
    results = _results(sweep_dir)
    assert len(rows) == len(results) == 2  # sweep.json (the manifest) is no result
    for result in results:
        row = rows[result["_path"]]
        flat = export.flatten(result)
        for key, value in flat.items():
            if key in export.CSV_OMITTED:
                assert key not in row
                continue
            assert row[key] == _jsonable(value), key  # every field back, typed (numbers exact, lists, bools, null)
        assert all(row[key] is None for key in set(row) - set(flat))  # the other method's columns, empty here
    fullkv = rows[results[0]["_path"]]
    assert fullkv["decode_step_ms.median"] == results[0]["decode_step_ms"]["median"]
    assert fullkv["step_ms"] == results[0]["step_ms"] and fullkv["env.git_dirty"] in (True, False)


def test_sglang_records_follow_bench_one_batch(sweep_dir, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--format", "sglang", "-o", tmp_path / "r.jsonl")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    for record, result in zip(records, _results(sweep_dir), strict=True):
        assert list(record) == SGLANG_KEYS
        batch, steps = result["workload"]["batch"], result["workload"]["steps"]
        assert (record["batch_size"], record["input_len"], record["output_len"]) == (batch, 512, steps + 1)
        assert record["median_decode_latency"] == pytest.approx(result["decode_step_ms"]["median"] / 1e3)
        # the one throughput of the tables, figures and gate (tokens over total time), not batch / the median step
        assert record["median_decode_throughput"] == result["decode_throughput_tok_s"]
        assert record["prefill_latency"] == pytest.approx(result["prefill_ms"] / 1e3)
        assert record["prefill_throughput"] == pytest.approx(512 * batch / record["prefill_latency"])
        assert record["total_latency"] == pytest.approx(record["prefill_latency"] + result["decode_time_s"])
        assert record["run_name"] == export.run_name(result)


def test_sglang_synthetic_prefill_has_no_prefill_numbers_and_says_so(sweep_dir, tmp_path, monkeypatch, capsys):
    """A synthetic prefill's records had null latencies and nothing said why."""
    result = copy.deepcopy(_results(sweep_dir)[0])
    result["workload"]["prefill"] = "synthetic"
    record = export.sglang_record(result)
    assert record["prefill_latency"] is None and record["prefill_throughput"] is None
    assert record["total_latency"] is None and record["overall_throughput"] is None
    assert record["median_decode_latency"] is not None
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "_path"}))
    code, _, err = run_cli(monkeypatch, capsys, "export", path, "--format", "sglang", "-o", tmp_path / "r.jsonl")
    assert code == 0 and "1 of 1 results had a synthetic prefill" in err and "--prefill real" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--format", "sglang", "-o", tmp_path / "s.jsonl")
    assert code == 0 and "synthetic prefill" not in err, err


def test_vllm_and_pytorch_formats(sweep_dir, tmp_path, monkeypatch, capsys):
    for fmt in ("vllm", "pytorch"):
        code, _, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--format", fmt, "-o", tmp_path / fmt)
        assert code == 0, err
    for result in _results(sweep_dir):
        name = export.run_name(result)
        latency = json.loads((tmp_path / "vllm" / f"{name}.json").read_text())
        seconds = [ms / 1e3 for ms in result["step_ms"]]
        assert list(latency) == ["avg_latency", "std_latency", "latencies", "percentiles", "scoutbench"]
        assert latency["scoutbench"]["latency"].startswith("one decode step of the whole batch, in seconds")
        assert latency["scoutbench"]["method"] == result["method"]
        assert latency["latencies"] == pytest.approx(seconds)
        assert latency["avg_latency"] == pytest.approx(statistics.fmean(seconds))
        assert latency["std_latency"] == pytest.approx(statistics.pstdev(seconds))  # numpy's np.std
        assert list(latency["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
        assert latency["percentiles"]["50"] == pytest.approx(result["decode_step_ms"]["median"] / 1e3)
        records = json.loads((tmp_path / "pytorch" / f"{name}.pytorch.json").read_text())
        assert [r["metric"]["name"] for r in records] == ["decode_step_latency_s", "decode_throughput_tok_s"]
        for record in records:  # vllm/benchmarks/lib/utils.py: convert_to_pytorch_benchmark_format
            assert set(record) == {"benchmark", "model", "metric"}
            assert set(record["metric"]) == {"name", "benchmark_values", "extra_info"}
            assert record["model"]["name"] == "tiny-qwen3"
            # the method is in what a dashboard keys a series by, not only inside extra_info
            assert record["benchmark"]["name"] == f"scoutbench decode: {result['method']}"
            assert record["benchmark"]["mode"] == "inference" and record["benchmark"]["dtype"] == "float32"
            assert record["benchmark"]["extra_info"]["args"]["method"] == result["method"]
        assert records[0]["metric"]["benchmark_values"] == pytest.approx(seconds)
        assert records[1]["metric"]["benchmark_values"] == [result["decode_throughput_tok_s"]]


def test_failed_points_and_other_files_are_listed_not_exported(sweep_dir, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    failed = {**_results(sweep_dir)[0], "status": "failed", "error": "out of memory"}
    failed.pop("_path")
    (folder / "failed.json").write_text(json.dumps(failed))
    (folder / "notes.json").write_text("{}")
    code, out, err = run_cli(monkeypatch, capsys, "export", folder, sweep_dir, "--format", "vllm",
                             "-o", tmp_path / "one.json")
    assert code == 2 and "2 results; pass a folder" in err
    code, out, err = run_cli(monkeypatch, capsys, "export", folder, "--format", "csv", "-o", tmp_path / "x.csv")
    assert code == 2 and "nothing to export" in err
    assert "failed.json: status failed (out of memory)" in err


def test_export_needs_something_to_do(sweep_dir, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "export", sweep_dir)
    assert code == 2 and "nothing to do" in err


def test_mlflow_logs_local_runs_offline(sweep_dir, tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip('needs the MLflow client: pip install "scoutbench[mlflow]"')
    store = tmp_path / "mlruns"
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--mlflow", store, "--experiment", "ci")
    assert code == 0, err
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("ci")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    results = _results(sweep_dir)
    assert set(runs) == {export.run_name(r) for r in results}
    for result in results:
        run = runs[export.run_name(result)]
        assert run.info.status == "FINISHED"
        assert run.data.params["method"] == result["method"] and run.data.params["model.name"] == "tiny-qwen3"
        assert run.data.metrics["decode_throughput_tok_s"] == pytest.approx(result["decode_throughput_tok_s"])
        assert run.data.metrics["decode_step_ms.median"] == pytest.approx(result["decode_step_ms"]["median"])
        history = client.get_metric_history(run.info.run_id, "step_ms")
        assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(result["step_ms"])
        artifact = client.download_artifacts(run.info.run_id, "result.json", str(tmp_path / run.info.run_id))
        with open(artifact) as handle:
            assert json.load(handle)["method_repr"] == result["method_repr"]
        # the run's time is when the result was measured, not the export's
        measured_ms = int(datetime.fromisoformat(result["created_at"]).timestamp() * 1000)
        assert run.info.start_time == measured_ms == run.info.end_time

    # a second export of the same results logs no duplicate runs
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--mlflow", store, "--experiment", "ci")
    assert code == 0 and "0 run(s)" in out and "2 result(s) logged there before" in out, out + err
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_wandb_writes_offline_runs(sweep_dir, tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip('needs the W&B client: pip install "scoutbench[wandb]"')
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--wandb", "scoutbench-ci",
                             "--wandb-dir", tmp_path / "wb")
    assert code == 0, err
    logs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2
    content = b"".join(log.read_bytes() for log in logs)  # W&B's transaction log: protobuf records
    for result in _results(sweep_dir):
        assert export.run_name(result).encode() in content
        assert json.dumps(result["decode_throughput_tok_s"]).encode() in content
    assert b"decode_step_ms.median" in content and b"scoutbench-ci" in content
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--wandb", "scoutbench-ci",
                             "--wandb-dir", tmp_path / "wb")
    assert code == 0 and "2 result(s) logged there before" in out, out + err
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))) == 2  # no duplicate runs


def _log_mlflow(tmp):
    from scoutbench.analysis.loggers import log_mlflow

    log_mlflow([], str(tmp))


def _log_wandb(tmp):
    from scoutbench.analysis.loggers import log_wandb

    log_wandb([], "project", tmp)


def _arrow(tmp):
    from scoutbench.workloads.longbench import arrow_dataset

    arrow_dataset("qasper", tmp)


@pytest.mark.parametrize("module,call,hint", [("mlflow", _log_mlflow, "scoutbench[mlflow]"),
                                              ("wandb", _log_wandb, "scoutbench[wandb]"),
                                              ("datasets", _arrow, "scoutbench[datasets]")])
def test_missing_optional_package_is_a_one_line_install_hint(module, call, hint, tmp_path, monkeypatch):
    from scoutbench.errors import ScoutbenchError

    for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when it is not installed
    with pytest.raises(ScoutbenchError, match=rf'pip install "{re.escape(hint)}"$'):
        call(tmp_path)


@pytest.mark.parametrize("fmt", ["vllm", "pytorch"])
def test_two_folders_with_the_same_file_names_keep_every_result(sweep_dir, tmp_path, monkeypatch, capsys, fmt):
    """Two sweeps of one grid share their file names: 4 results in gave 2 files out (exit 0 with --overwrite);
    without it, a half-written export and exit 2 blaming a file the export itself had just written."""
    shutil.copytree(sweep_dir, tmp_path / "runA")
    shutil.copytree(sweep_dir, tmp_path / "runB")
    for path in (tmp_path / "runB").glob("*.json"):  # a second run of the grid, not a byte-identical copy (read once)
        result = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**result, "created_at": "2001-01-01T00:00:00+00:00"}), encoding="utf-8")
    out = tmp_path / fmt
    code, stdout, err = run_cli(monkeypatch, capsys, "export", tmp_path / "runA", tmp_path / "runB", "--format", fmt,
                                "-o", out)
    assert code == 0, err
    written = sorted(p.name for p in out.iterdir())
    assert len(written) == 4 and stdout.count("wrote ") == 4
    assert all(name.startswith(("runA__", "runB__")) for name in written), written

    # again without --overwrite: refused before anything is touched; with it: the same 4 files
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, _, err = run_cli(monkeypatch, capsys, "export", tmp_path / "runA", tmp_path / "runB", "--format", fmt,
                           "-o", out)
    assert code == 2 and err.count("error:") == 1 and "--overwrite" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    code, _, err = run_cli(monkeypatch, capsys, "export", tmp_path / "runA", tmp_path / "runB", "--format", fmt,
                           "-o", out, "--overwrite")
    assert code == 0 and sorted(p.name for p in out.iterdir()) == written, err


def test_an_existing_file_refuses_the_whole_export_before_writing(sweep_dir, tmp_path, monkeypatch, capsys):
    results = _results(sweep_dir)
    taken = tmp_path / "out" / f"{export.run_name(results[1])}.json"
    taken.parent.mkdir()
    taken.write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "export", sweep_dir, "--format", "vllm", "-o", tmp_path / "out")
    assert code == 2 and str(taken) in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == [taken.name] and taken.read_text() == "mine"


def test_a_file_given_twice_is_one_result(sweep_dir, tmp_path, monkeypatch, capsys):
    one = sorted(sweep_dir.glob("fullkv_*.json"))[0]
    code, out, err = run_cli(monkeypatch, capsys, "export", sweep_dir, one, "--format", "sglang",
                             "-o", tmp_path / "r.jsonl")
    assert code == 0, err
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("fmt,missing", [("vllm", "step_ms"), ("pytorch", "decode_time_s"), ("sglang", "prefill_ms")])
def test_a_result_without_what_a_format_reads_is_listed_not_a_traceback(sweep_dir, tmp_path, monkeypatch, capsys,
                                                                         fmt, missing):
    """A throughput result without `step_ms` (an older or hand-made file) ended `export --format vllm` in a
    KeyError traceback."""
    folder = tmp_path / "runs"
    folder.mkdir()
    for result in _results(sweep_dir):
        kept = {k: v for k, v in result.items() if k != "_path"}
        if result["method"] == "scout":
            del kept[missing]
        (folder / Path(result["_path"]).name).write_text(json.dumps(kept))
    code, out, err = run_cli(monkeypatch, capsys, "export", folder, "--format", fmt, "-o", tmp_path / "out")
    assert code == 0 and out.count("wrote ") == 1, err
    assert "scout_tiny-qwen3" in err and f"no {missing} as" in err and "Traceback" not in err


def test_an_accuracy_result_is_named_in_good_english(tmp_path, monkeypatch, capsys):
    """`export --format sglang` of an accuracy result said "a accuracy result"."""
    from result_factory import make_accuracy, write_results

    folder = write_results(tmp_path / "acc", [make_accuracy("scout", {"qasper": 40.0})])
    code, _, err = run_cli(monkeypatch, capsys, "export", folder, "--format", "sglang", "-o", tmp_path / "r.jsonl")
    assert code == 2 and "an accuracy result (throughput only here)" in err and "a accuracy" not in err, err
