"""Host/device tiers and the asynchronous machinery of offloading methods.

- `HostArena`: a method's host tier as one exact-size allocation sliced into its tensors, pinned on CUDA by
  registering it (`cudaHostRegister`). torch's pinned allocator rounds every allocation up to a power of two (a
  1.001 GiB tier takes 2 GiB: 152 GiB pinned for 76 GiB of data at qwen3-14b 32k batch 16), which the arena
  avoids; the planner counts exactly what it holds. Its pages are transparent huge pages where the kernel allows
  them (`huge_page_backing`): the CPU attention of a sparse method reads random blocks of it, and with 4 KiB pages
  nearly every block is a TLB miss.
- `keep_host_memory`: one registered host buffer that the arenas of a process's runs take in turn. The first touch
  of fresh memory is slow where a VM's RAM grows on demand (0.13-0.3 GiB/s, docs/gpu.md), and registering is
  paid per call: a comparison of several methods pays both once instead of once per method.
- `device_zeros`: a method's compute-device caches, zeroed (on CPU an arena too, for its huge pages).
- `host_empty`: small host buffers (staging of one step), pinned when CUDA is present.
- `token_chunks`: bounded prefill transients (a copy or an fp32 temporary over a whole prompt is split).
- `CopyStream`: device<->host copies on their own CUDA stream, each followed by an event; on a CPU-only run the
  copy is a plain `copy_` and the "event" is already complete. `join_copy_streams` makes the compute stream wait
  for all of them (the timer's step end: a step's time includes every stream's work).
- `CpuWorkerPool`: threads for CPU-side attention. torch ops release the GIL, so a worker really runs while the
  main thread keeps issuing device work; the main thread's wait on a future is the measured idle time.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from scoutbench.environment import value
from scoutbench.errors import ScoutbenchError
from scoutbench.kernels.backends import USAGE as attention_backends

ARENA_ALIGN_BYTES = 256  # every tensor of an arena starts at a multiple of this (vector loads, any dtype)
PREFILL_CHUNK_TOKENS = 4096  # tokens per piece of a chunked prefill transient
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable, as torch's own pin_memory utilities use
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: the only cudaHostRegister error that a smaller batch fixes
# Test hook: fresh host memory fills at most this fast (GiB/s), as on a VM whose RAM grows on demand (the GPU check's
# CPU dry run simulates the lent machine's 0.13-0.3 GiB/s with it). Unset: as fast as the machine fills it.
HOST_FILL_ENV = "SCOUTBENCH_HOST_FILL_GIBS"
GIB = 1024**3
HUGE_PAGE_BYTES = 2 * 1024**2  # x86-64 and arm64 (4 KiB base pages) transparent huge pages
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14  # <sys/mman.h>, Linux
# GIL switch interval while a CPU worker runs beside the main thread (CpuWorkerPool): ScoutAttention's decode steps on
# bench-attn16 at 32k measured 3-7% faster than at CPython's default 5 ms (0.1-1 ms alike; HGCA, InfiniGen unchanged)
WORKER_SWITCH_INTERVAL_S = 0.0002
CPU_WORKER_STAGE = "cpu_worker"  # the stage a CPU worker's attention calls are booked under (`backends.USAGE`)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux (where there is nothing to advise)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def huge_page_backing(buffer: torch.Tensor) -> int:
    """Back the 2 MiB-aligned interior of a CPU tensor with transparent huge pages where Linux allows them (needed
    where /sys/kernel/mm/transparent_hugepage/enabled says `madvise`, the common default) and return the bytes
    advised. The interior's content is dropped (it reads as zeros): memory that the allocator recycles was already
    faulted in as small pages, which advice alone leaves small, so they are released and the next touch faults
    huge ones. Advice only: refused (no THP support) or impossible (a buffer under 2 MiB), it changes nothing else.
    Measured on a 2-core Xeon at load 2 (2048 of 64k tokens in blocks of 32, the compiled kernel; the host tier of
    benchmarks/bench_sparse_attention.py with and without): the sparse call read 0.40 instead of 0.34 of the read
    bandwidth in bf16 and 0.54 instead of 0.42 in fp32, a TLB miss per block fewer; full attention unchanged.
    docs/platform.md has the idle figures."""
    madvise = _madvise()
    start = -(-buffer.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is None or end <= start or madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return 0
    madvise(start, end - start, MADV_DONTNEED)
    return end - start


def arena_layout(specs: dict[Any, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[Any, int], int]:
    """Byte offset of each `(shape, dtype)` in an arena (in order, aligned to ARENA_ALIGN_BYTES) and its size."""
    offsets, end = {}, 0
    for key, (shape, dtype) in specs.items():
        start = -(-end // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
        offsets[key] = start
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


def clear_last_cuda_error(device: torch.device) -> None:
    """Consume CUDA's last error after a runtime call that failed and was handled (`cudaHostRegister`).

    A failed call stays the thread's last error, and torch's check after the next kernel launch reports it as a
    new failure of that kernel (the `--batch auto` retry then fails too, and halves the batch once more). torch's
    cudart bindings have no `cudaGetLastError`, but a check that fails clears it (c10_cuda_check_implementation
    calls it): one trivial launch absorbs the stale error.
    """
    try:
        torch.zeros(1, device=device)
    except RuntimeError:
        pass


def _unregister(pointer: int, device: torch.device) -> None:
    torch.cuda.synchronize()  # no copy may still be reading or writing the pages (rare: the end of a run)
    if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
        clear_last_cuda_error(device)


def fresh_host_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """A zeroed pageable allocation of `nbytes` and the bytes of it on huge pages (advised before the zeroing
    touches its pages). The zeroing is the first touch, which is what a VM whose RAM grows on demand is slow at;
    `SCOUTBENCH_HOST_FILL_GIBS` caps its rate (a test hook)."""
    start = time.perf_counter()
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    huge_page_bytes = huge_page_backing(buffer)
    buffer.zero_()
    fill_gib_s = value(HOST_FILL_ENV)
    if fill_gib_s > 0:
        time.sleep(max(0.0, nbytes / GIB / fill_gib_s - (time.perf_counter() - start)))
    return buffer, huge_page_bytes


def register_host(buffer: torch.Tensor, device: torch.device) -> weakref.finalize:
    """Page-lock `buffer` with `cudaHostRegister`; the returned finalizer unregisters it (at the latest when the
    buffer is collected). Out of memory (cudaErrorMemoryAllocation) raises an out-of-memory RuntimeError, which
    `--batch auto` answers with a smaller batch; any other error is no memory shortage, and a smaller batch would
    fail alike: a ScoutbenchError that names it. Either way CUDA's last error is cleared first: the next kernel
    launch would otherwise report it as a fresh failure of its own."""
    nbytes = buffer.numel() * buffer.element_size()
    pointer = buffer.data_ptr()
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(pointer, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        clear_last_cuda_error(torch.device(device))
        what = f"pinned host memory: registering {nbytes / GIB:.2f} GiB failed (cudaError {code}"
        if code == CUDA_ERROR_MEMORY_ALLOCATION:
            raise RuntimeError(f"{what}): out of memory")
        name = getattr(cudart, "cudaGetErrorString", None)
        reason = f": {name(code)}" if name is not None else ""
        raise ScoutbenchError(f"{what}{reason}), not a memory shortage; check the driver's log (dmesg) and that "
                              "nothing else registered this memory")
    release = weakref.finalize(buffer, _unregister, pointer, torch.device(device))
    release.atexit = False  # the CUDA context may already be gone at exit
    return release


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index (`cuda` is the current CUDA device): one device has one name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def measure_host_rates(probe_bytes: int, device: torch.device, chunk_bytes: int = 16 * 1024**2,
                       max_s: float = 5.0) -> dict[str, float]:
    """How fast this machine fills fresh host memory and (on CUDA) registers it, in GiB/s: `fresh_host_buffer`
    chunks, all kept until the end (a freed chunk's pages would serve the next one), until `probe_bytes` or
    `max_s` seconds of filling, then each registered and unregistered. Where a VM's RAM grows on demand, the fill
    rate is that growth (docs/gpu.md)."""
    chunks, fill_s = [], 0.0
    while sum(c.numel() for c in chunks) < probe_bytes and fill_s < max_s:
        start = time.perf_counter()
        chunks.append(fresh_host_buffer(min(chunk_bytes, probe_bytes - sum(c.numel() for c in chunks)))[0])
        fill_s += time.perf_counter() - start
    filled = sum(c.numel() for c in chunks)
    rates = {"probe_bytes": filled, "fill_s": fill_s, "fill_gib_s": filled / GIB / max(fill_s, 1e-9),
             "register_s": 0.0, "register_gib_s": math.inf}
    if indexed(device).type == "cuda":
        start = time.perf_counter()
        releases = [register_host(chunk, device) for chunk in chunks]
        rates["register_s"] = time.perf_counter() - start
        rates["register_gib_s"] = filled / GIB / max(rates["register_s"], 1e-9)
        for release in releases:
            release()
    return rates


class KeptHostMemory:
    """One host buffer, zeroed and (on CUDA) registered once, that the host arenas of a process's runs take in
    turn (`keep_host_memory`): one arena at a time holds it, as a view of its first bytes, zeroed again. It grows
    (a fresh buffer in place of the old) when an arena needs more than it has. `fill_s` and `register_s` say what
    its fresh memory cost."""

    def __init__(self, device: torch.device):
        self.device = indexed(device)
        self.buffer: torch.Tensor | None = None
        self.huge_page_bytes = 0
        self.lent = False
        self.fill_s = self.register_s = 0.0
        self.filled_bytes = 0
        self._release: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int) -> None:
        """At least `nbytes`, filled and registered now (not while a run is timed)."""
        if nbytes <= self.nbytes:
            return
        self.close()
        start = time.perf_counter()
        self.buffer, self.huge_page_bytes = fresh_host_buffer(nbytes)
        self.fill_s += time.perf_counter() - start
        self.filled_bytes += nbytes
        if self.device.type == "cuda":
            start = time.perf_counter()
            self._release = register_host(self.buffer, self.device)
            self.register_s += time.perf_counter() - start

    def lend(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes`, zeroed, for one arena until `give_back`."""
        if self.lent:
            raise RuntimeError("kept host memory is already lent to another arena")
        self.reserve(nbytes)
        view = self.buffer[:nbytes]
        view.zero_()
        self.lent = True
        return view

    def give_back(self) -> None:
        self.lent = False

    def close(self) -> None:
        """Unregister and drop the buffer (a view still held by a closed method keeps only its pageable memory)."""
        if self._release is not None:
            self._release()
            self._release = None
        self.buffer, self.huge_page_bytes = None, 0


_KEPT: KeptHostMemory | None = None


def kept_host_memory() -> KeptHostMemory | None:
    """The process's kept host memory (`keep_host_memory`), if any."""
    return _KEPT


@contextlib.contextmanager
def keep_host_memory(device: torch.device, reserve_bytes: int = 0) -> Iterator[KeptHostMemory]:
    """Within the block, the host arenas made for `device` take one kept buffer in turn instead of fresh memory
    each; `reserve_bytes` fills (and on CUDA registers) it now. One keeper at a time."""
    global _KEPT
    if _KEPT is not None:
        raise RuntimeError("host memory is already kept")
    kept = KeptHostMemory(device)
    try:
        kept.reserve(reserve_bytes)
        _KEPT = kept
        yield kept
    finally:
        _KEPT = None
        kept.close()


def _give_back(kept: KeptHostMemory) -> None:
    kept.give_back()


class HostArena:
    """A method's host tensors as views of one zeroed allocation of exactly their size (+ alignment), on huge pages
    where Linux allows them (their pages released and advised before the zeroing touches them).

    On CUDA the allocation is page-locked with `cudaHostRegister` (`register_host`), so copies from and to it are
    asynchronous and `is_pinned()` holds; `release()` (also run when the arena is collected) unregisters it.
    Within `keep_host_memory` for its device, the arena is a view of the kept buffer instead (registered once for
    every arena), and `release()` hands it back.
    """

    def __init__(self, specs: dict[Any, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        offsets, self.nbytes = arena_layout(specs)
        kept = _KEPT if _KEPT is not None and _KEPT.device == indexed(device) and not _KEPT.lent else None
        self._release = None
        if kept is not None:
            self.buffer = kept.lend(self.nbytes)
            self.huge_page_bytes = kept.huge_page_bytes
            self._release = weakref.finalize(self, _give_back, kept)
        else:
            self.buffer, self.huge_page_bytes = fresh_host_buffer(self.nbytes)
            if torch.device(device).type == "cuda" and self.nbytes:
                self._release = register_host(self.buffer, torch.device(device))
        self.tensors = {key: self.buffer[offsets[key]: offsets[key] + math.prod(shape) * dtype.itemsize]
                        .view(dtype).view(shape) for key, (shape, dtype) in specs.items()}

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.tensors[key]

    @property
    def pinned(self) -> bool:
        return self._release is not None and self._release.alive

    def release(self) -> None:
        """Unpin now (before an out-of-memory retry), or hand the kept buffer back; the memory itself goes with
        the last view of it."""
        if self._release is not None:
            self._release()


def device_zeros(specs: dict[Any, tuple[tuple[int, ...], torch.dtype]], device: torch.device
                 ) -> dict[Any, torch.Tensor]:
    """Zeroed compute-device tensors, one per `(shape, dtype)`: on CUDA `torch.zeros` each; on CPU, where the
    "device" is host memory, views of one `HostArena` on huge pages. The CPU kernels prefetch their rows ahead across
    4 KiB pages, which on small pages costs a TLB miss each: FullKV's 64k-token fp32 attention calls measured 9-14%
    faster on huge pages (bf16 0-3%)."""
    if torch.device(device).type == "cpu":
        arena = HostArena(specs, device)
        return {key: arena[key] for key in specs}
    return {key: torch.zeros(shape, dtype=dtype, device=device) for key, (shape, dtype) in specs.items()}


def token_chunks(num_tokens: int, chunk: int | None = None) -> Iterator[slice]:
    """Consecutive slices of at most `chunk` (default PREFILL_CHUNK_TOKENS) tokens covering `num_tokens`."""
    chunk = chunk or PREFILL_CHUNK_TOKENS
    for start in range(0, num_tokens, chunk):
        yield slice(start, min(start + chunk, num_tokens))


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-memory buffer; pinned if the compute device is CUDA (through torch's pinned allocator, which
    rounds the size up to a power of two: tiers go into a `HostArena`)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.device(device).type == "cuda")


class _DoneEvent:
    """An event that has already completed: what CPU-only copies (or nothing to wait for) return."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


DONE = _DoneEvent()


_COPY_STREAMS: weakref.WeakSet[CopyStream] = weakref.WeakSet()  # every live CUDA copy stream (join_copy_streams)
_COPY_STREAMS_LOCK = threading.Lock()


def join_copy_streams(device: torch.device) -> None:
    """Make `device`'s current stream wait for all work queued so far on every copy stream: an event recorded
    after this (the end of a timed step) then covers every stream's work, a recall's copies included."""
    with _COPY_STREAMS_LOCK:
        streams = [c.stream for c in _COPY_STREAMS if c.stream is not None and c.device == torch.device(device)]
    current = torch.cuda.current_stream(device)
    for stream in streams:
        current.wait_stream(stream)


class CopyStream:
    """Asynchronous copies with completion events (CUDA), or synchronous copies (CPU)."""

    def __init__(self, device: torch.device):
        self.device = indexed(device)
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        if self.stream is not None:
            with _COPY_STREAMS_LOCK:
                _COPY_STREAMS.add(self)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Enqueue `dst.copy_(src)` after the work already queued on the current stream, or only after the event
        `after` (a copy issued from a worker thread must not wait for compute queued since); return its event."""
        if self.stream is None:
            dst.copy_(src)
            return DONE
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)
        for tensor in (dst, src):
            if tensor.is_cuda:  # keep the caching allocator from reusing its memory before the copy ran
                tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (which enqueues copies) on the copy stream; return (result, event)."""
        if self.stream is None:
            return fn(), DONE
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            result = fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        return result, event


def usable_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CpuWorkerPool:
    """A small thread pool for CPU attention tasks (one worker serves the layer-ahead pipeline in order).

    `intra_op_threads`: each worker's torch thread count (the CPU kernels' too), which under OpenMP is per
    thread, so the main thread keeps its own. Default on a CUDA `device`: the usable cores less the one the main
    thread needs to keep issuing device work, shared among the workers (with every core the workers' threads
    preempt the issuing thread, and the GPU waits for launches); on a CPU run torch's, as the main thread's (the
    worker then shares the cores with the main thread's "device" work, and what that costs depends on the
    method's overlap: docs/platform.md), or `cpu_run_threads` where the method knows its overlap.

    While any pool is open, the interpreter's GIL switch interval is at most WORKER_SWITCH_INTERVAL_S (restored when
    the last one closes): the worker and the main thread both run short Python stretches between kernel calls, and
    with CPython's default 5 ms one of them can wait that long for the other to drop the GIL.
    """

    _open = 0
    _saved_interval_s: float | None = None
    _lock = threading.Lock()

    def __init__(self, workers: int = 1, intra_op_threads: int | None = None, device: torch.device | None = None,
                 cpu_run_threads: int | None = None):
        if intra_op_threads is None and device is not None:
            on_cuda = torch.device(device).type == "cuda"
            intra_op_threads = max(1, (usable_cores() - 1) // workers) if on_cuda else cpu_run_threads
        self.intra_op_threads = intra_op_threads
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scoutbench-cpu",
                                           initializer=self._start_worker)
        self._closed = False
        with CpuWorkerPool._lock:
            if CpuWorkerPool._open == 0:
                CpuWorkerPool._saved_interval_s = sys.getswitchinterval()
            sys.setswitchinterval(min(sys.getswitchinterval(), WORKER_SWITCH_INTERVAL_S))
            CpuWorkerPool._open += 1

    def _start_worker(self) -> None:
        """A worker's thread: its torch threads, and its attention calls booked as the CPU worker's
        (`backends.USAGE`: the stage timer's stages are the decode loop's thread's)."""
        if self.intra_op_threads is not None:
            torch.set_num_threads(self.intra_op_threads)
        attention_backends.enter_stage(CPU_WORKER_STAGE)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.executor.submit(fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        with CpuWorkerPool._lock:
            if self._closed:
                return
            self._closed = True
            CpuWorkerPool._open -= 1
            if CpuWorkerPool._open == 0 and CpuWorkerPool._saved_interval_s is not None:
                sys.setswitchinterval(CpuWorkerPool._saved_interval_s)
