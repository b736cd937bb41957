"""Sweep resume never trusts a point file's name: a point is done only when its file records this point and this
sweep's settings, and a folder whose manifest is gone takes its settings from its point files. The property test
drives random interleavings of runs (with other settings and grids), kills at every stage of a point, and removed
or corrupt manifests against a model of what the folder must hold; the end-to-end tests run the real CLI."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
from cli_runner import run_cli
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from result_factory import make_result

from scoutbench.bench.sweep import MANIFEST, run_sweep
from scoutbench.bench.sweep_grid import Settings, SweepPoint, run_environment, settings_record
from scoutbench.errors import UsageError
from scoutbench.results import LOCK_NAME

BASE = Settings(model="tiny-qwen3", steps=2, warmup=1, device="cpu", prefill="synthetic")
SETTINGS = [BASE, replace(BASE, steps=4), replace(BASE, seed=5)]
POINTS = [SweepPoint("fullkv", 1024, 1), SweepPoint("fullkv", 2048, 1), SweepPoint("quest", 1024, 1),
          SweepPoint("quest", 1024, 1, (("budget", 512),))]


class Killed(BaseException):
    """A kill -9 as the sweep sees it: no handler of its runs (KeyboardInterrupt is Ctrl-C or SIGTERM, which
    update the manifest before they end the sweep)."""


class Runner:
    """The point runner stubbed (the test is about resume): records what it ran, and at the `kill_at`-th point
    raises `signal` (no file for that point)."""

    def __init__(self, kill_at: int | None = None, signal: type[BaseException] = KeyboardInterrupt):
        self.kill_at, self.signal = kill_at, signal
        self.ran: list[tuple[str, int, tuple]] = []

    def __call__(self, cfg):
        if self.kill_at is not None and len(self.ran) == self.kill_at:
            raise self.signal
        self.ran.append((cfg.method, cfg.length, tuple(sorted(cfg.method_args.items()))))
        return make_result(cfg.method, 1e5 / cfg.length, length=cfg.length, batch=cfg.batch, config=cfg.method_args)


def _key(point: SweepPoint) -> tuple[str, int, tuple]:
    return point.method, point.length, point.method_args


def point_files(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.name != MANIFEST}


class FolderModel:
    """What the folder must hold: its point files' settings (all one settings) and the manifest's state."""

    def __init__(self) -> None:
        self.points: dict[str, int] = {}  # point id -> index into SETTINGS of its file
        self.manifest: int | str | None = None  # SETTINGS index, "corrupt" or None (absent)

    def accepts(self, index: int) -> bool:
        if self.manifest == "corrupt":
            return False
        if self.manifest is not None:
            return self.manifest == index
        return all(s == index for s in self.points.values())


RUN = st.tuples(st.just("run"), st.integers(0, len(SETTINGS) - 1),
                st.lists(st.sampled_from(range(len(POINTS))), min_size=1, max_size=len(POINTS), unique=True),
                st.one_of(st.none(), st.tuples(st.integers(0, len(POINTS) - 1),
                                               st.sampled_from(["ctrl-c", "running", "written", "writing"]))))
ACTIONS = st.lists(st.one_of(RUN, st.just(("remove manifest",)), st.just(("corrupt manifest",))), min_size=1,
                   max_size=7)


def _run(folder: Path, model: FolderModel, index: int, grid: list[SweepPoint], kill) -> None:
    """One `run_sweep`, stopped at point `kill[0]` (among those it runs) by `kill[1]`: Ctrl-C while it runs (no
    file), or a kill -9 while it runs, once its file is in place (the manifest not updated), or during the write
    (only a temp file)."""
    settings_ = SETTINGS[index]
    pending = [p for p in grid if model.points.get(p.point_id(BASE.model)) != index or not model.accepts(index)]
    kill_at, phase = kill if kill is not None else (None, None)
    runner = Runner(kill_at if phase in ("ctrl-c", "running") else None,
                    KeyboardInterrupt if phase == "ctrl-c" else Killed)
    import scoutbench.results as results

    real_write = results.write_json_atomic
    written = []

    def write(path, obj, overwrite=False, **kwargs):
        path = Path(path)
        if path.name != MANIFEST and path.suffix == ".json" and len(written) == kill_at:
            if phase == "writing":
                (path.parent / f".{path.name}.k1ll3d.tmp").write_text('{"schema_version": 2, "kind"')
                raise Killed
            real_write(path, obj, overwrite, **kwargs)
            raise Killed
        if path.name != MANIFEST:
            written.append(path)
        return real_write(path, obj, overwrite, **kwargs)

    accepted = model.accepts(index)
    killed = False
    with mock.patch.object(results, "write_json_atomic", write):
        try:
            run_sweep(grid, settings_, folder, runner=runner)
        except UsageError:
            assert not accepted, "a rerun that resumes this folder was refused"
            return
        except (KeyboardInterrupt, Killed):
            killed = True
    assert accepted, "a rerun with other settings was not refused"
    # it ran exactly the points without a finished file of these settings, in grid order, up to the kill
    assert runner.ran == [_key(p) for p in pending][:len(runner.ran)]
    done = len(runner.ran) - (phase == "writing" and killed)  # the points whose files are in place
    assert killed == (kill_at is not None and kill_at < len(pending)) and (killed or done == len(pending))
    model.manifest = index
    for point in pending[:done]:
        model.points[point.point_id(BASE.model)] = index


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, last=RUN)
def test_kills_and_reruns_with_other_settings_leave_only_points_of_the_folders_settings(actions, last):
    """After any interleaving, the folder's point files are exactly those the model says, each recording its point
    and the folder's settings (never a point of other settings), and a final uninterrupted run leaves every point of
    its grid done with its settings, listed in a manifest of those settings (or is refused, changing nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = FolderModel()
        for action in [*actions, (*last[:3], None)]:
            if action[0] == "remove manifest":
                (folder / MANIFEST).unlink(missing_ok=True)
                model.manifest = None
            elif action[0] == "corrupt manifest":
                (folder / MANIFEST).write_text('{"kind": "sweep", "points": [', encoding="utf-8")
                model.manifest = "corrupt"
            else:
                _, index, grid, kill = action
                _run(folder, model, index, [POINTS[i] for i in sorted(grid)], kill)
            files = point_files(folder)
            assert set(files) == set(model.points), action
            for point_id, result in files.items():
                stamp = result["sweep_point"]
                assert stamp["settings"] == settings_record(SETTINGS[model.points[point_id]], run_environment("cpu"))
                point = SweepPoint(stamp["point"]["method"], stamp["point"]["len"], stamp["point"]["batch"],
                                   tuple(sorted(stamp["point"]["method_args"].items())))
                assert point.point_id(BASE.model) == point_id and result["status"] == "ok"
        _, index, grid, _ = last
        if model.manifest == index:  # the final run was accepted
            assert all(model.points[POINTS[i].point_id(BASE.model)] == index for i in grid)
            manifest = json.loads((folder / MANIFEST).read_text())
            assert manifest["settings"] == settings_record(SETTINGS[index], run_environment("cpu"))
            listed = {p["id"]: p["status"] for p in manifest["points"]}
            assert {i: s for i, s in listed.items() if i in model.points} == dict.fromkeys(
                {POINTS[i].point_id(BASE.model) for i in grid}, "ok") | {
                i: s for i, s in listed.items() if i in model.points and i not in
                {POINTS[g].point_id(BASE.model) for g in grid}}
            assert not list(folder.glob(".*.tmp"))
        assert not (set(p.name for p in folder.iterdir()) - {MANIFEST, LOCK_NAME}
                    - {f"{i}.json" for i in model.points} - {p.name for p in folder.glob(".*.tmp")})


# ---- the reported case and its siblings, end to end ----------------------------------------------------------------

ARGS = ["sweep", "--method", "fullkv", "--len", "64,96", "--warmup", "0", "--device", "cpu", "--json"]


def test_removing_a_corrupt_manifest_then_changing_settings_is_refused(tmp_path, monkeypatch, capsys):
    """After removing a corrupt sweep.json as its error says, a rerun with --steps 4 or --seed 5 kept the old steps-2 /
    seed-0 points and its new manifest recorded the new settings."""
    out = tmp_path / "s"
    code, stdout, err = run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "-o", out)
    assert code == 0, err
    (out / MANIFEST).write_text("{", encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "-o", out)
    assert code == 2 and "not a readable sweep manifest" in err and "remove it" in err, err
    (out / MANIFEST).unlink()
    for change, named in ((["--steps", "4"], "steps 2 there vs 4 now"), (["--steps", "2", "--seed", "5"],
                                                                         "seed 0 there vs 5 now")):
        code, _, err = run_cli(monkeypatch, capsys, *ARGS, *change, "-o", out)
        assert code == 2 and "holds sweep points with other settings" in err and named in err, err
        assert not (out / MANIFEST).exists()
    code, stdout, err = run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "-o", out)  # the same settings resume
    manifest = json.loads(stdout)
    assert code == 0 and (manifest["ran"], manifest["skipped"]) == (0, 2) and manifest["settings"]["steps"] == 2


def test_a_point_file_of_other_settings_is_run_again_under_its_name(tmp_path, monkeypatch, capsys):
    """A file named like a point of this sweep, but made with other settings (copied from another sweep folder), was
    kept as done."""
    out, other = tmp_path / "s", tmp_path / "other"
    assert run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "-o", out)[0] == 0
    assert run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "--seed", "5", "-o", other)[0] == 0
    name = "fullkv_tiny-qwen3_len96_b1.json"
    (out / name).write_bytes((other / name).read_bytes())
    code, stdout, err = run_cli(monkeypatch, capsys, *ARGS, "--steps", "2", "-o", out)
    manifest = json.loads(stdout)
    assert code == 0 and (manifest["ran"], manifest["skipped"]) == (1, 1), err
    assert json.loads((out / name).read_text())["workload"]["seed"] == 0


def test_a_manifest_rebuilt_from_point_files_lists_earlier_grids(tmp_path):
    """The manifest's error says to remove it "to rebuild it from the point files": points of an earlier grid into the
    folder come back into it, with their results."""
    run_sweep(POINTS[:1], BASE, tmp_path, runner=Runner())
    run_sweep(POINTS[1:2], BASE, tmp_path, runner=Runner())
    (tmp_path / MANIFEST).unlink()
    runner = Runner()
    run_sweep(POINTS[2:3], BASE, tmp_path, runner=runner)
    listed = json.loads((tmp_path / MANIFEST).read_text())["points"]
    assert runner.ran == [_key(POINTS[2])]
    assert [(p["id"], p["status"]) for p in listed] == [(POINTS[i].point_id(BASE.model), "ok") for i in (2, 0, 1)]
    assert all(p["decode_throughput_tok_s"] > 0 for p in listed)


def test_a_recall_profile_is_reused_only_when_it_records_its_configuration(tmp_path):
    """A preset sweep reused `recall_profile-<hash>.json` by its name: a truncated one failed every ScoutAttention
    point. Now it is profiled again when it does not record the configuration it was made for."""
    from scoutbench.bench.sweep import attach_recall_profiles

    calls = []

    def profiler(*args, **kwargs):
        calls.append(args)
        return {"kind": "scout_recall_profile", "intervals": [None, None, 3, 5]}

    points, real = [SweepPoint("scout", 1024, 1)], replace(BASE, prefill="real")  # a synthetic prefill: none
    (attached,) = attach_recall_profiles(points, real, tmp_path, profiler=profiler)
    profile = Path(attached.args["recall_profile"])
    assert len(calls) == 1 and attach_recall_profiles(points, real, tmp_path, profiler=profiler) == [attached]
    assert len(calls) == 1
    profile.write_text(profile.read_text()[:40])  # truncated
    assert attach_recall_profiles(points, real, tmp_path, profiler=profiler) == [attached] and len(calls) == 2
    assert json.loads(profile.read_text())["intervals"] == [None, None, 3, 5]


@pytest.mark.parametrize("settings_index", [1, 2])
def test_resuming_into_a_folder_of_other_settings_profiles_nothing(tmp_path, settings_index):
    """A refused rerun first profiled recall (half a minute on a real model) and only then compared the settings."""
    run_sweep(POINTS[:1], BASE, tmp_path, runner=Runner())
    (tmp_path / MANIFEST).unlink()
    with mock.patch("scoutbench.bench.sweep.attach_recall_profiles", side_effect=AssertionError("profiled")):
        with pytest.raises(UsageError, match="holds sweep points with other settings"):
            run_sweep([SweepPoint("scout", 1024, 1)], SETTINGS[settings_index], tmp_path, runner=Runner(),
                      recall_profiles=True)


# ---- a large grid: work per point, not per point squared ---------------------------------------------------------

def test_a_large_grid_resolves_each_setting_once_and_rewrites_its_manifest_rarely(tmp_path, monkeypatch):
    """A grid of 10^6 points printed nothing for minutes (each point resolved its method fields again, and was sorted
    by list lookups), and at 10^4 points the 2.4 MB manifest was rewritten and fsynced after every point. Counted,
    not timed: the method fields are resolved once per setting, and a sweep of fast points rewrites its manifest at
    its start, every MANIFEST_INTERVAL_S, and at its end."""
    import scoutbench.bench.sweep as sweep
    import scoutbench.bench.sweep_grid as sweep_grid
    import scoutbench.results as results
    from scoutbench.bench.sweep_grid import Grid, expand

    resolved = []
    real_resolve = sweep_grid.resolve_method_args
    monkeypatch.setattr(sweep_grid, "resolve_method_args", lambda *a: resolved.append(a) or real_resolve(*a))
    grid = Grid(("fullkv", "quest"), tuple(range(64, 64 + 300)), tuple(range(1, 101)), budgets=(256, 512))
    points = expand(grid)
    assert len(points) == 300 * 100 * 3 and len(resolved) == 2  # fullkv has no budget: one point per (len, batch)
    assert points[:4] == [SweepPoint("fullkv", 64, 1), SweepPoint("quest", 64, 1, (("budget", 256),)),
                          SweepPoint("quest", 64, 1, (("budget", 512),)), SweepPoint("fullkv", 64, 2)]
    writes = []
    real_write = results.write_json_atomic
    monkeypatch.setattr(results, "write_json_atomic", lambda path, *a, **k: writes.append(Path(path).name)
                        or real_write(path, *a, **k))
    monkeypatch.setattr(sweep, "MANIFEST_INTERVAL_S", 3600.0)
    run_sweep(points[:60], BASE, tmp_path, runner=Runner())
    assert writes.count(MANIFEST) == 2 and len(writes) == 62  # at the start, at the end, and the 60 points
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert len(manifest["points"]) == 60 and {p["status"] for p in manifest["points"]} == {"ok"}


def test_a_real_sweep_killed_then_rerun_with_other_settings_then_resumed(tmp_path, monkeypatch, capsys):
    """End to end with the real point runner: a `scoutbench sweep` process killed (-9) once a point is on disk, its
    manifest removed, a rerun with other steps refused, and a rerun with its own settings running exactly the
    points that have no file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "sweep"
    args = ["sweep", "--method", "fullkv", "--len", "64,80,96,112", "--warmup", "0", "--device", "cpu", "--steps"]
    proc = subprocess.Popen([sys.executable, "-m", "scoutbench", *args, "1", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not list(out.glob("fullkv_*.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()[-2000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    done = set(point_files(out))
    assert 1 <= len(done) < 4, "the kill landed after the last point: use a longer grid"
    (out / MANIFEST).unlink(missing_ok=True)
    code, _, err = run_cli(monkeypatch, capsys, *args, "2", "-o", out)
    assert code == 2 and "steps 1 there vs 2 now" in err, err
    code, stdout, err = run_cli(monkeypatch, capsys, *args, "1", "-o", out, "--json")
    manifest = json.loads(stdout)
    assert code == 0 and (manifest["ran"], manifest["skipped"]) == (4 - len(done), len(done)), err
    files = point_files(out)
    assert len(files) == 4 and {r["sweep_point"]["settings"]["steps"] for r in files.values()} == {1}
    assert {r["workload"]["steps"] for r in files.values()} == {1}


# ---- a point's identity: everything that decides what it runs ---------------------------------------------------

PROFILE_ARGS = ["sweep", "--method", "scout", "--len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu",
                "--json"]


def _profile(path: Path, intervals: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": "scout_recall_profile", "intervals": intervals}), encoding="utf-8")
    return path


def test_two_recall_profiles_with_one_stem_are_two_points(tmp_path, monkeypatch, capsys):
    """`recall_profile=a/p.json -o sw`, then `recall_profile=b/p.json -o sw` printed "ran 1, skipped 0" and wrote
    over the first grid's point: the point id named the profile by its stem. A byte-identical profile elsewhere is
    the same point (its content decides the run, not its folder)."""
    out = tmp_path / "sw"
    a, b = _profile(tmp_path / "a" / "p.json", [None, None, 2, 3]), _profile(tmp_path / "b" / "p.json", [None, None, 5, 7])
    for profile in (a, b):
        code, stdout, err = run_cli(monkeypatch, capsys, *PROFILE_ARGS, "--method-arg", f"recall_profile={profile}",
                                    "-o", out)
        assert code == 0 and (json.loads(stdout)["ran"], json.loads(stdout)["skipped"]) == (1, 0), err
    files = point_files(out)
    assert len(files) == 2 and {r["method_config"]["recall_profile"] for r in files.values()} == {str(a), str(b)}
    same = _profile(tmp_path / "c" / "p.json", [None, None, 2, 3])  # a's content under another folder
    code, stdout, err = run_cli(monkeypatch, capsys, *PROFILE_ARGS, "--method-arg", f"recall_profile={same}", "-o", out)
    assert code == 0 and (json.loads(stdout)["ran"], json.loads(stdout)["skipped"]) == (0, 1), err


def test_an_edited_recall_profile_is_a_new_point(tmp_path, monkeypatch, capsys):
    """A resumed sweep reused a point after its recall profile was edited: the stamp recorded the path, not the
    content. The edited profile's point runs; the first one's file stays (no result is written over)."""
    out, profile = tmp_path / "sw", _profile(tmp_path / "p.json", [None, None, 2, 3])
    args = [*PROFILE_ARGS, "--method-arg", f"recall_profile={profile}", "-o", out]
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    first = point_files(out)
    _profile(profile, [None, None, 6, 6])
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and (json.loads(stdout)["ran"], json.loads(stdout)["skipped"]) == (1, 0), err
    files = point_files(out)
    assert len(files) == 2 and all(files[name] == result for name, result in first.items())


@pytest.mark.parametrize("remove_manifest", [False, True])
def test_resuming_under_another_cpu_attention_backend_is_refused(remove_manifest, tmp_path, monkeypatch, capsys):
    """`SCOUTBENCH_CPU_ATTENTION=torch` on resume counted the compiled kernel's points as done: the environment that
    decides a run is part of the sweep's settings, refused on a resume as other settings are (also without the
    manifest: the point files record it)."""
    from scoutbench.kernels import cpu_attention

    out = tmp_path / "sw"
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    cpu_attention.library.cache_clear()
    assert run_cli(monkeypatch, capsys, *ARGS, "--steps", "1", "-o", out)[0] == 0
    if remove_manifest:
        (out / MANIFEST).unlink()
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "torch")
    cpu_attention.library.cache_clear()
    try:
        code, _, err = run_cli(monkeypatch, capsys, *ARGS, "--steps", "1", "-o", out)
    finally:
        monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
        cpu_attention.library.cache_clear()
    assert code == 2 and "other settings" in err and "SCOUTBENCH_CPU_ATTENTION 'auto' there vs 'torch' now" in err, err
    assert len(point_files(out)) == 2


CONFIG_FIELDS = {f.name: f for f in __import__("dataclasses").fields(__import__(
    "scoutbench.bench.resolve", fromlist=["ThroughputConfig"]).ThroughputConfig)}


def _values(hint) -> st.SearchStrategy:
    """Values of a type hint (the run configuration's and the methods' fields), finite numbers within the bound
    every numeric field has (methods/declarations.py)."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_values(arg) for arg in args))
    simple = {type(None): st.none(), bool: st.booleans(), int: st.integers(-2**40, 2**40),
              float: st.floats(-1e12, 1e12, allow_nan=False), str: st.text(max_size=6)}
    if hint in simple:
        return simple[hint]
    if origin is list:
        return st.lists(_values(args[0]), max_size=3)
    raise AssertionError(f"no values for {hint!r}: teach _values this type")


def _identity(cfg, environment=None, inputs=()):
    from scoutbench.bench.sweep_grid import run_identity

    return run_identity(cfg, environment if environment is not None else {}, inputs)


def _same(a, b) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_point_identity_covers_every_field_of_the_run_configuration(data):
    """Every field of ThroughputConfig (but how the run was invoked) is part of a point's identity: changing one
    changes it, keeping it keeps it. The fields and their types come from the dataclass, not from a list here."""
    from scoutbench.bench.resolve import ThroughputConfig
    from scoutbench.bench.sweep_grid import NOT_IDENTITY_FIELDS
    from scoutbench.methods import METHODS

    hints = __import__("typing").get_type_hints(ThroughputConfig)
    name = data.draw(st.sampled_from(sorted(set(CONFIG_FIELDS) - set(NOT_IDENTITY_FIELDS) - {"method_args"})))
    base = ThroughputConfig(method=data.draw(st.sampled_from(METHODS.names())))
    value = data.draw(st.sampled_from(METHODS.names())) if name == "method" else data.draw(_values(hints[name]))
    changed = replace(base, **{name: value})
    assert (_identity(changed) == _identity(base)) == _same(value, getattr(base, name)), (name, value)
    assert _identity(replace(base, command=["elsewhere"])) == _identity(base)  # how it was invoked is no part


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_point_identity_covers_every_argument_of_every_method(data):
    """Every field of every registered method (its preset and defaults included) is part of a point's identity,
    drawn from each method's own dataclass: a value that changes the method's configuration changes the identity."""
    import dataclasses
    import typing

    from scoutbench.bench.resolve import ThroughputConfig
    from scoutbench.methods import METHODS

    method = data.draw(st.sampled_from([name for name in METHODS.names() if dataclasses.fields(METHODS.load(name))]))
    cls = METHODS.load(method)
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    value = data.draw(_values(typing.get_type_hints(cls)[field]))
    current = {**cls.defaults(), **METHODS.preset(method)}[field]
    base = ThroughputConfig(method=method)
    changed = ThroughputConfig(method=method, method_args={field: value})
    assert (_identity(changed) == _identity(base)) == _same(value, current), (method, field, value, current)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_point_identity_covers_every_environment_variable_that_decides_a_run(data):
    """Every variable the registry says decides a run (and the attention backend it resolves to) is part of the
    identity: drawn from the registry's declared values, not from a list here."""
    import os

    from scoutbench.bench.resolve import ThroughputConfig
    from scoutbench.environment import FOREIGN, VARIABLES
    from scoutbench.kernels import cpu_attention

    deciding = {name: v for name, v in {**VARIABLES, **FOREIGN}.items() if v.decides_run}
    name = data.draw(st.sampled_from(sorted(deciding)))
    first, second = (data.draw(st.sampled_from(deciding[name].examples)) for _ in range(2))
    cfg = ThroughputConfig(method="fullkv", device="cpu")

    def identity(text: str) -> dict:
        with mock.patch.dict(os.environ, {name: text}):
            cpu_attention.library.cache_clear()
            try:
                return _identity(cfg, run_environment("cpu"))
            except cpu_attention.NativeUnavailable:  # `native` where the kernel cannot be built: no run to identify
                assume(False)
            finally:
                cpu_attention.library.cache_clear()

    parse = deciding[name].parse
    assert (identity(first) == identity(second)) == (parse(first) == parse(second)), (name, first, second)


def test_a_point_identity_is_a_files_content_not_its_name(tmp_path):
    """The content of a file a method field names (`MethodArgs.file_fields`) decides the identity and the point
    id: an edit changes both, the same bytes elsewhere change neither (ids keep the readable stem)."""
    from scoutbench.methods import METHODS

    for method in METHODS.names():
        for field in METHODS.load(method).file_fields:
            a, b = tmp_path / method / "a" / "p.json", tmp_path / method / "b" / "p.json"
            _profile(a, [None, None, 2, 3])
            _profile(b, [None, None, 2, 3])
            points = [SweepPoint(method, 64, 1, ((field, str(path)),)) for path in (a, b)]
            assert points[0].inputs == points[1].inputs
            assert points[0].point_id("m") == points[1].point_id("m")
            stamps = [p.stamp(BASE, {}, {}) for p in points]
            assert stamps[0]["identity"] == stamps[1]["identity"]
            _profile(b, [None, None, 4, 3])
            edited = SweepPoint(method, 64, 1, ((field, str(b)),))
            assert edited.point_id("m") != points[0].point_id("m") and "p" in edited.point_id("m")
            assert edited.stamp(BASE, {}, {})["identity"] != stamps[0]["identity"]


def test_every_sweep_setting_reaches_the_run_configuration():
    """A sweep's settings are part of a point's identity through the ThroughputConfig the point runs with."""
    import dataclasses

    point = SweepPoint("fullkv", 64, 1)
    for field in dataclasses.fields(Settings):
        assert field.name in CONFIG_FIELDS
        assert getattr(point.config(BASE), field.name) == getattr(BASE, field.name)
