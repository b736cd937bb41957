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
    # the alpha count, read at a host point: alpha 1 puts it below the cap, varying by layer and step
    "infinigen-dynamic-alpha1": ("infinigen", {"dynamic_count": True, "alpha": 1.0}),
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
