"""Emulated CUDA graphs (`torch.cuda.CUDAGraph`, `torch.cuda.graph`, `graph_pool_handle`): capture records the
device work issued on the capture's streams without running it, as on a GPU; a replay re-runs the recorded
operations on the same tensors without the Python that issued them.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import Any

import torch

from scoutbench.testing.emulated_cuda.capture import INVALIDATED, NOT_PERMITTED, UNJOINED, Capture, GraphOp
from scoutbench.testing.emulated_cuda.state import call_site, require_active
from scoutbench.testing.emulated_cuda.streams import EmulatedStream, StreamContext

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_POOL_IDS = itertools.count(1)


class EmulatedCUDAGraph:
    """`torch.cuda.CUDAGraph(keep_graph=False)` while emulated. Capture records the device work issued on the
    capture's streams without running it; `replay()` re-dispatches the recorded operations, in order, on the same
    tensors, without the Python that issued them: values the Python computed at capture stay as they were.
    `num_ops` (operations per replay) and `replays` are the record tests read."""

    def __init__(self, keep_graph: bool = False):
        self.keep_graph = keep_graph
        self.replays = 0
        self._runtime = require_active()
        self._ops: list[GraphOp] | None = None
        self._pool: tuple[int, int] | None = None

    @property
    def num_ops(self) -> int:
        return len(self._ops or ())

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        """Start recording the current stream's device work. (`check_input_liveness` has nothing to check here:
        the recorded operations keep their tensors alive.)"""
        runtime = self._runtime
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise RuntimeError("Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                               f"{capture_error_mode}")
        if self._ops is not None:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. To capture a new graph, "
                               "create a new instance.")
        stream = runtime.current_stream()
        if stream.is_default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, after capture, "
                               "it's ok to replay them on the default stream.)")
        with runtime.lock:
            if runtime.capture is not None:
                raise RuntimeError("emulated CUDA: a capture is already underway (only one capture may be underway "
                                   "at a time in the process)")
            self._pool = pool if pool is not None else graph_pool_handle()
            runtime.capture = Capture(self, stream, capture_error_mode)
            runtime.pools_recording.append(tuple(self._pool))

    def capture_end(self) -> None:
        """End the capture. It fails, and ends, if an error invalidated it or a stream that joined it was not
        joined back; as torch's, a failed one leaves the allocator recording to its pool (`pools_recording`)."""
        runtime = self._runtime
        capture = runtime.capture
        if capture is None or capture.graph is not self:
            raise RuntimeError("emulated CUDA: capture_end() without this graph's capture_begin()")
        if runtime.current_stream() is not capture.origin:
            raise RuntimeError("Capture must end on the same stream it began on.")
        runtime.capture = None
        if capture.error is not None:
            raise RuntimeError(f"{INVALIDATED} (emulated CUDA: {capture.error})")
        unjoined = capture.unjoined()
        if unjoined:
            raise RuntimeError(f"{UNJOINED} (emulated CUDA: {len(unjoined)} stream(s) joined the capture and the "
                               "capturing stream did not wait for their last work)")
        runtime.pools_recording.remove(tuple(self._pool))
        if not capture.ops:
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
                          "on wrong device or stream.", stacklevel=2)
        self._ops = capture.ops

    def instantiate(self) -> None:
        self._captured("instantiate")

    def replay(self) -> None:
        """Device work on the current stream: at once on the default stream, queued on any other."""
        runtime = self._runtime
        ops = self._captured("replay")
        stream = runtime.current_stream()
        capture = runtime.capturing(stream)
        if capture is not None:
            capture.fail(f"{NOT_PERMITTED} (emulated CUDA: replaying a graph inside a capture is not emulated)")
        runtime.check_last_error()
        for op in ops:
            if op.copy is not None:
                runtime.count_transfer(op.copy, stream, op.device)
        self.replays += 1
        if stream.is_default and not runtime.executing:
            self._execute(stream, True)
        else:
            stream.enqueue(functools.partial(self._execute, stream, False))

    def reset(self) -> None:
        self._ops, self._pool = None, None

    def pool(self) -> tuple[int, int]:
        self._captured("pool")
        return self._pool

    def _captured(self, what: str) -> list[GraphOp]:
        if self._ops is None:
            raise RuntimeError(f"Called CUDAGraph::{what} without a preceding successful capture.")
        return self._ops

    def _execute(self, stream: EmulatedStream, on_default: bool) -> None:
        """Run the recorded operations (torch function modes off: a replay is one launch, not the captured
        calls). On the default stream the device is never behind the host, so a device-to-host copy lands when
        waited on and the pinned sources of host-to-device copies must stay unchanged until then, as eager."""
        runtime = self._runtime
        sources = []
        with runtime.lock, torch._C.DisableTorchFunction():
            for op in self._ops:
                if on_default and op.copy == "d2h":
                    stream.enqueue(functools.partial(op.host.copy_, op.device.clone()))
                    continue
                op.run()
                if on_default and op.copy == "h2d":
                    sources.append(op.host)
            if sources:
                site, position = call_site("").where(), stream.tail + 1
                runtime.source_checks += [(stream, position, src, src.clone(), site) for src in sources]
                stream.enqueue(lambda: None)  # the point where the copies are known complete


class EmulatedGraphContext:
    """`torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode="global")`: torch's context
    manager, step for step (a synchronize, then the capture on `stream` or on its own side stream). As in torch,
    a capture_end that raises leaves the capture stream current."""

    def __init__(self, cuda_graph: EmulatedCUDAGraph, pool: tuple[int, int] | None = None,
                 stream: EmulatedStream | None = None, capture_error_mode: str = "global",
                 enable_annotations: bool = False, check_input_liveness: bool = False):
        runtime = require_active()
        if enable_annotations:
            raise RuntimeError("emulated CUDA: graph annotations need cuda.bindings and are not emulated")
        if stream is None and runtime.graph_stream is None:
            runtime.graph_stream = EmulatedStream(runtime=runtime)
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else runtime.graph_stream
        self.stream_ctx = StreamContext(self.capture_stream)
        self.cuda_graph = cuda_graph
        self.capture_error_mode = capture_error_mode
        self.check_input_liveness = check_input_liveness

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode,
                                      check_input_liveness=self.check_input_liveness)

    def __exit__(self, *exc: object) -> None:
        self.cuda_graph.capture_end()
        self.stream_ctx.__exit__(*exc)


def graph_pool_handle() -> tuple[int, int]:
    """`torch.cuda.graph_pool_handle()`: an opaque pool id (the emulator allocates nothing from pools)."""
    return 0, next(_POOL_IDS)


def end_allocate_to_pool(device: int, pool: tuple[int, int]) -> None:
    """`torch._C._cuda_endAllocateToPool`: the allocator stops recording one capture's allocations to `pool`."""
    recording = require_active().pools_recording
    if tuple(pool) not in recording:
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
    recording.remove(tuple(pool))


def release_pool(device: int, pool: tuple[int, int]) -> None:
    """`torch._C._cuda_releasePool` (the emulator allocates nothing from pools)."""


def empty_cache() -> None:
    """`torch.cuda.empty_cache()`: as torch's allocator, it asserts while a capture records to a pool (a failed
    capture that nobody ended)."""
    if require_active().pools_recording:
        raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty() (emulated CUDA: empty_cache() while "
                           "the allocator records to a capture's pool; a failed capture_end left it)")


def is_current_stream_capturing() -> bool:
    runtime = require_active()
    capture = runtime.capture
    return capture is not None and runtime.current_stream() in capture.clocks


def make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("emulated CUDA does not emulate torch.cuda.make_graphed_callables (autograd through "
                              "graphs); capture with torch.cuda.graph")
