"""`scoutbench sweep`: grid expansion, presets, deterministic point files, failed points, and resuming after an
interrupt (Ctrl-C) or a SIGKILL mid-point without partial or corrupt files."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_runner import run_cli, signal_once_started
from repo_paths import TESTS_DIR
from result_factory import make_result

from scoutbench.bench.sweep import MANIFEST, run_sweep
from scoutbench.bench.sweep_grid import PRESETS, Grid, Settings, SweepPoint, expand
from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.results import LOCK_NAME, load_results

SCOUT_FIELDS = {"budget", "block_size", "pc", "pr", "recall_interval"}
FIELDS = {"fullkv": set(), "infinigen": {"budget"}, "infinigen-dynamic": {"budget"}, "hgca": {"budget", "block_size"}, "scout": SCOUT_FIELDS,
          "scout-base": SCOUT_FIELDS, "scout-pc": SCOUT_FIELDS}
SETTINGS = Settings(model="tiny-qwen3", steps=2, warmup=1, device="cpu", prefill="synthetic")
POINTS = [SweepPoint("fullkv", length, 1) for length in (1024, 2048, 4096)]


@pytest.fixture
def method_fields(monkeypatch):
    """Expansion asks each method for its fields; pin them so the tests do not depend on other methods' code."""
    monkeypatch.setattr("scoutbench.method_args.method_field_names", lambda name: FIELDS[name])


class FakeRunner:
    """Stands in for run_throughput: records the points it ran; `fail` maps a length to the exception to raise."""

    def __init__(self, fail: dict[int, BaseException] | None = None):
        self.fail = fail or {}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cfg):
        self.calls.append((cfg.method, cfg.length))
        if cfg.length in self.fail:
            raise self.fail[cfg.length]
        return make_result(cfg.method, 1e5 / cfg.length, length=cfg.length, batch=cfg.batch, config=cfg.method_args)


def files(folder: Path) -> list[str]:
    """The folder's files but the writer lock (an empty file the OS locks; it stays, unlocked, after a run)."""
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)


def manifest_statuses(folder: Path) -> list[str]:
    return [p["status"] for p in json.loads((folder / MANIFEST).read_text())["points"]]


def test_grid_expansion_collapses_axes_a_method_lacks(method_fields):
    grid = Grid(("fullkv", "scout"), (1024, 2048), (1,), budgets=(256, 512), block_sizes=(16, 32),
                method_args={"recall_interval": ("2", "4")})
    points = expand(grid)
    # fullkv has none of the swept fields: one point per length; scout: 2 budgets x 2 block sizes x 2 intervals
    assert len(points) == 2 * (1 + 8)
    assert [p.length for p in points] == [1024] * 9 + [2048] * 9  # lengths outermost
    assert SweepPoint("scout", 2048, 1, (("block_size", 16), ("budget", 512), ("recall_interval", "4"))) in points
    assert points[0] == SweepPoint("fullkv", 1024, 1)
    with pytest.raises(UsageError, match="'nope' is not a field of any selected method"):
        expand(Grid(("fullkv", "scout"), (1024,), (1,), method_args={"nope": ("1",)}))


def test_point_ids_are_deterministic_and_distinct(method_fields):
    points = expand(Grid(("fullkv", "scout"), (1024, 2048), (1, 2), budgets=(256, 512), block_sizes=(16, 32)))
    ids = [p.point_id("bench-attn") for p in points]
    assert len(set(ids)) == len(ids)
    assert ids == [p.point_id("bench-attn") for p in expand(Grid(("fullkv", "scout"), (1024, 2048), (1, 2),
                                                                   budgets=(256, 512), block_sizes=(16, 32)))]
    assert SweepPoint("scout", 16384, 1, (("block_size", 32), ("budget", 1024))).point_id("bench-attn") == \
        "scout_bench-attn_len16k_b1_block_size-32_budget-1024"
    assert SweepPoint("fullkv", 4096, 1).point_id("Qwen/Qwen3-8B") == "fullkv_Qwen--Qwen3-8B_len4k_b1"
    # values that are not file-name safe are replaced and a hash keeps otherwise-equal names apart
    odd, plain = SweepPoint("scout", 4096, 1, (("mode", "a/b"),)), SweepPoint("scout", 4096, 1, (("mode", "a_b"),))
    assert odd.point_id("m") != plain.point_id("m") and "/" not in odd.point_id("m")


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("scale", ["paper", "cpu"])
def test_presets_expand_to_valid_points(method_fields, name, scale):
    grid, settings = PRESETS[name].grid_and_settings(scale)
    points = expand(grid)
    from scoutbench.bench.resolve import resolve_prefill

    assert points and settings.prefill == "auto" and resolve_prefill(settings.prefill, settings.model) == "synthetic"
    assert settings.model == ("qwen3-14b" if scale == "paper" else "bench-attn16")
    for point in points:  # a budget at or above the context would attend everything
        assert point.args.get("budget", 0) < point.length
    if name == "ablation":
        assert [p.method for p in points] == ["scout-base", "scout-pc", "scout"]
    if name == "block-size":
        assert sorted(p.args["block_size"] for p in points) == [16, 32, 64]


def test_failed_point_is_recorded_and_the_sweep_continues(tmp_path):
    runner = FakeRunner(fail={2048: ScoutbenchError("fullkv: out of GPU memory at batch 1, len 2048"),
                              4096: RuntimeError("kernel bug")})
    outcome = run_sweep(POINTS, SETTINGS, tmp_path, runner=runner)
    assert runner.calls == [("fullkv", 1024), ("fullkv", 2048), ("fullkv", 4096)]
    assert manifest_statuses(tmp_path) == ["ok", "failed", "failed"]
    assert [p["error"] for p in outcome.failed] == ["fullkv: out of GPU memory at batch 1, len 2048",
                                                    "RuntimeError: kernel bug"]
    failed = json.loads((tmp_path / "fullkv_tiny-qwen3_len2k_b1.json").read_text())
    assert failed["status"] == "failed" and failed["workload"]["len"] == 2048 and failed["method"] == "fullkv"
    assert failed["model"] == {"name": "tiny-qwen3", "dtype": "float32"} and failed["device"]["type"] == "cpu"
    # a rerun runs nothing; --retry-failed runs only the failed points
    again = FakeRunner()
    assert run_sweep(POINTS, SETTINGS, tmp_path, runner=again).skipped == 3 and again.calls == []
    run_sweep(POINTS, SETTINGS, tmp_path, runner=again, retry_failed=True)
    assert again.calls == [("fullkv", 2048), ("fullkv", 4096)]
    assert manifest_statuses(tmp_path) == ["ok", "ok", "ok"]


def test_ctrl_c_mid_point_leaves_no_partial_file_and_resumes(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_sweep(POINTS, SETTINGS, tmp_path, runner=FakeRunner(fail={2048: KeyboardInterrupt()}))
    assert files(tmp_path) == ["fullkv_tiny-qwen3_len1k_b1.json", MANIFEST]
    assert manifest_statuses(tmp_path) == ["ok", "pending", "pending"]
    runner = FakeRunner()
    outcome = run_sweep(POINTS, SETTINGS, tmp_path, runner=runner)
    assert runner.calls == [("fullkv", 2048), ("fullkv", 4096)]  # point 1 skipped
    assert (outcome.ran, outcome.skipped) == (2, 1)
    assert manifest_statuses(tmp_path) == ["ok", "ok", "ok"]
    assert [r["workload"]["len"] for r in load_results([tmp_path])] == [1024, 2048, 4096]


def test_sigkill_mid_point_then_resume(tmp_path):
    out, started = tmp_path / "sweep", tmp_path / "started"
    script = tmp_path / "killme.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(TESTS_DIR)!r}]
        from test_sweep import POINTS, SETTINGS, FakeRunner
        from scoutbench.bench.sweep import run_sweep

        class Hang(FakeRunner):
            def __call__(self, cfg):
                if cfg.length == 2048:
                    Path({str(started)!r}).touch()
                    time.sleep(120)
                return super().__call__(cfg)

        run_sweep(POINTS, SETTINGS, {str(out)!r}, runner=Hang())
    """), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        signal_once_started(proc, started, 60, "the sweep never reached point 2")
    finally:
        proc.wait(timeout=30)
    assert files(out) == ["fullkv_tiny-qwen3_len1k_b1.json", MANIFEST]
    # what a kill during a rename-less write would leave: a temp file, ignored by readers and cleaned on resume
    (out / ".fullkv_tiny-qwen3_len2k_b1.json.k1ll3d.tmp").write_text('{"schema_version": 2, "kind"')
    assert len(load_results([out])) == 1
    runner = FakeRunner()
    run_sweep(POINTS, SETTINGS, out, runner=runner)
    assert runner.calls == [("fullkv", 2048), ("fullkv", 4096)]
    assert files(out) == ["fullkv_tiny-qwen3_len1k_b1.json", "fullkv_tiny-qwen3_len2k_b1.json",
                          "fullkv_tiny-qwen3_len4k_b1.json", MANIFEST]
    assert manifest_statuses(out) == ["ok", "ok", "ok"]


def test_resume_with_other_settings_is_refused(tmp_path):
    run_sweep(POINTS[:1], SETTINGS, tmp_path, runner=FakeRunner())
    with pytest.raises(UsageError, match="steps 2 there vs 4 now"):
        run_sweep(POINTS[:1], Settings(**{**SETTINGS.__dict__, "steps": 4}), tmp_path, runner=FakeRunner())


def test_growing_a_sweep_keeps_earlier_points(tmp_path):
    run_sweep(POINTS[:1], SETTINGS, tmp_path, runner=FakeRunner())
    runner = FakeRunner()
    run_sweep(POINTS[1:], SETTINGS, tmp_path, runner=runner)
    assert runner.calls == [("fullkv", 2048), ("fullkv", 4096)]
    ids = [p["id"] for p in json.loads((tmp_path / MANIFEST).read_text())["points"]]
    assert ids == ["fullkv_tiny-qwen3_len2k_b1", "fullkv_tiny-qwen3_len4k_b1", "fullkv_tiny-qwen3_len1k_b1"]




def test_sweep_cli_end_to_end_with_the_real_runner(tmp_path, monkeypatch, capsys):
    args = ["sweep", "--method", "fullkv", "--len", "64,96", "--steps", "2", "--warmup", "1", "--device", "cpu",
            "-o", tmp_path, "--json"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    manifest = json.loads(out)
    assert (manifest["ran"], manifest["skipped"]) == (2, 0)
    assert [(p["len"], p["status"]) for p in manifest["points"]] == [(64, "ok"), (96, "ok")]
    results = load_results([tmp_path])
    assert [r["decode_throughput_tok_s"] > 0 for r in results] == [True, True]
    assert {r["workload"]["steps"] for r in results} == {2}
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and (json.loads(out)["ran"], json.loads(out)["skipped"]) == (0, 2)


def test_sweep_cli_exits_1_when_a_point_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("scoutbench.bench.sweep.ThroughputRunner.__call__",
                        lambda self, cfg: FakeRunner(fail={96: ScoutbenchError("out of memory")})(cfg))
    code, out, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "64", "--len", "96",
                             "--device", "cpu", "-o", tmp_path)
    assert code == 1
    assert "1 of 2 points failed" in err and "--retry-failed" in err
    assert "failed: out of memory" in out


@pytest.mark.parametrize("manifest", [
    {"schema_version": 2, "kind": "sweep"},  # no settings, no points
    {"schema_version": 2, "kind": "sweep", "settings": {}, "points": [{"status": "ok"}]},  # a point without its id
    {"schema_version": 2, "kind": "sweep", "settings": [], "points": []},
])
def test_malformed_manifest_is_one_line(tmp_path, manifest):
    """(A manifest of another schema is refused before its fields are judged: test_old_schema_manifest_is_refused.)"""
    (tmp_path / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(UsageError, match="malformed sweep manifest"):
        run_sweep(POINTS, SETTINGS, tmp_path, runner=FakeRunner())
    (tmp_path / MANIFEST).write_bytes(b'{"kind": "sweep", "name": "caf\xe9"}')
    with pytest.raises(UsageError, match="not a readable sweep manifest"):
        run_sweep(POINTS, SETTINGS, tmp_path, runner=FakeRunner())


def test_malformed_point_file_is_run_again(tmp_path):
    run_sweep(POINTS, SETTINGS, tmp_path, runner=FakeRunner())
    point = tmp_path / "fullkv_tiny-qwen3_len2k_b1.json"
    point.write_text(json.dumps({**json.loads(point.read_text()), "workload": [2048]}), encoding="utf-8")
    runner = FakeRunner()
    run_sweep(POINTS, SETTINGS, tmp_path, runner=runner)
    assert runner.calls == [("fullkv", 2048)]


def test_report_lists_malformed_files_as_skipped(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "good.json").write_text(json.dumps(make_result("fullkv", 50.0)), encoding="utf-8")
    (results / "bad.json").write_text(json.dumps({**make_result("scout", 1.0), "model": "tiny-qwen3"}))
    (results / "latin1.json").write_bytes(b'{"schema_version": 2, "method": "caf\xe9"}')
    code, out, err = run_cli(monkeypatch, capsys, "report", str(results), "-o", str(tmp_path / "report"))
    assert code == 0, err
    assert f"skipped {results / 'bad.json'}: malformed result: model is str" in out
    assert f"skipped {results / 'latin1.json'}: unreadable" in out and "Traceback" not in out + err


def test_presets_run_scout_with_a_profiled_recall_interval_per_configuration(tmp_path):
    """Paper presets on a real prefill use per-layer recall intervals profiled offline (paper section 3.4): one
    profile per distinct ScoutAttention configuration, kept in the sweep folder and reused by a rerun; methods
    without periodic recall (FullKV, scout-base/-pc) and points that name their own profile are left as they are."""
    from scoutbench.bench.sweep import attach_recall_profiles

    calls = []

    def profiler(model, length, steps, beta, **kw):
        calls.append((model, length, kw["method_args"]["budget"], kw["method_args"]["block_size"]))
        return {"kind": "scout_recall_profile", "intervals": [None, None, 3, 5]}

    own = tmp_path / "own.json"
    own.write_text(json.dumps({"intervals": [None, None, 2, 2]}))
    points = expand(Grid(("fullkv", "scout-base", "scout-pc", "scout"), (2048, 1024), (1,), budgets=(256, 512)))
    points.append(SweepPoint("scout", 1024, 1, (("recall_profile", str(own)),)))
    real = dataclasses.replace(SETTINGS, prefill="real")
    attached = attach_recall_profiles(points, real, tmp_path, profiler=profiler)
    # profiled at the sweep's shortest length, once per budget (the only field that differs)
    assert sorted(calls) == [("tiny-qwen3", 1024, 256, 32), ("tiny-qwen3", 1024, 512, 32)]
    profiled = [p for p in attached if p.method == "scout" and p.args["recall_profile"] != str(own)]
    assert len(profiled) == 4 and len({p.args["recall_profile"] for p in profiled}) == 2
    for point in profiled:  # the profile is loadable by the method, and named by its stem in the point id
        from scoutbench.methods import build_method

        assert build_method(point.method, point.args)._profile_intervals == [None, None, 3, 5]
        assert Path(point.args["recall_profile"]).stem in point.point_id("tiny-qwen3")
        assert str(tmp_path) not in point.point_id("tiny-qwen3")
    untouched = [p for p in attached if p.method != "scout"] + [attached[-1]]
    assert untouched == [p for p in points if p.method != "scout"] + [points[-1]]
    assert attach_recall_profiles(points, real, tmp_path, profiler=profiler) == attached and len(calls) == 2
    # a synthetic prefill has no drift to profile: nothing is profiled, every point keeps its fixed interval
    assert attach_recall_profiles(points, SETTINGS, tmp_path / "synthetic", profiler=profiler) == points
    assert len(calls) == 2


def test_preset_sweep_on_a_synthetic_prefill_keeps_the_fixed_recall_interval(monkeypatch, capsys, tmp_path):
    """End to end through `scoutbench sweep --preset ablation` (synthetic prefill): no profile is made, the log
    says why, and the scout point's result says its intervals are the fixed one."""
    out = tmp_path / "ablation"
    code, stdout, stderr = run_cli(monkeypatch, capsys, "sweep", "--preset", "ablation", "--scale", "cpu", "--model",
                                   "tiny-qwen3", "--len", "2k", "--budget", "512", "--steps", "2", "--warmup", "1",
                                   "--device", "cpu", "-o", out)
    assert code == 0, stdout + stderr
    assert "no recall profile: a synthetic prefill has no drift to profile" in stderr
    assert not list(out.glob("recall_profile-*.json"))
    scout = json.loads(next(out.glob("scout_tiny-qwen3_*.json")).read_text())
    assert scout["method_config"]["recall_profile"] is None and scout["method_stats"]["recall"]["profile"] is None
    assert set(scout["method_stats"]["recall"]["intervals"][2:]) == {8}


def test_old_schema_manifest_is_refused(tmp_path):
    """Resuming into a folder a schema-1 sweep wrote names both schemas in one line (no guessing from fields)."""
    old = {"schema_version": 1, "kind": "sweep", "scoutbench_version": "0.1.0", "settings": {}, "points": []}
    (tmp_path / MANIFEST).write_text(json.dumps(old), encoding="utf-8")
    with pytest.raises(UsageError, match="schema_version 1, but this scoutbench reads schema_version 2"):
        run_sweep(POINTS, SETTINGS, tmp_path, runner=FakeRunner())
