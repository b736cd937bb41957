"""Per-stage decode timers with one API: CUDA events on a GPU, perf_counter on a CPU.

Stages are leaves (`qkv_proj`, `predict`, `attn_device`, `idle`, `merge`, `o_proj`, `mlp`); `other` is the part
of a step no stage covers (embedding, norms, lm_head, sampling, Python overhead). On CUDA, `idle` is measured
on the stream: events around a host wait capture exactly the time the GPU had nothing queued; the step's end
waits for the copy streams too.

Stages can also be annotated for profilers: `annotate` wraps each in a `torch.profiler.record_function` (what
`throughput --profile` turns on, so the trace shows the stages), and `nvtx` on CUDA pushes an NVTX range per stage
(what Nsight Systems shows). Both are off by default: they cost a little per stage and would perturb timed steps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from scoutbench.kernels.offload import join_copy_streams

STAGES = ("qkv_proj", "predict", "attn_device", "idle", "merge", "o_proj", "mlp", "other")


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
        self.enabled = True
        self.annotate = False  # torch.profiler.record_function per stage
        self.nvtx = False  # NVTX range per stage (CUDA)

    def _mark(self) -> object:
        if self.use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed_ms(self, start: object, end: object) -> float:
        if self.use_cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
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
        parent = self._stack[-1] if self._stack else None
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()
            end = self._mark()
            self._open.append((name, start, end, 1.0))
            if parent is not None:
                self._open.append((parent, start, end, -1.0))

    def begin_step(self) -> None:
        self._open.clear()
        self._step_start = self._mark()

    def end_step(self) -> dict[str, float]:
        """Close a step (synchronising the GPU once) and return ms per stage, plus `total`.

        On CUDA the end event is recorded after the compute stream has waited for every copy stream: a step ends
        when all its work has, not when its last kernel was queued (a recall's copies would otherwise run after
        the end event and the step look faster than it is)."""
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
        self._open.clear()
        return record
