"""Emulated CUDA streams and events. The default stream runs device work at once; every other stream queues
its work until someone waits for it, so a missing wait reads stale data, never a lucky finished copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scoutbench.testing.emulated_cuda.capture import capture_record, capture_wait, refuse_captured_event
from scoutbench.testing.emulated_cuda.state import require_active

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.capture import CapturedEvent
    from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime


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
        runtime = runtime or require_active()
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
        if capturing and capture_wait(self.runtime, self, event):
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
        self.captured: CapturedEvent | None = None  # last recorded inside a graph capture

    def record(self, stream: EmulatedStream | None = None) -> None:
        runtime = require_active()
        stream = stream or runtime.current_stream()
        with runtime.lock:
            self.captured = capture_record(runtime, stream)
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
        runtime = require_active()
        runtime.check_capture_sync("event.query()", self.stream or runtime.default_stream)
        refuse_captured_event(self, "query()")
        return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        runtime = require_active()
        runtime.check_capture_sync("event.synchronize()", self.stream or runtime.default_stream)
        refuse_captured_event(self, "synchronize()")
        if self.stream is None:
            return
        if not self.query():
            runtime.record_sync("event.synchronize()")
        elif not self.stream.is_default:
            runtime.record_sync("event.synchronize()")
        runtime.flush(self.stream, self.position)

    def wait(self, stream: EmulatedStream | None = None) -> None:
        (stream or require_active().current_stream()).wait_event(self)

    def elapsed_time(self, end: EmulatedEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        refuse_captured_event(self, "elapsed_time()")
        refuse_captured_event(end, "elapsed_time()")
        if self.time_s is None or end.time_s is None:
            raise RuntimeError("CUDA error: device not ready (an event was not recorded or has not completed)")
        return (end.time_s - self.time_s) * 1e3


class StreamContext:
    def __init__(self, stream: EmulatedStream | None):
        self.stream = stream

    def __enter__(self) -> EmulatedStream | None:
        runtime = require_active()
        self._previous = runtime.current_stream()
        if self.stream is not None:
            runtime.local.stream = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        require_active().local.stream = self._previous
