"""Provenance to lm-eval's level: code (commit, dirty flag), model (hub commit, chat template
hash), data (file sha256, hub commit, per-prompt hashes), GPU (driver, UUID, power limit, clock reasons) and host
(CPU capability, torch's environment report)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from repo_paths import TEST_DATA

from scoutbench import results
from scoutbench.eval.predictions import prediction_row, prompt_sha256, prompts_sha256
from scoutbench.workloads import longbench as lb

DATA = TEST_DATA / "longbench"


def test_env_records_commit_dirty_flag_cpu_capability_and_torch_report():
    info = results.env_info()
    assert info["git_commit"] == results.git_commit() and len(info["git_commit"]) == 40  # tests run in a checkout
    assert isinstance(info["git_dirty"], bool)
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "PyTorch version" in info["torch_env_summary"]
    assert results.torch_env_summary() is results.torch_env_summary()  # computed once per process (~2 s)
    json.dumps(info)  # plain JSON


@pytest.mark.parametrize("status,dirty", [(" M scoutbench/results.py\n", True), ("", False)])
def test_dirty_flag_counts_tracked_changes(monkeypatch, status, dirty):
    calls = []

    def fake_git(*args, cwd=None):
        calls.append(args)
        answers = {"--show-prefix": "scoutbench/\n", "HEAD": "a" * 40 + "\n", "--error-unmatch": "results.py\n"}
        return next((answer for arg, answer in answers.items() if arg in args), status)

    monkeypatch.setattr(results, "_git", fake_git)
    assert results.git_dirty() is dirty
    assert ("status", "--porcelain", "--untracked-files=no") in calls  # results and caches are not "dirty"


def test_outside_a_checkout_commit_and_dirty_are_null(monkeypatch):
    monkeypatch.setattr(results, "_git", lambda *args, cwd=None: None)
    assert results.git_commit() is None and results.git_dirty() is None and results.workdir_git() is None


def _git(folder, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder, check=True,
                   capture_output=True)


def test_installed_inside_a_users_repository_records_no_commit_of_that_repository(tmp_path):
    """Installed into a `.venv/` inside someone's checkout, every result recorded that repository's commit and
    dirty flag as scoutbench's. The package installed there (a copy of it, run in a fresh interpreter) records
    none of its own, and the user's repository separately, as the working directory's."""
    repo = tmp_path / "my-experiments"
    site = repo / ".venv" / "lib" / "site-packages"
    shutil.copytree(Path(results.__file__).parent, site / "scoutbench", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / "train.py").write_text("print('v1')\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "experiments")
    (repo / "train.py").write_text("print('v2')\n")  # the user's repository is dirty; scoutbench's is not theirs
    user_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    probe = ("import json; from scoutbench import results as r; "
             "print(json.dumps([r.__file__, r.git_commit(), r.git_dirty(), r.workdir_git()]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout
    path, commit, dirty, workdir = json.loads(out)
    assert path.startswith(str(site))
    assert commit is None and dirty is None
    assert workdir == {"commit": user_commit, "dirty": True}


def test_in_its_own_checkout_the_working_repository_is_not_recorded_twice(monkeypatch):
    monkeypatch.chdir(Path(results.__file__).resolve().parent.parent)
    assert results.git_commit() is not None and results.workdir_git() is None


# ---------------------------------------------------------------------------------------------- GPU via NVML
def _fake_pynvml(monkeypatch, *, renamed_reasons: bool = True, init_fails: bool = False):
    module = types.ModuleType("pynvml")
    handles = []

    def init():
        if init_fails:
            raise RuntimeError("NVML Shared Library Not Found")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda index: handles.append(index) or f"handle{index}"
    module.nvmlSystemGetDriverVersion = lambda: b"580.65.06"
    module.nvmlDeviceGetUUID = lambda handle: "GPU-8f1c2d3e-0000-1111-2222-333344445555"
    module.nvmlDeviceGetEnforcedPowerLimit = lambda handle: 700000  # mW
    reasons = lambda handle: 0x4 | 0x40  # noqa: E731 - sw power cap + hw thermal slowdown
    if renamed_reasons:
        module.nvmlDeviceGetCurrentClocksEventReasons = reasons
    else:
        module.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return handles


@pytest.mark.parametrize("renamed", [True, False])
def test_gpu_provenance_from_nvml(monkeypatch, renamed):
    from scoutbench.telemetry import nvml_device_info

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    handles = _fake_pynvml(monkeypatch, renamed_reasons=renamed)
    info = nvml_device_info(1)
    assert handles == [1]  # the visible ordinal 1 is physical GPU 1 under CUDA_VISIBLE_DEVICES=3,1
    assert info == {"driver_version": "580.65.06", "uuid": "GPU-8f1c2d3e-0000-1111-2222-333344445555",
                    "matched_by": {"matched_by": "CUDA_VISIBLE_DEVICES", "index": 1}, "power_limit_w": 700.0,
                    "clock_event_reasons": ["sw_power_cap", "hw_thermal_slowdown"]}


def test_gpu_provenance_without_nvml_is_null(monkeypatch):
    from scoutbench.telemetry import nvml_device_info

    _fake_pynvml(monkeypatch, init_fails=True)
    assert nvml_device_info(0) is None


# ---------------------------------------------------------------------------------------------- model
def test_model_provenance_commit_and_chat_template_hash(tiny_qwen3):
    from scoutbench.models import LoadedModel

    preset = LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)
    assert preset.describe(torch.float32)["commit_hash"] is None
    assert preset.describe(torch.float32)["chat_template_sha256"] is None
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    tokenizer = types.SimpleNamespace(chat_template=template)
    # the commit the loader resolved (models.resolved_commit; a real hub cache: tests/models/test_hub_models.py)
    info = {"commit_hash": "0123456789abcdef0123456789abcdef01234567"}
    described = LoadedModel(tiny_qwen3, "org/model", "hub", False, tokenizer, info).describe(torch.float32)
    assert described["commit_hash"] == "0123456789abcdef0123456789abcdef01234567"
    assert described["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- data
def test_folder_source_is_the_file_and_its_sha256():
    records, source = lb.load_task_data("qasper", DATA)
    assert records == lb.load_records("qasper", DATA)
    path = DATA / "qasper.jsonl"
    assert source == {"kind": "folder", "file": str(path.resolve()),
                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_hub_source_pins_the_revision_and_records_the_commit(tmp_path, monkeypatch):
    import huggingface_hub

    commit = "c" * 40
    snapshot = tmp_path / "datasets--zai-org--LongBench" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    archive = snapshot / "data.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.write(DATA / "qasper.jsonl", "data/qasper.jsonl")
    asked = []

    def fake_download(repo_id, filename, repo_type, local_files_only, revision=None):
        asked.append((repo_id, revision))
        return str(archive)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    records, source = lb.load_task_data("qasper", revision="v1.0")
    assert asked == [("zai-org/LongBench", "v1.0")]
    assert records == lb.load_records("qasper", DATA)
    assert source == {"kind": "hub", "repo": "zai-org/LongBench", "revision": "v1.0", "commit": commit,
                      "file": "data.zip", "member": "data/qasper.jsonl",
                      "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}


def test_task_describe_carries_the_source():
    records, source = lb.load_task_data("qasper", DATA)
    task = lb.LongBenchTask("qasper", records, None, max_length=1500, source=source)
    assert task.describe()["data"] == source


def test_prompt_hash_per_record_and_per_task():
    record = lb.load_records("qasper", DATA)[0]
    row = prediction_row(0, record, "an answer", [1, 20, 300])
    assert row["prompt_sha256"] == hashlib.sha256(b"1,20,300").hexdigest() == prompt_sha256([1, 20, 300])
    assert row["input_tokens"] == 3
    other = prediction_row(1, record, "x", [1, 20, 301])
    assert other["prompt_sha256"] != row["prompt_sha256"]
    assert prompts_sha256([row, other]) == hashlib.sha256((row["prompt_sha256"] + other["prompt_sha256"]).encode()
                                                          ).hexdigest()
    assert prompts_sha256([row, {"pred": "old row without a hash"}]) is None
