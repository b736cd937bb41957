"""Foundation CLI behaviour: registry, length parsing, bad input -> one line + exit 2, the result schema."""

import json

import pytest
from cli_runner import run_cli

from scoutbench.errors import UsageError
from scoutbench.units import format_length, parse_bytes, parse_fraction, parse_length


@pytest.mark.parametrize("text,tokens", [("4096", 4096), ("4k", 4096), ("64k", 65536), ("1m", 1 << 20),
                                         ("32K", 32768), (" 8k ", 8192)])
def test_parse_length(text, tokens):
    assert parse_length(text) == tokens


@pytest.mark.parametrize("text", ["64q", "", "k", "1.5k", "-4", "0", "64K0", "4kk"])
def test_parse_length_rejects(text):
    with pytest.raises(UsageError):
        parse_length(text)


def test_format_length_roundtrip():
    for tokens in (1000, 4096, 65536, 1 << 20):
        assert parse_length(format_length(tokens)) == tokens


def test_parse_bytes_and_fraction():
    assert parse_bytes("80GiB") == 80 * 1024**3
    assert parse_bytes("80GB") == 80 * 1000**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_fraction("5%") == pytest.approx(0.05)
    assert parse_fraction("0.1") == pytest.approx(0.1)
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_registry_did_you_mean_and_aliases():
    from scoutbench.methods import METHODS
    from scoutbench.methods.fullkv import FullKV

    assert METHODS.load("full") is FullKV and METHODS.canonical("full") == "fullkv"
    with pytest.raises(UsageError, match="did you mean 'fullkv'"):
        METHODS.load("fulkv")
    assert METHODS.preset("scout-base") == {"pc": False, "pr": False}
    with pytest.raises(ValueError):
        METHODS.register("fullkv", "x:y")


def test_method_from_args_converts_and_rejects():
    from dataclasses import dataclass

    from scoutbench.methods.base import AttentionMethod, require

    @dataclass
    class Toy(AttentionMethod):
        name = "toy"
        budget: int = 16
        alpha: float = 1.0
        pc: bool = True
        norm: str = "next"

        def __post_init__(self):
            require(self.budget > 0, "budget must be positive")

    toy = Toy.from_args({"budget": "2k", "alpha": "inf", "pc": "off", "norm": "self"})
    assert (toy.budget, toy.alpha, toy.pc, toy.norm) == (2048, float("inf"), False, "self")
    for bad in ({"nope": "1"}, {"budget": "x"}, {"pc": "maybe"}, {"budget": "-1"}):
        with pytest.raises(UsageError):
            Toy.from_args(bad)


@pytest.mark.parametrize("args,message", [
    (["--method", "fulkv"], "did you mean 'fullkv'"),
    (["--method", "fullkv", "--len", "64q"], "bad length '64q'"),
    (["--method", "fullkv", "--batch", "0"], "--batch must be at least 1"),
    (["--method", "fullkv", "--steps", "0"], "--steps must be at least 1"),
    (["--method", "fullkv", "--device", "cuda"], "CUDA is not available"),
    (["--method", "fullkv", "--model", "no-such-model-xyz"], "cannot load model"),
    (["--method", "fullkv", "--method-arg", "bogus=1"], "not a field of any selected method"),
    (["--method", "fullkv", "--method-arg", "novalue"], "use key=value"),
    (["--method", "fullkv", "--dtype", "int3"], "unknown dtype"),
    (["--method", "fullkv", "-o", "/proc/forbidden/x.json"], "cannot write results"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, args, message):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present")
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *args, "--len" if "--len" not in args else "--seed",
                             "64" if "--len" not in args else "0")
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert "Traceback" not in err


def test_throughput_json_schema_and_files(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "full",
                             "--len", "64", "--steps", "3", "--warmup", "1", "-o", str(tmp_path), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert [s["method"] for s in summary] == ["fullkv", "full"]
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    result = json.loads(files[0].read_text())
    for key in ("schema_version", "command", "method", "method_config", "model", "workload", "device",
                "decode_throughput_tok_s", "decode_step_ms", "latency_breakdown_ms", "gpu_idle_frac", "nvml", "env",
                "created_at"):
        assert key in result, key
    assert result["model"]["random_weights"] is True
    assert result["workload"] == {"name": "synthetic", "len": 64, "batch": 1, "steps": 3, "warmup": 1, "seed": 0,
                                  "prefill": "real", "kv_skew": 0.3}
    assert set(result["decode_step_ms"]) >= {"median", "p90", "mean"}
    assert len(result["step_ms"]) == 3  # warm-up excluded
    assert result["decode_throughput_tok_s"] == pytest.approx(3 / (sum(result["step_ms"]) / 1e3))
    breakdown = result["latency_breakdown_ms"]
    assert sum(breakdown.values()) == pytest.approx(result["decode_step_ms"]["mean"], rel=1e-6)
    assert result["nvml"] is None  # no GPU here: no telemetry, no crash
    # never overwrite: a second run writes new files
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--len", "64", "--steps", "1",
                           "--warmup", "0", "-o", str(tmp_path))
    assert code == 0, err
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_single_json_output_refuses_overwrite(monkeypatch, capsys, tmp_path):
    target = tmp_path / "r.json"
    args = ["throughput", "--method", "fullkv", "--len", "32", "--steps", "1", "--warmup", "0", "-o", str(target)]
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 1 and "exists" in err
    assert run_cli(monkeypatch, capsys, *args, "--overwrite")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "full", "-o",
                           str(target), "--len", "32")
    assert code == 2 and "single .json" in err


def test_synthetic_prefill_and_ragged_batch(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--len", "2k", "--steps", "2",
                             "--warmup", "1", "--batch", "2", "--prefill", "synthetic", "-o", str(tmp_path), "--json")
    assert code == 0, err
    assert json.loads(out)[0]["batch"] == 2


def test_env_and_methods_commands(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0 and info["torch"] and "nvml" in info and "flashinfer" in info
    code, out, _ = run_cli(monkeypatch, capsys, "methods")
    assert code == 0 and out.startswith("fullkv")
