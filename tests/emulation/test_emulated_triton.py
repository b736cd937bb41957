"""The lent H200's path on a CPU: emulated CUDA (scoutbench/testing/emulated_cuda) with triton installed runs the
project's Triton kernels and fused ops in triton's interpreter, so the dispatch is tested as the H200 takes it
(triton, no flashinfer): every dense decode (FullKV, each method's dense layers, InfiniGen's fetched rows, Quest's
gathered blocks) and HGCA's window on the Triton split-KV kernel, ScoutAttention's region, selection and merges and
InfiniGen's count on their fused Triton kernels, every call recorded with its stage. A silent fallback (a call that
takes torch where the Triton kernel serves, a fused op that runs its torch reference) fails these tests.

The checks run in a child pytest with TRITON_INTERPRET=1 (tests/triton_interpreter.py). The parent, where triton is
imported compiled, checks that emulated CUDA then keeps the torch references and launches no compiled kernel (it
would need libcuda). Skipped where triton is not installed; `nox -s triton` (CI) requires it.
"""

from __future__ import annotations

import pytest
import torch
from emulated import run_emulated, small_qwen3
from gpu_configs import ALL_NAMES, attention_inputs, method_args
from method_harness import ragged_prompt
from triton_interpreter import IN_INTERPRETER, child_run_test, interpreted, kernel_module

from scoutbench.kernels import backends, fused_ops
from scoutbench.kernels.attention import StepLengths, decode_attention, partial_attention
from scoutbench.testing.emulated_cuda import emulated_cuda

kernel_module("scoutbench.kernels.triton_decode")  # the file is skipped where triton is not installed
CUDA = torch.device("cuda")
SCALE = 0.088
# the device-side backends of the H200's path (triton, no flashinfer): the split-KV kernel and the fused region
TRITON_BACKENDS = {"cuda:triton", "cuda:fused-region"}

test_kernel_checks_in_triton_interpreter = child_run_test(__file__)


@pytest.mark.skipif(IN_INTERPRETER, reason="the parent's check: triton imported compiled")
def test_compiled_triton_is_never_launched_on_emulated_cuda():
    """triton imported without TRITON_INTERPRET=1: emulated CUDA cannot launch its compiled kernels (no libcuda), so
    it says so and serves every call as CUDA without triton does, the torch references recorded as what ran."""
    q, k, v, valid_len = attention_inputs(torch.float32, 4, 64)
    reference = partial_attention(q, k, v, SCALE, valid_len)
    with emulated_cuda() as runtime:
        assert backends.EMULATED_TRITON == backends.REFERENCE and not backends.triton_available()
        assert "torch references" in backends.triton_status() and backends.partial_backend(CUDA) == "torch"
        backends.USAGE.reset()
        got = partial_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), SCALE, valid_len.to(CUDA))
        decode_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), SCALE)
        assert backends.USAGE.snapshot() == {"cuda:torch": 2} and not runtime.triton_launches
        torch.testing.assert_close(got.o.cpu(), reference.o, atol=1e-5, rtol=0)


@interpreted
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("uniform", [False, True])
def test_dense_decode_runs_the_triton_kernel(dtype, atol, uniform):
    """`decode_attention` (FullKV's kernel, every dense layer's, InfiniGen's fetched rows) takes the Triton split-KV
    kernel where triton serves the device and flashinfer does not, records `cuda:triton`, and equals the CPU path;
    with a step's lengths, ragged or uniform (a uniform batch reads exactly its span). bf16 too: the emulation widens
    the interpreter's bf16 dot operands (scoutbench/testing/emulated_cuda/interpreter.py)."""
    q, k, v, valid_len = attention_inputs(dtype, 5, 128)  # Qwen3-14B's group of 5
    valid_len = torch.full((3,), 211) if uniform else valid_len[:, 1]
    reference = partial_attention(q.float(), k.float(), v.float(), SCALE, valid_len).o
    with emulated_cuda() as runtime:
        assert backends.triton_available() and "interpreter" in backends.triton_status()
        lengths = StepLengths(3, k.shape[2], dtype, CUDA, with_host=True)
        lengths.update(valid_len.to(CUDA), valid_len.tolist())
        backends.USAGE.reset()
        got = decode_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), SCALE, lengths=lengths)
        assert backends.USAGE.snapshot() == {"cuda:triton": 1}
        assert dict(runtime.triton_launches) == {"_partial_decode_kernel": 1}
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().float(), reference, atol=atol, rtol=0)


@pytest.fixture
def no_fused_reference(monkeypatch):
    """A fused op whose body runs its torch reference on the emulated device, instead of its Triton kernel, fails."""
    def refuse(name):
        def reference(*args, **kwargs):
            raise AssertionError(f"fused_ops.{name} ran on the emulated device: its Triton kernel did not")
        return reference

    for name in ("region_reference", "select_and_split_reference", "speculate_count_reference", "_interpolated"):
        monkeypatch.setattr(fused_ops, name, refuse(name))


@interpreted
@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_method_takes_the_triton_kernels(name, no_fused_reference):
    """Every method and ablation on emulated CUDA in the interpreter, CUDA graphs on (one eager step, one capture,
    replays): its device attention runs only the Triton kernels, recorded per stage, the dense layers' decode on the
    split-KV kernel in `attn_device`; each recorded call is a kernel that ran (the launches the interpreter counted);
    the logits equal the CPU path's at every step, and the step has no unexpected host sync."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = small_qwen3()
        prompt, lengths = ragged_prompt(model.config.vocab_size, [120, 83], seed=3)
        launches = {}
        run = run_emulated(model, lambda: _build(name), prompt, lengths, 8, cuda_graphs=True,
                           on_runtime=lambda runtime: launches.setdefault("runtime", runtime))
    finally:
        torch.set_num_threads(threads)
    by_stage = run.backends_by_stage
    device_calls = {key for stage in by_stage.values() for key in stage if key.startswith("cuda:")}
    assert device_calls <= TRITON_BACKENDS, by_stage  # e.g. cuda:torch: a silent fallback
    assert by_stage["attn_device"].get("cuda:triton", 0) > 0, by_stage
    assert sum(n for stage in by_stage.values() for n in stage.values()) == sum(run.backends.values())
    ran = launches["runtime"].triton_launches
    assert ran["_partial_decode_kernel"] >= run.backends.get("cuda:triton", 0) > 0
    assert ran["_region_kernel"] >= run.backends.get("cuda:fused-region", 0)
    assert run.graphs["captured"] and run.graphs["replayed_steps"] >= 6, run.graphs
    assert max(run.max_diff()) < 2e-4, run.max_diff()
    assert not run.unexpected_syncs(), run.unexpected_syncs()


def _build(name):
    from scoutbench.methods import build_method

    return build_method(name, method_args(name))


@interpreted
@pytest.mark.parametrize("name", ["fullkv", "scout"])
def test_throughput_result_records_the_triton_path_per_stage(name):
    """The throughput result of FullKV on emulated CUDA in the interpreter records its decode backend as the Triton
    kernel, per stage (`attention_backends_by_stage`), and its env says which path ran; ScoutAttention's records its
    region's fused kernel beside its dense layer's decode and its CPU worker's kernel."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.models import LoadedModel, load_model

    args = {} if name == "fullkv" else {"budget": 64, "block_size": 16, "dense_layers": 1}
    config = ThroughputConfig(method=name, method_args=args, model="tiny-qwen3", length=256, batch=2, steps=2,
                              warmup=1, device="cuda", dtype="float32", prefill="synthetic", count_steps=0)
    with emulated_cuda():
        model = load_model("tiny-qwen3", CUDA, torch.float32, seed=0).model
        result = run_throughput(config, LoadedModel(model, "tiny-qwen3", "preset", True))
    layers = model.config.num_hidden_layers
    by_stage = result["attention_backends_by_stage"]
    assert result["env"]["partial_attention_backend"] == "triton" and "interpreter" in result["env"]["triton"]
    if name == "fullkv":
        assert by_stage == {"attn_device": {"cuda:triton": layers * 2}}
    else:
        assert by_stage["attn_device"] == {"cuda:triton": 2, "cuda:fused-region": (layers - 1) * 2}
        assert set(by_stage) <= {"attn_device", "cpu_worker"}
