"""Helpers of the emulated CUDA graph tests: capture a piece into a graph, and the error a refused capture
raised first."""

from __future__ import annotations

import pytest
import torch

from scoutbench.decode.graphs import end_pool_recording

NOT_PERMITTED = "operation not permitted when stream is capturing"
INVALIDATED = "operation failed due to a previous error during capture"


def capture(piece, *args, **kwargs):
    """Capture `piece(*args)` into a fresh graph as torch.cuda.graph does; returns (graph, what the piece returned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, **kwargs):
        out = piece(*args)
    return graph, out


def refused(piece, *args, **kwargs) -> RuntimeError:
    """The error a capture of `piece` raised first (torch.cuda.graph's capture_end then reports the capture as
    invalidated, with that error as its context, as CUDA and torch do). As torch's, the caching allocator still
    records to the failed capture's pool afterwards; it is ended here, as a process that goes on must
    (`scoutbench.decode.graphs.end_pool_recording`), so that the test's next capture starts clean."""
    pool = kwargs.setdefault("pool", torch.cuda.graph_pool_handle())
    with pytest.raises(RuntimeError, match=INVALIDATED) as raised:
        capture(piece, *args, **kwargs)
    assert end_pool_recording(torch.device("cuda", 0), pool) == 1
    first = raised.value.__context__
    assert isinstance(first, RuntimeError), raised.value
    return first
