"""Host/device tiers and the asynchronous machinery of offloading methods.

- `host_empty`: host-tier tensors, pinned when CUDA is present (so H2D/D2H copies can be asynchronous).
- `CopyStream`: device<->host copies on their own CUDA stream, each followed by an event; on a CPU-only run the
  copy is a plain `copy_` and the "event" is already complete.
- `CpuWorkerPool`: threads for CPU-side attention. torch ops release the GIL, so a worker really runs while the
  main thread keeps issuing device work; the main thread's wait on a future is the measured idle time.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host-memory buffer; pinned if the compute device is CUDA."""
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


class CopyStream:
    """Asynchronous copies with completion events (CUDA), or synchronous copies (CPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

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
    """A small thread pool for CPU attention tasks (one worker serves the layer-ahead pipeline in order)."""

    def __init__(self, workers: int = 1):
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scoutbench-cpu")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.executor.submit(fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
