"""Hugging Face ids pinned with `--revision`, the documented path for real work: the revision travels with the model
name (`ID@REV`) into every result and is recorded with the commit it resolved to; `plan` and `project` read a hub
id's config. The hub is a local Hugging Face cache here (offline), laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from repo_paths import REPO_ROOT

REPO = REPO_ROOT
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """`acme/tiny` at COMMIT (also the `main` branch) in a Hugging Face cache: the tiny-qwen3 preset's weights."""
    from scoutbench.models import load_model

    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / "models--acme--tiny"
    load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model.save_pretrained(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


DRIVER = """
import contextlib, io, json, sys
from scoutbench.cli import main

outcomes = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["scoutbench", *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
    outcomes.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(outcomes))
"""


def _scoutbench(hub_cache: Path, tmp_path: Path, *commands: list[str]) -> list[tuple[int, str, str]]:
    """Each command's (exit code, stdout, stderr), run in one interpreter that sees only `hub_cache`, offline."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [tuple(outcome) for outcome in json.loads(proc.stdout.splitlines()[-1])]


def test_a_revision_is_run_recorded_and_planned(hub_cache, tmp_path):
    """There was no --revision, and `plan`/`project` refused hub ids."""
    out = tmp_path / "run.json"
    run, plan, project, unknown = _scoutbench(
        hub_cache, tmp_path,
        ["throughput", "--model", "acme/tiny", "--revision", COMMIT, "--method", "fullkv", "--len", "256", "--steps",
         "2", "--warmup", "1", "--device", "cpu", "-o", str(out)],
        ["plan", "--model", "acme/tiny", "--revision", "main", "--len", "4k", "--gpu-mem", "8GiB", "--method",
         "fullkv", "--json"],
        ["project", str(out), "--hardware", "h200", "--model", "acme/tiny", "--len", "8k", "--json"],
        ["plan", "--model", "acme/tiny", "--revision", "no-such-branch", "--len", "4k", "--gpu-mem", "8GiB"])
    assert run[0] == 0, run[2]
    model = json.loads(out.read_text())["model"]
    assert model["name"] == f"acme/tiny@{COMMIT}" and model["source"] == "hub" and model["repo"] == "acme/tiny"
    assert model["revision"] == COMMIT and model["commit_hash"] == COMMIT and model["random_weights"] is False

    assert plan[0] == 0, plan[2]
    (planned,) = json.loads(plan[1])
    assert planned["model"] == "acme/tiny@main" and planned["max_batch"] >= 1

    assert project[0] == 0, project[2]
    assert json.loads(project[1])["projections"][0]["model"] == "acme/tiny"

    assert unknown[0] == 2 and unknown[2].count("\n") == 1 and "acme/tiny@no-such-branch" in unknown[2], unknown


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny-qwen3", "--revision", "abc"], "'tiny-qwen3' is a built-in model"),
    (["--revision", "abc"], "pass --model ID too"),
    (["--model", "acme/tiny@v1", "--revision", "abc"], "already names a revision"),
    (["--model", "acme/tiny", "--revision", "a b"], "bad --revision 'a b'"),
])
def test_a_revision_that_pins_nothing_is_refused_in_one_line(monkeypatch, capsys, args, message):
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_local_folder_has_no_revision(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "plan", "--model", tmp_path, "--revision", "abc", "--len", "4k",
                           "--gpu-mem", "1GiB")
    assert code == 2 and "is a local folder" in err, err
