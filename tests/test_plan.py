"""Memory planning (`scoutbench plan`, `--batch auto`, OOM back-off) against hand-computed values.

Qwen3-14B: 40 layers, 8 KV heads, head_dim 128, 40 query heads, hidden 5120, intermediate 17408, vocab 151936,
untied embeddings. In bf16 one token of one layer holds K and V: 2 x 8 x 128 x 2 = 4096 bytes. At 64k tokens
N = 65536 and a 32-token block size gives 2048 blocks, each digest (min and max keys) 4096 bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import run_cli

from scoutbench.errors import ScoutbenchError
from scoutbench.methods import METHODS
from scoutbench.methods.base import ModelShape
from scoutbench.models import preset_config
from scoutbench.planning import (
    auto_batch,
    plan_method,
    run_with_oom_backoff,
    weights_bytes,
    workspace_bytes_per_seq,
)

GIB = 1024**3
N = 65536
KV = 4096  # bytes per token per layer
QWEN3_14B_WEIGHTS = 2 * (40 * (5120 * 128 * (2 * 40 + 2 * 8) + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128)
                         + 2 * 151936 * 5120 + 5120)  # 14.77e9 parameters x 2 bytes
# 80 GiB - weights - reserve (1 GiB + 10% of 80 GiB) = what the sequences share
FREE_80GIB = 80 * GIB - QWEN3_14B_WEIGHTS - (GIB + 8 * GIB)
# synthetic prefill transient per sequence: K and V [Hkv, N, D] bf16 (RoPE in place) + 256 observation queries
WORKSPACE_64K = 2 * 8 * N * 128 * 2 + 40 * 256 * 128 * 2

# method -> (device bytes, host bytes) per sequence at 64k, defaults of each method (issue 7's formulas)
EXPECTED_64K = {
    "fullkv": (40 * N * KV, 0),
    # + digests of the 38 sparse layers
    "quest": (40 * N * KV + 38 * 2048 * KV, 0),
    # 2 dense layers on the device; 38 sparse layers: digests + 2048 resident tokens; their full KV on the host
    "scout": (2 * N * KV + 38 * (2048 * KV + 2048 * KV), 38 * N * KV),
    # partial keys: ceil(0.2 x 128) = 26 dims; + 2 x 2047 fetched tokens (budget 2048 = 2047 fetched + the current)
    "infinigen": (2 * N * KV + 38 * N * 8 * 26 * 2 + 2 * 2047 * KV, 38 * N * KV),
    # no dense layers; window of N/4 tokens on the device; the rest + fp32 scores per query head on the host
    "hgca": (40 * (N // 4) * KV, 40 * (N - N // 4) * KV + 40 * 40 * (N - N // 4) * 4),
}


@pytest.fixture(scope="module")
def qwen3_14b():
    return ModelShape.from_config(preset_config("qwen3-14b"))




def test_weights_match_the_built_model(tiny_qwen3, qwen3_14b):
    """Every parameter is counted: exact against a built Qwen3 (tied embeddings), and Qwen3-14B is 14.77e9."""
    shape = ModelShape.from_config(tiny_qwen3.config)
    assert weights_bytes(shape, 4, tied_embeddings=True) == 4 * sum(p.numel() for p in tiny_qwen3.parameters())
    assert weights_bytes(qwen3_14b, 2) == QWEN3_14B_WEIGHTS == 2 * 14_768_307_200


@pytest.mark.parametrize("method", list(EXPECTED_64K))
def test_plan_json_matches_hand_computed_values(monkeypatch, capsys, method):
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem",
                             "80GiB", "--method", method, "--json")
    assert code == 0, err
    [row] = json.loads(out)
    device, host = EXPECTED_64K[method]
    assert row["method"] == method
    assert row["device_bytes_per_seq"] == device
    assert row["host_bytes_per_seq"] == host
    assert row["workspace_bytes_per_seq"] == WORKSPACE_64K
    assert row["max_batch"] == FREE_80GIB // (device + WORKSPACE_64K)


def test_plan_paper_scale_batches(monkeypatch, capsys):
    """The numbers behind Figure 8's comparison: FullKV fits 4 sequences of 64k in 80 GiB, ScoutAttention 32."""
    code, out, _ = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem", "80GiB",
                           "--method", "fullkv", "--method", "scout", "--json")
    assert code == 0
    assert {row["method"]: row["max_batch"] for row in json.loads(out)} == {"fullkv": 4, "scout": 32}


def test_plan_budget_and_block_size_change_scout(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem", "80GiB",
                           "--method", "scout", "--budget", "4k", "--block-size", "64", "--json")
    assert code == 0
    # 1024 blocks of 64 tokens, 4096 resident tokens
    assert json.loads(out)[0]["device_bytes_per_seq"] == 2 * N * KV + 38 * (1024 * KV + 4096 * KV)


def _fullkv_plan(shape, context_len, gpu_mem, host_mem=None):
    return plan_method(METHODS.load("fullkv")(), shape, context_len, 2, gpu_mem, host_mem)


def test_max_batch_grows_with_memory_and_shrinks_with_length(qwen3_14b):
    by_memory = [_fullkv_plan(qwen3_14b, N, gib * GIB).max_batch for gib in (40, 80, 141, 320, 640)]
    assert by_memory == sorted(by_memory) and by_memory[0] < by_memory[-1]
    by_length = [_fullkv_plan(qwen3_14b, length, 80 * GIB).max_batch for length in (4096, 8192, 32768, 65536, 131072)]
    assert by_length == sorted(by_length, reverse=True) and by_length[0] > by_length[-1]


def test_host_memory_caps_offloading_methods(qwen3_14b):
    scout = METHODS.load("scout")()
    unlimited = plan_method(scout, qwen3_14b, N, 2, 80 * GIB)
    capped = plan_method(scout, qwen3_14b, N, 2, 80 * GIB, host_mem_bytes=128 * GIB)
    # 80% of 128 GiB over 38 x 65536 x 4096 bytes per sequence
    assert capped.max_batch == int(128 * GIB * 0.8) // (38 * N * KV) < unlimited.max_batch
    assert capped.limited_by == "host" and unlimited.limited_by == "device"
    # FullKV keeps nothing on the host: the host cap never binds
    assert _fullkv_plan(qwen3_14b, N, 80 * GIB, host_mem=1 * GIB).max_batch == 4


def test_weights_that_do_not_fit(qwen3_14b):
    plan = _fullkv_plan(qwen3_14b, N, 24 * GIB)
    assert plan.max_batch == 0 and plan.limited_by == "weights"
    with pytest.raises(ScoutbenchError, match="weights"):
        auto_batch(METHODS.load("fullkv")(), qwen3_14b, N, 2, 24 * GIB, host_mem_bytes=None)


def test_auto_batch_is_the_plan(qwen3_14b):
    fullkv = METHODS.load("fullkv")()
    assert auto_batch(fullkv, qwen3_14b, 8192, 2, 141 * GIB) == _fullkv_plan(qwen3_14b, 8192, 141 * GIB).max_batch
    assert workspace_bytes_per_seq(qwen3_14b, 8192, 2) > 0


@pytest.mark.parametrize("args,message", [
    (("--gpu-mem", "80XB"), "bad memory size"),
    (("--gpu-mem", "0GiB"), "more than 0"),
    (("--gpu-mem", "80GiB", "--method", "nosuch"), "unknown method"),
    (("--gpu-mem", "80GiB", "--len", "64q"), "bad --len"),
])
def test_plan_bad_input_is_one_line_exit_2(monkeypatch, capsys, args, message):
    argv = ["plan", "--model", "qwen3-14b", "--len", "64k", *args]
    code, out, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ""


def test_plan_requires_gpu_mem_without_cuda(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: --gpu-mem defaults to its free memory")
    code, _, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--method", "fullkv")
    assert code == 2 and "--gpu-mem is required" in err and len(err.strip().splitlines()) == 1


def test_plan_unknown_model_is_exit_2(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "plan", "--model", "no-such-model", "--len", "8k", "--gpu-mem", "80GiB",
                           "--method", "fullkv")
    assert code == 2 and "preset" in err


def test_oom_backoff_halves_until_it_fits():
    calls = []

    def run(batch):
        calls.append(batch)
        if batch > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ran {batch}"

    result, attempts = run_with_oom_backoff(run, 16)
    assert result == "ran 2" and calls == [16, 8, 4, 2]
    assert [(a["batch"], a["status"]) for a in attempts] == [(16, "oom"), (8, "oom"), (4, "oom"), (2, "ok")]
    assert attempts[0]["error"].startswith("CUDA out of memory")


def test_oom_backoff_gives_up_at_batch_1_and_passes_other_errors():
    def always_oom(batch):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(ScoutbenchError, match="even at batch 1"):
        run_with_oom_backoff(always_oom, 4)

    def broken(batch):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError):
        run_with_oom_backoff(broken, 4)


def test_batch_auto_runs_the_planned_batch(tiny_qwen3):
    """`throughput --batch auto` on CPU: the run's batch is the plan's and the result records the plan."""
    from scoutbench.models import LoadedModel
    from scoutbench.throughput import ThroughputConfig, run_throughput

    gpu_mem = int(1.2 * GIB)  # 1 GiB + 10% is the reserve: a few dozen tiny sequences remain
    planned = plan_method(METHODS.load("fullkv")(), ModelShape.from_config(tiny_qwen3.config), 256 + 3, 4, gpu_mem,
                          tied_embeddings=True).max_batch
    config = ThroughputConfig(method="fullkv", model="tiny-qwen3", length=256, batch="auto", gpu_mem=gpu_mem,
                              steps=2, warmup=1, device="cpu", dtype="float32", prefill="synthetic")
    result = run_throughput(config, LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
    assert 1 < planned == result["workload"]["batch"]
    assert result["batch_plan"]["planned"] == planned
    assert result["batch_plan"]["attempts"] == [{"batch": planned, "status": "ok", "error": None}]
