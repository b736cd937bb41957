"""Emulated CUDA streams and events inside graph captures (scoutbench/testing/emulated_cuda/streams.py and
capture.py): replays on side streams, fork and join, waits on outside work, events, and the capture modes."""

from __future__ import annotations

import threading

import pytest
import torch
from graph_capture import INVALIDATED, NOT_PERMITTED, capture, refused

from scoutbench.testing.emulated_cuda import emulated_cuda

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present")


@pytest.fixture
def cuda():
    with emulated_cuda() as runtime:
        yield runtime


def test_a_replay_on_a_side_stream_runs_after_what_the_stream_waited_for(cuda):
    """(7) A replay is device work on the current stream: on a side stream it is queued behind the stream's waits
    (a copy on another stream here) and runs when someone waits for it."""
    static_x = torch.zeros(4, device="cuda")
    graph, out = capture(lambda x: x * 2 + 1, static_x)
    copy_stream, replay_stream = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(copy_stream):
        static_x.copy_(torch.arange(4.0).pin_memory(), non_blocking=True)
        copied = copy_stream.record_event()
    replay_stream.wait_event(copied)
    with torch.cuda.stream(replay_stream):
        graph.replay()
        replayed = replay_stream.record_event()
    assert torch.isnan(out._inner).all()  # queued: nothing ran yet
    torch.cuda.current_stream().wait_event(replayed)
    assert torch.equal(out.cpu(), torch.arange(4.0) * 2 + 1)

    unordered = torch.cuda.Stream()  # without the wait the replay reads the old input
    static_x.zero_()
    with torch.cuda.stream(copy_stream):
        static_x.copy_(torch.ones(4).pin_memory(), non_blocking=True)
    with torch.cuda.stream(unordered):
        graph.replay()
    unordered.synchronize()
    assert torch.equal(out.cpu(), torch.ones(4))  # 0 * 2 + 1: the copy had not run


def test_queued_work_runs_without_autograd_wherever_it_is_waited_for(cuda):
    """Work a decode step queues on a side stream under no_grad (a warm-up on the capture stream) runs when waited
    on, perhaps at a synchronize outside no_grad (a host arena's release at the end of a run): as on a GPU, autograd
    has no part in it (it refused the in-place add below on the step's view, and failed a comparison's second
    method)."""
    stream = torch.cuda.Stream()
    x = torch.ones(4, 8, device="cuda")
    weight = torch.nn.Parameter(torch.ones(8, device="cuda"))  # requires grad, as a module's parameters do
    with torch.no_grad(), torch.cuda.stream(stream):
        y = x * weight
        row = y[0]
        y.add_(1)
        out = torch.nn.functional.rms_norm(row, (8,), weight)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), torch.ones(8))


def test_fork_and_join_inside_a_capture(cuda):
    """A side stream that waits on an event of the capture joins it; its work is replayed in issue order."""
    x, side = torch.arange(4.0).to("cuda"), torch.cuda.Stream()

    def piece():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            doubled = x * 2
        torch.cuda.current_stream().wait_stream(side)
        return doubled + x

    graph, out = capture(piece)
    x.add_(1)
    graph.replay()
    assert torch.equal(out.cpu(), (torch.arange(4.0) + 1) * 3)


def test_an_unjoined_fork_fails_the_capture(cuda):
    x, side = torch.ones(4, device="cuda"), torch.cuda.Stream()

    def piece():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return x * 2

    with pytest.raises(RuntimeError, match="fork that was not joined"):
        capture(piece)


def test_waiting_on_work_outside_the_capture_is_refused(cuda):
    outside = torch.cuda.Stream()
    with torch.cuda.stream(outside):
        done = outside.record_event()
    first = refused(lambda: torch.cuda.current_stream().wait_event(done))
    assert "dependency created on uncaptured work" in str(first)


def test_work_on_a_stream_outside_the_capture_is_refused(cuda):
    """CUDA would run it once, at capture, and never on replay; the emulator refuses it."""
    x, other = torch.ones(4, device="cuda"), torch.cuda.Stream()

    def piece():
        with torch.cuda.stream(other):
            return x + 1

    def on_default():
        with torch.cuda.stream(torch.cuda.default_stream()):
            return x * 3

    assert "not part of the capture" in str(refused(piece))
    assert "not part of the capture" in str(refused(on_default))


def test_the_default_stream_cannot_join_a_capture(cuda):
    def piece():
        joined = torch.cuda.current_stream().record_event()
        torch.cuda.default_stream().wait_event(joined)

    assert "legacy stream" in str(refused(piece))


def test_an_event_recorded_inside_a_capture_is_not_recorded_by_a_replay(cuda):
    """Events recorded in a capture order its streams; a replay records nothing, so timing them or waiting on
    them later fails (record stage timers outside captured pieces)."""
    x = torch.ones(4, device="cuda")
    events = {}

    def piece():
        events["start"] = torch.cuda.Event(enable_timing=True)
        events["start"].record()
        y = x + 1
        events["end"] = torch.cuda.Event(enable_timing=True)
        events["end"].record()
        return y

    graph, _ = capture(piece)
    graph.replay()
    with pytest.raises(RuntimeError, match="event last recorded in a capturing stream"):
        events["start"].elapsed_time(events["end"])
    with pytest.raises(RuntimeError, match="event last recorded in a capturing stream"):
        torch.cuda.current_stream().wait_event(events["end"])
    events["end"].record()  # recorded again outside: an ordinary event
    events["end"].synchronize()


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_another_threads_sync_fails_only_in_the_global_capture_mode(cuda, mode):
    """"global" (torch's default) refuses potentially unsafe calls on every thread while a capture is underway:
    a CPU worker thread's event.synchronize() fails; "thread_local" lets other threads be."""
    x = torch.ones(4, device="cuda")
    copy_event = torch.cuda.current_stream().record_event()
    errors = []

    def worker():
        try:
            copy_event.synchronize()
        except RuntimeError as error:
            errors.append(error)

    def piece():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        return x + 1

    if mode == "global":
        with pytest.raises(RuntimeError, match=INVALIDATED):
            capture(piece, capture_error_mode=mode)
        assert len(errors) == 1 and NOT_PERMITTED in str(errors[0]) and "event.synchronize()" in str(errors[0])
    else:
        graph, out = capture(piece, capture_error_mode=mode)
        graph.replay()
        assert not errors and torch.equal(out.cpu(), torch.full((4,), 2.0))


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_the_capture_mode_decides_whether_the_capturing_thread_may_query_outside_events(cuda, mode):
    """Querying an event recorded outside the capture is potentially unsafe: refused in "global" and
    "thread_local", allowed in "relaxed" (its answer is then baked into the captured Python); a host read copies on
    the capturing stream and is refused in every mode."""
    x = torch.ones(4, device="cuda")
    outside = torch.cuda.current_stream().record_event()

    def query():
        return x + float(outside.query())

    if mode == "relaxed":
        graph, out = capture(query, capture_error_mode=mode)
        graph.replay()
        assert torch.equal(out.cpu(), torch.full((4,), 2.0))
    else:
        first = refused(query, capture_error_mode=mode)
        assert NOT_PERMITTED in str(first) and "event.query()" in str(first)
    first = refused(lambda: x.sum().item(), capture_error_mode=mode)
    assert NOT_PERMITTED in str(first) and ".item()" in str(first)
