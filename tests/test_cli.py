"""Foundation CLI behaviour: registry, length parsing, bad input -> one line + exit 2, the result schema."""

import dataclasses
import io
import json

import pytest
from cli_runner import run_cli, signal_once_started, throughput_hanging_on_second_method

from scoutbench.errors import ScoutbenchError, UsageError
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
    (["--method", "fullkv", "--len", "64q"], "bad --len '64q'"),
    (["--method", "scout", "--budget", "2q"], "bad --budget '2q'"),
    (["--method", "fullkv", "--seed", str(2**70)], "'--seed'"),
    (["--method", "fullkv", "--prefill", "fake"], "'--prefill'"),
    (["--method", "fullkv", "--stepz", "3"], "--steps"),  # click 8.2.0 lists "Possible options", later ones quote it
    (["--method", "fullkv", "--batch", "0"], "--batch must be at least 1"),
    (["--method", "fullkv", "--steps", "0"], "--steps must be at least 1"),
    (["--method", "fullkv", "--device", "cuda"], "CUDA is not available"),
    (["--method", "fullkv", "--model", "no-such-model-xyz"], "cannot load model"),
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


def test_throughput_json_schema_and_files(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "quest",
                             "--model", "tiny-qwen3", "--len", "64", "--steps", "3", "--warmup", "1", "-o",
                             str(tmp_path), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert [s["method"] for s in summary] == ["fullkv", "quest"]
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    result = json.loads(files[0].read_text())
    for key in ("schema_version", "command", "method", "method_config", "model", "workload", "device",
                "decode_throughput_tok_s", "decode_step_ms", "latency_breakdown_ms", "gpu_idle_frac", "nvml", "env",
                "created_at"):
        assert key in result, key
    assert result["model"]["random_weights"] is True
    assert result["workload"] == {"name": "synthetic", "len": 64, "batch": 1, "steps": 3, "warmup": 1, "seed": 0,
                                  "prefill": "synthetic", "kv_skew": 0.075}  # --prefill auto on random weights
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


def test_throughput_table_never_cuts_a_number(monkeypatch, capsys, tmp_path):
    """The throughput table shows each result's figures whole: in a log, and in an 80-column terminal with the
    default run's 3-digit steps."""
    from rich.console import Console

    from scoutbench.cli.throughput import _table

    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "infinigen",
                             "--model", "tiny-qwen3", "--len", "64", "--steps", "2", "--warmup", "0", "-o",
                             str(tmp_path))
    assert code == 0, err
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("*.json"))]
    assert "…" not in out
    for result in results:
        row = next(line for line in out.splitlines() if line.split()[:1] == [result["method"]])
        assert f"{result['decode_step_ms']['median']:.2f}" in row.split(), row
    for result in results:  # as the default run's: a 32k step on two cores takes hundreds of milliseconds
        scale = 321.0 / result["decode_step_ms"]["median"]
        for field in ("decode_step_ms", "latency_breakdown_ms"):
            result[field] = {k: None if v is None else scale * v for k, v in result[field].items()}
    terminal = Console(width=80, record=True, file=io.StringIO())
    terminal.print(_table(results))
    text = terminal.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert all(f"{r['decode_step_ms']['median']:.2f}" in text for r in results)


def test_methods_of_one_run_decode_the_prefill_they_would_alone(monkeypatch, capsys, tmp_path):
    """`--method A --method B` draws the synthetic prefill once (workloads/synthetic_kv.SyntheticKVCache): B's work
    counters, which follow its selections over that K/V, are those of B run alone."""
    from scoutbench.analysis.counter_gate import work_counters

    common = ["--model", "tiny-qwen3", "--len", "512", "--steps", "3", "--warmup", "1", "--method-arg", "budget=128",
              "--method-arg", "block_size=16", "--method-arg", "dense_layers=1"]
    assert run_cli(monkeypatch, capsys, "throughput", "--method", "quest", "--method", "scout", *common, "-o",
                   tmp_path / "both")[0] == 0
    assert run_cli(monkeypatch, capsys, "throughput", "--method", "scout", *common, "-o", tmp_path / "alone")[0] == 0
    both, alone = (json.loads(next((tmp_path / run).glob("*scout*.json")).read_text()) for run in ("both", "alone"))
    assert work_counters(both) == work_counters(alone)
    assert (both["prefill_kv_reused"], alone["prefill_kv_reused"]) == (True, False)
    assert work_counters(both)["cpu_attended_tokens_per_step"] > 0  # selections left the device: the K/V decided


def test_single_json_output_refuses_overwrite(monkeypatch, capsys, tmp_path):
    target = tmp_path / "r.json"
    args = ["throughput", "--method", "fullkv", "--model", "tiny-qwen3", "--len", "32", "--steps", "1", "--warmup",
            "0", "-o", str(target)]
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    monkeypatch.setattr("scoutbench.models.load_model", _never)  # the conflict is found before any work
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "exists" in err and len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    assert run_cli(monkeypatch, capsys, *args, "--overwrite")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "quest", "-o",
                           str(target), "--len", "32")
    assert code == 2 and "single .json" in err


def test_synthetic_prefill_and_ragged_batch(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--model", "tiny-qwen3", "--len",
                             "2k", "--steps", "2", "--warmup", "1", "--batch", "2", "--prefill", "synthetic", "-o",
                             str(tmp_path), "--json")
    assert code == 0, err
    assert json.loads(out)[0]["batch"] == 2


def test_env_and_methods_commands(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0 and info["torch"] and "nvml" in info and "flashinfer" in info
    code, out, _ = run_cli(monkeypatch, capsys, "methods")
    assert code == 0 and out.startswith("fullkv")


# ------------------------------------------------------- reliability: bad input, memory checks and safe defaults
TINY = ["--model", "tiny-qwen3", "--len", "64", "--steps", "1", "--warmup", "0"]


def _never(*args, **kwargs):
    raise AssertionError("the run should have stopped before loading the model")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_unknown_command_did_you_mean(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "thruput")
    assert code == 2 and "did you mean 'throughput'?" in _one_error_line(err)


def test_memory_check_refuses_what_cannot_fit(monkeypatch, capsys, tmp_path):
    """`--len 64m` used to grow until the kernel killed it (exit 137, no message): now one line before any work."""
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--model", "tiny-qwen3", "--len",
                           "64m", "--prefill", "synthetic", "-o", str(tmp_path))
    line = _one_error_line(err)
    assert code == 1 and "of host memory but" in line and "--force" in line
    assert list(tmp_path.glob("*.json")) == []


def test_memory_need_is_the_planners_footprint(monkeypatch, tiny_qwen3):
    """What the check compares is exactly the planner's method footprint plus workspace, times the batch."""
    from scoutbench.bench.resolve import ThroughputConfig, check_memory, memory_need
    from scoutbench.methods import build_method
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import LoadedModel
    from scoutbench.planning import workspace_bytes_per_seq

    cfg = ThroughputConfig(method="scout", length=4096, steps=4, warmup=1)
    loaded = LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)
    method = build_method("scout", {})
    shape = ModelShape.from_config(tiny_qwen3.config)
    stored = 4096 + 1 + 4 + cfg.count_steps  # prompt, warm-up, timed and counted steps
    footprint = method.memory_footprint(shape, stored, 4)
    need = memory_need(cfg, method, loaded, batch=3)
    workspace = workspace_bytes_per_seq(shape, stored, 4, footprint.prefill_bytes_per_seq)
    assert need == {"device": 3 * (footprint.device_bytes_per_seq + workspace), "host": 3 * footprint.host_bytes_per_seq}
    total = need["device"] + need["host"]
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(total / 0.8) + 16)
    check_memory(cfg, method, loaded, 3)  # just fits (the planner's 20% host reserve kept)
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(total / 0.8) - 16)
    with pytest.raises(ScoutbenchError, match="needs about"):
        check_memory(cfg, method, loaded, 3)
    check_memory(dataclasses.replace(cfg, force=True), method, loaded, 3)  # --force


def test_an_explicit_host_mem_is_what_the_host_check_uses(monkeypatch, tiny_qwen3):
    """On CUDA (emulated) the host tier is checked against --host-mem where it is given: a VM whose RAM grows on
    demand reports less MemAvailable than it can have, and every offloading method was refused there (the check
    read 0.8 x MemAvailable whatever --host-mem said). Without --host-mem, MemAvailable stays the budget."""
    from emulated import emulated_model

    from scoutbench.bench.resolve import ThroughputConfig, check_memory, memory_need
    from scoutbench.methods import build_method
    from scoutbench.models import LoadedModel
    from scoutbench.testing.emulated_cuda import emulated_cuda

    method = build_method("scout", {})
    with emulated_cuda():
        loaded = LoadedModel(emulated_model(tiny_qwen3), "tiny-qwen3", "preset", True)
        cfg = ThroughputConfig(method="scout", length=4096, steps=4, warmup=1, device="cuda")
        host = memory_need(cfg, method, loaded, batch=3)["host"]
        monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: int(host / 0.8) - 16)
        with pytest.raises(ScoutbenchError, match="of host memory .*free less the planner's reserve"):
            check_memory(cfg, method, loaded, 3)  # MemAvailable: too little now
        check_memory(dataclasses.replace(cfg, host_mem=int(host / 0.8) + 16), method, loaded, 3)
        with pytest.raises(ScoutbenchError, match=r"of host memory .*\(--host-mem less the planner's reserve\)"):
            check_memory(dataclasses.replace(cfg, host_mem=int(host / 0.8) - 16), method, loaded, 3)


def test_prefill_auto_is_synthetic_for_random_weights_and_real_otherwise(tiny_qwen3):
    from scoutbench.bench.throughput import resolve_prefill
    from scoutbench.models import LoadedModel

    assert resolve_prefill("auto", LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)) == "synthetic"
    assert resolve_prefill("auto", LoadedModel(tiny_qwen3, "some/model", "hub", False)) == "real"
    assert resolve_prefill("real", LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)) == "real"


def test_default_run_is_the_regime_where_methods_differ():
    """No arguments: the compared methods at 32k, on the paper's Qwen3-14B shape on CUDA and on bench-attn16 on a
    CPU: the dense share (2 of 16 layers) and GQA group (4) of the paper's models, one dense-layer setting for every
    sparse method (the default run's time is in the closing note)."""
    from scoutbench.cli.throughput import DEFAULT_METHODS, DEFAULT_MODELS, command
    from scoutbench.methods import build_method
    from scoutbench.methods.base import DEFAULT_DENSE_LAYERS, dense_layers_of
    from scoutbench.models import preset_config

    defaults = {p.name: p.default for p in command.params}
    assert (defaults["model"], defaults["length"], defaults["prefill"]) == (None, "32k", "auto")
    assert DEFAULT_MODELS == {"cuda": "qwen3-14b", "cpu": "bench-attn16"}
    cpu = preset_config(DEFAULT_MODELS["cpu"])
    assert cpu.num_hidden_layers >= 16 and cpu.num_attention_heads // cpu.num_key_value_heads == 4
    dense = {name: dense_layers_of(build_method(name, {})) for name in DEFAULT_METHODS}
    assert dense == {"fullkv": None, **{name: DEFAULT_DENSE_LAYERS for name in DEFAULT_METHODS if name != "fullkv"}}


def test_dense_layers_is_one_run_level_setting(monkeypatch, capsys, tmp_path):
    """`--dense-layers N` sets the dense layers of every selected sparse method (FullKV is dense
    everywhere), each result records it, and the table says it once; without it every method keeps the shared
    default. Alone with FullKV, or together with `--method-arg dense_layers=`, it is a usage error."""
    methods = ["--method", "fullkv", "--method", "quest", "--method", "infinigen", "--method", "hgca", "--method",
               "scout"]
    args = [*methods, "--model", "tiny-qwen3", "--len", "256", "--budget", "128", "--steps", "1", "--warmup", "0"]
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *args, "--dense-layers", "1", "-o",
                             str(tmp_path / "one"))
    assert code == 0, err
    assert "dense layers 1" in out
    results = {r["method"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "one").glob("*.json"))}
    assert {m: r["dense_layers"] for m, r in results.items()} == {"fullkv": None, "quest": 1, "infinigen": 1,
                                                                  "hgca": 1, "scout": 1}
    assert all(r["method_config"]["dense_layers"] == 1 for m, r in results.items() if m != "fullkv")
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *args, "--json", "-o", str(tmp_path / "default"))
    assert code == 0, err
    assert {s["method"]: s["dense_layers"] for s in json.loads(out)} == {
        "fullkv": None, "quest": 2, "infinigen": 2, "hgca": 2, "scout": 2}
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *TINY, "--dense-layers", "1")
    assert code == 2 and "no selected method keeps dense layers" in _one_error_line(err)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "hgca", *TINY, "--dense-layers", "1",
                           "--method-arg", "dense_layers=0")
    assert code == 2 and "--dense-layers and --method-arg dense_layers= both set" in _one_error_line(err)


def test_each_method_is_freed_before_the_next_one_runs(monkeypatch, capsys, tmp_path):
    """A finished method's storage is freed as the run ends, without waiting for the garbage collector: the
    context reaches the engine weakly (method -> context -> engine -> method was a cycle) and HGCA drops its
    deferred bound methods at close. A FullKV left alive at 32k on bench-attn16 is 4 GB that the next method's
    memory check counted as used."""
    import gc

    from scoutbench.bench import throughput
    from scoutbench.methods.base import AttentionMethod

    real, bound = throughput.run_throughput, []

    def counting(cfg, *args, **kwargs):
        bound.append(sum(isinstance(o, AttentionMethod) and hasattr(o, "ctx") for o in gc.get_objects()))
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(throughput, "run_throughput", counting)
    methods = ["fullkv", "quest", "infinigen", "hgca", "scout"]
    gc.collect()
    gc.disable()  # reference counting alone must free each run
    try:
        code, _, err = run_cli(monkeypatch, capsys, "throughput", *(f"--method={m}" for m in methods), "--model",
                               "tiny-qwen3", "--len", "256", "--budget", "128", "--steps", "1", "--warmup", "1",
                               "-o", str(tmp_path))
    finally:
        gc.enable()
    assert code == 0, err
    assert len(bound) == len(methods) and len(set(bound)) == 1


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


def test_progress_lines_when_not_a_terminal():
    import io

    from scoutbench.progress import PhaseProgress

    stream = io.StringIO()
    with PhaseProgress(console=None, interval_s=0.0, stream=stream) as progress:
        for done in range(0, 5):
            progress.update("[1/1] scout decode", done, 4)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/1] scout decode: 1/4, ") and "ETA" in lines[0]
    assert lines[-1].endswith("done") and len(lines) == 4


def test_each_result_is_written_as_soon_as_its_method_finishes(monkeypatch, capsys, tmp_path):
    """Ctrl-C during the second method keeps the first one's result."""
    import scoutbench.bench.throughput as throughput

    real = throughput.run_throughput

    def run_then_stop(cfg, *args, **kwargs):
        if cfg.method == "quest":  # the second method
            raise KeyboardInterrupt
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(throughput, "run_throughput", run_then_stop)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "quest", *TINY,
                           "-o", str(tmp_path))
    assert code == 130, err
    (kept,) = tmp_path.glob("*.json")
    assert json.loads(kept.read_text())["method"] == "fullkv" and "kept 1 finished result" in err


@pytest.mark.parametrize("where", ["resolve", "run"])
def test_a_failing_method_writes_a_failed_result_and_the_next_one_runs(monkeypatch, capsys, tmp_path, where):
    """A method refused before the runs start (its memory check) or failing while it runs gets a failed result
    with its error, and the other methods still run and are written; the command exits 1 and names it. (A
    refusal of the second method once ended the command before the first one ran: no result at all.)"""
    import scoutbench.bench.resolve as resolve
    import scoutbench.bench.throughput as throughput

    module = {"resolve": resolve, "run": throughput}[where]
    real = {"resolve": resolve.check_memory, "run": throughput.run_throughput}[where]

    def fail_for_quest(cfg_or_run, *args, **kwargs):
        if cfg_or_run.method == "quest":
            raise ScoutbenchError("quest: needs about 9 GiB of host memory but only 1 GiB is usable")
        return real(cfg_or_run, *args, **kwargs)

    monkeypatch.setattr(module, {"resolve": "check_memory", "run": "run_throughput"}[where], fail_for_quest)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "quest", "--method", "fullkv", *TINY,
                             "-o", str(tmp_path), "--json")
    assert code == 1 and "1 of 2 methods failed (quest)" in err, err
    results = {r["method"]: r for r in map(json.loads, (p.read_text() for p in tmp_path.glob("*.json")))}
    assert results["fullkv"]["status"] == "ok" and results["fullkv"]["decode_throughput_tok_s"] > 0
    assert results["quest"]["status"] == "failed" and "9 GiB of host memory" in results["quest"]["error"]
    assert results["quest"]["method_config"]["budget"] > 0  # identified as a sweep's failed point is
    summary = {s["method"]: s for s in json.loads(out)}
    assert summary["quest"]["status"] == "failed" and summary["fullkv"]["status"] == "ok"


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


def test_sigkill_mid_throughput_keeps_the_finished_method(tmp_path, monkeypatch, capsys):
    """A real SIGKILL while the second method runs: the first method's result is complete on disk, nothing
    partial, and the folder's lock does not outlive the process (a rerun into the folder works)."""
    import signal

    out = tmp_path / "runs"
    proc, started = throughput_hanging_on_second_method(tmp_path, out, TINY)
    try:
        signal_once_started(proc, started, 120, "the second method never started")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    (kept,) = out.glob("*.json")
    assert json.loads(kept.read_text())["method"] == "fullkv" and not list(out.glob(".*.tmp"))
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *TINY, "-o", out)
    assert code == 0, err
    assert len(list(out.glob("*.json"))) == 2


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
