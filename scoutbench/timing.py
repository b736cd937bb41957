"""Per-stage decode timers with one API: CUDA events on a GPU, perf_counter on a CPU.

Stages are leaves (`qkv_proj`, `predict`, `attn_device`, `idle`, `merge`, `o_proj`, `mlp`); `other` is the part
of a step no stage covers (embedding, norms, lm_head, sampling, Python overhead). On CUDA, `idle` is measured
on the stream: events around a host wait capture exactly the time the GPU had nothing queued; the step's end
waits for the copy streams too.

The host side of a step is measured too. `TorchCallCounter` counts the torch calls a thread issues (metadata reads
such as `size()` excluded): on a GPU each costs 5-20 us of host time, so a step of thousands of calls is
launch-bound and ranks methods by their call counts. On CUDA each step also records `host_issue` (ms from the step's
start to its last launch, before the final synchronisation, less the host's waits on CPU work or transfers) and
`host_wait`, so a step whose host issue time nearly fills it is flagged as launch-bound (`LAUNCH_BOUND_FRAC`).

Stages can also be annotated for profilers: `annotate` wraps each in a `torch.profiler.record_function` (what
`throughput --profile` turns on, so the trace shows the stages), and `nvtx` on CUDA pushes an NVTX range per stage
(what Nsight Systems shows). Both are off by default: they cost a little per stage and would perturb timed steps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from scoutbench.kernels.backends import USAGE as attention_backends
from scoutbench.runtime.offload import join_copy_streams

STAGES = ("qkv_proj", "predict", "attn_device", "idle", "merge", "o_proj", "mlp", "other")
# the stages in which the host waits for work it does not issue (the CPU worker, a transfer): not issue time
HOST_WAIT_STAGES = frozenset({"idle"})
# a CUDA step whose host issue time is at least this share of the step is launch-bound: the device waited for the
# host's launches, so the step measures the Python and dispatch cost of the implementation, not the method
LAUNCH_BOUND_FRAC = 0.9

# reads of a tensor's metadata: no dispatcher work and no launch on any device, so not counted as calls
METADATA_CALLS = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.itemsize.__get__,
    torch.Tensor.nbytes.__get__, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.storage_offset, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_cpu.__get__, torch.Tensor._base.__get__, torch.Tensor.is_nested.__get__,
    torch.Tensor.grad.__get__, torch.Tensor.is_mkldnn.__get__})


# what the counter also leaves out: reads of a tensor's address, layout and pinning, which launch nothing (the
# compiled CPU kernels read pointers for every argument)
UNCOUNTED_CALLS = METADATA_CALLS | {torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.is_pinned}


class TorchCallCounter(TorchFunctionMode):
    """Counts the torch calls issued by the thread that enters it (a torch function mode is thread-local: the
    CPU worker's calls are not the decode loop's), metadata reads excluded (`UNCOUNTED_CALLS`). Only the outermost call counts: what a
    torch function calls inside itself runs with the mode off. The mode adds Python work to every call, so
    counted steps are never timed ones (bench/throughput.py counts extra steps after the timed ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in UNCOUNTED_CALLS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class StageTimer:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.use_cuda = self.device.type == "cuda"
        self.steps: list[dict[str, float]] = []
        # (stage, start, end, sign): a stage nested in another is subtracted from the enclosing one (sign -1), so
        # e.g. a host wait timed as `idle` inside `predict` is not counted twice
        self._open: list[tuple[str, object, object, float]] = []
        self._stack: list[str] = []
        self._step_start: object = None
        self._host_start = 0.0
        self._host_wait_s = 0.0
        # CUDA: timing events reused from step to step (a fresh event per stage costs a call and an allocation)
        self._events: list[Any] = []
        self._next_event = 0
        self.enabled = True
        # while a step is captured for CUDA graphs (graphs.GraphRunner): stage boundaries end pieces, nothing is timed
        self.recorder: Any = None
        self.annotate = False  # torch.profiler.record_function per stage
        self.nvtx = False  # NVTX range per stage (CUDA)

    def _mark(self) -> object:
        if self.use_cuda:
            if self._next_event == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            event = self._events[self._next_event]
            self._next_event += 1
            event.record()
            return event
        return time.perf_counter()

    def _elapsed_ms(self, start: object, end: object) -> float:
        if self.use_cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name`. A stage inside the same stage is the enclosing one (nothing more is
        marked, no capture piece ends): the engine books every method's `decode` as `attn_device`, so a method
        that times its own device work there costs nothing extra, and one that forgets is still booked right.
        The attention calls of the block are booked under the stage too (`backends.USAGE`)."""
        if self._stack and self._stack[-1] == name:
            yield
            return
        previous = attention_backends.enter_stage(name)
        try:
            yield from self._stage(name)
        finally:
            attention_backends.exit_stage(previous)

    def _stage(self, name: str) -> Iterator[None]:
        if self.recorder is not None:
            self._stack.append(name)
            self.recorder.enter_stage(name)
            try:
                yield
            finally:
                self.recorder.exit_stage(name)
                self._stack.pop()
            return
        if not self.enabled:
            yield
            return
        if self.annotate or self.nvtx:
            with self._annotated(name):
                yield from self._timed(name)
            return
        yield from self._timed(name)

    @contextmanager
    def _annotated(self, name: str) -> Iterator[None]:
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            if self.annotate:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def _timed(self, name: str) -> Iterator[None]:
        start = self._mark()
        host_start = time.perf_counter() if self.use_cuda and name in HOST_WAIT_STAGES else None
        parent = self._stack[-1] if self._stack else None
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()
            if host_start is not None:
                self._host_wait_s += time.perf_counter() - host_start
            end = self._mark()
            self._open.append((name, start, end, 1.0))
            if parent is not None:
                self._open.append((parent, start, end, -1.0))

    @contextmanager
    def piece(self, name: str | None) -> Iterator[None]:
        """A replayed CUDA graph piece, timed as the stage `name` it was captured in (None: `other`)."""
        if name is None or not self.enabled:
            yield
            return
        start = self._mark()
        yield
        self._open.append((name, start, self._mark(), 1.0))

    def begin_step(self) -> None:
        self._open.clear()
        self._next_event = 0
        self._host_wait_s = 0.0
        self._host_start = time.perf_counter()
        self._step_start = self._mark()

    def end_step(self) -> dict[str, float]:
        """Close a step (synchronising the GPU once) and return ms per stage, plus `total`; on CUDA also
        `host_issue` and `host_wait` (module docstring).

        On CUDA the end event is recorded after the compute stream has waited for every copy stream: a step ends
        when all its work has, not when its last kernel was queued (a recall's copies would otherwise run after
        the end event and the step look faster than it is)."""
        host_ms = (time.perf_counter() - self._host_start) * 1e3
        if self.use_cuda:
            join_copy_streams(self.device)
        end = self._mark()
        if self.use_cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for name, start, stop, sign in self._open:
            totals[name] += sign * self._elapsed_ms(start, stop)
        step_ms = self._elapsed_ms(self._step_start, end)
        record = {stage: totals.get(stage, 0.0) for stage in STAGES if stage != "other"}
        record["other"] = max(0.0, step_ms - sum(record.values()))
        record["total"] = step_ms
        if self.use_cuda:
            record["host_wait"] = self._host_wait_s * 1e3
            record["host_issue"] = max(0.0, host_ms - record["host_wait"])
        self._open.clear()
        return record
