"""Piecewise CUDA graphs (scoutbench/graphs.py) on emulated CUDA, whose capture records device work without running
it and whose replay re-runs the recorded operations on the recorded tensors, as a GPU does: every method and
ablation, replayed over a ragged batch for 64 steps that cross block boundaries with recalls, migrations and fetches,
gives the logits of its eager CPU path; a Python value baked into a piece (a position, a length) makes the replay
differ, and the test catches it."""

from __future__ import annotations

import dataclasses

import gpu_configs
import pytest
import torch
from emulated import run_emulated, small_qwen3, teacher_tokens
from method_harness import ragged_prompt

from scoutbench.methods import build_method
from scoutbench.methods.fullkv import FullKV

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present")

STEPS = 64
LENGTHS = [120, 83]
ATOL = 2e-4  # as tests/test_emulated_cuda.py: the CUDA branches compute attention with other exact kernels
VARIANTS = {name: (name, {}) for name in gpu_configs.ALL_NAMES} | {
    "scout-dense0": ("scout", {"dense_layers": 0}),
    "scout-pool2": ("scout", {"pool_factor": 2}),
    "scout-beta": ("scout", {"beta_trigger": True, "beta": 0.05}),
    "hgca-fractions": ("hgca", {"budget": None, "refresh_interval": 4, "migrate_block": 16}),
    "infinigen-dynamic": ("infinigen", {"dynamic_count": True}),  # the count read at a host point
    "infinigen-dense0": ("infinigen", {"dense_layers": 0}),  # layer 0 fetches for itself, inside its decode
}


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return small_qwen3()


@pytest.fixture(scope="module")
def prompt(model):
    return ragged_prompt(model.config.vocab_size, LENGTHS, seed=3)


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
