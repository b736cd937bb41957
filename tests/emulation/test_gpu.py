"""CUDA checks. scripts/gpu_check.sh runs them on a lent GPU; without one they run on emulated CUDA
(scoutbench/testing/emulated_cuda) in the default suite, so that every assertion here has run before a GPU is lent.
Tests marked `gpu` need the hardware itself (the allocator's bytes, a real out-of-memory, compiled Triton) and
are skipped without it (tests/conftest.py). Every method's CUDA path is compared with its CPU path on the same
weights (the CPU paths are checked against FullKV and the paper's definitions by each method's own tests), the
shared kernels with their CPU reference, and the offloading machinery for what offloading needs: pinned host
tiers, no implicit device sync in the decode loop.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
from gpu_configs import ALL_NAMES, DECODE_STEPS, PROMPT_LENGTHS, attention_inputs
from gpu_configs import build as _method
from gpu_configs import method_args as _method_args

CUDA = torch.device("cuda")
REAL_CUDA = torch.cuda.is_available()  # before any emulation: the tests below run on whichever CUDA there is


@pytest.fixture(scope="module", autouse=True)
def cuda_runtime():
    """The emulated CUDA runtime where this machine has no GPU (None on a real one)."""
    if REAL_CUDA:
        yield None
        return
    from scoutbench.testing.emulated_cuda import emulated_cuda

    with emulated_cuda() as runtime:
        yield runtime


@pytest.fixture(scope="module")
def models(cuda_runtime):
    """tiny-qwen3 in fp32 on the CPU and the same weights on CUDA."""
    from scoutbench.models import load_model

    cpu = load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model
    return cpu, copy.deepcopy(cpu).to(CUDA)


def _prompt(vocab_size: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), generator=generator)
    return ids, torch.tensor(PROMPT_LENGTHS)


# ---------------------------------------------------------------------------------------------- kernels
def _attention_inputs(dtype, num_keys=300, seed=0, group=5):
    """Qwen3-14B's GQA group (5) by default: flashinfer's CUDA-core decode has no kernel for it."""
    return attention_inputs(dtype, group, 128, num_keys, seed)


def _expected_backend(dtype, group, lengths_on_host):
    from scoutbench.kernels.backends import flashinfer_available, select_backend, triton_available

    return select_backend("cuda", dtype, group, 128, flashinfer=flashinfer_available(), triton=triton_available(),
                          lengths_on_host=lengths_on_host)


@pytest.mark.parametrize("group", [4, 5])
@pytest.mark.parametrize("lengths_on_host", [True, False])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_partial_attention_cuda_matches_cpu(dtype, atol, group, lengths_on_host):
    """Whichever backend the dispatch picks on CUDA (fp32 never goes to flashinfer; group 5 takes its tensor-core
    decode) against the CPU path on the same (rounded) values in fp32; and that backend is what ran."""
    from scoutbench.kernels.attention import partial_attention
    from scoutbench.kernels.backends import USAGE

    q, k, v, valid_len = _attention_inputs(dtype, group=group)
    ref = partial_attention(q.float(), k.float(), v.float(), 0.088, valid_len)
    USAGE.reset()
    host = valid_len.reshape(-1).tolist() if lengths_on_host else None
    got = partial_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), 0.088, valid_len.to(CUDA), host)
    assert USAGE.snapshot() == {f"cuda:{_expected_backend(dtype, group, lengths_on_host)}": 1}
    torch.testing.assert_close(got.lse.cpu(), ref.lse, atol=atol, rtol=0)
    torch.testing.assert_close(got.o.cpu(), ref.o, atol=atol, rtol=0)


def test_flashinfer_plans_once_per_step_for_every_layer():
    """The layers of a step share one plan (same shape, same host lengths); a new step's lengths replan once."""
    from scoutbench.kernels import backends, flashinfer_decode
    from scoutbench.kernels.attention import decode_attention

    if not backends.flashinfer_available():
        pytest.skip("flashinfer is not installed")
    cache_k = torch.randn(4, 8, 4096, 128, dtype=torch.bfloat16, device=CUDA)
    cache_v = torch.randn_like(cache_k)
    q = torch.randn(4, 40, 128, dtype=torch.bfloat16, device=CUDA)  # group 5: the tensor-core wrapper
    site = (4, 8, 5, 128, 4096, 16, torch.bfloat16, 0.088)  # the call site: batch, KV heads, group, ..., scale
    planned = flashinfer_decode._wrapper(0, True, site)
    calls = []
    original = planned.wrapper.plan
    planned.wrapper.plan = lambda *args, **kwargs: (calls.append(1), original(*args, **kwargs))[1]
    try:
        for step, lengths in enumerate(([3000, 2999, 100, 4096], [3001, 3000, 101, 4096])):
            valid = torch.tensor(lengths, device=CUDA)
            for _layer in range(6):
                out = decode_attention(q, cache_k, cache_v, 0.088, valid, lengths)
            assert len(calls) == step + 1
        ref = decode_attention(q.float(), cache_k.float(), cache_v.float(), 0.088, valid)  # torch SDPA, fp32
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    finally:
        planned.wrapper.plan = original


@pytest.mark.gpu  # compiled Triton (tests/kernels/test_triton.py runs the kernel in Triton's interpreter on emulated CUDA)
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


@pytest.mark.gpu  # compiled Triton (tests/kernels/test_triton_region.py runs the kernels in Triton's interpreter)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_fused_region_and_merge_kernels_match_their_references(dtype, atol):
    """The one-launch region attention and merge of fused_ops on the GPU, bf16 included (the interpreter's bf16
    dot is wrong): Qwen3-14B's group of 5, 130 slots of 32 tokens, some closed and one partly open per row."""
    pytest.importorskip("triton")
    from scoutbench.kernels import fused_ops, triton_region

    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, group, dim, slots, block = 3, 8, 5, 128, 130, 32
    q = torch.randn(batch, kv_heads * group, dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, kv_heads, slots * block, dim, generator=generator).to(dtype) for _ in range(2))
    slot_tokens = torch.randint(0, 2, (batch, kv_heads, slots), generator=generator) * block
    slot_tokens[..., -1] = 7  # the tail, partly open
    # the reference in fp64: in fp32 the LSE over 2000 keys varies by 3e-5 with the summation order (torch's CPU
    # reduction gave two values in two runs of one process, as the buffer's alignment changed)
    ref_o, ref_lse = (t.float() for t in fused_ops.region_reference(q.double(), k.double(), v.double(), 0.088,
                                                                      slot_tokens))
    o, lse = triton_region.region_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), 0.088, slot_tokens.to(CUDA))
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=atol, rtol=0)
    torch.testing.assert_close(o.cpu(), ref_o, atol=atol, rtol=0)
    other_o = torch.randn(ref_o.shape, generator=generator)
    other_lse = ref_lse + torch.randn(ref_lse.shape, generator=generator)
    merged = triton_region.merged_output(o, lse, other_o.to(CUDA), other_lse.to(CUDA), dtype)
    want = fused_ops.merged_output(o.cpu(), lse.cpu(), other_o, other_lse, dtype)
    torch.testing.assert_close(merged.cpu().float(), want.float(), atol=atol, rtol=0)


@pytest.mark.gpu  # compiled Triton (tests/kernels/test_triton_select.py runs the kernel in Triton's interpreter)
def test_fused_select_and_split_kernel_matches_its_reference():
    """ScoutAttention's one-launch selection and split at paper granularity on the GPU: 2048 blocks (64k tokens
    of 32), k = 61, a pool of 122 slots half full, fp32 digests (distinct scores: the same selection)."""
    pytest.importorskip("triton")
    from scoutbench.kernels import fused_ops, triton_select

    generator = torch.Generator().manual_seed(4)
    batch, kv_heads, group, dim, blocks, k, slots = 2, 8, 5, 128, 2048, 61, 122
    q = torch.randn(batch, kv_heads * group, dim, generator=generator)
    digests = torch.randn(batch, kv_heads, blocks, 2 * dim, generator=generator)
    blocked = torch.zeros(batch, 1, blocks, dtype=torch.bool)
    blocked[:, :, :1] = True
    blocked[1, :, 1500:] = True
    count = (blocks - blocked.sum(-1)).clamp(max=k)
    block_slot = torch.full((batch, kv_heads, blocks + 1), -1, dtype=torch.long)
    slot_block = torch.full((batch, kv_heads, slots + 1), -1, dtype=torch.long)
    resident = torch.randperm(blocks, generator=generator)[: slots // 2]
    block_slot[:, :, resident] = torch.arange(slots // 2)
    slot_block[:, :, : slots // 2] = resident
    slot_ready = torch.zeros((batch, kv_heads, slots + 1), dtype=torch.bool)
    slot_ready[:, :, : slots // 3] = True
    inputs = (q, digests, blocked, count, block_slot, slot_ready, slot_block)
    want_data, want_pool = fused_ops.select_and_split_reference(*inputs[:4], k, *inputs[4:], True)
    data = torch.zeros_like(want_data, device=CUDA)
    pool_use = torch.zeros_like(want_pool, device=CUDA)
    triton_select.select_and_split(*(t.to(CUDA) for t in inputs), True, data, pool_use)
    assert torch.equal(data.cpu(), want_data) and torch.equal(pool_use.cpu(), want_pool)


def test_digest_table_on_cuda_scores_in_the_kv_dtype():
    """bf16 center/radius on the device (no fp32 copy of the digests per call): the scores still bound every
    key's logit and agree with the fp32 reference to bf16 precision."""
    from scoutbench.kernels.digest import block_digests, upper_bound_scores
    from scoutbench.runtime.digest_table import DigestTable

    keys = torch.randn(2, 8, 4096, 128, dtype=torch.bfloat16, device=CUDA)
    q = torch.randn(2, 40, 128, dtype=torch.bfloat16, device=CUDA)
    kmax, kmin = block_digests(keys, 32)
    table = DigestTable(range(1), (2, 8, 128, 128), torch.bfloat16, CUDA)
    table.write_blocks(0, keys, 32)
    assert table.center2[0].dtype == table.radius2[0].dtype == torch.bfloat16
    scores = table.scores(0, q, 128)
    reference = upper_bound_scores(q.float(), kmax, kmin)
    # the scale of the two products the score is made of: bf16 rounds each to 2^-8 of its size
    magnitude = upper_bound_scores(q.float().abs(), kmax.float().abs().maximum(kmin.float().abs()),
                                   -kmax.float().abs().maximum(kmin.float().abs()))
    assert ((scores - reference).abs() <= 2**-6 * magnitude).all()
    logits = torch.einsum("bhgd,bhnd->bhgn", q.float().view(2, 8, 5, 128), keys.float())
    best = logits.view(2, 8, 5, 128, 32).amax(-1).amax(2)
    assert (scores >= best - 2**-7 * magnitude).all()  # an upper bound, up to the rounding of the score itself


def test_host_arena_is_pinned_exact_and_released():
    from scoutbench.runtime.offload import HostArena, host_empty

    specs = {("k", 0): ((1000, 33), torch.bfloat16), ("ema", 0): ((7, 5), torch.float32)}
    arena = HostArena(specs, CUDA)
    assert arena.pinned and arena["k", 0].is_pinned() and arena["ema", 0].is_pinned()
    assert arena.nbytes == 66_048 + 7 * 5 * 4  # 1000 x 33 x 2 bytes, aligned to 256, then 35 floats
    device = torch.ones(1000, 33, dtype=torch.bfloat16, device=CUDA)
    arena["k", 0].copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert bool((arena["k", 0] == 1).all())
    arena.release()
    assert not arena.pinned and not arena["k", 0].is_pinned()
    assert host_empty((4, 8), torch.bfloat16, CUDA).is_pinned()


# ---------------------------------------------------------------------------------------------- methods
@pytest.mark.parametrize("name", ALL_NAMES)
def test_method_cuda_matches_cpu(models, name):
    """Teacher-forced: both devices decode the CPU run's greedy tokens; the logits agree at every step."""
    from scoutbench.decode.engine import DecodeEngine

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
    from scoutbench.decode.engine import DecodeEngine
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
def test_no_copy_goes_through_pageable_memory(models, cuda_runtime, name):
    """Every device-host copy of a method's prefill and decode reads or writes its host memory in place: torch
    stages a copy to or from a non-contiguous host view through a fresh pageable buffer and a CPU copy (HGCA's
    prefill copied each sequence's prompt into a strided slice of its pinned tier: ~190 ms per 132 MB, 380 copies
    per run at the check's shape). The emulator sees the staging (`staged_copies`); a GPU cannot say."""
    from scoutbench.decode.engine import DecodeEngine

    if cuda_runtime is None:
        pytest.skip("torch's staging is visible only to the emulator")
    method = _method(name)
    _, cuda_model = models
    engine = DecodeEngine(cuda_model, method)
    cuda_runtime.staged_copies.clear()
    try:
        engine.start(2, 1024 + 4)
        engine.prefill_synthetic(torch.tensor([1024, 1000]))
        tokens = torch.zeros(2, dtype=torch.long, device=CUDA)
        for _ in range(3):
            tokens = engine.decode_step(tokens).argmax(-1)
        torch.cuda.synchronize()
        assert not cuda_runtime.staged_copies, dict(cuda_runtime.staged_copies)
    finally:
        method.close()


# Host syncs a method documents (file, source text of the line): InfiniGen's dynamic fetch count (dynamic_count=True,
# as in the original) is one `.item()` per sparse layer. Anything else the sync debug mode reports fails the test.
ALLOWED_SYNCS = {"infinigen": ("methods/infinigen.py", "int(mean_count.item())")}


@contextlib.contextmanager
def _recorded_syncs(cuda_runtime) -> Iterator[list[tuple[str, str]]]:
    """Every implicit host-device sync inside the block as (file, source text of the line): torch's sync debug
    mode on a GPU, the emulator's record on emulated CUDA."""
    import linecache

    sites: list[tuple[str, str]] = []
    if cuda_runtime is not None:
        with cuda_runtime.detect_syncs() as found:
            yield sites
        sites += [(site.filename, site.line) for site in found]
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites += [(w.filename, linecache.getline(w.filename, w.lineno).strip()) for w in caught
              if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_decode_step_has_no_implicit_device_sync(models, cuda_runtime, name):
    """The decode loop never blocks the host on the GPU (`.item()`, `.cpu()`, copies to pageable memory) except
    where the method documents it: torch's sync debug mode (or the emulator) reports every such call with its
    Python line."""
    from scoutbench.decode.engine import DecodeEngine

    method = _method(name)
    _, cuda_model = models
    engine = DecodeEngine(cuda_model, method)
    steps = 4
    try:
        engine.start(2, 1024 + 8)
        engine.prefill_synthetic(torch.tensor([1024, 1000]))
        tokens = torch.zeros(2, dtype=torch.long, device=CUDA)
        tokens = engine.decode_step(tokens).argmax(-1)  # first step may set up lazily
        torch.cuda.synchronize()
        with _recorded_syncs(cuda_runtime) as sites:
            for _ in range(steps):
                logits = engine.decode_step(tokens)
                tokens = logits.argmax(-1)
        allowed_file, allowed_text = ALLOWED_SYNCS.get(method.name, ("", None))
        allowed = [site for site in sites if site[0].endswith(allowed_file) and allowed_text and allowed_text in site[1]]
        unexpected = [site for site in sites if site not in allowed]
        assert not unexpected, f"{name}: {len(unexpected)} device syncs in {steps} decode steps, e.g. {unexpected[0]}"
        if allowed_text is not None:  # exactly the documented ones: one per sparse layer and step, if counting
            assert len(allowed) == (steps * len(method.sparse_layers) if method.dynamic_count else 0)
    finally:
        method.close()


# ---------------------------------------------------------------------------------------------- runner
@pytest.mark.parametrize("name,cuda_graphs", [
    ("fullkv", "off"), ("scout", "off"), ("infinigen", "off"), ("hgca", "off"), ("fullkv", "auto"), ("scout", "auto")])
def test_throughput_run_on_cuda(name, cuda_graphs):
    """A short bf16 run at the planned batch. The CUDA-event step times agree with the host's wall clock between
    steps (the step ends with a sync), the named stages do not overlap (their sum stays within the step), and the
    backends that ran are recorded. (No counted steps: they are no part of this.)"""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import preset_config
    from scoutbench.planning import auto_batch

    method = _method(name)
    shape = ModelShape.from_config(preset_config("tiny-qwen3"))
    batch = min(8, auto_batch(method, shape, 2048 + 6, 2, 2 * 1024**3, tied_embeddings=True))
    step_ends = []
    result = run_throughput(ThroughputConfig(method=name, method_args=_method_args(name), model="tiny-qwen3",
                                             length=2048, batch=batch, steps=4, warmup=2, device="cuda",
                                             dtype="bfloat16", prefill="synthetic", count_steps=0,
                                             cuda_graphs=cuda_graphs),
                            on_progress=lambda phase, done, total: step_ends.append(time.perf_counter())
                            if phase == "decode" and done else None)
    assert result["decode_throughput_tok_s"] > 0 and result["device"]["type"] == "cuda"
    # steps end with a sync: the wall time between the ends of steps 2..5 against the timed steps 3..5 (0-based)
    wall_ms = [(b - a) * 1e3 for a, b in zip(step_ends[2:5], step_ends[3:6], strict=True)]
    for event_ms, host_ms in zip(result["step_ms"][1:], wall_ms, strict=True):
        assert event_ms == pytest.approx(host_ms, rel=0.2, abs=1.0)
    breakdown = result["latency_breakdown_ms"]
    named = sum(value for stage, value in breakdown.items() if stage != "other")  # `other` is clamped at 0
    assert named <= 1.02 * result["decode_step_ms"]["mean"], breakdown
    assert min(breakdown.values()) >= 0 and breakdown["attn_device"] > 0 and breakdown["mlp"] > 0
    assert result["attention_backends"] and all(key.startswith(("cuda:", "cpu:")) for key in result["attention_backends"])


@pytest.mark.gpu  # the caching allocator's bytes (emulated CUDA allocates none)
@pytest.mark.parametrize("name", ["fullkv", "quest", "scout", "infinigen", "hgca"])
def test_planned_bytes_are_what_cuda_allocates(name):
    """bench-attn (32/8 heads, head_dim 128) at 16k, batch 2, bf16: the device tier bind allocates, the pinned
    host arena, and the peak of the synthetic prefill above them against the planner (what --batch auto uses)."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import load_model
    from scoutbench.planning import workspace_bytes_per_seq

    model = load_model("bench-attn", CUDA, torch.bfloat16, seed=0).model
    method = _method(name)
    shape = ModelShape.from_config(model.config)
    batch, length = 2, 16384
    engine = DecodeEngine(model, method)
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.start(batch, length)
        torch.cuda.synchronize()
        bound = torch.cuda.memory_allocated()
        footprint = method.memory_footprint(shape, length, 2)
        # within 3%, or 16 MiB of buffers that do not grow with the batch (HGCA's window shift scratch)
        assert bound - before == pytest.approx(batch * footprint.device_bytes_per_seq, rel=0.03, abs=16 * 1024**2)
        arena = method.host_arena
        if footprint.host_bytes_per_seq:
            assert arena.pinned and arena.nbytes == pytest.approx(batch * footprint.host_bytes_per_seq, rel=0.02)
        torch.cuda.reset_peak_memory_stats()
        engine.prefill_synthetic(torch.tensor([length] * batch))
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - bound
        planned = batch * workspace_bytes_per_seq(shape, length, 2, footprint.prefill_bytes_per_seq)
        assert transient <= planned + 256 * 1024**2, (transient, planned)  # constants: the fixed reserve's share
    finally:
        method.close()


@pytest.mark.gpu  # a real out-of-memory (tests/emulation/test_emulated_cuda.py has the host-register failure)
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
