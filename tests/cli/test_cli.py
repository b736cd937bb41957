"""The command line (scoutbench/cli/__init__.py and options.py): bad input is one line and exit 2, unknown
commands, tables in a log, `env` and `methods`, OS errors and output conflicts in every command, method fields from
arguments, and the dense-layers option of sweeps and accuracy."""

import json

import pytest
from cli_runner import run_cli

from scoutbench.errors import UsageError

TINY = ["--model", "tiny-qwen3", "--len", "64", "--steps", "1", "--warmup", "0"]


def _never(*args, **kwargs):
    raise AssertionError("the run should have stopped before loading the model")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_method_from_args_converts_and_rejects():
    from dataclasses import dataclass

    from scoutbench.methods.base import AttentionMethod, require

    @dataclass
    class Toy(AttentionMethod):
        name = "toy"
        infinite_fields = ("alpha",)  # declared: other float fields take finite values only
        budget: int = 16
        alpha: float = 1.0
        pc: bool = True
        norm: str = "next"

        def __post_init__(self):
            require(self.budget > 0, "budget must be positive")

    toy = Toy.from_args({"budget": "2k", "alpha": "inf", "pc": "off", "norm": "self"})
    assert (toy.budget, toy.alpha, toy.pc, toy.norm) == (2048, float("inf"), False, "self")
    for bad in ({"nope": "1"}, {"budget": "x"}, {"pc": "maybe"}, {"budget": "-1"}, {"alpha": "nan"}):
        with pytest.raises(UsageError):
            Toy.from_args(bad)


@pytest.mark.parametrize("args,message", [
    (["--method", "fulkv"], "did you mean 'fullkv'"),
    (["--method", "fullkv", "--len", "64q"], "bad --len '64q'"),
    (["--method", "scout", "--budget", "2q"], "bad --budget '2q'"),
    (["--method", "fullkv", "--seed", str(2**70)], "'--seed'"),
    (["--method", "fullkv", "--prefill", "fake"], "'--prefill'"),
    (["--method", "fullkv", "--stepz", "3"], "--steps"),  # click 8.2.0 lists "Possible options", later ones quote it
    (["--method", "fullkv", "--batch", "0"], "--batch must be at least 1"),
    (["--method", "fullkv", "--steps", "0"], "--steps must be at least 1"),
    (["--method", "fullkv", "--device", "cuda"], "CUDA is not available"),
    (["--method", "fullkv", "--model", "no-such-model-xyz"], "cannot load config.json of 'no-such-model-xyz'"),  # checked before loading
    (["--method", "fullkv", "--method-arg", "bogus=1"], "not a field of any selected method"),
    (["--method", "fullkv", "--method-arg", "novalue"], "use key=value"),
    (["--method", "fullkv", "--dtype", "int3"], "unknown dtype"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, args, message):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present")
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *args, "--len" if "--len" not in args else "--warmup",
                             "64" if "--len" not in args else "0")
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert "Traceback" not in err


def test_a_log_gets_tables_whole(capsys):
    """A log (CI, `| tee`) is no terminal: rich would assume 80 columns there and print `320.…`."""
    from rich.table import Table

    from scoutbench.cli.options import rich_console

    table = Table()
    for column in range(12):
        table.add_column(f"stage {column}", no_wrap=True)
    table.add_row(*["1234.56"] * 12)
    rich_console().print(table)
    out = capsys.readouterr().out
    assert "…" not in out and out.count("1234.56") == 12 and max(map(len, out.splitlines())) > 80


def test_env_and_methods_commands(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0 and info["torch"] and "nvml" in info and "flashinfer" in info
    code, out, _ = run_cli(monkeypatch, capsys, "methods")
    assert code == 0 and out.startswith("fullkv")


def test_unknown_command_did_you_mean(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "thruput")
    assert code == 2 and "did you mean 'throughput'?" in _one_error_line(err)


def test_sweep_and_accuracy_take_dense_layers():
    """The same option in a sweep (every point's sparse method) and in accuracy/fidelity (the method's field)."""
    from scoutbench.bench.sweep_grid import Grid, expand
    from scoutbench.eval.generation import method_spec

    points = expand(Grid(("fullkv", "hgca", "scout"), (4096,), (1,), dense_layers=3))
    assert {p.method: p.args.get("dense_layers") for p in points} == {"fullkv": None, "hgca": 3, "scout": 3}
    spec = method_spec("hgca", {}, None, 0)
    assert spec.args == {"dense_layers": 0} and spec.describe()["dense_layers"] == 0
    with pytest.raises(UsageError, match="no selected method keeps dense layers"):
        method_spec("fullkv", {}, None, 1)


def test_os_errors_are_one_line_exit_1_and_leave_nothing(monkeypatch, capsys, tmp_path):
    import errno
    import os

    (tmp_path / "folder.json").mkdir()
    for output, message in (("/proc/forbidden/x.json", "cannot write results"),
                            (str(tmp_path / "folder.json"), "it is a folder")):
        for command in (["throughput", "--method", "fullkv", *TINY], ["sweep", "--method", "fullkv", *TINY],
                        ["accuracy", "--dataset", "passkey", "--model", "smollm2-135m"]):
            if command[0] != "throughput" and output.endswith("folder.json"):
                continue  # a folder named *.json is a fine sweep/accuracy folder
            monkeypatch.setattr("scoutbench.models.load_model", _never)
            code, _, err = run_cli(monkeypatch, capsys, *command, "-o", output)
            assert code == 1 and message in _one_error_line(err), (command, err)
            monkeypatch.undo()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "full"
    monkeypatch.setattr(os, "fsync", disk_full)  # the result's write fails the way a full disk fails it
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *TINY, "-o", str(out))
    assert code == 1 and "No space left on device" in _one_error_line(err)
    assert list(out.iterdir()) == [out / ".scoutbench.lock"]  # no partial result, no temp file


def test_second_writer_into_a_folder_is_refused(monkeypatch, capsys, tmp_path):
    """Another process holds the folder's lock: throughput and sweep refuse at once, before any work."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom scoutbench.results import output_lock\n"
                               f"with output_lock({str(tmp_path)!r}):\n    print('held', flush=True)\n"
                               "    time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr("scoutbench.models.load_model", _never)
        for command in ("throughput", "sweep"):
            code, _, err = run_cli(monkeypatch, capsys, command, "--method", "fullkv", *TINY, "-o", str(tmp_path))
            last = err.strip().splitlines()[-1]  # a sweep announces its grid first
            assert code == 1 and last.startswith("error: another scoutbench run is writing to"), err
            assert "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.undo()
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *TINY, "-o", str(tmp_path))
    assert code == 0, err  # the kernel released the killed holder's lock


def test_output_conflicts_have_one_exit_code_everywhere(monkeypatch, capsys, tmp_path):
    """An existing output without --overwrite is a usage error (2) in every command; an output of the wrong kind
    (a folder where a file goes, or the reverse) is an OS error (1); both before any model loads."""
    existing, folder = tmp_path / "r.json", tmp_path / "dir.out"
    existing.write_text("{}")
    folder.mkdir()
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    fidelity = ["fidelity", "--model", "tiny-llama", "--len", "64", "--steps", "1", "--prompts", "1"]
    cosine = ["cosine", "--model", "tiny-qwen3", "--len", "64", "--steps", "1"]
    for command, output, exit_code, message in (
            (["throughput", "--method", "fullkv", *TINY], existing, 2, "exists; pass --overwrite"),
            (fidelity, existing, 2, "exists; pass --overwrite"),
            (cosine, existing, 2, "exists; pass --overwrite"),
            (fidelity, folder, 1, "it is a folder"),
            (["accuracy", "--dataset", "passkey"], existing, 1, "it is a file, not a folder")):
        code, _, err = run_cli(monkeypatch, capsys, *command, "-o", str(output))
        assert code == exit_code and message in _one_error_line(err), (command, err)
