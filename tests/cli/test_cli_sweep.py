"""`scoutbench sweep` (scoutbench/cli/sweep.py): its table, presets and SIGTERM."""

from __future__ import annotations

from cli_runner import collapsed_words, rendered_table, run_cli


def test_sweep_table_shows_the_cpu_wait_share():
    """The sweep's final table shows a CPU run's main-thread wait share (HGCA's 17.4% here), as its JSON does."""
    from scoutbench.cli.sweep import _sweep_table

    manifest = {"settings": {"model": "tiny-qwen3", "prefill": "synthetic", "steps": 8}, "points": [
        {"method": "hgca", "method_args": {}, "len": 4096, "batch": 1, "status": "ok", "batch_used": 1,
         "decode_throughput_tok_s": 10.0, "decode_step_ms_median": 100.0, "gpu_idle_frac": None,
         "main_thread_wait_frac": 0.174}]}
    text = rendered_table(_sweep_table(manifest))
    row = next(line for line in text.splitlines() if "hgca" in line)
    assert "17.4" in row and "tokens over the total timed decode time" in collapsed_words(text)
    assert "median step ms: the median step" in collapsed_words(text)
    assert "vs fullkv: tok/s over FullKV's at the same len and batch" in collapsed_words(text)
    # each point's setting, its args resolved, the paper's beside it; a method the registry does not know has none
    manifest["points"] += [{**manifest["points"][0], "method": "scout", "method_args": {"pool_factor": "2"}},
                           {**manifest["points"][0], "method": "someone-elses"}]
    assert ("settings: hgca window 0.5, selected read (paper: window 0.25, all read), scout pool 2 (paper: pool 1)"
            in collapsed_words(rendered_table(_sweep_table(manifest))))


def test_a_presets_own_budget_is_not_a_usage_error(monkeypatch, capsys, tmp_path):
    """`sweep --preset lengths --method fullkv` runs FullKV without the preset's budget, not a --budget usage error."""
    from scoutbench.errors import ScoutbenchError

    seen = {}

    def record(points, *args, **kwargs):
        seen["points"] = points
        raise ScoutbenchError("stop before running")

    monkeypatch.setattr("scoutbench.bench.sweep.run_sweep", record)
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--preset", "lengths", "--scale", "cpu", "--method", "fullkv",
                           "-o", tmp_path / "s")
    assert code == 1 and "stop before running" in err, err
    assert {p.method for p in seen["points"]} == {"fullkv"} and all(p.args == {} for p in seen["points"])


def test_sigterm_in_a_sweep_keeps_the_finished_points_and_says_so(tmp_path, monkeypatch, capsys):
    from scoutbench.errors import Terminated

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr("scoutbench.bench.sweep.run_sweep", terminated)
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "-o", tmp_path / "s")
    assert code == 143 and "kept the finished points" in err and err.strip().endswith("terminated"), err


def test_sweep_and_throughput_of_the_same_flags_record_the_same_prefill(monkeypatch, capsys, tmp_path):
    """`sweep` without --preset ran a real prefill where `throughput` fills a random-weight model synthetically
    (~39 s of prefill per point at 2k, and a result saying `workload.name: synthetic`, `prefill: real`). Both
    default to auto now and record what ran."""
    import json

    from scoutbench.bench.resolve import resolve_prefill
    from scoutbench.results import load_results

    flags = ("--method", "fullkv", "--model", "tiny-qwen3", "--len", "256", "--steps", "1", "--warmup", "0",
             "--device", "cpu")
    code, _, err = run_cli(monkeypatch, capsys, "sweep", *flags, "-o", tmp_path / "sweep")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "throughput", *flags, "-o", tmp_path / "run")
    assert code == 0, err
    (swept,), (measured,) = load_results([tmp_path / "sweep"]), load_results([tmp_path / "run"])
    assert swept["workload"]["prefill"] == measured["workload"]["prefill"] == "synthetic"
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert manifest["settings"]["prefill"] == "synthetic"  # the resolved value, not "auto"
    assert "prefill: synthetic" in (tmp_path / "sweep" / "sweep_config.yaml").read_text()
    # the name decides before anything loads: only the built-in presets have random weights
    assert [resolve_prefill("auto", name) for name in ("bench-attn16", "qwen3-14b", "smollm2-135m", "Qwen/Qwen3-8B@main",
                                                         "./my-model")] == ["synthetic", "synthetic", "real", "real",
                                                                            "real"]
    assert resolve_prefill("real", "tiny-qwen3") == "real" and resolve_prefill("synthetic", "smollm2-135m") == "synthetic"
