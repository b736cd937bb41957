"""A CUDA graph capture underway: the device operations it recorded, each capturing stream's vector clock,
and the events recorded inside it. CUDA's messages are its own (cudaGetErrorString), so that code written
against a GPU matches the same text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from scoutbench.testing.emulated_cuda.state import call_site, require_active

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.graphs import EmulatedCUDAGraph
    from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime
    from scoutbench.testing.emulated_cuda.streams import EmulatedEvent, EmulatedStream


NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
UNJOINED = "CUDA error: capture sequence contains a fork that was not joined to the primary stream"
_ISOLATION = "CUDA error: dependency created on uncaptured work in another stream"
_IMPLICIT = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
_CAPTURED_EVENT = "CUDA error: operation not permitted on an event last recorded in a capturing stream"


@dataclass
class GraphOp:
    """One recorded device operation; `run` re-dispatches it on the tensors recorded at capture. A copy between
    host and device memory also names its direction and both sides: a replay counts its bytes, delivers a
    device-to-host copy when waited on, and checks the pinned source of a host-to-device copy."""

    run: Callable[[], Any]
    copy: str | None = None  # "h2d" or "d2h"
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None


@dataclass
class CapturedEvent:
    """Where an event recorded inside a capture stands: the streams' captured work it covers (a vector clock)."""

    capture: Capture
    clock: dict[EmulatedStream, int]


class Capture:
    """A capture underway. Each stream in it keeps a vector clock (how much of each captured stream's work it
    depends on); a stream joins the capture by waiting on an event recorded in it, and the capture ends cleanly
    only if its origin stream depends on all the work of every stream that joined (else CUDA's unjoined error)."""

    def __init__(self, graph: EmulatedCUDAGraph, stream: EmulatedStream, mode: str):
        self.graph = graph
        self.origin = stream
        self.mode = mode
        self.thread = threading.get_ident()
        self.ops: list[GraphOp] = []
        self.clocks: dict[EmulatedStream, dict[EmulatedStream, int]] = {stream: {stream: 0}}
        self.error: str | None = None  # the first error: it invalidates the capture

    def record(self, stream: EmulatedStream, run: Callable[[], Any], copy: str | None = None, *,
               host: torch.Tensor | None = None, device: torch.Tensor | None = None) -> None:
        self.ops.append(GraphOp(run, copy, host, device))
        self.tick(stream)

    def tick(self, stream: EmulatedStream) -> None:
        self.clocks[stream][stream] += 1

    def fail(self, message: str) -> NoReturn:
        self.error = self.error or message
        raise RuntimeError(message)

    def refuse(self, kind: str) -> NoReturn:
        """A host-device sync: CUDA cannot capture it."""
        self.fail(f"{NOT_PERMITTED} (emulated CUDA: {kind} {call_site('').where()} while a CUDA graph capture is "
                  "underway; a captured piece reads nothing back to the host)")

    def unjoined(self) -> list[EmulatedStream]:
        origin = self.clocks[self.origin]
        return [s for s, clock in self.clocks.items() if s is not self.origin and origin.get(s, 0) < clock[s]]


def capture_record(runtime: EmulatedRuntime, stream: EmulatedStream) -> CapturedEvent | None:
    """An event recorded on a capturing stream marks a point of the capture (it records no time)."""
    capture = runtime.capture
    if capture is None or runtime.executing or stream not in capture.clocks:
        return None
    return CapturedEvent(capture, dict(capture.clocks[stream]))


def capture_wait(runtime: EmulatedRuntime, stream: EmulatedStream, event: EmulatedEvent) -> bool:
    """`stream.wait_event(event)` while a capture is underway; True when handled here. Waiting on an event of the
    capture forks `stream` into it (or joins it back); a capturing stream must not wait on outside work."""
    capture = None if runtime.executing else runtime.capture
    captured = event.captured
    if captured is not None:
        if captured.capture is not capture:
            raise RuntimeError(f"{_CAPTURED_EVENT} (emulated CUDA: a wait {call_site('').where()} on an event "
                               "recorded inside a CUDA graph capture that has ended; a replay does not record it)")
        if stream.is_default:
            capture.fail(f"{_IMPLICIT} (emulated CUDA: the default stream waited {call_site('').where()} on an "
                         "event recorded in the capture; fork a side stream instead)")
        clock = capture.clocks.setdefault(stream, {stream: 0})
        for other, position in captured.clock.items():
            clock[other] = max(clock.get(other, 0), position)
        capture.tick(stream)
        return True
    if capture is not None and stream in capture.clocks and event.stream is not None:
        capture.fail(f"{_ISOLATION} (emulated CUDA: a capturing stream waited on an event recorded outside the "
                     f"capture, {call_site('').where()}; wait before the capture, or before each replay)")
    return False


def refuse_captured_event(event: EmulatedEvent, what: str) -> None:
    if event.captured is not None:
        message = (f"{_CAPTURED_EVENT} (emulated CUDA: {what} {call_site('').where()} of an event recorded inside "
                   "a CUDA graph capture; a replay does not record it: record it outside the captured piece)")
        if event.captured.capture is require_active().capture:
            event.captured.capture.fail(message)
        raise RuntimeError(message)
