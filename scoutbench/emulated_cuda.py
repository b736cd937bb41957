"""Emulated CUDA on a CPU: scoutbench's CUDA-only code paths run, unchanged, on CPU tensors that say `cuda:0`.

Why: a GPU is lent rarely and briefly, so the CUDA branches (pinned staging, `non_blocking` copies, copy streams
and their events, event-gated slot readiness, the flashinfer adapter) must be proven on a CPU first. Enable it
with `with emulated_cuda() as cuda:` (tests) or `SCOUTBENCH_EMULATE_CUDA=1` (the CLI, `scripts/gpu_check.sh`'s dry
run). It is adversarial where real hardware is lucky:

- Device memory is an `EmulatedTensor`: `.device` is `cuda:0`, the data a CPU tensor. Every torch call on it runs
  on the CPU data (`__torch_function__`), so HF modules, methods and kernels run as they are; mixing it with a
  CPU tensor of one or more dimensions raises as CUDA does.
- Host memory is plain CPU memory; it is pinned when made by `pin_memory` / `torch.empty(..., pin_memory=True)` or
  registered with `cudart().cudaHostRegister` (a registry of address ranges answers `is_pinned()`).
- The default stream runs device work at once (the device is never behind the host); every other stream queues its
  work, which runs only when someone waits for it (an event or stream wait, a synchronize), in stream order and
  after whatever it waited on (`lazy=True`). So a missing wait reads stale data, never a lucky finished copy.
- A device-to-host copy into pinned memory lands only when it is waited on; a host-to-device copy from pinned memory
  reads its source at once, and that source must not change before the copy is known complete (else
  `EmulatedCudaHazard`: the host overwrote a buffer a queued copy still reads). A copy from or to a non-contiguous
  host view is staged through pageable memory, as torch does, pinned or not (`staged_copies`).
- Host-device synchronisations (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, a blocking or pageable copy,
  `torch.tensor(data, device=cuda)`, indexing with host or boolean indices, `nonzero`, a host wait on an event or
  stream) on a thread inside `detect_syncs()` are recorded with the source line that caused them.
- `cudart()` (the functions torch binds) keeps CUDA's per-thread last error: a failed call (see
  `fail_host_register` and `host_register_error`) leaves it set and the next device operation raises it, as
  torch's kernel-launch check does (which also clears it).
- CUDA graphs (`torch.cuda.CUDAGraph`, `torch.cuda.graph`, `graph_pool_handle`, `is_current_stream_capturing`):
  capture records and does not run, as on a GPU. Each device operation issued on a capturing stream is recorded
  with its device tensors by identity and its Python scalars (and host scalar tensors) by value; its outputs are
  allocated from meta shapes and poisoned, views are made at once, in-place and `out=` operations, factories and
  pinned copies either way are recorded. A replay re-runs the recorded operations in order on the same tensors,
  writing each one's outputs into the tensors capture returned, without the Python that issued them, so a baked
  Python value, a fresh allocation filled from one, or an input not copied into its static buffer makes replayed
  results differ from eager ones. A replay is device work on the current stream (at once on the default stream,
  queued on another) and one launch: torch function modes do not see its operations. What CUDA refuses in a
  capture raises its error: host reads and syncs (by capture mode, as CUDA: see `check_capture_sync`), a wait on
  work outside the capture, device work on a stream outside it, a fork not joined back by the capture's end, a
  capture on the default stream, a random op with an explicit generator; waits, queries and timing of an event
  recorded in a capture fail afterwards (a replay does not record it). A kernel reading device memory by address
  (Triton's interpreter) is refused in a capture: it would run at capture only.

What it cannot see is listed in docs/gpu.md ("What emulation cannot catch").
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import linecache
import os
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from scoutbench.timing import METADATA_CALLS

EMULATED_DEVICE = torch.device("cuda", 0)
CPU = torch.device("cpu")
CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_STRINGS = {CUDA_SUCCESS: "no error", 1: "invalid argument", CUDA_ERROR_MEMORY_ALLOCATION: "out of memory",
                      CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                          "part or all of the requested memory range is already mapped",
                      801: "operation not supported"}  # cudaGetErrorString's texts
_OWN_FILES = (__file__, os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "threading.py",
              os.sep + "concurrent" + os.sep, os.sep + "_pytree.py")


class EmulatedCudaHazard(RuntimeError):
    """A data race the emulator proved: the host overwrote memory that a queued copy had not read yet."""


@dataclass
class SyncSite:
    """One host-device synchronisation: what kind, and the first source line outside torch and the emulator."""

    kind: str
    filename: str
    lineno: int
    line: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.filename}:{self.lineno}: {self.line}"


# ---------------------------------------------------------------------------------------------- streams and events
@dataclass
class _Item:
    run: Callable[[], None]
    deps: list[tuple[EmulatedStream, int]]


class EmulatedStream(torch.Stream):
    """A CUDA stream. The default stream executes device work when issued and queues only the deliveries of
    device-to-host copies and the source checks of host-to-device copies; other streams queue everything.
    (A `torch.Stream` subclass, so that `Tensor.record_stream` accepts it.)"""

    def __new__(cls, device: Any = None, priority: int = 0, *, runtime: EmulatedRuntime | None = None,
                default: bool = False) -> EmulatedStream:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, *, runtime: EmulatedRuntime | None = None,
                 default: bool = False):
        """`torch.cuda.Stream(device=None, priority=0)` while emulated (the runtime's default stream otherwise)."""
        runtime = runtime or _active()
        self.runtime = runtime
        self.is_default = default
        self.items: list[_Item] = []
        self.done = 0  # items executed
        self._waits: list[tuple[EmulatedStream, int]] = []  # dependencies of the next item
        self.done_time = time.perf_counter()  # when the last item finished
        if not default:
            with runtime.lock:
                runtime.streams.append(self)

    def enqueue(self, run: Callable[[], None]) -> None:
        with self.runtime.lock:
            self.items.append(_Item(run, self._waits))
            self._waits = []
            if not self.runtime.lazy or self.runtime.executing:
                self.runtime.flush(self, len(self.items))

    @property
    def tail(self) -> int:
        return len(self.items)

    def wait_event(self, event: EmulatedEvent) -> None:
        capturing = event.captured is not None or self.runtime.capture is not None
        if capturing and _capture_wait(self.runtime, self, event):
            return
        if event.stream is None:
            return
        if self.is_default:  # the default stream runs device work now: what it waits for must have run
            self.runtime.flush(event.stream, event.position)
        else:
            self._waits.append((event.stream, event.position))

    def wait_stream(self, stream: EmulatedStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event or EmulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        self.runtime.check_capture_sync("stream.query()", self)
        return self.done >= self.tail

    def synchronize(self) -> None:
        self.runtime.record_sync("stream.synchronize()", self)
        self.runtime.flush(self, self.tail)

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


class EmulatedEvent:
    """A CUDA event: a position in a stream. `query()` is true only once that stream has executed up to it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.stream: EmulatedStream | None = None
        self.position = 0
        self.time_s: float | None = None
        self.captured: _CapturedEvent | None = None  # last recorded inside a graph capture

    def record(self, stream: EmulatedStream | None = None) -> None:
        runtime = _active()
        stream = stream or runtime.current_stream()
        with runtime.lock:
            self.captured = _capture_record(runtime, stream)
            if self.captured is not None:
                self.stream, self.time_s = None, None
                return
            self.stream, self.position = stream, stream.tail
            self.time_s = None
            if stream.is_default or stream.done >= self.position:
                self.time_s = time.perf_counter()  # the default stream's device work has run; an idle stream is here
            else:
                runtime.timed_events.append(self)  # stamped when the stream's queued work reaches it

    def query(self) -> bool:
        runtime = _active()
        runtime.check_capture_sync("event.query()", self.stream or runtime.default_stream)
        _refuse_captured_event(self, "query()")
        return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        runtime = _active()
        runtime.check_capture_sync("event.synchronize()", self.stream or runtime.default_stream)
        _refuse_captured_event(self, "synchronize()")
        if self.stream is None:
            return
        if not self.query():
            runtime.record_sync("event.synchronize()")
        elif not self.stream.is_default:
            runtime.record_sync("event.synchronize()")
        runtime.flush(self.stream, self.position)

    def wait(self, stream: EmulatedStream | None = None) -> None:
        (stream or _active().current_stream()).wait_event(self)

    def elapsed_time(self, end: EmulatedEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        _refuse_captured_event(self, "elapsed_time()")
        _refuse_captured_event(end, "elapsed_time()")
        if self.time_s is None or end.time_s is None:
            raise RuntimeError("CUDA error: device not ready (an event was not recorded or has not completed)")
        return (end.time_s - self.time_s) * 1e3


class _StreamContext:
    def __init__(self, stream: EmulatedStream | None):
        self.stream = stream

    def __enter__(self) -> EmulatedStream | None:
        runtime = _active()
        self._previous = runtime.current_stream()
        if self.stream is not None:
            runtime.local.stream = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        _active().local.stream = self._previous


# ---------------------------------------------------------------------------------------------- cudart
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


# ---------------------------------------------------------------------------------------------- the runtime
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
        self._source_checks: list[tuple[EmulatedStream, int, torch.Tensor, torch.Tensor, str]] = []
        # bytes copied, by (direction "h2d"/"d2h", stream "default"/"side", dtype): methods' counters are checked on it
        self.transfers: Counter[tuple[str, str, torch.dtype]] = Counter()
        self.capture: _Capture | None = None  # the CUDA graph capture underway (one at a time, as torch allows)
        self.graph_stream: EmulatedStream | None = None  # `torch.cuda.graph`'s own capture stream
        self.staged_copies: Counter[tuple[str, str]] = Counter()  # through a pageable buffer: see `_staged`

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
        armed.append(_call_site(kind))

    def capturing(self, stream: EmulatedStream) -> _Capture | None:
        """The capture that device work issued to `stream` now goes into, or None (the work runs as usual). The
        capturing thread's work on a stream outside the capture is refused: CUDA would run it once, now, and
        never on a replay."""
        capture = self.capture
        if capture is None or self.executing:
            return None
        if stream in capture.clocks:
            return capture
        if threading.get_ident() == capture.thread:
            capture.fail(f"{_NOT_PERMITTED} (emulated CUDA: device work on a stream that is not part of the "
                         f"capture, {_call_site('').where()}; fork it from the capture by waiting on an event "
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
        calls of the thread that happens to wait for them."""
        with self.lock, torch._C.DisableTorchFunction():
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
        checks = [c for c in self._source_checks if c[0] is stream and stream.done >= c[1]]
        for check in checks:
            self._source_checks.remove(check)
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
            self.staged_copies[direction, _call_site("").where()] += host.numel() * host.element_size()
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
        self._count("h2d", stream, src)
        if not non_blocking:
            self.record_sync("blocking host-to-device copy")
        elif not pinned:
            self.record_sync("non_blocking host-to-device copy from pageable memory (synchronous, or unsafe)")
        if stream.is_default or self.executing or not (non_blocking and pinned):
            with self.lock:
                dst.copy_(src)
                if non_blocking and pinned and stream.is_default and not self.executing:
                    self._source_checks.append((stream, stream.tail + 1, src, src.clone(), _call_site("").where()))
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
        self._count("d2h", stream, src)
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

    def _count(self, direction: str, stream: EmulatedStream, tensor: torch.Tensor) -> None:
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


_RUNTIME: EmulatedRuntime | None = None


def _active() -> EmulatedRuntime:
    if _RUNTIME is None:
        raise RuntimeError("emulated CUDA is not active")
    return _RUNTIME


def active_runtime() -> EmulatedRuntime | None:
    """The running emulation, or None."""
    return _RUNTIME


class _Site(SyncSite):
    def where(self) -> str:
        return f"at {self.filename}:{self.lineno} ({self.line})"


def _call_site(kind: str) -> _Site:
    """The innermost frame outside torch and the emulator, and outside any torch function mode's handler (a call
    counter pushed above the emulator is not where a call comes from)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.name != "__torch_function__" and not any(part in frame.filename for part in _OWN_FILES):
            line = frame.line or linecache.getline(frame.filename, frame.lineno).strip()
            return _Site(kind, frame.filename, frame.lineno or 0, line)
    return _Site(kind, "?", 0, "")


# ---------------------------------------------------------------------------------------------- device tensors
def tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """`fn` over the leaves of nested tuples, lists and dicts (torch's pytree is several times slower here)."""
    if isinstance(value, (list, tuple)):
        mapped = [tree_map(fn, item) for item in value]
        if type(value) is list:
            return mapped
        return tuple(mapped) if type(value) is tuple else type(value)(mapped)
    if isinstance(value, dict):
        return {key: tree_map(fn, item) for key, item in value.items()}
    return fn(value)


def tree_leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from tree_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tree_leaves(item)
    else:
        yield value


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)  # `.to(0)`, `device=0`: a CUDA ordinal


def _is_host_device(value: Any) -> bool:
    return value is not None and not _is_cuda_device(value) and torch.device(value).type == "cpu"


def _unwrap(value: Any) -> Any:
    if isinstance(value, EmulatedTensor):
        return value._inner
    if isinstance(value, torch.device) and value.type == "cuda":
        return CPU
    return value


_METADATA = METADATA_CALLS
_HOST_READS = {torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.__bool__: "bool(tensor)",
               torch.Tensor.__int__: "int(tensor)", torch.Tensor.__float__: "float(tensor)",
               torch.Tensor.__index__: "tensor used as an index", torch.Tensor.numpy: ".numpy()",
               torch.Tensor.__array__: "numpy conversion", torch.Tensor.__repr__: "repr(tensor)",
               torch.Tensor.__format__: "format(tensor)", torch.Tensor.__str__: "str(tensor)"}
_DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                   torch.unique, torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere,
                   torch.unique_consecutive, torch.Tensor.unique_consecutive}
_SHAPE_CHANGING = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
                   "swapdims_", "swapaxes_"}


class EmulatedTensor(torch.Tensor):
    """A tensor on the emulated `cuda:0`: metadata of its own, data in `_inner` (a CPU tensor)."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmulatedTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=EMULATED_DEVICE, requires_grad=False)
        tensor._inner = inner
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(f"emulated CUDA: {func} reached the dispatcher (call it through torch's Python API)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206, C901
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch._has_compatible_shallow_copy_type:
            return False  # `Module.to("cuda")`: new device parameters, never host storage swapped for device data
        runtime = _active()
        if func in _HOST_READS:
            runtime.record_sync(_HOST_READS[func])
            inner = args[0]._inner
            if func in (torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__):
                return f"{func(inner, *args[1:], **kwargs)} (emulated cuda:0)"
            return func(inner, *[_unwrap(a) for a in args[1:]], **kwargs)
        if func is torch.Tensor.copy_:
            return _copy(runtime, args[0], args[1], bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory,
                    torch.Tensor.is_pinned, torch.Tensor.record_stream, torch.Tensor.data_ptr,
                    torch.Tensor.untyped_storage):
            result = _tensor_method(runtime, func, args, kwargs)
            if result is not NotImplemented:
                return result
        if func in _DATA_DEPENDENT:
            runtime.record_sync(f"{func.__name__} (its output size depends on device data)")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            _index_syncs(runtime, args)
        inner_args = _unwrap_all(args)
        inner_kwargs = {key: _unwrap(value) if not isinstance(value, (list, tuple)) else tree_map(_unwrap, value)
                        for key, value in kwargs.items()} if kwargs else kwargs
        if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            _check_same_device(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _SHAPE_CHANGING:
            raise RuntimeError(f"emulated CUDA: in-place shape change {name} is not emulated")
        if _is_host_device(kwargs.get("device")):  # `t.new_empty(0, device="cpu")` (Triton's interpreter): host
            return func(*inner_args, **inner_kwargs)
        if func in _EMPTY and runtime.poison_empty and not inplace_name(name):
            with runtime.lock:
                return _wrap_result(_poison(func(*inner_args, **inner_kwargs)), args, kwargs)
        inplace = inplace_name(name) or name in _INPLACE_DUNDERS or "out" in kwargs or kwargs.get("inplace") is True
        stream = runtime.current_stream()
        capture = runtime.capturing(stream)
        if capture is not None:
            return _capture_op(capture, stream, func, inplace, args, kwargs)
        if stream.is_default or runtime.executing:
            runtime.check_last_error()
            with runtime.lock:
                result = func(*inner_args, **inner_kwargs)
            return _wrap_result(result, args, kwargs)
        return _side_stream_op(runtime, stream, func, inner_args, inner_kwargs, inplace, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an emulated CUDA tensor cannot be pickled or deep-copied; copy the CPU model instead")


def inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__")


def _inplace_result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What an in-place or `out=` operation returns without running: its `out` (several as torch's named tuple,
    such as `torch.return_types.topk`), else the tensor it modified (`__setitem__`: None)."""
    out = kwargs.get("out")
    if isinstance(out, (tuple, list)):
        return getattr(torch.return_types, getattr(func, "__name__", ""), tuple)(out)
    if out is not None:
        return out
    return None if getattr(func, "__name__", "") == "__setitem__" else args[0]


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _wrap_result(result: Any, args: tuple, kwargs: dict) -> Any:
    """Device tensors for the CPU results of an operation; an in-place operation returns its own argument."""
    if isinstance(result, torch.Tensor):
        for arg in args:
            if isinstance(arg, EmulatedTensor) and arg._inner is result:
                return arg
        return result if isinstance(result, EmulatedTensor) else EmulatedTensor(result)
    if isinstance(result, (list, tuple)):
        return tree_map(lambda value: _wrap_result(value, args, kwargs), result)
    return result


def _unwrap_all(values: Any) -> Any:
    """`_unwrap` over call arguments: one level of tuples/lists covers torch's signatures (cat, indexing)."""
    out = []
    for value in values:
        if isinstance(value, EmulatedTensor):
            out.append(value._inner)
        elif isinstance(value, (list, tuple, dict)):
            out.append(tree_map(_unwrap, value))
        elif isinstance(value, torch.device) and value.type == "cuda":
            out.append(CPU)
        else:
            out.append(value)
    return out


def _check_same_device(func: Any, args: Any, kwargs: Any) -> None:
    """CUDA refuses an operation mixing device tensors with host tensors of one or more dimensions."""
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and not isinstance(item, EmulatedTensor) and item.dim() > 0:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:0 and cpu! (emulated CUDA: {getattr(func, '__name__', func)} got a host "
                                   f"tensor of shape {tuple(item.shape)})")


def _index_syncs(runtime: EmulatedRuntime, args: tuple) -> None:
    """Indexing a device tensor with host index tensors copies them (a sync); boolean masks need `nonzero`."""
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    for entry in index:
        if isinstance(entry, list) and any(isinstance(i, int) for i in tree_leaves(entry)):
            runtime.record_sync("indexing a device tensor with a Python list (blocking copy)")
        for item in tree_leaves(entry):
            if isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.dim() > 0:
                runtime.record_sync("indexing with a boolean mask (nonzero)")
            elif isinstance(item, torch.Tensor) and not isinstance(item, EmulatedTensor) and item.dim() > 0:
                runtime.record_sync("indexing a device tensor with a host index tensor (blocking copy)")
    if len(args) > 2 and isinstance(args[2], torch.Tensor) and not isinstance(args[2], EmulatedTensor) \
            and args[2].dim() > 0:
        runtime.record_sync("assigning a host tensor into a device tensor (blocking copy)")


def _side_stream_op(runtime: EmulatedRuntime, stream: EmulatedStream, func: Any, inner_args: Any,
                    inner_kwargs: Any, inplace: bool, args: tuple, kwargs: dict) -> Any:
    """Work issued on a non-default stream: queued. Its outputs are allocated now from the shapes torch's meta
    kernels give (the inputs may not hold their data yet); views are made now (metadata only)."""
    if inplace:
        stream.enqueue(lambda: func(*inner_args, **inner_kwargs))
        return _inplace_result(func, args, kwargs)
    metas: set[int] = set()

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            metas.add(id(meta))
            return meta
        return torch.device("meta") if isinstance(value, torch.device) else value

    try:
        shapes = func(*tree_map(to_meta, inner_args), **tree_map(to_meta, inner_kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel (or data-dependent): run the stream up to here, then this
        runtime.flush(stream, stream.tail)
        with runtime.lock:
            return _wrap_result(func(*inner_args, **inner_kwargs), args, kwargs)
    outputs = [t for t in tree_leaves(shapes) if isinstance(t, torch.Tensor)]
    if outputs and all(t._base is not None and id(t._base) in metas for t in outputs):
        return _wrap_result(func(*inner_args, **inner_kwargs), args, kwargs)  # views: no data is read
    buffers = tree_map(lambda t: _poison(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
                       if isinstance(t, torch.Tensor) else t, shapes)

    def run() -> None:
        fresh = func(*inner_args, **inner_kwargs)
        for buffer, value in zip(list(tree_leaves(buffers)), list(tree_leaves(fresh)), strict=True):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(value)

    stream.enqueue(run)
    return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, buffers)


def _copy(runtime: EmulatedRuntime, dst: torch.Tensor, src: Any, non_blocking: bool) -> torch.Tensor:
    dst_device, src_device = isinstance(dst, EmulatedTensor), isinstance(src, EmulatedTensor)
    if dst_device and src_device:
        runtime.run_device(lambda: dst._inner.copy_(src._inner), inplace=True)
    elif dst_device:
        src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
        runtime.check_last_error()
        runtime.host_to_device(dst._inner, src, non_blocking)
    else:
        runtime.check_last_error()
        runtime.device_to_host(dst, src._inner, non_blocking)
    return dst


def _tensor_method(runtime: EmulatedRuntime, func: Any, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    if func is torch.Tensor.record_stream:
        return None  # the emulator never reuses memory (see docs/gpu.md: what it cannot catch)
    if func is torch.Tensor.is_pinned:
        return False
    if func is torch.Tensor.pin_memory:
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
    if func in (torch.Tensor.data_ptr, torch.Tensor.untyped_storage):
        capture = runtime.capturing(runtime.current_stream())
        if capture is not None:
            capture.fail(f"emulated CUDA: {func.__name__}() of a device tensor inside a capture, "
                         f"{_call_site('').where()}: a kernel that reads device memory by address (Triton's "
                         "interpreter) would run now, at capture, and no replay would run it; capturing it is not "
                         "emulated (on a GPU the kernel's launch is captured)")
        return func(tensor._inner)
    if func is torch.Tensor.cpu:
        return _to_host(runtime, tensor, non_blocking=False)
    if func is torch.Tensor.cuda:
        return tensor
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device is not None and device.type == "cpu":
        host = _to_host(runtime, tensor, non_blocking)
        return host.to(dtype=dtype) if dtype is not None else host
    return NotImplemented  # a dtype or layout change on the device: an ordinary device operation


def _to_host(runtime: EmulatedRuntime, tensor: EmulatedTensor, non_blocking: bool) -> torch.Tensor:
    """`.cpu()` / `.to("cpu")`: with non_blocking torch returns pinned memory that is valid once waited on."""
    if non_blocking:
        out = runtime.pinned_empty(tensor.shape, dtype=tensor.dtype)
        runtime.device_to_host(out, tensor._inner, True)
        return out
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    runtime.device_to_host(out, tensor._inner, False)
    return out


def to_host_h2d(runtime: EmulatedRuntime, host: torch.Tensor, non_blocking: bool) -> EmulatedTensor:
    """`host.to("cuda")`: a fresh device tensor filled from host memory."""
    runtime.check_last_error()
    out = torch.empty_like(host, device=CPU)
    if runtime.poison_empty:
        _poison(out)
    runtime.host_to_device(out, host, non_blocking)
    return EmulatedTensor(out)


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill fresh `empty` memory the way a reused allocation looks: NaN, a huge negative index, True, 0xA5."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    elif tensor.dtype == torch.uint8:
        tensor.fill_(0xA5)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min // 2)
    return tensor


_EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


# ---------------------------------------------------------------------------------------------- factories (a mode)
_FACTORY_SYNCS = {torch.tensor: "torch.tensor(host data, device=cuda) (a blocking copy)",
                  torch.as_tensor: "torch.as_tensor(host data, device=cuda) (a blocking copy)"}


class _EmulationMode(TorchFunctionMode):
    """Calls without a device tensor among their arguments: factories with `device=cuda`, host tensors moving to
    the device, and pinning. (Thread-local, as torch function modes are: the decode loop's thread has it.)"""

    def __init__(self, runtime: EmulatedRuntime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        runtime = self.runtime
        if types and any(issubclass(t, EmulatedTensor) for t in types):
            return func(*args, **kwargs)  # EmulatedTensor.__torch_function__ handles it
        if func is torch.Tensor.pin_memory:
            return runtime.pinned_like(args[0])
        if func is torch.Tensor.is_pinned:
            return runtime.is_pinned(args[0])
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            if func is torch.Tensor.cuda:
                return to_host_h2d(runtime, args[0], bool(kwargs.get("non_blocking", False)))
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cuda":
                moved = to_host_h2d(runtime, args[0], non_blocking)
                return moved.to(dtype) if dtype is not None else moved
            return func(*args, **kwargs)
        if kwargs.get("pin_memory"):
            if func is torch.empty:
                pinned = runtime.pinned_empty(*args, **kwargs)
                return _poison(pinned) if runtime.poison_empty else pinned
            return runtime.pinned_like(func(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"}))
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            runtime.check_last_error()
            capture = runtime.capturing(runtime.current_stream())
            if capture is not None:
                return _capture_factory(runtime, capture, func, args, kwargs)
            kwargs = {**kwargs, "device": CPU}
            result = func(*args, **kwargs)
            if func in _FACTORY_SYNCS:  # host data copied to the device, synchronously
                runtime.record_sync(_FACTORY_SYNCS[func])
                runtime._count("h2d", runtime.current_stream(), result)
            if func in _EMPTY and runtime.poison_empty:
                _poison(result)
            return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, result)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- CUDA graphs
# CUDA's messages (cudaGetErrorString), so that code written against a GPU matches the same text
_NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"
_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
_UNJOINED = "CUDA error: capture sequence contains a fork that was not joined to the primary stream"
_ISOLATION = "CUDA error: dependency created on uncaptured work in another stream"
_IMPLICIT = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
_CAPTURED_EVENT = "CUDA error: operation not permitted on an event last recorded in a capturing stream"
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_POOL_IDS = itertools.count(1)


@dataclass
class _GraphOp:
    """One recorded device operation; `run` re-dispatches it on the tensors recorded at capture. A copy between
    host and device memory also names its direction and both sides: a replay counts its bytes, delivers a
    device-to-host copy when waited on, and checks the pinned source of a host-to-device copy."""

    run: Callable[[], Any]
    copy: str | None = None  # "h2d" or "d2h"
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None


@dataclass
class _CapturedEvent:
    """Where an event recorded inside a capture stands: the streams' captured work it covers (a vector clock)."""

    capture: _Capture
    clock: dict[EmulatedStream, int]


class _Capture:
    """A capture underway. Each stream in it keeps a vector clock (how much of each captured stream's work it
    depends on); a stream joins the capture by waiting on an event recorded in it, and the capture ends cleanly
    only if its origin stream depends on all the work of every stream that joined (else CUDA's unjoined error)."""

    def __init__(self, graph: EmulatedCUDAGraph, stream: EmulatedStream, mode: str):
        self.graph = graph
        self.origin = stream
        self.mode = mode
        self.thread = threading.get_ident()
        self.ops: list[_GraphOp] = []
        self.clocks: dict[EmulatedStream, dict[EmulatedStream, int]] = {stream: {stream: 0}}
        self.error: str | None = None  # the first error: it invalidates the capture

    def record(self, stream: EmulatedStream, run: Callable[[], Any], copy: str | None = None, *,
               host: torch.Tensor | None = None, device: torch.Tensor | None = None) -> None:
        self.ops.append(_GraphOp(run, copy, host, device))
        self.tick(stream)

    def tick(self, stream: EmulatedStream) -> None:
        self.clocks[stream][stream] += 1

    def fail(self, message: str) -> NoReturn:
        self.error = self.error or message
        raise RuntimeError(message)

    def refuse(self, kind: str) -> NoReturn:
        """A host-device sync: CUDA cannot capture it."""
        self.fail(f"{_NOT_PERMITTED} (emulated CUDA: {kind} {_call_site('').where()} while a CUDA graph capture is "
                  "underway; a captured piece reads nothing back to the host)")

    def unjoined(self) -> list[EmulatedStream]:
        origin = self.clocks[self.origin]
        return [s for s, clock in self.clocks.items() if s is not self.origin and origin.get(s, 0) < clock[s]]


def _capture_record(runtime: EmulatedRuntime, stream: EmulatedStream) -> _CapturedEvent | None:
    """An event recorded on a capturing stream marks a point of the capture (it records no time)."""
    capture = runtime.capture
    if capture is None or runtime.executing or stream not in capture.clocks:
        return None
    return _CapturedEvent(capture, dict(capture.clocks[stream]))


def _capture_wait(runtime: EmulatedRuntime, stream: EmulatedStream, event: EmulatedEvent) -> bool:
    """`stream.wait_event(event)` while a capture is underway; True when handled here. Waiting on an event of the
    capture forks `stream` into it (or joins it back); a capturing stream must not wait on outside work."""
    capture = None if runtime.executing else runtime.capture
    captured = event.captured
    if captured is not None:
        if captured.capture is not capture:
            raise RuntimeError(f"{_CAPTURED_EVENT} (emulated CUDA: a wait {_call_site('').where()} on an event "
                               "recorded inside a CUDA graph capture that has ended; a replay does not record it)")
        if stream.is_default:
            capture.fail(f"{_IMPLICIT} (emulated CUDA: the default stream waited {_call_site('').where()} on an "
                         "event recorded in the capture; fork a side stream instead)")
        clock = capture.clocks.setdefault(stream, {stream: 0})
        for other, position in captured.clock.items():
            clock[other] = max(clock.get(other, 0), position)
        capture.tick(stream)
        return True
    if capture is not None and stream in capture.clocks and event.stream is not None:
        capture.fail(f"{_ISOLATION} (emulated CUDA: a capturing stream waited on an event recorded outside the "
                     f"capture, {_call_site('').where()}; wait before the capture, or before each replay)")
    return False


def _refuse_captured_event(event: EmulatedEvent, what: str) -> None:
    if event.captured is not None:
        message = (f"{_CAPTURED_EVENT} (emulated CUDA: {what} {_call_site('').where()} of an event recorded inside "
                   "a CUDA graph capture; a replay does not record it: record it outside the captured piece)")
        if event.captured.capture is _active().capture:
            event.captured.capture.fail(message)
        raise RuntimeError(message)


def _captured_leaf(value: Any) -> Any:
    """An argument as a recorded operation keeps it: device tensors by identity (their data as it is at each
    replay), host scalar tensors and Python values by their value at capture (a kernel's launch arguments)."""
    if isinstance(value, EmulatedTensor):
        return value._inner
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, torch.device) and value.type == "cuda":
        return CPU
    return value


def _refill(buffers: list[torch.Tensor], func: Any, args: Any, kwargs: dict) -> None:
    """Run a recorded operation and write its outputs into the tensors capture allocated for them."""
    fresh = [value for value in tree_leaves(func(*args, **kwargs)) if isinstance(value, torch.Tensor)]
    for buffer, value in zip(buffers, fresh, strict=True):
        buffer.copy_(value)


def _allocate_outputs(shapes: Any) -> Any:
    """Poisoned CPU tensors shaped as the meta results: what the captured work will write, unwritten yet."""
    return tree_map(lambda t: _poison(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
                    if isinstance(t, torch.Tensor) else t, shapes)


def _record_outputs(capture: _Capture, stream: EmulatedStream, func: Any, args: Any, kwargs: dict,
                    shapes: Any) -> Any:
    buffers = _allocate_outputs(shapes)
    leaves = [b for b in tree_leaves(buffers) if isinstance(b, torch.Tensor)]
    capture.record(stream, functools.partial(_refill, leaves, func, args, kwargs))
    return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, buffers)


def _refuse_generator(capture: _Capture, name: str, kwargs: dict) -> None:
    if kwargs.get("generator") is not None:
        capture.fail(f"{_NOT_PERMITTED} (emulated CUDA: {name} with an explicit generator inside a capture is not "
                     "emulated; use the default generator, whose draws a replay repeats afresh)")


def _capture_op(capture: _Capture, stream: EmulatedStream, func: Any, inplace: bool, args: tuple,
                kwargs: dict) -> Any:
    """A device operation issued on a capturing stream: recorded, not run. Outputs are allocated now from the
    shapes torch's meta kernels give, poisoned; views are made now (metadata only); an operation whose result
    needs device data on the host (no meta result) is refused, as CUDA refuses the sync it would take."""
    name = getattr(func, "__name__", str(func))
    _refuse_generator(capture, name, kwargs)
    call_args, call_kwargs = tree_map(_captured_leaf, args), tree_map(_captured_leaf, kwargs)
    if inplace:
        capture.record(stream, functools.partial(func, *call_args, **call_kwargs))
        return _inplace_result(func, args, kwargs)
    input_storages: set[int] = set()

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            input_storages.add(meta.untyped_storage()._cdata)
            return meta
        return torch.device("meta") if isinstance(value, torch.device) else value

    try:
        shapes = func(*tree_map(to_meta, call_args), **tree_map(to_meta, call_kwargs))
    except Exception as error:  # noqa: BLE001 - no meta result: the result depends on device data
        capture.fail(f"{_NOT_PERMITTED} (emulated CUDA: {name} {_call_site('').where()} needs device data on the "
                     f"host to produce its result: {str(error).splitlines()[0] if str(error) else type(error)})")
    aliases = [t.untyped_storage()._cdata in input_storages for t in tree_leaves(shapes)
               if isinstance(t, torch.Tensor)]
    if all(aliases):  # views of the inputs, the inputs themselves, or metadata: no device work
        return _wrap_result(func(*call_args, **call_kwargs), args, kwargs)
    if any(aliases):
        capture.fail(f"{_NOT_PERMITTED} (emulated CUDA: capturing {name}, which returns views of its inputs "
                     "beside new tensors, is not emulated)")
    return _record_outputs(capture, stream, func, call_args, call_kwargs, shapes)


def _capture_factory(runtime: EmulatedRuntime, capture: _Capture, func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory with `device=cuda` on a capturing stream: its fill is device work, recorded and redone at every
    replay with the values it had at capture; `empty` only allocates; host data copied in is a blocking copy."""
    name = getattr(func, "__name__", str(func))
    if func in _FACTORY_SYNCS:
        capture.refuse(_FACTORY_SYNCS[func])
    _refuse_generator(capture, name, kwargs)
    host_kwargs = {**kwargs, "device": CPU}
    if func in _EMPTY:
        result = func(*args, **host_kwargs)
        return EmulatedTensor(_poison(result) if runtime.poison_empty else result)
    call_args, call_kwargs = tree_map(_captured_leaf, args), tree_map(_captured_leaf, host_kwargs)
    shapes = func(*call_args, **{**call_kwargs, "device": torch.device("meta")})
    return _record_outputs(capture, runtime.current_stream(), func, call_args, call_kwargs, shapes)


class EmulatedCUDAGraph:
    """`torch.cuda.CUDAGraph(keep_graph=False)` while emulated. Capture records the device work issued on the
    capture's streams without running it; `replay()` re-dispatches the recorded operations, in order, on the same
    tensors, without the Python that issued them: values the Python computed at capture stay as they were.
    `num_ops` (operations per replay) and `replays` are the record tests read."""

    def __init__(self, keep_graph: bool = False):
        self.keep_graph = keep_graph
        self.replays = 0
        self._runtime = _active()
        self._ops: list[_GraphOp] | None = None
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
            runtime.capture = _Capture(self, stream, capture_error_mode)

    def capture_end(self) -> None:
        """End the capture. It fails, and ends, if an error invalidated it or a stream that joined it was not
        joined back."""
        runtime = self._runtime
        capture = runtime.capture
        if capture is None or capture.graph is not self:
            raise RuntimeError("emulated CUDA: capture_end() without this graph's capture_begin()")
        if runtime.current_stream() is not capture.origin:
            raise RuntimeError("Capture must end on the same stream it began on.")
        runtime.capture = None
        if capture.error is not None:
            raise RuntimeError(f"{_INVALIDATED} (emulated CUDA: {capture.error})")
        unjoined = capture.unjoined()
        if unjoined:
            raise RuntimeError(f"{_UNJOINED} (emulated CUDA: {len(unjoined)} stream(s) joined the capture and the "
                               "capturing stream did not wait for their last work)")
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
            capture.fail(f"{_NOT_PERMITTED} (emulated CUDA: replaying a graph inside a capture is not emulated)")
        runtime.check_last_error()
        for op in ops:
            if op.copy is not None:
                runtime._count(op.copy, stream, op.device)
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

    def _captured(self, what: str) -> list[_GraphOp]:
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
                site, position = _call_site("").where(), stream.tail + 1
                runtime._source_checks += [(stream, position, src, src.clone(), site) for src in sources]
                stream.enqueue(lambda: None)  # the point where the copies are known complete


class _EmulatedGraphContext:
    """`torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode="global")`: torch's context
    manager, step for step (a synchronize, then the capture on `stream` or on its own side stream). As in torch,
    a capture_end that raises leaves the capture stream current."""

    def __init__(self, cuda_graph: EmulatedCUDAGraph, pool: tuple[int, int] | None = None,
                 stream: EmulatedStream | None = None, capture_error_mode: str = "global",
                 enable_annotations: bool = False, check_input_liveness: bool = False):
        runtime = _active()
        if enable_annotations:
            raise RuntimeError("emulated CUDA: graph annotations need cuda.bindings and are not emulated")
        if stream is None and runtime.graph_stream is None:
            runtime.graph_stream = EmulatedStream(runtime=runtime)
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else runtime.graph_stream
        self.stream_ctx = _StreamContext(self.capture_stream)
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


def _is_current_stream_capturing() -> bool:
    runtime = _active()
    capture = runtime.capture
    return capture is not None and runtime.current_stream() in capture.clocks


def _make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("emulated CUDA does not emulate torch.cuda.make_graphed_callables (autograd through "
                              "graphs); capture with torch.cuda.graph")


class _EmulatedGenerator(torch.Generator):
    """`torch.Generator(device="cuda")` on the emulated device: a CPU generator (random streams differ from CUDA)."""

    def __new__(cls, device: Any = "cpu") -> _EmulatedGenerator:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = "cpu") -> None:
        pass


# ---------------------------------------------------------------------------------------------- activation
def _patches(runtime: EmulatedRuntime) -> dict[tuple[Any, str], Any]:
    cuda = torch.cuda
    mib = 1024**2

    def current_stream(device: Any = None) -> EmulatedStream:
        return runtime.current_stream()

    return {
        (cuda, "is_available"): lambda: True,
        (cuda, "device_count"): lambda: 1,
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): lambda device: None,
        (cuda, "init"): lambda: None,
        (cuda, "is_initialized"): lambda: True,
        (cuda, "Stream"): EmulatedStream,
        (cuda, "Event"): EmulatedEvent,
        (cuda, "current_stream"): current_stream,
        (cuda, "default_stream"): lambda device=None: runtime.default_stream,
        (cuda, "stream"): _StreamContext,
        (cuda, "synchronize"): lambda device=None: runtime.synchronize(),
        (cuda, "cudart"): lambda: runtime.cudart,
        (cuda, "set_sync_debug_mode"): lambda mode: None,
        (cuda, "get_device_properties"): lambda device=None: runtime.properties,
        (cuda, "get_device_name"): lambda device=None: runtime.properties.name,
        (cuda, "get_device_capability"): lambda device=None: (runtime.properties.major, runtime.properties.minor),
        (cuda, "mem_get_info"): lambda device=None: (runtime.properties.total_memory - 256 * mib,
                                                     runtime.properties.total_memory),
        (cuda, "memory_allocated"): lambda device=None: 0,
        (cuda, "memory_reserved"): lambda device=None: 0,
        (cuda, "max_memory_allocated"): lambda device=None: 0,
        (cuda, "reset_peak_memory_stats"): lambda device=None: None,
        (cuda, "empty_cache"): lambda: None,
        (torch, "Generator"): _EmulatedGenerator,
        **{(owner, name): value for owner in (cuda, cuda.graphs) for name, value in (
            ("CUDAGraph", EmulatedCUDAGraph), ("graph", _EmulatedGraphContext), ("graph_pool_handle", graph_pool_handle),
            ("is_current_stream_capturing", _is_current_stream_capturing),
            ("make_graphed_callables", _make_graphed_callables))},
        **({(torch.accelerator, "empty_host_cache"): lambda: None}
           if hasattr(getattr(torch, "accelerator", None), "empty_host_cache") else {}),
        **({(torch._C, "_host_emptyCache"): lambda: None} if hasattr(torch._C, "_host_emptyCache") else {}),
    }


@contextlib.contextmanager
def emulated_cuda(lazy: bool = True, memory_bytes: int = 8 * 1024**3,
                  side_item_delay_s: float = 0.0) -> Iterator[EmulatedRuntime]:
    """Run the block with emulated CUDA (see the module docstring); one emulation at a time."""
    runtime = activate(lazy, memory_bytes, side_item_delay_s)
    try:
        yield runtime
    finally:
        deactivate()


_SAVED: dict[tuple[Any, str], Any] = {}
_MODE: _EmulationMode | None = None


def activate(lazy: bool = True, memory_bytes: int = 8 * 1024**3, side_item_delay_s: float = 0.0) -> EmulatedRuntime:
    """Patch `torch.cuda` and push the emulation's torch function mode on this thread (`deactivate` undoes it)."""
    global _RUNTIME, _MODE
    if _RUNTIME is not None:
        raise RuntimeError("emulated CUDA is already active")
    if torch.cuda.is_available():
        raise RuntimeError("emulated CUDA refuses to run where a real CUDA device is available")
    runtime = EmulatedRuntime(lazy, memory_bytes, side_item_delay_s)
    _clear_device_caches()
    for (owner, name), value in _patches(runtime).items():
        _SAVED[owner, name] = getattr(owner, name)
        setattr(owner, name, value)
    _RUNTIME = runtime
    _MODE = _EmulationMode(runtime)
    _MODE.__enter__()
    return runtime


def _clear_device_caches() -> None:
    """Per-device caches of scoutbench's backends (flashinfer wrappers and workspace) belong to one emulation."""
    from scoutbench.kernels import backends

    for value in vars(backends).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def deactivate() -> None:
    global _RUNTIME, _MODE
    _clear_device_caches()
    gc.collect()  # host arenas that are garbage unregister now, while `cudaHostUnregister` is still emulated
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
    for (owner, name), value in _SAVED.items():
        setattr(owner, name, value)
    _SAVED.clear()
    _RUNTIME, _MODE = None, None


def to_emulated_device(module: torch.nn.Module) -> torch.nn.Module:
    """Move a (CPU) module's parameters and buffers to the emulated device, in place; returns it."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(EmulatedTensor(param.detach().clone()), requires_grad=False)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = EmulatedTensor(buffer.detach().clone())
    return module


def activate_from_environment() -> EmulatedRuntime | None:
    """`SCOUTBENCH_EMULATE_CUDA=1` (the CLI calls this first): the whole process runs on emulated CUDA, with
    `SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES` of device memory (8 GiB)."""
    if os.environ.get("SCOUTBENCH_EMULATE_CUDA") != "1":
        return None
    memory = int(os.environ.get("SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES", str(8 * 1024**3)))
    torch.set_num_threads(1)  # thousands of tiny emulated device ops: a second intra-op thread only adds waits
    return activate(lazy=True, memory_bytes=memory)


__all__ = ["EMULATED_DEVICE", "EmulatedCudaHazard", "EmulatedEvent", "EmulatedRuntime", "EmulatedStream",
           "EmulatedTensor", "SyncSite", "activate", "activate_from_environment", "active_runtime", "deactivate",
           "emulated_cuda", "to_emulated_device"]
