"""The GPU backend decisions as pure functions, on CPU: which backend a call gets, flashinfer's host-side page
table (checked by reading the pages back the way flashinfer does), plan reuse across the layers of a step, and
the per-method record of what ran."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from scoutbench.kernels import backends, cpu_attention, flashinfer_decode
from scoutbench.kernels.attention import partial_attention
from scoutbench.kernels.backends import select_backend
from scoutbench.kernels.flashinfer_decode import page_size_for, page_table, row_lengths_host, row_pages

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("device,dtype,group,head_dim,flashinfer,triton,on_host,expected", [
    ("cpu", BF16, 4, 128, True, True, True, "torch"),
    ("cuda", BF16, 4, 128, True, True, True, "flashinfer"),
    ("cuda", FP16, 1, 64, True, False, True, "flashinfer"),
    ("cuda", BF16, 8, 256, True, False, True, "flashinfer"),
    ("cuda", BF16, 3, 128, True, False, True, "flashinfer"),
    ("cuda", BF16, 5, 128, True, True, True, "flashinfer-tc"),  # Qwen3-14B: 40 query heads over 8 KV heads
    ("cuda", BF16, 6, 128, True, True, True, "flashinfer-tc"),
    ("cuda", BF16, 16, 128, True, True, True, "flashinfer-tc"),
    ("cuda", FP32, 4, 128, True, True, True, "triton"),  # flashinfer has no fp32 kernels
    ("cuda", FP32, 4, 128, True, False, True, "torch"),
    ("cuda", BF16, 4, 96, True, True, True, "triton"),  # head_dim outside {64, 128, 256}
    ("cuda", BF16, 4, 32, True, False, True, "torch"),
    ("cuda", BF16, 4, 128, True, True, False, "triton"),  # lengths only on the device: planning would sync
    ("cuda", BF16, 5, 128, False, True, True, "triton"),
    ("cuda", BF16, 5, 128, False, False, True, "torch"),
])
def test_backend_dispatch_rules(device, dtype, group, head_dim, flashinfer, triton, on_host, expected):
    assert select_backend(device, dtype, group, head_dim, flashinfer=flashinfer, triton=triton,
                          lengths_on_host=on_host) == expected


@pytest.mark.parametrize("version,groups", [("0.6.17", (1, 2, 3, 4, 8)), ("0.6.18", (1, 2, 3, 4, 6, 8)),
                                            ("0.7.0", (1, 2, 3, 4, 6, 8)), ("0.7.4", (1, 2, 3, 4, 6, 8, 16)),
                                            ("0.7.2.post1", (1, 2, 3, 4, 6, 8, 16))])
def test_decode_group_sizes_follow_the_release(version, groups):
    """DISPATCH_GQA_GROUP_SIZE as each release's include/flashinfer/utils.cuh has it (read from the wheels)."""
    assert backends.decode_group_sizes(version) == groups
    for group in (5, 6, 16):
        expected = "flashinfer" if group in groups else "flashinfer-tc"
        assert select_backend("cuda", BF16, group, 128, flashinfer=True, triton=True, lengths_on_host=True,
                              decode_groups=groups) == expected


def test_page_aligned_rows():
    assert [flashinfer_decode.page_aligned(n) for n in (1, 16, 17, 2047, 65555)] == [16, 16, 32, 2048, 65568]


def test_row_lengths_host_per_sequence_per_row_and_clamped():
    assert row_lengths_host(None, 2, 3, 7) == [7] * 6
    assert row_lengths_host([5, 9], 2, 3, 7) == [5, 5, 5, 7, 7, 7]
    assert row_lengths_host([1, 0, -2, 3, 8, 4], 2, 3, 7) == [1, 0, 0, 3, 7, 4]
    with pytest.raises(ValueError, match="4 values"):
        row_lengths_host([1, 2, 3, 4], 2, 3, 7)


@pytest.mark.parametrize("capacity,page", [(4096, 16), (4104, 8), (40, 8), (7, 1), (48, 16)])
def test_page_size_tiles_the_row(capacity, page):
    assert page_size_for(capacity) == page and capacity % page == 0


def _read_pages(pages: torch.Tensor, indptr, indices, last_page_len, page_size):
    """What flashinfer reads for each request: its pages in order, the last one up to last_page_len."""
    rows = []
    for r in range(len(indptr) - 1):
        ids = indices[indptr[r]:indptr[r + 1]].tolist()
        tokens = torch.cat([pages[i, 0] for i in ids])
        rows.append(tokens[: (len(ids) - 1) * page_size + int(last_page_len[r])])
    return rows


def test_page_table_reads_back_each_rows_valid_prefix():
    cache = torch.randn(2, 3, 48, 4)
    prefix = cache[:, :, :33]  # FullKV's span: a prefix of the preallocated cache, viewed in place
    pages = row_pages(prefix, 16)
    assert pages.shape == (18, 1, 16, 4) and pages.data_ptr() == cache.data_ptr()
    lengths = [33, 0, 16, 1, 17, 32]
    indptr, indices, last = page_table(lengths, 48, 16)
    assert indptr.tolist() == [0, 3, 4, 5, 6, 8, 10]
    assert indices.tolist() == [0, 1, 2, 3, 6, 9, 12, 13, 15, 16]
    assert last.tolist() == [1, 1, 16, 1, 1, 16]  # an empty row: one page, one token (masked by the caller)
    assert all(dtype == torch.int32 for dtype in (indptr.dtype, indices.dtype, last.dtype))
    read = _read_pages(pages, indptr, indices, last, 16)
    flat = cache.reshape(6, 48, 4)
    for r, n in enumerate(lengths):
        assert torch.equal(read[r], flat[r, : max(n, 1)])


class _FakeWrapper:
    """flashinfer's decode wrapper emulated on CPU from the page table it was planned with (natural attention,
    base-2 LSE out), counting plans."""

    def __init__(self):
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"  # no device sync in plan()
        self.plans += 1
        self.table = (indptr, indices, last_page_len, page_size, kwargs["sm_scale"])

    def run(self, q, paged_kv, return_lse):
        indptr, indices, last, page_size, scale = self.table
        keys = _read_pages(paged_kv[0], indptr, indices, last, page_size)
        values = _read_pages(paged_kv[1], indptr, indices, last, page_size)
        out, lse = [], []
        for r in range(q.shape[0]):
            logits = q[r].float() @ keys[r].float().T * scale
            out.append(torch.softmax(logits, -1) @ values[r].float())
            lse.append(torch.logsumexp(logits, -1) / math.log(2))
        return torch.stack(out).to(q.dtype), torch.stack(lse)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    planned = flashinfer_decode._Planned(_FakeWrapper())
    monkeypatch.setattr(flashinfer_decode, "_wrapper", lambda device_index, use_tensor_cores, site=(): planned)
    monkeypatch.setattr(flashinfer_decode, "_record_event", lambda device: None)
    return planned.wrapper


def test_flashinfer_adapter_matches_reference_and_plans_once_per_step(fake_flashinfer):
    generator = torch.Generator().manual_seed(0)
    cache_k = torch.randn(2, 2, 64, 16, generator=generator)
    cache_v = torch.randn(2, 2, 64, 16, generator=generator)
    q = torch.randn(2, 10, 16, generator=generator)  # group 5
    for step, lengths in enumerate([[40, 37], [41, 38]]):
        span = max(lengths)
        valid = torch.tensor(lengths)
        for _layer in range(3):  # the layers of a step share the plan
            got = flashinfer_decode.flashinfer_partial(q, cache_k[:, :, :span], cache_v[:, :, :span], 0.3, valid, lengths,
                                              use_tensor_cores=True)
            ref = partial_attention(q, cache_k[:, :, :span], cache_v[:, :, :span], 0.3, valid)
            torch.testing.assert_close(got.o, ref.o, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.lse, ref.lse, atol=1e-5, rtol=0)
        assert fake_flashinfer.plans == step + 1


def test_flashinfer_adapter_empty_rows_and_strided_input(fake_flashinfer):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, generator=generator)
    k = torch.randn(2, 20, 2, 16, generator=generator).transpose(1, 2)  # rows not evenly spaced: made contiguous
    v = torch.randn(2, 20, 2, 16, generator=generator).transpose(1, 2)
    valid = torch.tensor([[20, 0], [3, 17]])
    got = flashinfer_decode.flashinfer_partial(q, k, v, 0.25, valid, valid.reshape(-1).tolist(), use_tensor_cores=False)
    ref = partial_attention(q, k, v, 0.25, valid)
    assert torch.isneginf(got.lse[0, 2:]).all() and torch.equal(got.o[0, 2:], torch.zeros(2, 16))
    torch.testing.assert_close(got.o, ref.o, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.lse, ref.lse, atol=1e-5, rtol=0)


def test_quest_host_lengths_equal_its_device_selection(tiny_qwen3):
    """Quest hands flashinfer the host copy of select()'s valid_len; it must be the same numbers."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods.base import StepInfo
    from scoutbench.methods.quest import Quest

    method = Quest(budget=64, block_size=16, dense_layers=1)
    engine = DecodeEngine(tiny_qwen3, method)
    engine.start(4, 320)
    engine.prefill_synthetic(torch.tensor([256, 200, 47, 16]))
    q = torch.randn(4, tiny_qwen3.config.num_attention_heads, tiny_qwen3.config.head_dim)
    for positions in ([256, 200, 47, 16], [20, 47, 48, 63], [300, 1, 15, 33]):
        method.begin_step(StepInfo(torch.tensor(positions), positions, 0))
        _, valid_len = method.select(1, q)
        expected = torch.tensor(method._attended_len.host)[:, None].expand_as(valid_len)
        assert torch.equal(valid_len, expected), positions


def test_usage_books_each_call_under_its_threads_stage():
    """A call is booked under the stage its own thread is in (the decode loop's stage timer; a CPU worker's
    `cpu_worker`), a call outside every stage under `other`; the totals sum the stages."""
    import threading

    usage = backends._Usage()
    usage.add("cuda", "triton")
    previous = usage.enter_stage("attn_device")
    usage.add("cuda", "triton")

    def worker():
        usage.enter_stage("cpu_worker")
        usage.add("cpu", "native")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    usage.add("cuda", "fused-region")
    usage.exit_stage(previous)
    usage.add("cuda", "triton")
    assert usage.by_stage() == {"attn_device": {"cuda:fused-region": 1, "cuda:triton": 1},
                                "cpu_worker": {"cpu:native": 1}, "other": {"cuda:triton": 2}}
    assert usage.snapshot() == {"cpu:native": 1, "cuda:fused-region": 1, "cuda:triton": 3}
    records = usage.records()
    usage.reset()
    usage.add_counts(records)  # what a CUDA graph's replay adds: the same calls, in the same stages
    assert usage.records() == records


@pytest.mark.parametrize("cuda_present", [False, True])
@pytest.mark.parametrize("name,expected", [("fullkv", {"cpu:{}"}), ("quest", {"cpu:{}"}),
                                           ("scout", {"cpu:{}"})])
def test_result_records_the_backends_that_ran(tiny_qwen3, cpu_backend, name, expected, cuda_present):
    """Each call's CPU backend (the compiled kernel or torch's, `cpu_backend`) is counted in the result; scout's
    device region runs the compiled kernel too, or with torch's kernels a masked one of its own (torch-region).
    `cuda_present`: the same CPU run on a machine with CUDA (emulated), as the GPU check's tests phase runs it: the
    env's `partial_attention_backend` is then CUDA's best, not the CPU kernel."""
    expected = {key.format(cpu_backend) for key in expected}
    if name == "scout" and cpu_backend == "torch":
        expected.add("cpu:torch-region")
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.devices import resolve_device
    from scoutbench.models import LoadedModel
    from scoutbench.runtime.offload import CPU_WORKER_STAGE
    from scoutbench.testing.emulated_cuda import emulated_cuda
    from scoutbench.timing import STAGES

    args = {"budget": 64, "block_size": 16, "dense_layers": 1} if name != "fullkv" else {}
    config = ThroughputConfig(method=name, method_args=args, model="tiny-qwen3", length=256, batch=2, steps=2,
                              warmup=1, device="cpu", dtype="float32", prefill="synthetic")
    emulate = cuda_present and not torch.cuda.is_available()  # a GPU machine has CUDA present as it is
    with emulated_cuda() if emulate else contextlib.nullcontext():
        result = run_throughput(config, LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
        best_installed = backends.partial_backend(resolve_device("auto"))
    used, by_stage = result["attention_backends"], result["attention_backends_by_stage"]
    assert set(used) == expected and all(count > 0 for count in used.values())
    if name == "fullkv":  # one call per layer and timed step (warm-up calls are not counted), in attn_device
        assert used == {f"cpu:{cpu_backend}": tiny_qwen3.config.num_hidden_layers * 2}
        assert by_stage == {"attn_device": used}
    per_backend: dict[str, int] = {}
    for stage, calls in by_stage.items():  # per stage, adding up to the totals
        assert stage in (*STAGES, CPU_WORKER_STAGE) and calls
        for backend, count in calls.items():
            per_backend[backend] = per_backend.get(backend, 0) + count
    assert per_backend == used
    assert result["env"]["cpu_attention_backend"] == cpu_attention.backend_name()
    assert result["env"]["partial_attention_backend"] == best_installed  # the machine's, not the CPU kernel
