"""Piecewise CUDA graphs of a decode step: its device work captured once and replayed, its host work run between.

Why: on a GPU each eager torch call costs 5-20 us of host time, so a decode step of hundreds of calls per layer is
launch-bound and ranks methods by their call counts; serving engines (vLLM, SGLang, in which the ScoutAttention
paper's implementation runs) decode from CUDA graphs. An offloading method cannot be one graph: the host hands work
to the CPU worker, waits for it and issues recalls in the middle of a layer. So the step is captured piecewise,
as vLLM's piecewise mode splits at attention: a piece ends at every host point (`MethodContext.host`) and at every
stage boundary of the stage timer (so that the per-stage breakdown stays measured: each replayed piece is timed as
its stage), and a step is the replay of its schedule, pieces and host points in capture order.

What a piece may do is what the method contract says (methods/base.py, "CUDA graphs"): read only device tensors
that every step writes in place (tokens, positions, the method's per-step metadata written by `begin_step`), with
no host read and no Python value that changes per step. tests/emulation/test_graphs.py replays every method under emulated
CUDA (scoutbench/testing/emulated_cuda, whose capture records device work without running it, as a GPU does) against
its eager logits, and a planted Python scalar makes it fail.

A step's variant is its method's `graph_key()`: the first step of a key runs eagerly on the stream that will
capture it (it warms up what capture must not do: allocator pools, library handles, kernel compilation; torch's
docs warm up on the capture stream, whose cached blocks the capture can then reuse), the second captures and
replays, every later one replays. A capture that fails leaves the run eager and says why (`failure`), and the
result records it. A capture interrupted by anything (a phase's time limit, Ctrl-C) or failing is ended before the
error goes on, with the caching allocator's record of it (`end_pool_recording`): the next run in the process (the
GPU check's next method) starts with no capture open and no allocator state left behind.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from scoutbench.kernels.backends import USAGE as attention_backends
from scoutbench.timing import TorchCallCounter

MAX_VARIANTS = 8  # captured variants per run; a method whose keys keep changing runs its further ones eagerly


@dataclass
class _Piece:
    """One captured graph and the stage its device work is timed as (None: outside every stage, `other`)."""

    graph: Any
    stage: str | None


@dataclass
class _HostPoint:
    """Host work between pieces, and the stages it ran in at capture (it is timed in them at every replay)."""

    fn: Callable[..., None]
    args: tuple
    stages: tuple[str, ...]


@dataclass
class _Schedule:
    items: list[_Piece | _HostPoint] = field(default_factory=list)
    logits: torch.Tensor | None = None
    # the attention backends the captured pieces call (`backends.USAGE`): its bookkeeping is Python, which a replay
    # does not run, so each replay adds what the capture recorded
    backend_calls: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, device:backend)

    @property
    def pieces(self) -> int:
        return sum(isinstance(item, _Piece) for item in self.items)


class GraphRunner:
    """Runs an engine's decode steps (`engine.forward_step`) as replays of their captured schedules."""

    def __init__(self, engine: Any, batch: int):
        self.engine = engine
        self.timer = engine.timer
        self.tokens = torch.zeros(batch, dtype=torch.long, device=engine.device)  # the steps' static input
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every piece: they replay in order
        self.stream = torch.cuda.Stream(engine.device)  # capture on a side stream, as torch.cuda.graph does
        self.schedules: dict[Any, _Schedule] = {}
        self.seen: set[Any] = set()
        self.capturing = False
        self.failure: str | None = None  # why the run fell back to eager
        self.replayed_steps = 0
        self.replayed_pieces = 0  # graph launches: a host cost of their own (what `count_calls` adds to the calls)
        self.eager_steps = 0
        self._schedule: _Schedule | None = None
        self._graph: Any = None
        self._stages: list[str] = []
        self._calls = TorchCallCounter()  # at capture: a piece with no torch call is empty and is not kept
        self._calls_at_begin = 0

    # ------------------------------------------------------------------ a step
    def step(self, tokens: torch.Tensor, key: Any) -> torch.Tensor:
        """Logits `[B, vocab]` of the step for `tokens` `[B]`: replayed, captured and replayed, or eager."""
        self.tokens.copy_(tokens)
        schedule = self.schedules.get(key)
        if schedule is None and self.failure is None and key in self.seen and len(self.schedules) < MAX_VARIANTS:
            schedule = self._capture(key)
        if schedule is None:
            warm_up = self.failure is None and key not in self.seen and len(self.schedules) < MAX_VARIANTS
            self.seen.add(key)
            self.eager_steps += 1
            return self._warm_up() if warm_up else self.engine.forward_step(self.tokens)
        self.replayed_steps += 1
        self.replayed_pieces += schedule.pieces
        attention_backends.add_counts(schedule.backend_calls)
        return self._replay(schedule)

    def _warm_up(self) -> torch.Tensor:
        """An eager step on the capture stream (torch.cuda.graph's rule: warm up on the stream that captures), in
        order with the current stream's work on both sides."""
        current = torch.cuda.current_stream(self.engine.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            logits = self.engine.forward_step(self.tokens)
        current.wait_stream(self.stream)
        return logits

    def _replay(self, schedule: _Schedule) -> torch.Tensor:
        timer = self.timer
        for item in schedule.items:
            if isinstance(item, _Piece):
                with timer.piece(item.stage):
                    item.graph.replay()
            else:
                with contextlib.ExitStack() as stages:
                    for name in item.stages:
                        stages.enter_context(timer.stage(name))
                    item.fn(*item.args)
        return schedule.logits

    # ------------------------------------------------------------------ capture
    def _capture(self, key: Any) -> _Schedule | None:
        """Capture the step's schedule (nothing runs: a capture records), or None with `failure` set."""
        schedule = _Schedule()
        self._schedule, self._stages = schedule, []
        self.capturing = True
        self.timer.recorder = self
        self.stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        backends_before = attention_backends.records()
        try:
            with self._calls, torch.cuda.stream(self.stream):  # the capturing stream is current throughout
                self._begin_piece()
                schedule.logits = self.engine.forward_step(self.tokens)
                self._end_piece()
        except BaseException as exc:  # noqa: BLE001 - any capture error: this run decodes eagerly, and says why
            self._abandon()
            if not isinstance(exc, Exception):  # an interrupt (a phase's limit, Ctrl-C): ended, and it goes on
                raise
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(f"scoutbench: warning: CUDA graph capture failed ({self.failure}); decoding eagerly",
                  file=sys.stderr)
            return None
        finally:
            self.capturing = False
            self.timer.recorder = None
            self._schedule = None
        after = attention_backends.records()
        schedule.backend_calls = {name: n - backends_before.get(name, 0) for name, n in after.items()
                                  if n > backends_before.get(name, 0)}
        attention_backends.reset()  # nothing ran at capture: the replay that follows adds these calls
        attention_backends.add_counts(backends_before)
        self.schedules[key] = schedule
        return schedule

    def _begin_piece(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: the CPU worker threads go on synchronising with events of their own (a recall's staging)
        # while the main thread captures; CUDA's default, global, would invalidate the capture for it
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._calls_at_begin = self._calls.calls

    def _end_piece(self) -> None:
        graph, self._graph = self._graph, None
        with warnings.catch_warnings():  # a piece with no device work is dropped below, not an error
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            graph.capture_end()
        if self._calls.calls > self._calls_at_begin:
            self._schedule.items.append(_Piece(graph, self._stages[-1] if self._stages else None))

    def _abandon(self) -> None:
        """End a capture that raised, so that the stream leaves capture mode and the allocator its capture state;
        raise if either is still capturing (the process could not run another method on the device)."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            with contextlib.suppress(Exception), torch.cuda.stream(self.stream), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")  # interrupted before any work
                graph.capture_end()
        end_pool_recording(self.engine.device, self.pool)
        with torch.cuda.stream(self.stream):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("CUDA graph capture: the capture stream is still capturing after its capture was "
                                   "ended; this process cannot run further device work (start a new process)")

    # what the timer and the method call while a step is captured
    def enter_stage(self, name: str) -> None:
        self._end_piece()
        self._stages.append(name)
        self._begin_piece()

    def exit_stage(self, name: str) -> None:
        self._end_piece()
        self._stages.pop()
        self._begin_piece()

    def host(self, fn: Callable[..., None], args: tuple) -> None:
        self._end_piece()
        self._schedule.items.append(_HostPoint(fn, args, tuple(self._stages)))
        self._begin_piece()

    # ------------------------------------------------------------------ the result's record
    def describe(self) -> dict[str, Any]:
        """`cuda_graphs` of a throughput result: whether steps replayed, their pieces and host points, why not."""
        pieces = [s.pieces for s in self.schedules.values()]
        hosts = [len(s.items) - s.pieces for s in self.schedules.values()]
        return {"enabled": True, "captured": bool(self.schedules) and self.failure is None,
                "variants": len(self.schedules), "pieces_per_step": max(pieces) if pieces else None,
                "host_points_per_step": max(hosts) if hosts else None, "replayed_steps": self.replayed_steps,
                "eager_steps": self.eager_steps, "failure": self.failure}


def end_pool_recording(device: torch.device, pool: Any) -> int:
    """End the caching allocator's capture state for `pool` that a failed capture left; returns how many it ended.

    torch's `CUDAGraph::capture_end` tells the allocator that the capture ended (`endAllocateToPool`) only after
    `cudaStreamEndCapture` succeeded: a capture that an error invalidated leaves the allocator recording to the
    pool, so frees wait for a capture that never ends and `empty_cache()` asserts (`captures_underway.empty()`),
    for every later method of the process. Each capture_begin on `pool` adds one record, a successful capture_end
    removes it, so what is left belongs to failed captures: each is ended, and its hold on the pool released (the
    graph never releases it: its reset only releases a pool whose capture ended). The allocator refuses to end a
    pool it does not record to (a RuntimeError): that is the check that nothing is left.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    ended = 0
    while True:
        try:
            torch.cuda.memory._cuda_endAllocateToPool(index, pool)
        except RuntimeError:
            return ended  # "not currently recording to mempool_id": none left
        torch.cuda.memory._cuda_releasePool(index, pool)
        ended += 1
