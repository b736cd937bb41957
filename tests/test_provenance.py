"""Provenance to lm-eval's level: code (commit, dirty flag), model (hub commit, chat template
hash), data (file sha256, hub commit, per-prompt hashes), GPU (driver, UUID, power limit, clock reasons) and host
(CPU capability, torch's environment report)."""

import hashlib
import json
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from scoutbench import results
from scoutbench.eval.accuracy import prediction_row, prompt_sha256, prompts_sha256
from scoutbench.workloads import longbench as lb

DATA = Path(__file__).parent / "data" / "longbench"


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

    def fake_git(*args):
        calls.append(args)
        return "a" * 40 + "\n" if args[0] == "rev-parse" else status

    monkeypatch.setattr(results, "_git", fake_git)
    assert results.git_dirty() is dirty
    assert ("status", "--porcelain", "--untracked-files=no") in calls  # results and caches are not "dirty"


def test_outside_a_checkout_commit_and_dirty_are_null(monkeypatch):
    monkeypatch.setattr(results, "_git", lambda *args: None)
    assert results.git_commit() is None and results.git_dirty() is None


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
    tiny_qwen3.config._commit_hash = "0123456789abcdef0123456789abcdef01234567"
    try:
        described = LoadedModel(tiny_qwen3, "org/model", "hub", False, tokenizer).describe(torch.float32)
    finally:
        tiny_qwen3.config._commit_hash = None
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
