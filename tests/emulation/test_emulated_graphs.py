"""Emulated CUDA graphs (scoutbench/testing/emulated_cuda/graphs.py): `torch.cuda.CUDAGraph`, `torch.cuda.graph`
and friends on a CPU, faithful enough that a graph bug shows up as a difference between replayed and eager results.

Capture records device work without running it; a replay re-dispatches the recorded operations on the same tensors
without the Python that issued them. So the classic bugs of a captured piece (a Python scalar baked in, a fresh
allocation filled from a Python value, an input not copied into its static buffer) make replayed results differ
from eager ones, and what CUDA refuses inside a capture (a host read, a sync, a wait on outside work, an unjoined
fork) raises CUDA's error."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_capture import NOT_PERMITTED, capture, refused
from torch.overrides import TorchFunctionMode

from scoutbench.testing.emulated_cuda import EmulatedCudaHazard, emulated_cuda, to_emulated_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present")

STEPS = 5


@pytest.fixture
def cuda():
    with emulated_cuda() as runtime:
        yield runtime


# ---------------------------------------------------------------------------------------------- a small piece
def norm_piece(x, weight, cache, index, eps=1e-6):
    """Matmul, RMSNorm-like math, an index_copy_ at device positions and an in-place cache write."""
    h = x @ weight
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    cache.index_copy_(0, index, h)
    cache.mul_(0.5)
    return cache.sum(0) + h.softmax(-1)


def piece_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, generator=generator), torch.randperm(6, generator=generator)[:2]


def test_a_replayed_piece_equals_eager_over_steps(cuda):
    """(1) New inputs copied into the static buffers before each replay: exactly the eager results."""
    weight = torch.randn(8, 8).to("cuda")
    x0, index0 = piece_inputs(0)
    static_x, static_index = x0.to("cuda"), index0.to("cuda")
    static_cache, eager_cache = torch.zeros(6, 8, device="cuda"), torch.zeros(6, 8, device="cuda")
    graph, out = capture(norm_piece, static_x, weight, static_cache, static_index)
    assert graph.num_ops >= 8 and torch.isnan(out.cpu()).all()  # recorded, not run: outputs are unwritten
    assert torch.equal(static_cache.cpu(), torch.zeros(6, 8))  # the in-place writes did not run either
    for step in range(STEPS):
        x, index = piece_inputs(step)
        static_x.copy_(x.to("cuda"))
        static_index.copy_(index.to("cuda"))
        graph.replay()
        expected = norm_piece(x.to("cuda"), weight, eager_cache, index.to("cuda"))
        assert torch.equal(out.cpu(), expected.cpu()), step
        assert torch.equal(static_cache.cpu(), eager_cache.cpu()), step
    assert graph.replays == STEPS


@torch.library.custom_op("scoutbench_tests::scaled_into", mutates_args=("out",))
def scaled_into(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """A custom op that writes its argument and returns nothing (as fused_ops.select_and_split fills a static plan)."""
    out.copy_(x * scale)


@scaled_into.register_fake
def _(x, scale, out):
    return None


def test_a_custom_op_that_writes_its_arguments_is_recorded_and_replayed(cuda):
    """(1) A custom op's `mutates_args` make it in-place device work whatever its name: recorded, not run, at
    capture, and run again at every replay (it ran at capture and never again before the schema was read)."""
    static_x, out = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    graph, result = capture(lambda: (scaled_into(static_x, 2.0, out), out + 1)[1])
    assert torch.equal(out.cpu(), torch.zeros(4)) and torch.isnan(result.cpu()).all()  # nothing ran yet
    for step in range(1, STEPS):
        static_x.fill_(float(step))
        graph.replay()
        assert torch.equal(out.cpu(), torch.full((4,), 2.0 * step)) and torch.equal(result.cpu(), out.cpu() + 1)


def test_a_python_scalar_baked_into_a_piece_makes_replay_differ(cuda):
    """(2) A position passed as a Python int and used as an index is the capture's value at every replay."""
    def write(cache, value, position: int):
        cache[position] = value * 2
        return cache[: position + 1].sum(0)

    static_value = torch.zeros(4, device="cuda")
    replayed, eager = torch.zeros(6, 4, device="cuda"), torch.zeros(6, 4, device="cuda")
    graph, out = capture(write, replayed, static_value, 1)
    for position in range(1, 4):
        static_value.copy_(torch.full((4,), float(position), device="cuda"))
        graph.replay()
        expected = write(eager, static_value, position)
    assert not torch.equal(replayed.cpu(), eager.cpu())
    assert torch.equal(replayed.cpu()[1], torch.full((4,), 6.0))  # every replay wrote row 1, the last one won
    assert torch.equal(replayed.cpu()[2:], torch.zeros(4, 4))
    assert not torch.equal(out.cpu(), expected.cpu())


def test_an_allocation_filled_from_a_python_value_is_refilled_with_the_stale_value(cuda):
    """(3) `torch.full(..., pos, device="cuda")` inside a piece: refilled at every replay with the capture's pos."""
    def positions(base, pos: int):
        return base + torch.full((3,), pos, device="cuda")

    base = torch.arange(3.0).to("cuda")
    graph, out = capture(positions, base, 7)
    for pos in (8, 9):
        graph.replay()
        assert torch.equal(out.cpu(), torch.arange(3.0) + 7)
        assert not torch.equal(out.cpu(), positions(base, pos).cpu())
    zeros_graph, zeros = capture(lambda: torch.zeros(3, device="cuda"))
    zeros.add_(1)
    zeros_graph.replay()  # a captured factory's fill is device work: it runs again
    assert torch.equal(zeros.cpu(), torch.zeros(3))


# ---------------------------------------------------------------------------------------------- refused in a capture
def _pinned_copy(x):
    return torch.empty(4, pin_memory=True).copy_(x)


HOST_READS = {
    ".item()": (lambda x: x.sum().item(), ".item()"),
    ".tolist()": (lambda x: x.tolist(), ".tolist()"),
    ".cpu()": (lambda x: x.cpu(), "blocking device-to-host copy"),
    "bool(t)": (lambda x: bool(x.sum() > 0), "bool(tensor)"),
    "print": (lambda x: str(x), "str(tensor)"),
    "blocking d2h copy": (_pinned_copy, "blocking device-to-host copy"),
    "pageable d2h copy": (lambda x: torch.empty(4).copy_(x, non_blocking=True), "into pageable memory"),
    "blocking h2d copy": (lambda x: x.copy_(torch.ones(4).pin_memory()), "blocking host-to-device copy"),
    "pageable h2d copy": (lambda x: x.copy_(torch.ones(4), non_blocking=True), "from pageable memory"),
    "torch.tensor": (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"), "torch.tensor(host data"),
    "nonzero": (lambda x: x.nonzero(), "nonzero"),
    "boolean mask": (lambda x: x[x > 0], "boolean mask"),
    "list index": (lambda x: x[[0, 2]], "Python list"),
    "equal": (lambda x: torch.equal(x, x), "equal"),
    "event.synchronize": (lambda x: torch.cuda.Event().synchronize(), "event.synchronize()"),
    "event.query": (lambda x: torch.cuda.current_stream().record_event().query(), "event.query()"),
    "stream.synchronize": (lambda x: torch.cuda.current_stream().synchronize(), "stream.synchronize()"),
    "torch.cuda.synchronize": (lambda x: torch.cuda.synchronize(), "torch.cuda.synchronize()"),
}


@pytest.mark.parametrize("kind", list(HOST_READS))
def test_a_host_read_or_sync_inside_a_capture_raises(cuda, kind):
    """(4) What a real capture refuses raises inside the capture with CUDA's message, naming what was refused."""
    piece, what = HOST_READS[kind]
    x = torch.arange(4.0).to("cuda")
    first = refused(piece, x)
    assert NOT_PERMITTED in str(first) and what in str(first), str(first)
    assert not torch.cuda.is_current_stream_capturing()  # the capture ended with the error


def test_a_failed_capture_leaves_the_capture_stream_current_as_torch_does(cuda):
    """torch.cuda.graph's __exit__ calls capture_end before restoring the stream: when capture_end raises, the
    capture's side stream stays current (a fallback to eager must restore its stream itself)."""
    default = torch.cuda.current_stream()
    x = torch.ones(2, device="cuda")
    refused(lambda t: t.sum().item(), x)
    assert torch.cuda.current_stream() is not default
    good, _ = capture(lambda t: t + 1, x)  # a new capture works
    assert good.num_ops == 1


@pytest.mark.parametrize("access", ["data_ptr", "untyped_storage"])
def test_a_kernel_reading_device_memory_by_address_is_refused(cuda, access):
    """Triton's interpreter reads and writes a device tensor's memory by address, bypassing the emulator: inside a
    capture it would run once, at capture, and never on replay, so the emulator refuses it instead."""
    x = torch.ones(4, device="cuda")
    first = refused(lambda: getattr(x, access)())
    assert f"{access}() of a device tensor inside a capture" in str(first)
    assert getattr(x, access)() is not None  # outside a capture: as before


@pytest.mark.parametrize("where", ["capture", "side stream"])
def test_an_out_op_returns_its_out_tensors_as_torch_does(cuda, where):
    """`torch.topk(..., out=(values, indices))` returns torch's named tuple of the out tensors, recorded in a capture
    or queued on a side stream alike (the side stream returned its input, the capture a plain tuple)."""
    x = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]]).to("cuda")
    values, indices = torch.empty(2, 2, device="cuda"), torch.empty(2, 2, dtype=torch.long, device="cuda")
    total = torch.empty(2, 3, device="cuda")

    def piece():
        top = torch.topk(x, 2, dim=-1, out=(values, indices))
        summed = torch.add(x, 1, out=total)
        return top.indices, top.values, summed

    if where == "capture":
        graph, (top_indices, top_values, summed) = capture(piece)
        graph.replay()
    else:
        with torch.cuda.stream(torch.cuda.Stream()) as side:
            top_indices, top_values, summed = piece()
        side.synchronize()
    assert top_indices is indices and top_values is values and summed is total
    assert torch.equal(indices.cpu(), torch.tensor([[1, 2], [2, 0]])) and torch.equal(total.cpu(), x.cpu() + 1)


def test_random_ops_with_a_generator_are_refused_and_default_draws_repeat_afresh(cuda):
    generator = torch.Generator(device="cuda")
    first = refused(lambda: torch.randn(4, device="cuda", generator=generator))
    assert "explicit generator" in str(first)
    graph, noise = capture(lambda: torch.randn(4, device="cuda"))
    graph.replay()
    before = noise.cpu()
    graph.replay()
    assert not torch.equal(before, noise.cpu())


# ---------------------------------------------------------------------------------------------- host copies
def test_a_pinned_host_to_device_copy_rereads_the_host_buffer_at_every_replay(cuda):
    """(5) The copy reads the same pinned host tensor at each replay; a copy back into pinned memory is written
    again at each replay (and, as any device-to-host copy, lands once waited on)."""
    host_in, host_out = torch.zeros(4).pin_memory(), torch.zeros(4).pin_memory()
    static = torch.zeros(4, device="cuda")

    def piece():
        static.copy_(host_in, non_blocking=True)
        host_out.copy_(static * 10, non_blocking=True)

    graph, _ = capture(piece)
    assert torch.equal(host_out, torch.zeros(4))
    for step in range(1, 4):
        host_in.fill_(step)
        graph.replay()
        done = torch.cuda.current_stream().record_event()
        assert torch.equal(host_out, torch.full((4,), 10.0 * (step - 1)))  # not landed yet
        done.synchronize()
        assert torch.equal(host_out, torch.full((4,), 10.0 * step))
    assert cuda.transferred("h2d") >= 3 * 16 and cuda.transferred("d2h") >= 3 * 16


def test_changing_a_pinned_source_before_the_replay_is_known_complete_is_a_hazard(cuda):
    """As for an eager copy: the host must not overwrite a pinned source until an event after the replay passed."""
    host_in = torch.zeros(4).pin_memory()
    static = torch.zeros(4, device="cuda")
    graph, _ = capture(lambda: static.copy_(host_in, non_blocking=True))
    graph.replay()
    host_in.fill_(1.0)
    with pytest.raises(EmulatedCudaHazard, match="pinned source"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- streams


def test_graph_api_checks_as_torch(cuda):
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(capture_error_mode="strict")
    x = torch.ones(2, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    first, _ = capture(lambda: x + 1, pool=pool)
    second, _ = capture(lambda: x + 2, pool=first.pool())
    assert first.pool() == second.pool() == pool
    with pytest.raises(RuntimeError, match="already owns a captured graph"), torch.cuda.stream(torch.cuda.Stream()):
        first.capture_begin()
    first.reset()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        first.replay()
    seen = []
    with pytest.warns(UserWarning, match="The CUDA Graph is empty"):
        capture(lambda: seen.append(torch.cuda.is_current_stream_capturing()))
    assert seen == [True] and not torch.cuda.is_current_stream_capturing()


class CallCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_on_top_sees_the_capture_and_not_the_replayed_ops(cuda):
    """A call-counting mode pushed above the emulator keeps working: it counts the captured Python's calls once,
    at capture; a replay runs none of them (like torch's replay, a C++ call no torch function mode sees)."""
    weight = torch.randn(8, 8).to("cuda")
    x, index = piece_inputs(0)
    static_x, static_index = x.to("cuda"), index.to("cuda")
    cache, eager_cache = torch.zeros(6, 8, device="cuda"), torch.zeros(6, 8, device="cuda")
    with CallCounter() as counter:
        graph, out = capture(norm_piece, static_x, weight, cache, static_index)
        captured_calls = counter.calls
        graph.replay()
        graph.replay()
        replay_calls = counter.calls - captured_calls
        expected = norm_piece(static_x, weight, eager_cache, static_index)
        expected = norm_piece(static_x, weight, eager_cache, static_index)
    assert captured_calls >= graph.num_ops and replay_calls == 0
    assert torch.equal(out.cpu(), expected.cpu()) and torch.equal(cache.cpu(), eager_cache.cpu())


def test_a_refusal_names_the_callers_line_not_a_torch_function_modes(cuda):
    x = torch.ones(4, device="cuda")
    with CallCounter():
        first = refused(lambda: x.sum().item())
    assert "test_emulated_graphs.py" in str(first) and "x.sum().item()" in str(first), str(first)
    with CallCounter(), cuda.detect_syncs() as found:
        x.sum().item()
    assert found[0].filename.endswith("test_emulated_graphs.py") and "x.sum().item()" in found[0].line


def test_side_stream_work_is_counted_once_when_issued_not_again_when_it_runs(cuda):
    """Queued device work runs when some thread waits for it; a torch function mode on that thread must not count
    it again (a GPU runs it without any host call)."""
    x, side = torch.ones(4, device="cuda"), torch.cuda.Stream()
    with CallCounter() as counter:
        with torch.cuda.stream(side):
            y = x + 1
            z = y * 2
            z.copy_(torch.ones(4).pin_memory(), non_blocking=True)
        issued = counter.calls
        side.synchronize()
        assert counter.calls == issued == 5  # add, mul, ones, pin_memory, copy_
    assert torch.equal(z.cpu(), torch.ones(4))


# ---------------------------------------------------------------------------------------------- an HF block
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # its name on the GPU box's transformers
@pytest.mark.parametrize("planted", [False, True], ids=["device-position", "planted-python-position"])
def test_a_decode_loop_captured_per_layer_equals_eager(tiny_qwen3, planted):
    """(6) Greedy decode of an HF Qwen3 with a StaticCache (its write position is a device counter): per step one
    captured prologue (rotary tables and the mask, from the device position) and one graph per decoder layer,
    replayed; the embedding and lm_head run eagerly. The logits equal the eager loop's at every step, and a
    prologue whose mask reads the position as a Python int (planted) makes them differ."""
    from transformers import StaticCache

    steps, max_len, prompt = 10, 16, [5, 17, 3]
    with emulated_cuda():
        model = to_emulated_device(copy.deepcopy(tiny_qwen3))
        inner = model.model

        def prologue(hidden, position, step: int):
            cos, sin = inner.rotary_emb(hidden, position)
            last = step if planted else position[:, None, :, None]
            return cos, sin, torch.arange(max_len, device="cuda")[None, None, None, :] <= last

        def layer_piece(layer, hidden, cos, sin, mask, cache):
            return layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), past_key_values=cache)

        def decode(graphs: bool) -> tuple[list[torch.Tensor], list]:
            cache = StaticCache(config=model.config, max_cache_len=max_len)
            position = torch.zeros(1, 1, dtype=torch.long, device="cuda")
            hidden_in = torch.zeros(1, 1, model.config.hidden_size, device="cuda")
            token, pieces, logits = prompt[0], [], []
            for step in range(steps):
                hidden_in.copy_(inner.embed_tokens(torch.tensor([[token]]).to("cuda")))
                if not graphs or step == 0:  # step 0 also warms up: the cache allocates at its first update
                    cos, sin, mask = prologue(hidden_in, position, step)
                    hidden = hidden_in
                    for layer in inner.layers:
                        hidden = layer_piece(layer, hidden, cos, sin, mask, cache)
                else:
                    if not pieces:  # captured once, at step 1: static inputs are the previous piece's outputs
                        pieces.append(capture(prologue, hidden_in, position, step))
                        for layer in inner.layers:
                            previous = pieces[-1][1] if len(pieces) > 1 else hidden_in
                            pieces.append(capture(layer_piece, layer, previous, *pieces[0][1], cache))
                    for graph, _ in pieces:
                        graph.replay()
                    hidden = pieces[-1][1]
                out = model.lm_head(inner.norm(hidden))
                logits.append(out.cpu())
                token = prompt[step + 1] if step + 1 < len(prompt) else int(out[0, -1].argmax())
                position.add_(1)
            return logits, pieces

        eager, _ = decode(graphs=False)
        replayed, pieces = decode(graphs=True)
    assert len(pieces) == 1 + len(inner.layers) and all(graph.replays == steps - 1 for graph, _ in pieces)
    assert min(graph.num_ops for graph, _ in pieces[1:]) >= 20  # a whole layer per graph
    differs = [step for step, (a, b) in enumerate(zip(eager, replayed, strict=True)) if not torch.equal(a, b)]
    if planted:  # the mask of step 1, the capture's, at every later step
        assert differs == list(range(2, steps))
    else:
        assert not differs, [float((eager[s] - replayed[s]).abs().max()) for s in differs]
