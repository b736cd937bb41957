"""`scoutbench calibrate`: measure this machine's hardware profile for the projection (scoutbench/analysis/projection.py).

Each number is timed with the kernels the methods use (the same `partial_attention` and `block_sparse_attention`,
the same flattened `index_select` gathers, the engine's own decode step), repeated, and summarised by its median;
its `source` says what was measured, where and when. On a CPU-only machine the "device" is the main thread's torch pool and
the "host" is the CPU worker, on the same cores (`host.shares_device`); with CUDA the device numbers come from
the GPU (HBM copy bandwidth, bf16 GEMM, attention) and the bus from pinned host <-> device copies. The `efficiency`
section (each device attention kernel class as a fraction of the weight-streaming rate, and the layer hand-off) is
measured on the device it runs on, with the kernels the methods call there.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from scoutbench.devices import cpu_model, resolve_dtype
from scoutbench.results import utc_now

MIB = 1024 * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` (synchronised on CUDA) over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_stream_bytes_s(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Matrix-vector products over weights larger than the caches: the rate decode's linear layers read weights."""
    hidden = 4096
    count = max(2, (256 * MIB) // (hidden * hidden * dtype.itemsize))
    weights = [torch.randn(hidden, hidden, device=device).to(dtype) for _ in range(count)]
    x = torch.randn(1, hidden, device=device).to(dtype)

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    return count * hidden * hidden * dtype.itemsize / median_seconds(run, device, repeats)


def peak_flops(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, device, repeats)


def attention_bytes_s(device: torch.device, dtype: torch.dtype, repeats: int, tokens: int = 16384,
                      selected_blocks: int | None = None, block: int = 32) -> float:
    """KV bytes per second of decode attention over `tokens` tokens (8 KV heads, 32 query heads, head_dim 128);
    with `selected_blocks`, over that many random `block`-token blocks per KV head, attended as the methods do
    (`block_sparse_attention`: in place on a CPU, gathered then attended on a GPU)."""
    from scoutbench.kernels.attention import block_sparse_attention, partial_attention

    heads, kv_heads, head_dim = 32, 8, 128
    q = torch.randn(1, heads, head_dim, device=device).to(dtype)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    if selected_blocks is None:
        seconds = median_seconds(lambda: partial_attention(q, k, v, scale), device, repeats)
        return 2 * k.numel() * dtype.itemsize / seconds
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.stack([torch.randperm(tokens // block, generator=gen)[:selected_blocks] for _ in range(kv_heads)])
    ids = ids.view(1, kv_heads, selected_blocks).to(device)
    blocked = (1, kv_heads, tokens // block, block, head_dim)
    seconds = median_seconds(lambda: block_sparse_attention(q, k.view(blocked), v.view(blocked), ids, scale), device,
                             repeats)
    return 2 * selected_blocks * block * kv_heads * head_dim * dtype.itemsize / seconds


def selection_bytes_s(device: torch.device, dtype: torch.dtype, repeats: int, tokens: int = 16384,
                      block: int = 32, budget: int = 2048) -> float:
    """Digest bytes per second of block selection as Quest and ScoutAttention select: the upper bound of every
    block's digest for the step's queries (`rank_from_digests`, 32 query heads over 8 KV heads) and the top-k of a
    `budget`'s worth of blocks over them (`CandidateBlocks.top`)."""
    from scoutbench.kernels.digest import CandidateBlocks, rank_from_digests

    heads, kv_heads, head_dim = 32, 8, 128
    num_blocks = tokens // block
    q = torch.randn(1, heads, head_dim, device=device).to(dtype)
    digests = torch.randn(1, kv_heads, num_blocks, 2 * head_dim, device=device).to(dtype)
    candidates = CandidateBlocks.build(num_blocks, torch.tensor([num_blocks], device=device), budget // block, None,
                                       device)
    seconds = median_seconds(lambda: candidates.top(rank_from_digests(q, digests)), device, repeats)
    return digests.numel() * dtype.itemsize / seconds


def layer_handoff_s(device: torch.device, repeats: int, meetings: int = 64) -> float:
    """Seconds one meeting of device and host costs the device's stream, per layer with a host part. On CUDA: a
    step that waits for the host (an event the host synchronises on, then a small host-to-device copy) against the
    same work issued without the wait. On a CPU: the main thread's cost of handing a task to the CPU worker and
    collecting its result (submit, and `result()` of a finished task; the worker's own latency is
    `host.task_overhead_s`)."""
    if device.type == "cuda":
        counter = torch.zeros(1, device=device)
        src = torch.zeros(1024, pin_memory=True)
        dst = torch.empty(1024, device=device)
        event = torch.cuda.Event()

        def meet() -> None:
            for _ in range(meetings):
                counter.add_(1)
                event.record()
                event.synchronize()
                dst.copy_(src, non_blocking=True)

        def flow() -> None:
            for _ in range(meetings):
                counter.add_(1)
                dst.copy_(src, non_blocking=True)

        return max((median_seconds(meet, device, repeats) - median_seconds(flow, device, repeats)) / meetings, 1e-9)
    from concurrent.futures import wait

    from scoutbench.runtime.offload import CpuWorkerPool

    pool = CpuWorkerPool(1)
    try:
        costs = []
        for _ in range(repeats):
            start = time.perf_counter()
            futures = [pool.submit(lambda: None) for _ in range(meetings)]
            submit_s = time.perf_counter() - start
            wait(futures)
            start = time.perf_counter()
            for future in futures:
                future.result()
            costs.append((submit_s + time.perf_counter() - start) / meetings)
        return max(statistics.median(costs), 1e-9)
    finally:
        pool.close()


def kernel_efficiencies(device: torch.device, dtype: torch.dtype, repeats: int, memory_bw_bytes_s: float,
                        measured: Callable[[float, str], dict[str, Any]]) -> dict[str, Any]:
    """The profile's `efficiency` section on `device`: each attention kernel class's rate as a fraction of the
    measured weight-streaming rate, and the layer hand-off, all `measured`."""
    def fraction(rate: float, what: str) -> dict[str, Any]:
        return {**measured(rate / memory_bw_bytes_s, f"{what} (KV bytes/s) / the {dtype} weight-streaming rate "
                                                     f"{memory_bw_bytes_s:.4g} B/s"), "basis": "measured"}

    sparse = {f"block_sparse_{block}": fraction(attention_bytes_s(device, dtype, repeats, 16384, 2048 // block, block),
                                                f"{dtype} block-sparse attention over 2048 // {block} random "
                                                f"{block}-token blocks of 16k tokens, 8 KV heads")
              for block in (16, 32)}
    return {"dense_attention": fraction(attention_bytes_s(device, dtype, repeats),
                                        f"{dtype} decode attention over 16k tokens, 8 KV heads"),
            "digest_topk": fraction(selection_bytes_s(device, dtype, repeats),
                                    f"{dtype} digest bounds of 512 32-token blocks, 8 KV heads, and their top-64"),
            **sparse,
            "layer_handoff_s": {**measured(layer_handoff_s(device, repeats),
                                           "event wait and small copy of a device-host meeting (s)" if
                                           device.type == "cuda" else "main thread's submit and collect of a CPU "
                                           "worker task (s)"), "basis": "measured"}}


def gather_bytes_s(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Host-side gather of scattered 32-token blocks into a staging buffer (recall and InfiniGen fetches)."""
    from scoutbench.kernels.gather import gather_blocks

    kv_heads, tokens, head_dim, block, picked = 8, 32768, 128, 32, 256
    cache = torch.randn(1, kv_heads, tokens, head_dim, device=device).to(dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.stack([torch.randperm(tokens // block, generator=gen)[:picked] for _ in range(kv_heads)])
    ids = ids.view(1, kv_heads, picked).to(device)
    out = torch.empty(1, kv_heads, picked * block, head_dim, device=device, dtype=dtype)
    return out.numel() * dtype.itemsize / median_seconds(lambda: gather_blocks(cache, ids, block, out), device, repeats)


def copy_profile(device: torch.device, repeats: int) -> tuple[float, float]:
    """(bytes per second of a large copy, seconds of overhead per copy) host -> device; on a CPU-only machine a
    copy between two host buffers (what the methods' "transfers" are there)."""
    pin = device.type == "cuda"
    big_src = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=pin)
    big_dst = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    small_src = torch.empty(4096, dtype=torch.uint8, pin_memory=pin)
    small_dst = torch.empty(4096, dtype=torch.uint8, device=device)
    bw = big_src.numel() / median_seconds(lambda: big_dst.copy_(big_src, non_blocking=pin), device, repeats)
    copies = 64

    def small() -> None:
        for _ in range(copies):
            small_dst.copy_(small_src, non_blocking=pin)

    per_copy = median_seconds(small, device, repeats) / copies
    return bw, max(per_copy - small_src.numel() / bw, 1e-9)


def worker_task_overhead_s(repeats: int) -> float:
    """Round trip of an empty task through the CPU worker pool the offloading methods use."""
    from scoutbench.runtime.offload import CpuWorkerPool

    pool = CpuWorkerPool(1)
    try:
        return max(median_seconds(lambda: pool.submit(lambda: None).result(), torch.device("cpu"), repeats * 10), 1e-9)
    finally:
        pool.close()


def in_worker(fn: Callable[[], float]) -> float:
    """Run a measurement on the CPU worker thread (the host part of the methods runs there)."""
    from scoutbench.runtime.offload import CpuWorkerPool

    pool = CpuWorkerPool(1)
    try:
        return pool.submit(fn).result()
    finally:
        pool.close()


def engine_overhead_per_layer_s(device: torch.device, memory_bw_bytes_s: float) -> float:
    """Per-layer fixed cost of the eager decode loop: the engine's median step on the tiny preset at a short
    context, less the time its weights and KV take to read at `memory_bw_bytes_s`, divided by its layers."""
    from scoutbench.analysis.work import measured_work, result_shape, step_work
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput

    cfg = ThroughputConfig(method="fullkv", model="tiny-qwen3", length=64, batch=1, steps=8, warmup=2,
                           device=str(device), prefill="synthetic", command=["scoutbench", "calibrate"])
    result = run_throughput(cfg)
    work = step_work(measured_work(result), result_shape(result)).totals()
    read_s = (work["weight_bytes_per_step"] + work["device_kv_bytes_per_step"]) / memory_bw_bytes_s
    step_s = result["decode_step_ms"]["median"] / 1e3
    return max(step_s - read_s, 1e-9) / result["model"]["num_layers"]


def total_host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(device: torch.device, repeats: int = 5, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """A hardware profile of this machine in the format of scoutbench/data/hardware/*.json."""
    cuda = device.type == "cuda"
    dtype = resolve_dtype(None, device)  # what a run on this device uses by default, for the host KV too
    threads = torch.get_num_threads()
    where = f"{socket.gethostname()} ({cpu_model()}, {threads} torch threads) at {utc_now()}"

    def measured(value: float, what: str) -> dict[str, Any]:
        log(f"{what}: {value:.4g}")
        return {"value": value, "source": f"measured by scoutbench calibrate on {where}: {what}"}

    cpu = torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU ({cpu_model()})"
    memory_bw = weight_stream_bytes_s(device, dtype, repeats)
    device_section: dict[str, Any] = {
        "name": device_name,
        "memory_bytes": measured(float(torch.cuda.get_device_properties(device).total_memory if cuda
                                       else total_host_bytes()), "device memory (bytes)"),
        "memory_bw_bytes_s": measured(memory_bw, f"{dtype} matrix-vector over 256 MiB of 4096x4096 weights "
                                      "(bytes/s)"),
        "peak_flops": measured(peak_flops(device, dtype, repeats), f"{dtype} square matmul (FLOP/s)"),
        "layer_overhead_s": measured(engine_overhead_per_layer_s(device, memory_bw),
                                     "engine decode step of tiny-qwen3 at 64 tokens, less its weight and KV reads, "
                                     "per layer (s)"),
    }
    if not cuda:
        device_section["cores"] = measured(float(threads), "torch intra-op threads of the main thread")
    bw, overhead = copy_profile(device, repeats)
    bus_section = {"generation": "PCIe (measured)" if cuda else "host memory copy (no bus)",
                   "bw_bytes_s": measured(bw, "64 MiB copy host -> device (bytes/s)" if cuda
                                          else "64 MiB copy between host buffers (bytes/s)"),
                   "transfer_overhead_s": measured(overhead, "4 KiB copies, minus their bytes at the copy rate (s)")}
    host_section = {
        "cpu": cpu_model(),
        "cores": measured(1.0, "CPU worker threads of the offloading methods (cpu_workers=1)"),
        "memory_bytes": measured(float(total_host_bytes()), "host memory (bytes)"),
        "memory_bw_bytes_s": measured(in_worker(lambda: gather_bytes_s(cpu, dtype, repeats)),
                                      f"{dtype} gather of 256 random 32-token blocks per KV head on the "
                                      "worker thread (bytes/s)"),
        "attention_bytes_s": measured(in_worker(lambda: attention_bytes_s(cpu, dtype, repeats, 16384, 64)),
                                      f"{dtype} decode attention over 64 of 512 blocks read in place on the "
                                      "worker thread (KV bytes/s)"),
        "task_overhead_s": measured(worker_task_overhead_s(repeats), "empty task round trip through the worker (s)"),
        "shares_device": not cuda,
    }
    return {"name": f"local-{socket.gethostname()}", "description": f"measured on {where}",
            "device": device_section, "bus": bus_section, "host": host_section,
            "efficiency": kernel_efficiencies(device, dtype, repeats, memory_bw, measured)}
