"""Host/device tiers and the asynchronous machinery of offloading methods.

- `HostArena`: a method's host tier as one exact-size allocation sliced into its tensors, pinned on CUDA by
  registering it (`cudaHostRegister`). torch's pinned allocator rounds every allocation up to a power of two (a
  1.001 GiB tier takes 2 GiB: 152 GiB pinned for 76 GiB of data at qwen3-14b 32k batch 16), which the arena
  avoids; the planner counts exactly what it holds. Its pages are transparent huge pages where the kernel allows
  them (`huge_page_backing`): the CPU attention of a sparse method reads random blocks of it, and with 4 KiB pages
  nearly every block is a TLB miss.
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

import ctypes
import ctypes.util
import functools
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

ARENA_ALIGN_BYTES = 256  # every tensor of an arena starts at a multiple of this (vector loads, any dtype)
PREFILL_CHUNK_TOKENS = 4096  # tokens per piece of a chunked prefill transient
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable, as torch's own pin_memory utilities use
HUGE_PAGE_BYTES = 2 * 1024**2  # x86-64 and arm64 (4 KiB base pages) transparent huge pages
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14  # <sys/mman.h>, Linux
# GIL switch interval while a CPU worker runs beside the main thread (CpuWorkerPool): ScoutAttention's decode steps on
# bench-attn16 at 32k measured 3-7% faster than at CPython's default 5 ms (0.1-1 ms alike; HGCA, InfiniGen unchanged)
WORKER_SWITCH_INTERVAL_S = 0.0002


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





class HostArena:
    """A method's host tensors as views of one zeroed allocation of exactly their size (+ alignment), on huge pages
    where Linux allows them (their pages released and advised before the zeroing touches them).

    On CUDA the allocation is page-locked with `cudaHostRegister`, so copies from and to it are asynchronous and
    `is_pinned()` holds; `release()` (also run when the arena is collected) unregisters it. A registration that
    fails raises an out-of-memory RuntimeError, which `--batch auto` answers by halving the batch; it first clears
    CUDA's last error, which the next kernel launch (of the retry) would otherwise report as a fresh failure.
    """

    def __init__(self, specs: dict[Any, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        offsets, self.nbytes = arena_layout(specs)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        self.huge_page_bytes = huge_page_backing(self.buffer)
        self.buffer.zero_()
        self.tensors = {key: self.buffer[offsets[key]: offsets[key] + math.prod(shape) * dtype.itemsize]
                        .view(dtype).view(shape) for key, (shape, dtype) in specs.items()}
        self._release = None
        if torch.device(device).type == "cuda" and self.nbytes:
            pointer = self.buffer.data_ptr()
            code = int(torch.cuda.cudart().cudaHostRegister(pointer, self.nbytes, CUDA_HOST_REGISTER_PORTABLE))
            if code != 0:
                clear_last_cuda_error(torch.device(device))
                raise RuntimeError(f"pinned host memory: registering {self.nbytes / 1024**3:.2f} GiB failed "
                                   f"(cudaError {code}): out of memory")
            self._release = weakref.finalize(self, _unregister, pointer, torch.device(device))
            self._release.atexit = False  # the CUDA context may already be gone at exit

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.tensors[key]

    @property
    def pinned(self) -> bool:
        return self._release is not None and self._release.alive

    def release(self) -> None:
        """Unpin now (before an out-of-memory retry); the memory itself goes with the last view of it."""
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
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
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


class CpuWorkerPool:
    """A small thread pool for CPU attention tasks (one worker serves the layer-ahead pipeline in order).

    `intra_op_threads` (None: torch's, as the main thread): each worker's torch thread count, which under OpenMP is
    per thread, so the main thread keeps its own. On a CPU-only run the worker shares the cores with the main
    thread's "device" work, and what that costs depends on the method's overlap (docs/platform.md).

    While any pool is open, the interpreter's GIL switch interval is at most WORKER_SWITCH_INTERVAL_S (restored when
    the last one closes): the worker and the main thread both run short Python stretches between kernel calls, and
    with CPython's default 5 ms one of them can wait that long for the other to drop the GIL.
    """

    _open = 0
    _saved_interval_s: float | None = None
    _lock = threading.Lock()

    def __init__(self, workers: int = 1, intra_op_threads: int | None = None):
        initializer = None if intra_op_threads is None else (lambda: torch.set_num_threads(intra_op_threads))
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scoutbench-cpu",
                                           initializer=initializer)
        self._closed = False
        with CpuWorkerPool._lock:
            if CpuWorkerPool._open == 0:
                CpuWorkerPool._saved_interval_s = sys.getswitchinterval()
            sys.setswitchinterval(min(sys.getswitchinterval(), WORKER_SWITCH_INTERVAL_S))
            CpuWorkerPool._open += 1

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
