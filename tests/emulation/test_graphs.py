"""Piecewise CUDA graphs (scoutbench/decode/graphs.py) on emulated CUDA, whose capture records device work without running
it and whose replay re-runs the recorded operations on the recorded tensors, as a GPU does: every method and
ablation, replayed over a ragged batch for 64 steps that cross block boundaries with recalls, migrations and fetches,
gives the logits of its eager CPU path; a Python value baked into a piece (a position, a length) makes the replay
differ, and the test catches it."""

from __future__ import annotations

import copy
import dataclasses

import gpu_configs
import pytest
import torch
from emulated import ATOL, run_emulated, teacher_tokens
from method_harness import ragged_prompt

from scoutbench.methods import build_method
from scoutbench.methods.fullkv import FullKV

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present"),
              pytest.mark.usefixtures("one_intra_op_thread")]

STEPS = 64
VARIANTS = {name: (name, {}) for name in gpu_configs.ALL_NAMES} | {
    "scout-dense0": ("scout", {"dense_layers": 0}),
    "scout-pool2": ("scout", {"pool_factor": 2}),
    "scout-beta": ("scout", {"beta_trigger": True, "beta": 0.05}),
    "hgca-fractions": ("hgca", {"budget": None, "refresh_interval": 4, "migrate_block": 16}),
    # the alpha count, read at a host point: alpha 1 puts it below the cap, varying by layer and step
    "infinigen-dynamic-alpha1": ("infinigen", {"dynamic_count": True, "alpha": 1.0}),
    "infinigen-dense0": ("infinigen", {"dense_layers": 0}),  # layer 0 fetches for itself, inside its decode
}




def _factory(key: str):
    name, extra = VARIANTS[key]
    return lambda: build_method(name, {**gpu_configs.method_args(name), **extra})


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_replayed_steps_give_the_eager_logits(model, prompt, key):
    run = run_emulated(model, _factory(key), *prompt, STEPS, cuda_graphs=True)
    assert run.graphs["captured"], run.graphs
    assert run.graphs["replayed_steps"] >= STEPS - 2 * run.graphs["variants"]
    for step, diff in enumerate(run.max_diff()):
        assert diff <= ATOL, f"{key}: step {step} differs by {diff}"
    assert run.unexpected_syncs() == []


@dataclasses.dataclass
class BakedPositionFullKV(FullKV):
    """The classic graph bug: the new token's slot taken from the host position (a Python int baked at capture)."""

    name = "fullkv-baked"

    def decode(self, layer, q, k, v):
        position = self.step.positions_host[0]
        self.keys[layer][:, :, position] = k
        self.values[layer][:, :, position] = v
        return super().decode(layer, q, k, v)


def test_a_baked_python_position_makes_the_replay_differ(model):
    prompt = ragged_prompt(model.config.vocab_size, [40, 40], seed=3)
    eager = run_emulated(model, BakedPositionFullKV, *prompt, 12)
    assert max(eager.max_diff()) <= ATOL  # eager: the planted write is the right one
    replayed = run_emulated(model, BakedPositionFullKV, *prompt, 12, cuda_graphs=True,
                            reference=teacher_tokens(model, BakedPositionFullKV(), *prompt, 12))
    assert replayed.graphs["captured"]
    assert max(replayed.max_diff()) > 1e-3  # replays keep writing the captured step's slot


def test_replayed_steps_record_the_attention_backends_they_call(model, prompt):
    """A replay runs no Python, so the backends' call counts would stop at the capture: each replay adds what its
    capture recorded, and a replayed run records the eager run's counts."""
    eager = run_emulated(model, _factory("quest"), *prompt, 8)
    replayed = run_emulated(model, _factory("quest"), *prompt, 8, cuda_graphs=True)
    assert replayed.graphs["replayed_steps"] >= 6
    assert replayed.backends == eager.backends and sum(eager.backends.values()) > 0


STAT_VARIANTS = ["scout", "hgca", "infinigen", "quest"]


@pytest.mark.parametrize("key", STAT_VARIANTS)
def test_replayed_steps_keep_the_methods_statistics(model, prompt, key):
    """What a method counts (tokens attended, CPU share, recalls, fetches, moved bytes) is kept in host points or in
    place on the device, never in Python that only the capture runs: a replayed run counts what the eager CUDA
    path counts."""
    from scoutbench.analysis.counter_gate import measured_counters

    eager = run_emulated(model, _factory(key), *prompt, 24)
    replayed = run_emulated(model, _factory(key), *prompt, 24, cuda_graphs=True)
    assert replayed.graphs["replayed_steps"] >= 20
    want = measured_counters({"method_stats": eager.cuda_stats})
    got = measured_counters({"method_stats": replayed.cuda_stats})
    assert got.keys() == want.keys()
    assert {name: got[name] for name in want if got[name] != pytest.approx(want[name])} == {}


# ------------------------------------------------------------------ a capture that fails or is interrupted
@dataclasses.dataclass
class InterruptedFullKV(FullKV):
    """FullKV interrupted while its step is captured, as the GPU check's SIGALRM (PhaseCut) or a Ctrl-C would be:
    a BaseException, which no `except Exception` catches."""

    name = "fullkv-interrupted"

    def decode(self, layer, q, k, v):
        if torch.cuda.is_current_stream_capturing():
            raise KeyboardInterrupt
        return super().decode(layer, q, k, v)


@dataclasses.dataclass
class HostReadFullKV(FullKV):
    """FullKV reading a device value on the host in its step: a real capture fails there (invalidated)."""

    name = "fullkv-host-read"

    def decode(self, layer, q, k, v):
        self.step.positions.max().item()
        return super().decode(layer, q, k, v)


def _decode_with_graphs(cuda_model, method, prompt, steps):
    """(logits of each decode step, the runner's record) of `method` with CUDA graphs, teacher-forced."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.testing.emulated_cuda import EMULATED_DEVICE

    tokens, lengths = prompt
    engine = DecodeEngine(cuda_model, method)
    engine.start(tokens.shape[0], int(lengths.max()) + steps, cuda_graphs=True)
    try:
        engine.prefill(tokens.to(EMULATED_DEVICE), lengths)
        logits = [engine.decode_step(torch.full((tokens.shape[0],), 7, device=EMULATED_DEVICE)).cpu()
                  for _ in range(steps)]
        return logits, engine.graphs.describe()
    finally:
        method.close()


@pytest.mark.parametrize("first", [InterruptedFullKV, HostReadFullKV])
def test_a_failed_or_interrupted_capture_leaves_the_next_method_able_to_run(model, first):
    """One process runs every method of the GPU check: an interrupt inside a capture ends the capture before it
    goes on (else the capture stays open and every later capture fails), and a capture that fails leaves neither
    an open capture nor the caching allocator recording to its pool (else `empty_cache()` asserts, as torch's
    allocator does, between methods); the next method then captures and replays its eager logits."""
    from scoutbench.testing.emulated_cuda import emulated_cuda, to_emulated_device

    prompt = ragged_prompt(model.config.vocab_size, [40, 23], seed=5)
    with emulated_cuda() as runtime:
        cuda_model = to_emulated_device(copy.deepcopy(model))
        if first is InterruptedFullKV:
            with pytest.raises(KeyboardInterrupt):
                _decode_with_graphs(cuda_model, first(), prompt, 3)
        else:
            _, graphs = _decode_with_graphs(cuda_model, first(), prompt, 3)
            assert not graphs["captured"] and "not permitted when stream is capturing" in graphs["failure"]
        assert runtime.capture is None and runtime.pools_recording == []
        assert torch.cuda.current_stream() is runtime.default_stream
        torch.cuda.empty_cache()  # what the throughput runner does between methods
        replayed, graphs = _decode_with_graphs(cuda_model, FullKV(), prompt, 4)
    assert graphs["captured"] and graphs["replayed_steps"] == 3, graphs
    with emulated_cuda():
        eager = [t for t in _eager_logits(model, prompt, 4)]
    for step, (a, b) in enumerate(zip(replayed, eager, strict=True)):
        assert (a - b).abs().max() <= ATOL, step


def _eager_logits(model, prompt, steps):
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.testing.emulated_cuda import EMULATED_DEVICE, to_emulated_device

    tokens, lengths = prompt
    engine = DecodeEngine(to_emulated_device(copy.deepcopy(model)), FullKV())
    engine.start(tokens.shape[0], int(lengths.max()) + steps)
    engine.prefill(tokens.to(EMULATED_DEVICE), lengths)
    return [engine.decode_step(torch.full((tokens.shape[0],), 7, device=EMULATED_DEVICE)).cpu() for _ in range(steps)]


@dataclasses.dataclass
class StreamRecordingFullKV(FullKV):
    """FullKV noting the stream each step's first layer runs on, and whether it was captured."""

    name = "fullkv-streams"
    streams: list = dataclasses.field(default_factory=list)

    def decode(self, layer, q, k, v):
        if layer == 0:
            self.streams.append((torch.cuda.current_stream(), torch.cuda.is_current_stream_capturing()))
        return super().decode(layer, q, k, v)


def test_a_step_warms_up_on_the_stream_that_captures_it(model):
    """torch's rule: warm up on the capture stream (its cached blocks can then serve the capture; eager
    temporaries of the default stream cannot serve a private pool). The first step of a variant runs eagerly on
    the runner's capture stream, the second is captured on it."""
    from scoutbench.testing.emulated_cuda import emulated_cuda, to_emulated_device

    prompt = ragged_prompt(model.config.vocab_size, [40, 23], seed=5)
    method = StreamRecordingFullKV()
    with emulated_cuda() as runtime:
        _, graphs = _decode_with_graphs(to_emulated_device(copy.deepcopy(model)), method, prompt, 3)
    (warm_up, warm_captured), (capture, captured) = method.streams[:2]
    assert graphs["captured"] and len(method.streams) == 2  # the third step replayed: no Python ran
    assert not warm_captured and captured
    assert warm_up is capture and warm_up is not runtime.default_stream
