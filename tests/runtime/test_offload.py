"""The offload helpers' contracts: device caches from `device_zeros`, the CPU worker pool's GIL switch interval."""

from __future__ import annotations

import sys

import pytest
import torch

from scoutbench.runtime.offload import WORKER_SWITCH_INTERVAL_S, CpuWorkerPool, device_zeros


def test_device_zeros_on_cpu_are_zeroed_views_of_one_arena():
    """On CPU every tensor is a zeroed view of one buffer (an arena, on huge pages where Linux allows them), with
    its own shape and dtype, and writing one leaves the others untouched."""
    specs = {("k", 0): ((2, 3, 40, 8), torch.float32), ("v", 0): ((2, 3, 40, 8), torch.bfloat16),
             "ids": ((5,), torch.long)}
    tensors = device_zeros(specs, torch.device("cpu"))
    assert list(tensors) == list(specs)
    for key, (shape, dtype) in specs.items():
        assert tensors[key].shape == shape and tensors[key].dtype == dtype
        assert tensors[key].is_contiguous() and torch.count_nonzero(tensors[key]) == 0
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1
    tensors["k", 0].fill_(1.5)
    assert torch.count_nonzero(tensors["v", 0]) == 0 and torch.count_nonzero(tensors["ids"]) == 0


def test_worker_pools_lower_the_switch_interval_until_the_last_closes():
    """While any CpuWorkerPool is open the GIL switch interval is at most WORKER_SWITCH_INTERVAL_S; the last close
    (a second close of one pool counts once) restores the interval that was set before."""
    before = sys.getswitchinterval()
    already_open = CpuWorkerPool._open  # a pool another test left open keeps the interval low
    sys.setswitchinterval(0.004)
    try:
        first = CpuWorkerPool(1)
        assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        second = CpuWorkerPool(1)
        assert second.submit(lambda: 6 * 7).result() == 42
        first.close()
        first.close()
        assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        second.close()
        if already_open:
            assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        else:
            assert abs(sys.getswitchinterval() - 0.004) < 1e-9
    finally:
        sys.setswitchinterval(before)


GIB = 1024**3


def test_fresh_host_fill_follows_the_rate_hook(monkeypatch):
    """SCOUTBENCH_HOST_FILL_GIBS (the GPU check's simulation of a VM whose RAM grows on demand) makes the first
    touch of fresh host memory last nbytes / rate: the fill sleeps what the machine's own zeroing did not take."""
    from types import SimpleNamespace

    from scoutbench.runtime import offload

    slept, clock = [], iter([100.0, 100.01, 200.0])  # the first zeroing takes 10 ms
    monkeypatch.setattr(offload, "time", SimpleNamespace(perf_counter=lambda: next(clock), sleep=slept.append))
    monkeypatch.setenv(offload.HOST_FILL_ENV, "0.25")
    buffer, _ = offload.fresh_host_buffer(8 * 1024**2)
    assert buffer.numel() == 8 * 1024**2 and torch.count_nonzero(buffer) == 0
    assert slept == [pytest.approx(8 / 1024 / 0.25 - 0.01)]  # 31.25 ms at 0.25 GiB/s, less the zeroing's 10 ms
    monkeypatch.delenv(offload.HOST_FILL_ENV)
    offload.fresh_host_buffer(1024)
    assert len(slept) == 1


def test_kept_host_memory_serves_the_arenas_in_turn(monkeypatch):
    """Within keep_host_memory (emulated CUDA) arenas made one after another are views of one buffer, filled and
    registered once, handed over zeroed; it grows for a larger arena; an arena made while another holds it gets
    its own memory; at the end the buffer is unregistered."""
    from scoutbench.runtime import offload
    from scoutbench.testing.emulated_cuda import emulated_cuda

    fills, registers = [], []
    fresh, register = offload.fresh_host_buffer, offload.register_host
    monkeypatch.setattr(offload, "fresh_host_buffer", lambda n: (fills.append(n), fresh(n))[1])
    monkeypatch.setattr(offload, "register_host", lambda b, d: (registers.append(b.numel()), register(b, d))[1])
    cuda = torch.device("cuda", 0)
    specs = {"k": ((1000, 64), torch.bfloat16), "ema": ((7, 5), torch.float32)}
    with emulated_cuda() as runtime, offload.keep_host_memory(cuda, reserve_bytes=300_000) as kept:
        assert fills == registers == [300_000] and kept.fill_s > 0
        first = offload.HostArena(specs, cuda)
        assert first.pinned and first["k"].is_pinned() and first.buffer.data_ptr() == kept.buffer.data_ptr()
        first["k"].fill_(1.0)
        second = offload.HostArena(specs, cuda)  # the first still holds it: fresh memory
        assert second.buffer.data_ptr() != kept.buffer.data_ptr() and fills == [300_000, second.nbytes]
        second.release()
        first.release()
        third = offload.HostArena(specs, cuda)
        assert third.buffer.data_ptr() == kept.buffer.data_ptr() and torch.count_nonzero(third["k"]) == 0
        third.release()
        bigger = offload.HostArena({"k": ((3000, 64), torch.bfloat16)}, cuda)  # 384,000 bytes: the keeper grows
        assert kept.nbytes == bigger.nbytes == 384_000 and bigger["k"].is_pinned()
        assert fills == [300_000, second.nbytes, 384_000] and registers == fills
        bigger.release()
        pointer = kept.buffer.data_ptr()
    with emulated_cuda() as runtime:
        assert not any(lo <= pointer < hi for lo, hi, _ in runtime._pinned)


def _worker_pool(method) -> CpuWorkerPool:
    """A bound offloading method's worker pool (HGCA's own, ScoutAttention's transport's, InfiniGen's fetch's)."""
    owner = getattr(method, "transport", None) or getattr(method, "fetch", None) or method
    return owner.pool


@pytest.mark.parametrize("name", ["scout", "hgca", "infinigen"])
def test_cuda_workers_leave_a_core_to_the_issuing_thread(monkeypatch, tiny_qwen3, name):
    """On CUDA an offloading method's CPU worker runs its kernels on the usable cores less one, which the main
    thread needs to keep issuing device work; it took every core (torch's default for a new thread), so its
    threads preempted the issuing thread. On a CPU run the methods keep their own choice."""
    from emulated import emulated_model
    from gpu_configs import build

    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.runtime import offload
    from scoutbench.testing.emulated_cuda import emulated_cuda

    monkeypatch.setattr(offload, "usable_cores", lambda: 16)
    with emulated_cuda():
        method = build(name)
        DecodeEngine(emulated_model(tiny_qwen3), method).start(2, 300)
        try:
            pool = _worker_pool(method)
            assert pool.submit(torch.get_num_threads).result() == 15
        finally:
            method.close()
    method = build(name)
    DecodeEngine(tiny_qwen3, method).start(2, 300)
    try:
        pool = _worker_pool(method)
        assert pool.intra_op_threads == (1 if name == "hgca" else None)  # HGCA: one (docs/platform.md)
    finally:
        method.close()


def test_oom_retry_empties_the_host_cache_only_where_torch_has_one(monkeypatch):
    """The out-of-memory retry's release on CUDA (emulated) with a torch that has neither
    torch.accelerator.empty_host_cache nor torch._C._host_emptyCache: nothing to empty, no AttributeError."""
    from scoutbench.planning import release_cached_memory
    from scoutbench.testing.emulated_cuda import emulated_cuda

    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    with emulated_cuda():
        release_cached_memory()


def test_host_rates_are_measured_on_fresh_chunks(monkeypatch):
    """The GPU check's host probe fills fresh chunks and keeps each until the end (a freed chunk's pages would
    serve the next one fast), so it sees the fill rate a VM's growth allows (the hook's 0.25 GiB/s here) and, on
    CUDA (emulated), registers what it filled."""
    from scoutbench.runtime import offload
    from scoutbench.testing.emulated_cuda import emulated_cuda

    live, fresh = [], offload.fresh_host_buffer

    def fresh_and_counted(nbytes):
        buffer, huge_page_bytes = fresh(nbytes)
        live.append(buffer.data_ptr())
        return buffer, huge_page_bytes

    monkeypatch.setattr(offload, "fresh_host_buffer", fresh_and_counted)
    monkeypatch.setenv(offload.HOST_FILL_ENV, "0.25")
    with emulated_cuda():
        rates = offload.measure_host_rates(5 * 1024**2, torch.device("cuda"), chunk_bytes=2 * 1024**2)
    assert rates["probe_bytes"] == 5 * 1024**2 and len(set(live)) == 3  # three chunks, alive together
    assert 0 < rates["fill_gib_s"] <= 0.25 and 0 < rates["register_gib_s"] < float("inf")
    assert offload.measure_host_rates(1024**2, torch.device("cpu"))["register_gib_s"] == float("inf")
