"""`scoutbench throughput` (scoutbench/cli/throughput.py): result files and their schema, the table, the
default run, run-level settings, memory checks, failures and interruptions."""

from __future__ import annotations

import io
import json

import pytest
from cli_runner import (
    collapsed_words,
    rendered_table,
    run_cli,
    signal_once_started,
    throughput_hanging_on_second_method,
)
from result_factory import SCOUT_CONFIG, make_result

from scoutbench.errors import ScoutbenchError

TINY_1K = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


GIB = 1024**3


def test_batch_auto_is_checked_against_free_memory_without_allocating(monkeypatch, capsys, tmp_path):
    """`--batch auto --gpu-mem 1TiB` on a CPU plans a batch (179557) that free host memory cannot hold: refused
    before anything is allocated. Free memory is faked here and the run itself is never reached."""
    import scoutbench.bench.throughput as throughput

    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(throughput, "_run_at_batch", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--model", "tiny-qwen3", "--len", "2k", "--steps",
                             "2", "--method", "fullkv", "--batch", "auto", "--gpu-mem", "1TiB", "-o", tmp_path / "o")
    assert code == 1, err
    assert "--batch auto's planned batch" in err and "host memory" in err and "6.40 GiB is usable" in err
    assert len(err.strip().splitlines()) == 1 and not list((tmp_path / "o").glob("*.json"))
    # the library path (sweeps run points through it) refuses the same batch before running it
    from scoutbench.errors import ScoutbenchError

    cfg = throughput.ThroughputConfig(method="fullkv", model="tiny-qwen3", length=2048, batch="auto", gpu_mem=1 << 40,
                                      steps=2, warmup=0, device="cpu")
    with pytest.raises(ScoutbenchError, match="planned batch"):
        throughput.run_throughput(cfg)


def test_batch_auto_that_fits_free_memory_still_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.planning.available_host_bytes", lambda: 8 * GIB)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--model", "tiny-qwen3", "--len", "256", "--steps",
                             "1", "--warmup", "0", "--method", "fullkv", "--batch", "auto", "--gpu-mem", "1.15GiB",
                             "-o", tmp_path / "o", "--json")
    assert code == 0, err
    (summary,) = json.loads(out)
    assert summary["batch"] >= 1


def test_throughput_table_at_auto_batches_says_each_batch_and_labels_the_comparison():
    """At --batch auto the table gives each method's batch and labels the comparison with FullKV per sequence
    where the batches differ."""
    from scoutbench.cli.throughput import _table

    def result(method, tok_s, batch):
        r = make_result(method, tok_s, batch=batch, config=SCOUT_CONFIG if method == "scout" else None)
        r["device"]["type"], r["main_thread_wait_frac"] = "cpu", 0.1
        return r

    text = rendered_table(_table([result("fullkv", 151.0, 151), result("scout", 218.0, 109)]))
    assert "batch per method (--batch auto)" in text and "batch 151" not in text
    scout_row = next(line for line in text.splitlines() if line.strip().startswith("scout"))
    assert " 109 " in scout_row and "1.44x (2.00x/seq)" in scout_row
    assert "tok/s: batch x timed steps / timed decode time (the mean step); step: the median step" in collapsed_words(text)
    # the ±95% column's unit and its mark are in the caption
    assert ("±95%: half-width of the median's 95% interval, % of the median (!: over 10% or under 6 steps"
            in collapsed_words(text))
    assert "vs full: tok/s over FullKV's (x/seq: per sequence, where the batches differ)" in collapsed_words(text)
    same = rendered_table(_table([result("fullkv", 10.0, 2), result("scout", 20.0, 2)]))
    same_row = next(line for line in same.splitlines() if line.strip().startswith("scout"))
    assert "batch 2 " in same and "2.00x" in same_row and "/seq" not in same_row


def test_throughput_table_names_each_rows_setting_with_the_papers_beside_it():
    """The caption names each row's grid point (docs/methods.md, one rule for every method's defaults) and the
    paper-literal point beside it; FullKV has no grid and no entry."""
    from scoutbench.cli.throughput import _table

    results = [make_result("fullkv", 10.0), make_result("scout", 20.0, config={**SCOUT_CONFIG, "pool_factor": 2.0})]
    for r in results:
        r["device"]["type"] = "cpu"
    text = collapsed_words(rendered_table(_table(results)))
    assert "settings: scout pool 2 (paper: pool 1)" in text and "fullkv (" not in text


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_kv_skew_must_be_finite(value, monkeypatch, capsys, tmp_path):
    """`--kv-skew` takes finite numbers only."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", *TINY_1K, "--method", "fullkv", "--kv-skew", value,
                             "-o", tmp_path)
    assert code == 2 and "--kv-skew must be a finite number" in err, err


def test_other_float_inputs_refuse_nan(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", *TINY_1K, "--method", "hgca", "--method-arg",
                           "window_share=nan", "-o", tmp_path)
    assert code == 2 and "window_share='nan' is not a finite number" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--executor", "ray",
                           "--cpus-per-point", "nan", "-o", tmp_path / "s")
    assert code == 2 and "--cpus-per-point" in err, err


def test_sigterm_keeps_and_lists_the_finished_results_like_sigint(tmp_path):
    """SIGTERM exited 143 without the "kept N finished results" line that Ctrl-C gives."""
    import signal

    out = tmp_path / "runs"
    proc, started = throughput_hanging_on_second_method(tmp_path, out, TINY_1K)
    try:
        signal_once_started(proc, started, 120, "the second method never started", signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    err = err.decode()
    assert proc.returncode == 143, err
    assert "kept 1 finished result(s)" in err and err.strip().endswith("terminated"), err
    (kept,) = out.glob("*.json")
    assert json.loads(kept.read_text())["method"] == "fullkv"


TINY = ["--model", "tiny-qwen3", "--len", "64", "--steps", "1", "--warmup", "0"]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


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
    # another run (the default model) into the same folder: its own files beside these
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--len", "64", "--steps", "1",
                           "--warmup", "0", "-o", str(tmp_path))
    assert code == 0, err
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_throughput_table_never_cuts_a_number(monkeypatch, capsys, tmp_path):
    """The throughput table shows each result's figures whole: in a log, and in an 80-column terminal with the
    default run's longest method name and 3-digit steps."""
    from rich.console import Console

    from scoutbench.cli.throughput import _table

    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--method", "infinigen-dynamic",
                             "--model", "tiny-qwen3", "--len", "64", "--steps", "2", "--warmup", "0", "-o",
                             str(tmp_path))  # the default run's longest method name
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


def test_a_folder_output_that_holds_this_runs_results_is_exit_2_without_overwrite(monkeypatch, capsys, tmp_path):
    """An existing output folder without --overwrite appended `-1` files and exited 0, where docs/exit_codes.md
    promises exit 2 (as for a .json output)."""
    args = ["throughput", "--method", "fullkv", "--method", "quest", "--model", "tiny-qwen3", "--len", "32", "--steps",
            "1", "--warmup", "0", "-o", str(tmp_path)]
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    before = {path.name: path.read_bytes() for path in tmp_path.glob("*.json")}
    assert len(before) == 2
    monkeypatch.setattr("scoutbench.models.load_model", _never)  # refused before any work
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "already holds this run's results" in err, err
    assert "--overwrite" in err and {path.name: path.read_bytes() for path in tmp_path.glob("*.json")} == before
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--model", "tiny-qwen3", "--len",
                           "32", "--batch", "auto", "--gpu-mem", "1GiB", "-o", str(tmp_path))  # any batch of fullkv's
    assert code == 2 and "throughput_fullkv_tiny-qwen3_len32_b1.json" in err, err
    monkeypatch.undo()
    assert run_cli(monkeypatch, capsys, *args, "--overwrite")[0] == 0
    assert sorted(path.name for path in tmp_path.glob("*.json")) == sorted(before)  # replaced, no `-1` files


def test_synthetic_prefill_and_ragged_batch(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--model", "tiny-qwen3", "--len",
                             "2k", "--steps", "2", "--warmup", "1", "--batch", "2", "--prefill", "synthetic", "-o",
                             str(tmp_path), "--json")
    assert code == 0, err
    assert json.loads(out)[0]["batch"] == 2


def test_memory_check_refuses_what_cannot_fit(monkeypatch, capsys, tmp_path):
    """`--len 64m` needs more host memory than there is: one error line before any work, and no result file."""
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--model", "tiny-qwen3", "--len",
                           "64m", "--prefill", "synthetic", "-o", str(tmp_path))
    line = _one_error_line(err)
    assert code == 1 and "of host memory but" in line and "--force" in line
    assert list(tmp_path.glob("*.json")) == []


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
    context reaches the engine weakly (method -> context -> engine -> method would be a cycle) and HGCA drops its
    deferred bound methods at close. A FullKV left alive at 32k on bench-attn16 would be 4 GB that the next
    method's memory check counts as used."""
    import gc

    from scoutbench.bench import throughput
    from scoutbench.methods.base import AttentionMethod

    real, bound = throughput.run_throughput, []

    def counting(cfg, *args, **kwargs):
        # type(), not isinstance(): isinstance reads `__class__`, which torch's deprecated module aliases warn on
        bound.append(sum(issubclass(type(o), AttentionMethod) and hasattr(o, "ctx") for o in gc.get_objects()))
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
    with its error, and the other methods still run and are written; the command exits 1 and names it."""
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
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *TINY, "-o", out, "--overwrite")
    assert code == 0, err  # the lock died with the process; the rerun replaces the kept result (exit 2 without
    assert [path.name for path in out.glob("*.json")] == [kept.name]  # --overwrite: the folder holds it)
