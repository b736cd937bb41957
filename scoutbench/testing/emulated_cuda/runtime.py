"""The state of one emulation (`EmulatedRuntime`): its streams and how they run, the pinned-memory registry,
copies between host and device (counted, and checked for hazards), recorded syncs and `cudart()` with CUDA's
per-thread last error.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from scoutbench.testing.emulated_cuda.capture import NOT_PERMITTED
from scoutbench.testing.emulated_cuda.state import (
    CPU,
    CUDA_ERROR_MEMORY_ALLOCATION,
    CUDA_ERROR_STRINGS,
    CUDA_SUCCESS,
    EmulatedCudaHazard,
    SyncSite,
    call_site,
)
from scoutbench.testing.emulated_cuda.streams import EmulatedStream

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.capture import Capture
    from scoutbench.testing.emulated_cuda.streams import EmulatedEvent


class EmulatedCudart:
    """The part of `torch.cuda.cudart()` scoutbench calls, with CUDA's per-thread last error."""

    cudaError = int  # noqa: N815 - torch's enum; `int(code)` is how callers read it

    def __init__(self, runtime: EmulatedRuntime):
        self.runtime = runtime

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        if self.runtime.fail_host_register > 0:
            self.runtime.fail_host_register -= 1
            self.runtime.local.last_error = self.runtime.host_register_error
            return self.runtime.host_register_error
        self.runtime.register_pinned(pointer, nbytes)
        return CUDA_SUCCESS

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.runtime.unregister_pinned(pointer)
        return CUDA_SUCCESS

    def cudaGetErrorString(self, code: int) -> str:  # noqa: N802
        return CUDA_ERROR_STRINGS.get(int(code), "unrecognized error code")

    # No cudaGetLastError: torch's bindings (torch/csrc/cuda/shared/cudart.cpp) have none either.


@dataclass
class _DeviceProperties:
    name: str = "Emulated CUDA device (CPU)"
    total_memory: int = 8 * 1024**3
    multi_processor_count: int = 4
    major: int = 9
    minor: int = 0
    uuid: str | None = None  # torch's `get_device_properties(i).uuid` (tests set one)


class EmulatedRuntime:
    """State of one emulation: streams, the pinned-memory registry, recorded syncs, options."""

    def __init__(self, lazy: bool = True, memory_bytes: int = 8 * 1024**3, side_item_delay_s: float = 0.0):
        self.lazy = lazy  # False: side streams run at once (an infinitely fast device)
        self.poison_empty = True  # `torch.empty` on the device (and pinned) returns NaN / garbage, as reused memory does
        self.side_item_delay_s = side_item_delay_s  # wall time each queued side-stream item takes (timing tests)
        self.lock = threading.RLock()
        self.local = threading.local()
        self.default_stream = EmulatedStream(runtime=self, default=True)
        self.streams: list[EmulatedStream] = [self.default_stream]
        self.timed_events: list[EmulatedEvent] = []
        self.syncs: list[SyncSite] = []
        self.fail_host_register = 0  # the next N cudaHostRegister calls fail, with host_register_error
        self.host_register_error = CUDA_ERROR_MEMORY_ALLOCATION
        self.properties = _DeviceProperties(total_memory=memory_bytes)
        self.cudart = EmulatedCudart(self)
        self._pinned: list[tuple[int, int, Any]] = []  # (start, end, StorageWeakRef or None for registered)
        self.source_checks: list[tuple[EmulatedStream, int, torch.Tensor, torch.Tensor, str]] = []
        # bytes copied, by (direction "h2d"/"d2h", stream "default"/"side", dtype): methods' counters are checked on it
        self.transfers: Counter[tuple[str, str, torch.dtype]] = Counter()
        self.capture: Capture | None = None  # the CUDA graph capture underway (one at a time, as torch allows)
        self.graph_stream: EmulatedStream | None = None  # `torch.cuda.graph`'s own capture stream
        # the caching allocator's pools that captures record to (torch's `captures_underway`): capture_begin adds
        # its pool, only a successful capture_end removes it (graphs.end_allocate_to_pool)
        self.pools_recording: list[tuple[int, int]] = []
        self.staged_copies: Counter[tuple[str, str]] = Counter()  # through a pageable buffer: see `_staged`
        self.triton_launches: Counter[str] = Counter()  # Triton kernels run in triton's interpreter, by name

    # -- threads
    def current_stream(self) -> EmulatedStream:
        return getattr(self.local, "stream", None) or self.default_stream

    @property
    def executing(self) -> bool:
        return getattr(self.local, "executing", False)

    @contextlib.contextmanager
    def detect_syncs(self) -> Iterator[list[SyncSite]]:
        """Record every host-device sync this thread causes inside the block (returns the list)."""
        found: list[SyncSite] = []
        previous = getattr(self.local, "armed", None)
        self.local.armed = found
        try:
            yield found
        finally:
            self.local.armed = previous
            self.syncs.extend(found)

    def record_sync(self, kind: str, stream: EmulatedStream | None = None) -> None:
        """Note a host-device sync (`stream`: the one it waits on, the current one by default)."""
        self.check_capture_sync(kind, stream)
        armed = getattr(self.local, "armed", None)
        if armed is None or self.executing:
            return
        armed.append(call_site(kind))

    def capturing(self, stream: EmulatedStream) -> Capture | None:
        """The capture that device work issued to `stream` now goes into, or None (the work runs as usual). The
        capturing thread's work on a stream outside the capture is refused: CUDA would run it once, now, and
        never on a replay."""
        capture = self.capture
        if capture is None or self.executing:
            return None
        if stream in capture.clocks:
            return capture
        if threading.get_ident() == capture.thread:
            capture.fail(f"{NOT_PERMITTED} (emulated CUDA: device work on a stream that is not part of the "
                         f"capture, {call_site('').where()}; fork it from the capture by waiting on an event "
                         "recorded in it, and join it back before the capture ends)")
        return None

    def check_capture_sync(self, kind: str, stream: EmulatedStream | None = None) -> None:
        """A host-device sync or an event or stream query while a capture is underway fails as CUDA fails it:
        always when it waits on a capturing stream (`stream`, the current one by default: a host read copies on
        it); otherwise it is "potentially unsafe", refused on every thread in the "global" capture mode, on the
        capturing thread in "thread_local", nowhere in "relaxed"."""
        capture = self.capture
        if capture is None or self.executing:
            return
        waits_on_capture = (stream or self.current_stream()) in capture.clocks
        unsafe_here = capture.mode == "global" or (capture.mode == "thread_local" and
                                                   threading.get_ident() == capture.thread)
        if waits_on_capture or unsafe_here:
            capture.refuse(kind)

    def check_last_error(self) -> None:
        """A device operation after a failed CUDA call raises that call's error (torch's launch check)."""
        error = getattr(self.local, "last_error", CUDA_SUCCESS)
        if error != CUDA_SUCCESS:
            self.local.last_error = CUDA_SUCCESS
            raise RuntimeError(f"CUDA error: {CUDA_ERROR_STRINGS.get(error, 'unrecognized error code')} (cudaError "
                               f"{error}, left by an earlier CUDA call and reported by this kernel launch)")

    # -- execution
    def flush(self, stream: EmulatedStream, upto: int) -> None:
        """Run `stream`'s queued items up to position `upto` (and first what each of them waits for). Torch
        function modes are off: the items are device work the host issued earlier (and a mode saw then), not
        calls of the thread that happens to wait for them. So is autograd, which device work knows nothing of: a
        decode step's queued ops, issued under no_grad, may run at a synchronize outside it, where autograd would
        refuse in-place work on the step's views."""
        with self.lock, torch._C.DisableTorchFunction(), torch.no_grad():
            previous = (self.executing, getattr(self.local, "stream", None))
            self.local.executing = True
            try:
                while stream.done < min(upto, stream.tail):
                    item = stream.items[stream.done]
                    for other, position in item.deps:
                        self.flush(other, position)
                    self.local.stream = stream
                    item.run()
                    if self.side_item_delay_s and not stream.is_default:
                        time.sleep(self.side_item_delay_s)
                    stream.done += 1
                    stream.done_time = time.perf_counter()
                    self._passed(stream)
            finally:
                self.local.executing, self.local.stream = previous

    def synchronize(self) -> None:
        self.record_sync("torch.cuda.synchronize()")
        with self.lock:
            for stream in list(self.streams):
                self.flush(stream, stream.tail)

    def _passed(self, stream: EmulatedStream) -> None:
        for event in [e for e in self.timed_events if e.stream is stream and stream.done >= e.position]:
            event.time_s = stream.done_time
            self.timed_events.remove(event)
        checks = [c for c in self.source_checks if c[0] is stream and stream.done >= c[1]]
        for check in checks:
            self.source_checks.remove(check)
            self._verify_source(check)

    def _verify_source(self, check: tuple) -> None:
        _, _, source, snapshot, site = check
        if not torch.equal(source, snapshot):
            raise EmulatedCudaHazard(f"the host changed the pinned source of a host-to-device copy before the copy "
                                     f"was known complete (no wait on an event recorded after it); copy issued {site}")

    # -- pinned memory
    def register_pinned(self, pointer: int, nbytes: int, storage: Any = None) -> None:
        with self.lock:
            self._pinned.append((pointer, pointer + nbytes, StorageWeakRef(storage) if storage is not None else None))

    def unregister_pinned(self, pointer: int) -> None:
        with self.lock:
            self._pinned = [entry for entry in self._pinned if entry[0] != pointer]

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        with self.lock:
            self._pinned = [e for e in self._pinned if e[2] is None or not e[2].expired()]
            return any(lo <= start < hi for lo, hi, _ in self._pinned) and storage.nbytes() > 0

    def pinned_empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        kwargs["device"] = CPU
        tensor = torch.empty(*args, **kwargs)
        storage = tensor.untyped_storage()
        self.register_pinned(storage.data_ptr(), max(storage.nbytes(), 1), storage)
        return tensor

    def pinned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self.pinned_empty(tensor.shape, dtype=tensor.dtype)
        out.copy_(tensor)
        return out

    # -- copies between host and device
    def _staged(self, direction: str, host: torch.Tensor) -> bool:
        """A copy whose host side is not contiguous goes through a fresh pageable buffer and a CPU copy (torch's
        copy_kernel_cuda makes it contiguous first): as slow and as synchronous as pageable memory, pinned or not.
        Counted in `staged_copies` (bytes by direction and source line), armed or not."""
        if host.is_contiguous():
            return False
        with self.lock:
            self.staged_copies[direction, call_site("").where()] += host.numel() * host.element_size()
        return True

    def host_to_device(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """dst (device data) <- src (host): now on the default stream, queued on another one."""
        stream = self.current_stream()
        pinned = not self._staged("h2d", src) and self.is_pinned(src)
        capture = self.capturing(stream)
        if capture is not None:
            if not (non_blocking and pinned):
                capture.refuse("blocking host-to-device copy" if not non_blocking else
                               "non_blocking host-to-device copy from pageable memory")
            capture.record(stream, functools.partial(dst.copy_, src), "h2d", host=src, device=dst)
            return
        self.count_transfer("h2d", stream, src)
        if not non_blocking:
            self.record_sync("blocking host-to-device copy")
        elif not pinned:
            self.record_sync("non_blocking host-to-device copy from pageable memory (synchronous, or unsafe)")
        if stream.is_default or self.executing or not (non_blocking and pinned):
            with self.lock:
                dst.copy_(src)
                if non_blocking and pinned and stream.is_default and not self.executing:
                    self.source_checks.append((stream, stream.tail + 1, src, src.clone(), call_site("").where()))
                    stream.enqueue(lambda: None)  # the point where the copy is known complete
            return
        stream.enqueue(lambda: dst.copy_(src))

    def device_to_host(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """dst (host) <- src (device data): lands when waited on (pinned, non_blocking), else now with a sync."""
        stream = self.current_stream()
        capture = self.capturing(stream)
        if capture is not None:
            if not non_blocking or not self.is_pinned(dst):
                capture.refuse("blocking device-to-host copy" if not non_blocking else
                               "non_blocking device-to-host copy into pageable memory")
            capture.record(stream, functools.partial(dst.copy_, src), "d2h", host=dst, device=src)
            return
        self.count_transfer("d2h", stream, src)
        if self._staged("d2h", dst) or not non_blocking or not self.is_pinned(dst):
            kind = "blocking device-to-host copy" if not non_blocking else \
                "non_blocking device-to-host copy into pageable memory (synchronous)"
            self.record_sync(kind)
            self.flush(stream, stream.tail)
            with self.lock:
                dst.copy_(src)
            return
        if stream.is_default and not self.executing:
            snapshot = src.clone()  # the device has computed src by now; the host sees it only once waited on
            stream.enqueue(lambda: dst.copy_(snapshot))
        else:
            stream.enqueue(lambda: dst.copy_(src))

    def count_transfer(self, direction: str, stream: EmulatedStream, tensor: torch.Tensor) -> None:
        if not self.executing:
            with self.lock:
                self.transfers[direction, "default" if stream.is_default else "side", tensor.dtype] += \
                    tensor.numel() * tensor.element_size()

    def transferred(self, direction: str) -> int:
        """Bytes copied in `direction` ("h2d" or "d2h") since the counters were last cleared."""
        return sum(n for (d, _, _), n in self.transfers.items() if d == direction)

    def run_device(self, fn: Callable[[], Any], inplace: bool) -> Any:
        """A device operation: now on the default stream; queued on another stream (see EmulatedTensor)."""
        self.check_last_error()
        stream = self.current_stream()
        capture = self.capturing(stream)
        if capture is not None:
            capture.record(stream, fn)
            return None
        if stream.is_default or self.executing:
            with self.lock:
                return fn()
        if inplace:
            stream.enqueue(fn)
            return None
        raise AssertionError("non-inplace side-stream work goes through EmulatedTensor")
