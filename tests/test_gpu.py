"""CUDA checks (marked `gpu`; tests/conftest.py skips them without CUDA). scripts/gpu_check.sh runs them on a lent
GPU. Every method's CUDA path is compared with its CPU path on the same weights (the CPU paths are checked against
FullKV and the paper's definitions by each method's own tests), the shared kernels with their CPU reference, and
the offloading machinery for what the issue asks: pinned host tiers, no implicit device sync in the decode loop.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from scoutbench.methods import METHODS

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PROMPT_LENGTHS = [256, 200]  # ragged: exercises per-sequence valid lengths
DECODE_STEPS = 4
# tiny but really sparse: 64-token budgets in 16-token blocks, one dense layer of four
BUDGET, BLOCK_SIZE, COMMON_ARGS = 64, 16, {"dense_layers": 1}
ALL_NAMES = METHODS.names()


def _method_args(name: str) -> dict:
    from scoutbench.cli.options import method_args_for

    return method_args_for(name, COMMON_ARGS, BUDGET, BLOCK_SIZE, set())


def _method(name: str):
    from scoutbench.throughput import build_method

    return build_method(name, _method_args(name))


@pytest.fixture(scope="module")
def models():
    """tiny-qwen3 in fp32 on the CPU and the same weights on CUDA."""
    from scoutbench.models import load_model

    cpu = load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model
    return cpu, copy.deepcopy(cpu).to(CUDA)


def _prompt(vocab_size: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), generator=generator)
    return ids, torch.tensor(PROMPT_LENGTHS)


# ---------------------------------------------------------------------------------------------- kernels
def _attention_inputs(dtype, num_keys=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 10, 128, generator=generator).to(dtype)
    k = torch.randn(3, 2, num_keys, 128, generator=generator).to(dtype)
    v = torch.randn(3, 2, num_keys, 128, generator=generator).to(dtype)
    valid_len = torch.tensor([[num_keys, 0], [1, 77], [150, num_keys - 3]])
    return q, k, v, valid_len


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_partial_attention_cuda_matches_cpu(dtype, atol):
    """Whichever backend partial_attention picks on CUDA (flashinfer, Triton or torch) against the CPU path on the
    same (rounded) values in fp32."""
    from scoutbench.kernels.attention import partial_attention

    q, k, v, valid_len = _attention_inputs(dtype)
    ref = partial_attention(q.float(), k.float(), v.float(), 0.088, valid_len)
    got = partial_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), 0.088, valid_len.to(CUDA))
    torch.testing.assert_close(got.lse.cpu(), ref.lse, atol=atol, rtol=0)
    torch.testing.assert_close(got.o.cpu(), ref.o, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_keys", [300, 20000])  # 20000 keys over 6 rows: the default split-K path
def test_triton_kernel_matches_torch(dtype, atol, num_keys):
    pytest.importorskip("triton")
    from scoutbench.kernels.attention import partial_attention
    from scoutbench.kernels.triton_decode import triton_partial_attention

    q, k, v, valid_len = _attention_inputs(dtype, num_keys, seed=2)
    ref = partial_attention(q.float(), k.float(), v.float(), 0.088, valid_len)
    got = triton_partial_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), 0.088, valid_len.to(CUDA))
    torch.testing.assert_close(got.lse.cpu(), ref.lse, atol=atol, rtol=0)
    torch.testing.assert_close(got.o.cpu(), ref.o, atol=atol, rtol=0)


def test_host_empty_is_pinned_for_cuda():
    from scoutbench.kernels.offload import host_empty

    assert host_empty((4, 8), torch.bfloat16, CUDA).is_pinned()


# ---------------------------------------------------------------------------------------------- methods
@pytest.mark.parametrize("name", ALL_NAMES)
def test_method_cuda_matches_cpu(models, name):
    """Teacher-forced: both devices decode the CPU run's greedy tokens; the logits agree at every step."""
    from scoutbench.engine import DecodeEngine

    cpu_model, cuda_model = models
    ids, lengths = _prompt(cpu_model.config.vocab_size)
    engines = [DecodeEngine(cpu_model, _method(name)), DecodeEngine(cuda_model, _method(name))]
    try:
        for engine in engines:
            engine.start(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + DECODE_STEPS)
        cpu_logits = engines[0].prefill(ids, lengths)
        cuda_logits = engines[1].prefill(ids, lengths)
        for step in range(DECODE_STEPS + 1):
            torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, atol=2e-3, rtol=2e-3,
                                       msg=lambda m, step=step: f"{name} step {step}: {m}")
            if step == DECODE_STEPS:
                break
            tokens = cpu_logits.argmax(-1)
            cpu_logits = engines[0].decode_step(tokens)
            cuda_logits = engines[1].decode_step(tokens.to(CUDA))
    finally:
        for engine in engines:
            engine.method.close()


def _cpu_tensors(obj, seen=None):
    """Every CPU tensor reachable from a method's attributes (lists, dicts, helper objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            yield obj
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _cpu_tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _cpu_tensors(item, seen)
    elif type(obj).__module__.startswith("scoutbench") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _cpu_tensors(item, seen)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_host_tier_is_pinned(models, name):
    """Large host tensors (host KV, staging buffers) are pinned, so device<->host copies can be asynchronous;
    methods that offload (memory_footprint has host bytes) really hold some."""
    from scoutbench.engine import DecodeEngine
    from scoutbench.methods.base import ModelShape

    method = _method(name)
    _, cuda_model = models
    engine = DecodeEngine(cuda_model, method)
    try:
        engine.start(2, 1024 + DECODE_STEPS)
        engine.prefill_synthetic(torch.tensor([1024, 1000]))
        engine.decode_step(torch.zeros(2, dtype=torch.long, device=CUDA))
        large = [t for t in _cpu_tensors(method) if t.numel() * t.element_size() >= 256 * 1024]
        assert all(t.is_pinned() for t in large), [tuple(t.shape) for t in large if not t.is_pinned()]
        offloads = method.memory_footprint(ModelShape.from_config(cuda_model.config), 1024, 4).host_bytes_per_seq > 0
        assert bool(large) == offloads
    finally:
        method.close()


@pytest.mark.parametrize("name", ALL_NAMES)
def test_decode_step_has_no_implicit_device_sync(models, name):
    """The decode loop never blocks the host on the GPU (`.item()`, `.cpu()`, copies to pageable memory):
    torch's sync debug mode reports every such call."""
    from scoutbench.engine import DecodeEngine

    method = _method(name)
    _, cuda_model = models
    engine = DecodeEngine(cuda_model, method)
    try:
        engine.start(2, 1024 + 8)
        engine.prefill_synthetic(torch.tensor([1024, 1000]))
        tokens = torch.zeros(2, dtype=torch.long, device=CUDA)
        tokens = engine.decode_step(tokens).argmax(-1)  # first step may set up lazily
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(4):
                    tokens = engine.decode_step(tokens).argmax(-1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, f"{name}: {len(syncs)} device syncs in 4 decode steps, e.g. {syncs[0]}"
    finally:
        method.close()


# ---------------------------------------------------------------------------------------------- runner
@pytest.mark.parametrize("name", ["fullkv", "scout"])
def test_throughput_run_on_cuda(name):
    """A short bf16 run at the planned batch: CUDA-event stage times add up to the step."""
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import preset_config
    from scoutbench.planning import auto_batch
    from scoutbench.throughput import ThroughputConfig, run_throughput

    method = _method(name)
    shape = ModelShape.from_config(preset_config("tiny-qwen3"))
    batch = min(8, auto_batch(method, shape, 2048 + 6, 2, 2 * 1024**3, tied_embeddings=True))
    result = run_throughput(ThroughputConfig(method=name, method_args=_method_args(name), model="tiny-qwen3",
                                             length=2048, batch=batch, steps=4, warmup=2, device="cuda",
                                             dtype="bfloat16", prefill="synthetic"))
    assert result["decode_throughput_tok_s"] > 0 and result["device"]["type"] == "cuda"
    breakdown = result["latency_breakdown_ms"]
    stages = sum(value for stage, value in breakdown.items() if stage != "other") + breakdown["other"]
    assert stages == pytest.approx(result["decode_step_ms"]["mean"], rel=0.05)


def test_oom_backoff_on_a_real_cuda_oom():
    from scoutbench.planning import run_with_oom_backoff

    torch.cuda.empty_cache()
    unit = torch.cuda.mem_get_info()[0] // 3

    def allocate(batch):
        block = torch.empty(batch * unit, dtype=torch.uint8, device=CUDA)
        return block.numel()

    size, attempts = run_with_oom_backoff(allocate, 8)
    assert size == 2 * unit
    assert [(a["batch"], a["status"]) for a in attempts] == [(8, "oom"), (4, "oom"), (2, "ok")]
