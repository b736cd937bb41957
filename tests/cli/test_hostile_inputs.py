"""Inputs that gave a traceback, a silent wrong result or an inconsistent exit code (issue 37's reports and their
siblings): each test is a reproducer and failed before its fix. Every error is one line on stderr with the exit
code of docs/exit_codes.md."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
from pathlib import Path

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
BASELINE = ROOT / "results" / "baselines" / "cpu-ci" / "run1"
H200 = json.loads((ROOT / "scoutbench" / "data" / "hardware" / "h200.json").read_text())


def _strict_json(text: str):
    """JSON as a strict reader takes it: `NaN`, `Infinity` and `-Infinity` are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _one_line(err: str, internal: bool = False) -> str:
    """The one error line; unless `internal`, of a fault the tool classifies (not the line of a bug)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert internal == ("internal error" in lines[0]), err
    return lines[0]


# ---- project: hardware numbers ---------------------------------------------------------------------------------

def _profile(tmp_path: Path, edit) -> Path:
    profile = copy.deepcopy(H200)
    edit(profile)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile), encoding="utf-8")  # Python writes Infinity/NaN literals, as a user may
    return path


@pytest.mark.parametrize("value, shown", [(float("inf"), "Infinity"), (True, "true"), (float("nan"), "NaN"),
                                          (0, "0"), (-1.0, "-1.0"), ("4.8e12", '"4.8e12"')])
def test_project_refuses_a_hardware_number_that_is_not_a_positive_finite_number(value, shown, tmp_path,
                                                                                 monkeypatch, capsys):
    """`Infinity` and `true` were accepted as hardware numbers (true as 1 byte/s)."""
    def edit(profile):
        profile["device"]["memory_bw_bytes_s"]["value"] = value

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit),
                             "--json")
    line = _one_line(err)
    assert code == 2 and "device.memory_bw_bytes_s needs" in line and f"got {shown}" in line and out == "", err


def test_project_refuses_numbers_that_give_no_finite_step(tmp_path, monkeypatch, capsys):
    """A positive, finite but absurd rate overflowed the step to infinity (NaN idle), printed as `Infinity`/`NaN`
    by --json (not JSON) and tabulated as a projection."""
    def edit(profile):
        profile["device"]["memory_bw_bytes_s"]["value"] = 1e-320

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit),
                             "--json")
    assert code == 2 and "its numbers give fullkv a step of nan ms" in _one_line(err) and out == "", err


def test_json_on_stdout_is_strict_json():
    """Every `--json` prints through one writer, which writes a non-finite float as the result files do."""
    from scoutbench.results import json_text

    assert _strict_json(json_text({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5})) == {
        "a": "nan", "b": ["inf", "-inf"], "c": 1.5}


def test_project_refuses_a_gpu_that_cannot_hold_one_sequence(tmp_path, monkeypatch, capsys):
    """A 1-byte GPU was projected with exit 0."""
    def edit(profile):
        profile["device"]["memory_bytes"]["value"] = 1

    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", _profile(tmp_path, edit))
    assert code == 2 and "not one sequence of" in _one_line(err) and "fits on h200 (weights memory)" in err, err


def test_project_marks_a_batch_the_hardware_cannot_hold(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "a100-80gb-pcie", "--model",
                             "qwen3-14b", "--len", "32k", "--dtype", "bf16", "--batch", "64", "--json")
    assert code == 0, err
    fullkv = next(p for p in _strict_json(out)["projections"] if p["method"] == "fullkv")
    assert fullkv["fits_memory"] is False and 1 <= fullkv["max_batch"] < 64
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "a100-80gb-pcie", "--model",
                             "qwen3-14b", "--len", "32k", "--dtype", "bf16", "--batch", "64")
    assert code == 0 and f"64 (> max {fullkv['max_batch']})" in out and "cannot hold" in err, out + err


@pytest.mark.parametrize("document", [[1, 2], "h200", 3])
def test_a_hardware_profile_that_is_not_an_object_is_one_line(document, tmp_path, monkeypatch, capsys):
    """A hardware profile that is a JSON list was a traceback (AttributeError)."""
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", path)
    assert code == 2 and "a hardware profile is a JSON object of sections" in _one_line(err), err


# ---- LongBench data: every fault of a data file is bad input (exit 2), in every command that reads one ----------

RECORD = {"input": "q?", "context": "a long text", "answers": ["a"], "length": 3, "dataset": "samsum",
          "language": "en", "all_classes": None, "_id": "x1"}


def _never(*args, **kwargs):
    raise AssertionError("the data must be refused before the model loads")


@pytest.mark.parametrize("content, message", [
    (json.dumps(RECORD).encode() + b"\n{\"input\": \n", "samsum.jsonl line 2: not valid JSON"),
    (json.dumps({k: v for k, v in RECORD.items() if k != "answers"}).encode() + b"\n",
     "line 1: field 'answers' must be a non-empty list of strings"),
    (b"", "samsum.jsonl: no records"),
    (json.dumps(RECORD).encode() + b'\n{"input": "caf\xe9"}\n', "samsum.jsonl: not UTF-8 text"),
    (None, "samsum.jsonl does not exist"),
    (b"PAR1 not a parquet file", "cannot read samsum from"),
])
def test_bad_longbench_data_is_exit_2_in_every_command(content, message, tmp_path, monkeypatch, capsys):
    """A malformed line, a missing field or a missing file gave exit 1, an empty or non-UTF-8 file exit 2 (docs:
    bad input is 2); a corrupt parquet mirror was a traceback. `profile-recall --dataset` loaded the model first."""
    data, official = tmp_path / "data", tmp_path / "official"
    data.mkdir()
    official.mkdir()
    (official / "samsum.jsonl").write_text(json.dumps(RECORD) + "\n", encoding="utf-8")
    if content is not None:
        name = "samsum.parquet" if content.startswith(b"PAR1") else "samsum.jsonl"
        if name.endswith(".parquet"):
            pytest.importorskip("datasets")
        (data / name).write_bytes(content)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    monkeypatch.setattr("scoutbench.models.model_config", _never)  # the data is checked before the model's config too
    for command in (["accuracy", "--dataset", "samsum", "--data-dir", data, "-o", tmp_path / "out"],
                    ["data-check", data, "--against", official],
                    ["profile-recall", "--dataset", "samsum", "--data-dir", data, "--model", "smollm2-135m",
                     "--len", "64", "-o", tmp_path / "out.json"]):
        code, out, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and message in _one_line(err), (command[0], err)
    assert not (tmp_path / "out").exists()


def test_a_byte_order_mark_is_not_part_of_the_data(tmp_path, monkeypatch, capsys):
    """A UTF-8 byte-order mark (as some editors save) made the first record 'not valid JSON'."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "samsum.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORD).encode() + b"\n")
    (tmp_path / "official").mkdir()
    (tmp_path / "official" / "samsum.jsonl").write_text(json.dumps(RECORD) + "\n", encoding="utf-8")
    code, out, err = run_cli(monkeypatch, capsys, "data-check", data, "--against", tmp_path / "official")
    assert code == 0 and "samsum: 1 records from folder: identical" in out, out + err


# ---- a model folder whose config.json transformers rejects ------------------------------------------------------

@pytest.mark.parametrize("config", [{"model_type": "qwen3", "hidden_size": "abc"},
                                    {"model_type": "qwen3", "num_hidden_layers": -1},
                                    {"model_type": "qwen3", "rope_parameters": 5}])
def test_a_model_folder_whose_config_transformers_rejects_is_one_line(config, tmp_path, monkeypatch, capsys):
    """transformers' config validation raised its own exception type: a traceback in `throughput` and `plan`."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for command in (["throughput", "--len", "256", "--steps", "1", "--method", "fullkv", "-o", tmp_path / "o"],
                    ["plan", "--len", "256", "--gpu-mem", "1GiB"]):
        code, out, err = run_cli(monkeypatch, capsys, *command, "--model", folder)
        line = _one_line(err)
        assert code == 2 and str(folder) in line and ("Validation error" in line or "validation error" in line), err


# ---- a file name that is not UTF-8 ---------------------------------------------------------------------------------

@pytest.fixture
def latin1_folder(tmp_path) -> Path:
    """A folder named `café` in Latin-1 (byte 0xe9: not UTF-8), holding the CI baseline's two results."""
    import os

    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    try:
        folder.mkdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this filesystem takes only UTF-8 names")
    for path in BASELINE.glob("*_bench-attn16_*.json"):
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "not-a-result.json").write_text('{"x": 1}', encoding="utf-8")  # named in report's skipped list
    return folder


def test_text_outputs_naming_a_non_utf8_path_are_written(latin1_folder, tmp_path, monkeypatch, capsys):
    """`export --format csv` of results under a non-UTF-8 folder name was a traceback (UnicodeEncodeError); so were
    `report` (its summary lists the files it skipped) and `sweep -o` there (its sweep_config.yaml names the folder)."""
    code, out, err = run_cli(monkeypatch, capsys, "export", latin1_folder, "--format", "csv", "-o", tmp_path / "r.csv")
    assert code == 0, err
    assert "caf\\udce9" in (tmp_path / "r.csv").read_text(encoding="utf-8")  # valid UTF-8, the byte still named
    code, out, err = run_cli(monkeypatch, capsys, "report", latin1_folder, "-o", tmp_path / "report")
    assert code == 0 and "caf\\udce9" in (tmp_path / "report" / "summary.md").read_text(encoding="utf-8"), err
    code, out, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--steps", "1",
                             "--warmup", "0", "--device", "cpu", "-o", latin1_folder / "sweep")
    assert code == 0 and (latin1_folder / "sweep" / "sweep_config.yaml").read_text(encoding="utf-8"), err


# ---- sweep --config: a value is parsed as the command line's would be ----------------------------------------------

@pytest.mark.parametrize("line, flag", [("steps: true", "--steps"), ("steps: 2.5", "--steps"), ("seed: .inf", "--seed"),
                                        ("warmup: false", "--warmup"), ("seed: true", "--seed")])
def test_a_sweep_config_value_of_the_wrong_type_is_refused(line, flag, tmp_path, monkeypatch, capsys):
    """YAML's `true` ran 1 step and 2.5 ran 2 (click took them as integers); `seed: .inf` was a traceback."""
    config = tmp_path / "grid.yaml"
    config.write_text(f"len: [64]\nmethod: fullkv\n{line}\n", encoding="utf-8")
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "sweep", "--config", config, "-o", tmp_path / "o")
    assert code == 2 and f"Invalid value for '{flag}'" in _one_line(err) and not (tmp_path / "o").exists(), err


# ---- a fault nothing classifies ----------------------------------------------------------------------------------

def test_an_unclassified_fault_is_one_line_that_says_it_is_a_bug(monkeypatch, capsys):
    """Any exception no handler classified was a traceback: the mechanism behind every report of this kind."""
    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr("scoutbench.analysis.hardware.load_hardware", broken)
    code, out, err = run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "h200")
    assert code == 1 and _one_line(err, internal=True) == (
        "error: internal error, a bug in scoutbench (TypeError: unsupported operand type(s) for +: 'int' and "
        "'NoneType'); rerun with SCOUTBENCH_TRACEBACK=1 for the traceback and report it")
    monkeypatch.setenv("SCOUTBENCH_TRACEBACK", "1")
    with pytest.raises(TypeError, match="unsupported operand"):
        run_cli(monkeypatch, capsys, "project", BASELINE, "--hardware", "h200")


# ---- readers of result folders: regular files, each read once, bounded in size and nesting ----------------------

@contextlib.contextmanager
def _no_hang(seconds: float = 60.0):
    """A reader that blocks (a FIFO opened for reading waits for a writer forever) fails the test, not the suite."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


HOSTILE = {"fifo.json": "a FIFO, not a regular file", "zero.json": "a character device, not a regular file",
           "deep.json": "nested deeper than 64 levels", "huge.json": "more than the 67108864 bytes an input file may have"}


@pytest.fixture
def hostile_folder(tmp_path) -> Path:
    """The CI baseline's two results beside a FIFO, a symlink to /dev/zero, a `[` x 100000 file and a 65 MiB file,
    all named *.json."""
    folder = tmp_path / "hostile"
    folder.mkdir()
    for path in BASELINE.glob("*_bench-attn16_*.json"):
        (folder / path.name).write_bytes(path.read_bytes())
    os.mkfifo(folder / "fifo.json")
    (folder / "zero.json").symlink_to("/dev/zero")
    (folder / "deep.json").write_text("[" * 100_000, encoding="utf-8")
    with open(folder / "huge.json", "wb") as handle:  # sparse: no disk space, and never read
        handle.truncate(65 * 1024**2)
    return folder


def _skipped_each_hostile_file(text: str, folder: Path) -> None:
    for name, reason in HOSTILE.items():
        line = next((line for line in text.splitlines() if f"{folder / name}" in line), None)
        assert line is not None and reason in line, (name, text)


@pytest.mark.parametrize("command", [["report", "{folder}", "-o", "{out}"],
                                     *(["export", "{folder}", "--format", fmt, "-o", "{out}." + fmt]
                                       for fmt in ("csv", "sglang", "vllm", "pytorch")),
                                     ["gate", "--baseline", "{folder}", "--current", "{folder}"]])
def test_a_fifo_a_device_a_deep_and_a_huge_file_are_skipped_by_name(command, hostile_folder, tmp_path, monkeypatch,
                                                                     capsys):
    """A FIFO named *.json blocked report, every export format and gate forever; a symlink to /dev/zero grew
    report to 7.7 GB; `[` x 100000 stopped them with a RecursionError. Each is skipped, named, with its reason."""
    args = [part.format(folder=hostile_folder, out=tmp_path / "out") for part in command]
    with _no_hang():
        code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "Traceback" not in err, stdout + err
    _skipped_each_hostile_file(stdout + err, hostile_folder)


def test_load_results_skips_them_with_reasons_or_refuses_the_first_by_name(hostile_folder):
    from scoutbench import api
    from scoutbench.errors import UsageError

    skipped: list[tuple[str, str]] = []
    with _no_hang():
        results = api.load_results(hostile_folder, skipped=skipped)
    assert len(results) == 2
    _skipped_each_hostile_file("\n".join(f"{path}: {why}" for path, why in skipped), hostile_folder)
    with _no_hang(), pytest.raises(UsageError, match=r"cannot read result .*(deep|fifo|huge|zero)\.json: "):
        api.load_results(hostile_folder)


@pytest.mark.parametrize("command", [["gate", "--counters", "--baseline", "{f}", "--current", "{f}"],
                                     ["project", "{f}", "--hardware", "h200"]])
def test_commands_that_need_every_input_refuse_a_hostile_file_in_one_line(command, hostile_folder, monkeypatch,
                                                                          capsys):
    """`gate --counters` and `project` refuse an input they cannot use (docs/exit_codes.md): one line, exit 2."""
    with _no_hang():
        code, out, err = run_cli(monkeypatch, capsys, *[str(part).format(f=hostile_folder) for part in command])
    assert code == 2 and "cannot read result" in _one_line(err), err


def _repeats_folder(tmp_path: Path, tok_s: tuple[float, ...]) -> Path:
    from result_factory import make_result

    folder = tmp_path / f"runs-{'-'.join(map(str, tok_s))}"
    folder.mkdir()
    for index, value in enumerate(tok_s):
        (folder / f"run{index}.json").write_text(json.dumps(make_result("fullkv", value)), encoding="utf-8")
    return folder


def test_a_file_reached_twice_or_copied_counts_once(tmp_path):
    """`report R R/run0.json` merged 3 repeats of 2 runs; a symlink or a byte-identical copy beside its original
    was a further repeat. Each file is read once by its resolved path, and a copy is listed, not merged."""
    from scoutbench.analysis.report import collect

    folder = _repeats_folder(tmp_path, (100.0, 200.0))
    (folder / "link.json").symlink_to(folder / "run0.json")
    (folder / "copy.json").write_bytes((folder / "run0.json").read_bytes())
    report = collect([folder, folder / "run0.json", f"{folder}/./run1.json"])
    (point,) = report.points
    assert sorted(r["decode_throughput_tok_s"] for r in point.runs) == [100.0, 200.0]
    reasons = dict(report.skipped)
    assert reasons[str(folder / "link.json")] == f"the same file as {folder / 'run0.json'} (read once)"
    assert reasons[str(folder / "run0.json")].startswith(f"byte-identical to {folder / 'copy.json'}: a copy")


def test_a_baseline_named_twice_is_not_a_further_repeat(tmp_path, monkeypatch, capsys):
    """`gate --baseline R --baseline R/run0.json` took run0 twice: the baseline median fell from 150 to 100 tok/s
    and a regression (130 against 150) passed as improved."""
    from result_factory import make_result

    baseline = _repeats_folder(tmp_path, (100.0, 200.0))
    current = tmp_path / "current.json"
    current.write_text(json.dumps(make_result("fullkv", 130.0)), encoding="utf-8")
    for extra in ([], ["--baseline", baseline / "run0.json"]):
        code, out, err = run_cli(monkeypatch, capsys, "gate", "--baseline", baseline, *extra, "--current", current,
                                 "--metric", "decode_throughput_tok_s")
        assert code == 1 and "REGRESSED" in out and "improved" not in out, out + err


def test_a_sweep_folder_with_a_fifo_or_a_device_named_like_a_point_resumes(tmp_path, monkeypatch, capsys):
    """The sweep reads its folder's *.json to resume (and sweep.json): a FIFO there blocked it as it blocked report."""
    out = tmp_path / "sweep"
    out.mkdir()
    os.mkfifo(out / "fifo.json")
    (out / "zero.json").symlink_to("/dev/zero")
    with _no_hang():
        code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--steps", "1",
                               "--warmup", "0", "--device", "cpu", "-o", out)
    assert code == 0 and "ran 1, skipped 0" in err, err
    os.mkfifo(tmp_path / "fifo")
    (out / "sweep.json").unlink()
    (out / "sweep.json").symlink_to(tmp_path / "fifo")
    with _no_hang():
        code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--steps", "1",
                               "--warmup", "0", "--device", "cpu", "-o", out)
    last = err.strip().splitlines()[-1]  # after the sweep's header line
    assert code == 2 and "sweep.json is not a readable sweep manifest (a FIFO, not a regular file)" in last, err


# ---- numeric arguments: finite and in range before anything runs -------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "1e309", "nan", "-inf", "1e308"])
def test_a_method_number_that_is_not_finite_or_in_range_is_refused_before_loading(value, tmp_path, monkeypatch,
                                                                                   capsys):
    """`--method-arg pool_factor=inf` (or 1e309) passed the `>= 1` check and crashed the planner (OverflowError)."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--len", "4k", "--device", "cpu",
                             "--method-arg", f"pool_factor={value}", "-o", tmp_path / "o")
    assert code == 2 and f"pool_factor='{value}' is " in _one_line(err), err
    assert ("out of range" if value == "1e308" else "not a finite number") in err


def test_every_numeric_method_field_refuses_what_is_not_finite_or_in_range():
    """Every int and float field of every registered method, from their declarations: nan, an infinity (but where
    the method declares it meaningful, InfiniGen's `alpha=inf`: every token), 1e309 and a magnitude past 2**53 are
    usage errors, as strings from the command line and as values from the API."""
    import dataclasses
    import typing

    from scoutbench.errors import UsageError
    from scoutbench.methods import METHODS, build_method
    from scoutbench.methods.declarations import _unwrap_optional

    checked = 0
    for name in METHODS.names():
        cls = METHODS.load(name)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind = _unwrap_optional(hints[field.name])
            if kind not in (int, float):
                continue
            checked += 1
            infinite = field.name in cls.infinite_fields
            hostile = [str(2**60), 2**60] + (["nan", float("nan")] + ["1e309", "-inf"] * (not infinite)) * (kind is float)
            for value in hostile:
                with pytest.raises(UsageError, match=rf"--method-arg {field.name}=.* is (not a finite number|out of range)"):
                    build_method(name, {field.name: value})
            if kind is float and infinite:
                assert build_method(name, {field.name: "inf"}).config()[field.name] == float("inf")
            elif kind is float:
                with pytest.raises(UsageError, match="is not a finite number"):
                    build_method(name, {field.name: "inf"})
    assert checked >= 10


# ---- a method configuration the model cannot run: refused before anything runs -----------------------------------

def test_a_recall_profile_of_another_model_is_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A profile measured on a 4-layer model, given to a 16-layer one, failed only during the run (a failed result,
    exit 1)."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"intervals": [None, None, 2, 3]}), encoding="utf-8")
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    for command in (["throughput", "--method", "fullkv", "--method", "scout", "-o", tmp_path / "o"],
                    ["sweep", "--method", "fullkv,scout", "-o", tmp_path / "s"]):
        code, out, err = run_cli(monkeypatch, capsys, *command, "--model", "bench-attn16", "--len", "4k",
                                 "--device", "cpu", "--method-arg", f"recall_profile={profile}")
        assert code == 2 and "has 4 layers, the model has 16" in err.strip().splitlines()[-1], (command[0], err)
        assert not list(tmp_path.glob("o/*.json")) and not list(tmp_path.glob("s/*.json"))


def test_more_dense_layers_than_the_model_has_is_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    """`--dense-layers 16` on a 16-layer model with FullKV beside Quest ran FullKV and failed Quest (exit 1)."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "quest", "--model",
                             "bench-attn16", "--len", "4k", "--device", "cpu", "--dense-layers", "16",
                             "-o", tmp_path / "o")
    assert code == 2 and "dense_layers 16 keeps all 16 layers" in _one_line(err), err


# ---- a repeated --method-arg key: one meaning in every command ---------------------------------------------------

@pytest.mark.parametrize("command", [["throughput", "--method", "quest", "--len", "4k", "--device", "cpu", "-o", "{o}"],
                                     ["plan", "--method", "quest", "--model", "tiny-qwen3", "--len", "4k",
                                      "--gpu-mem", "1GiB"],
                                     ["fidelity", "--method", "quest", "--device", "cpu"],
                                     ["profile-recall", "--device", "cpu", "-o", "{o}.json"]])
def test_a_key_given_twice_with_two_values_is_refused_where_one_value_runs(command, tmp_path, monkeypatch, capsys):
    """`throughput --method-arg budget=512 --method-arg budget=1024` kept 1024 silently, while `sweep` sweeps both."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    args = [str(part).format(o=tmp_path / "o") for part in command]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--method-arg", "block_size=16", "--method-arg",
                             "block_size=64")
    line = _one_line(err)
    assert code == 2 and "--method-arg block_size is given twice ('16' and '64')" in line and "scoutbench sweep" in line


def test_a_key_given_twice_runs_both_values_in_a_sweep_and_one_value_once(tmp_path, monkeypatch, capsys):
    from scoutbench.bench.sweep import MANIFEST

    args = ["sweep", "--method", "quest", "--len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu",
            "--method-arg", "block_size=16"]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--method-arg", "block_size=32", "-o", tmp_path / "two")
    assert code == 0 and "ran 2, skipped 0" in err, err
    code, out, err = run_cli(monkeypatch, capsys, *args, "--method-arg", "block_size=16", "-o", tmp_path / "one")
    assert code == 0 and "ran 1, skipped 0" in err, err
    assert len(json.loads((tmp_path / "one" / MANIFEST).read_text())["points"]) == 1
    from scoutbench.errors import ScoutbenchError

    def reached(*args, **kwargs):
        raise ScoutbenchError("the model would load now")

    monkeypatch.setattr("scoutbench.models.load_model", reached)  # the same value twice is that value: no refusal
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "quest", "--len", "4k", "--device", "cpu",
                             "--method-arg", "block_size=16", "--method-arg", "block_size=16", "-o", tmp_path / "t")
    assert code == 1 and _one_line(err) == "error: the model would load now", err


# The least each command needs to reach its numeric options' checks (the options themselves come from the commands)
COMMAND_BASE = {"throughput": ["--method", "fullkv", "--device", "cpu", "-o", "{o}"],
                "plan": ["--model", "tiny-qwen3", "--gpu-mem", "1GiB"],
                "profile-recall": ["--device", "cpu", "-o", "{o}.json"], "cosine": ["--device", "cpu"],
                "accuracy": ["--dataset", "passkey", "--device", "cpu", "-o", "{o}"],
                "fidelity": ["--device", "cpu"], "sweep": ["--method", "fullkv", "--device", "cpu", "-o", "{o}"],
                "project": [str(BASELINE), "--hardware", "h200"], "calibrate": ["-o", "{o}.json"]}


def _numeric_options() -> list[tuple[str, str]]:
    """(command, option) of every option whose declared type parses to a number."""
    import importlib

    import click

    from scoutbench.cli import COMMANDS

    found = []
    for name, (target, _) in COMMANDS.items():
        module, attr = target.split(":")
        for param in getattr(importlib.import_module(module), attr).params:
            numeric = isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)) or \
                type(param.type).__name__ in ("LengthType", "BytesType")
            if numeric and isinstance(param, click.Option):
                found.append((name, param.opts[0]))
    return found


@pytest.mark.parametrize("command, option", _numeric_options())
def test_every_numeric_option_is_finite_and_in_range_before_anything_runs(command, option, tmp_path, monkeypatch,
                                                                           capsys):
    """nan, infinities and magnitudes past int64 in any numeric option of any command: one line, exit 2, before a
    model loads (click's FLOAT took `nan` and `inf`; an integer past int64 overflowed the first tensor it sized)."""
    assert command in COMMAND_BASE, f"add the least arguments of `{command}` to COMMAND_BASE"
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    base = [part.format(o=tmp_path / "o") for part in COMMAND_BASE[command]]
    for value in ("nan", "inf", "-inf", "1e309", "9" * 30):
        code, out, err = run_cli(monkeypatch, capsys, command, *base, option, value)
        assert code == 2 and "internal error" not in err, (option, value, err)
        assert err.strip().splitlines()[-1].startswith("error: "), (option, value, err)


# ---- signals: a second one while the first winds down ------------------------------------------------------------

SECOND_SIGNAL = r"""
import atexit, os, signal, sys
import scoutbench.bench.throughput as throughput
import scoutbench.errors as errors
from scoutbench.cli import main

real_run, real_exit_code = throughput.run_throughput, errors.exit_code
second = getattr(signal, {second!r})
armed = []


def send_second() -> None:
    os.kill(os.getpid(), second)
    sum(range(10))  # a few bytecodes: a Python-level handler would run here


def exit_code_then_second(exc):  # the CLI chooses the exit code while it handles the interrupt
    if armed == ["interrupt handling"]:
        send_second()
    return real_exit_code(exc)


def interrupt_on_second_method(cfg, *args, **kwargs):
    if cfg.method == "quest":
        armed.append({where!r})
        if {where!r} == "exit hooks":  # as the interpreter runs its exit hooks (torch's printed the traceback there)
            atexit.register(send_second)
        signal.raise_signal(signal.SIGINT)  # the first: its handler runs before this call returns
    return real_run(cfg, *args, **kwargs)


throughput.run_throughput = interrupt_on_second_method
errors.exit_code = exit_code_then_second
sys.argv = ["scoutbench", "throughput", "--method", "fullkv", "--method", "quest", "--model", "tiny-qwen3", "--len",
            "64", "--steps", "1", "--warmup", "0", "--count-steps", "0", "--device", "cpu", "-o", {out!r}]
main()
"""


@pytest.mark.parametrize("second, where", [("SIGINT", "exit hooks"), ("SIGTERM", "interrupt handling")])
def test_a_second_signal_while_the_first_winds_down_prints_no_traceback(second, where, tmp_path):
    """Two SIGINTs with no gap printed a traceback from torch's exit hook (exit 130, the result kept). The first
    signal decides (130); a second one, here sent from inside the run as its interrupt is handled or as the
    interpreter's exit hooks run, is ignored: no traceback, the finished result kept and listed."""
    import subprocess
    import sys

    script = tmp_path / "second_signal.py"
    out = tmp_path / "out"
    script.write_text(SECOND_SIGNAL.format(second=second, where=where, out=str(out)), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "kept 1 finished result(s)" in done.stderr and done.stderr.strip().endswith("interrupted"), done.stderr
    assert len(list(out.glob("*fullkv*.json"))) == 1


# ---- profile-recall and cosine: the free-memory check of a throughput run ----------------------------------------

@pytest.mark.parametrize("command", [["profile-recall", "--prefill", "synthetic", "-o", "{o}.json"],
                                     ["profile-recall", "-o", "{o}.json"], ["cosine"]])
def test_a_profile_or_cosine_run_that_cannot_fit_is_refused_by_the_free_memory_check(command, tmp_path, monkeypatch,
                                                                                      capsys):
    """`profile-recall --len 10m` had no free-memory check: its allocation failure was reported as a bug (here, the
    kernel killed it). With 1 GiB usable, 10m tokens of tiny-qwen3 are refused in one line, exit 1."""
    monkeypatch.setattr("scoutbench.planning.usable_host_bytes", lambda: 2**30)
    args = [part.format(o=tmp_path / "o") for part in command]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--len", "10m", "--device", "cpu")
    line = _one_line(err)
    assert code == 1 and "at len 10m needs about" in line and "pass --force" in line, err
    assert not list(tmp_path.glob("o*"))


def test_an_allocation_failure_past_the_checks_is_out_of_memory_not_a_bug(tmp_path, monkeypatch, capsys):
    """An allocation the checks do not plan for (or one past --force) failing is out of memory: exit 1, one line."""
    def fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 26843545600 bytes")

    monkeypatch.setattr("scoutbench.bench.recall._decode_trace", fail)
    code, out, err = run_cli(monkeypatch, capsys, "profile-recall", "--prefill", "synthetic", "--len", "4k",
                             "--budget", "256", "--device", "cpu", "--force", "-o", tmp_path / "p.json")
    assert code == 1 and _one_line(err).startswith("error: out of memory ([enforce fail"), err


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_recall_profile_or_sweep_config_is_one_line(name, hostile_folder, tmp_path, monkeypatch, capsys):
    """Every file scoutbench is given is read as result folders are: a recall profile or a `sweep --config` that is
    a FIFO blocked, a `[` x 100000 one was a RecursionError."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    path = hostile_folder / name
    with _no_hang():
        code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--len", "4k", "--device",
                                 "cpu", "--method-arg", f"recall_profile={path}", "-o", tmp_path / "o")
    line = _one_line(err)
    assert code == 2 and f"recall_profile '{path}' cannot be used: " in line and HOSTILE[name] in line, err
    config = tmp_path / "grid.yaml"
    config.symlink_to(path)
    with _no_hang():
        code, out, err = run_cli(monkeypatch, capsys, "sweep", "--config", config, "-o", tmp_path / "s")
    assert code == 2 and f"--config {config}: " in _one_line(err), err


def _single_value_options() -> list[tuple[str, str]]:
    """(command, option) of every option that takes one value, from the commands' declarations."""
    import importlib

    import click

    from scoutbench.cli import COMMANDS

    found = []
    for name, (target, _) in COMMANDS.items():
        module, attr = target.split(":")
        for param in getattr(importlib.import_module(module), attr).params:
            if isinstance(param, click.Option) and not (param.multiple or param.is_flag or param.count):
                found.append((name, param.opts[-1]))
    return found


@pytest.mark.parametrize("command, option", _single_value_options())
def test_an_option_that_takes_one_value_refuses_two(command, option, monkeypatch, capsys):
    """`throughput --budget 512 --budget 1k` ran 1k silently (click keeps the last), the kind of a repeated
    `--method-arg` key; one value given twice is that value."""
    import importlib

    from scoutbench.cli import COMMANDS, _refuse_repeated_options

    code, out, err = run_cli(monkeypatch, capsys, command, option, "first", f"{option}=second")
    assert code == 2 and f"{option} is given twice ('first' and 'second')" in _one_line(err), err
    module, attr = COMMANDS[command][0].split(":")
    _refuse_repeated_options(getattr(importlib.import_module(module), attr), [option, "same", f"{option}=same"])
