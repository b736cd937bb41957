"""The work model is the method's own: instance methods of the method a run was configured as (built from its
config, not bound), declared through `WorkModel`, reading the quantities the runtime reads; and the counters every
method reports (steps, bytes each way, attended tokens) are the base's."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch
from method_harness import ragged_prompt, run_engine

from scoutbench.analysis.work import MeasuredWork, Shape, step_work
from scoutbench.methods import ALL_METHODS, METHODS, build_method, recorded_method
from scoutbench.methods.base import ModelShape
from scoutbench.methods.declarations import WorkModel
from scoutbench.methods.hgca import HGCA
from scoutbench.methods.infinigen import InfiniGen

SHAPE = Shape(ModelShape(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=512,
                         intermediate_size=1024, vocab_size=1000), context_len=4096, batch=2, elem_bytes=2)
WORK_MODEL_NAMES = ("work_fractions", "recorded_config", "measure_work", "work_dense_layers", "sparse_layer_work")


def test_every_class_that_declares_work_is_a_work_model():
    """A mixin that declares (part of) a method's work model inherits `WorkModel`, so its `super()` calls reach
    the declaration's defaults whatever the method's bases are."""
    for name in METHODS.names():
        for klass in METHODS.load(name).__mro__:
            if any(attr in vars(klass) for attr in WORK_MODEL_NAMES):
                assert issubclass(klass, WorkModel), (name, klass.__qualname__)


def test_a_result_builds_its_method_without_binding_it():
    """What `project` and `gate --counters` build from a result's config is validated but never bound: no context,
    no storage, no counters, no worker thread."""
    threads = threading.active_count()
    for name in METHODS.names():
        method = recorded_method(name, build_method(name, {}).config())
        assert not hasattr(method, "ctx") and not hasattr(method, "counters"), name
    assert threading.active_count() == threads


@pytest.mark.parametrize(("name", "ran"), [
    ("scout", {"pool_factor": 1.0, "dense_layers": 0}),
    ("hgca", {"score_read": "all"}),
    ("infinigen", {"count_cap": None, "count_cap_frac": None}),
    ("quest", {"dense_layers": 0})])
def test_a_result_written_before_a_field_builds_the_method_it_ran(name: str, ran: dict):
    """A result's config that lacks a field added later builds the method at the value its run had, not today's
    default; the target's budget and block size replace the run's where the method has them."""
    config = {key: value for key, value in build_method(name, {}).config().items() if key not in ran}
    method = recorded_method(name, config)
    assert {key: getattr(method, key) for key in ran} == ran
    assert build_method(name, {}).config() != method.config()
    retargeted = recorded_method(name, config, budget=1024, block_size=16)
    assert retargeted.budget == 1024
    assert getattr(retargeted, "block_size", 16) == 16
    assert recorded_method("hgca", {"budget": None}, budget=1024).budget is None  # the fraction policy stays


@dataclass
class EveryChannel(InfiniGen):
    """InfiniGen speculating with every channel of the head (its `partial_dim`, which the runtime sizes by)."""

    def partial_dim(self, head_dim: int) -> int:
        return head_dim


@dataclass
class FixedWindow(HGCA):
    """HGCA whose device window holds 256 tokens whatever the budget (its `window_tokens`, which the runtime reads)."""

    @property
    def window_tokens(self) -> int:
        return 256


def test_the_work_model_reads_the_quantities_the_runtime_uses():
    """InfiniGen's speculation reads `partial_dim` channels of every key, HGCA's device window is `window_tokens`
    (and half a migration block): the work model asks the method, so a method that changes them changes its work."""
    with METHODS.scoped() as registry:
        registry.register("every-channel", EveryChannel)
        registry.register("fixed-window", FixedWindow)
        own, every = (step_work(MeasuredWork(name, "infinigen", {"dense_layers": 0}), SHAPE).sparse
                      for name in ("infinigen", "every-channel"))
        window = step_work(MeasuredWork("fixed-window", "hgca", {"budget": 2048, "dense_layers": 0}), SHAPE).sparse
    head_dim = SHAPE.model.head_dim
    assert every.select_bytes / own.select_bytes == head_dim / math.ceil(0.2 * head_dim)
    assert window.device_tokens == SHAPE.batch * SHAPE.model.num_kv_heads * (256 + 32 / 2)


# small budgets on a ragged batch of 40 and 29 tokens: every sparse method selects, offloads and copies
SMALL = {"quest": {"budget": 16, "block_size": 4}, "infinigen": {"budget": 16},
         "hgca": {"budget": 24, "migrate_block": 4}, "scout": {"budget": 16, "block_size": 4, "recall_interval": 2}}


@pytest.mark.parametrize("name", ALL_METHODS)
def test_the_base_counts_every_methods_steps_and_reset_zeroes_them(tiny_llama, name: str):
    """Each decode step is counted once by the base; `reset_stats` (after warm-up) zeroes the steps, the bytes
    each way and the attended tokens, so the statistics cover exactly the steps after it."""
    method = build_method(name, {"dense_layers": 1, **SMALL[name]} if name in SMALL else {})
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [40, 29])
    tokens = [torch.tensor([b + 7 * step for b in range(2)]) for step in range(5)]
    counted, after_reset = [], []

    def on_step(_engine) -> None:
        counted.append(method.counters.steps)
        if len(counted) == 2:
            method.reset_stats()
            counters = method.counters
            after_reset.append((counters.steps, counters.h2d_bytes, counters.d2h_bytes,
                                counters.attended.stats(None)["mean"]))
        if len(counted) == 5:
            stats = method.stats()
            assert stats["h2d_bytes_per_step"] == method.counters.h2d_bytes / 3
            assert stats["d2h_bytes_per_step"] == method.counters.d2h_bytes / 3
            assert stats["attended_tokens_per_head"]["mean"] is not None

    run_engine(tiny_llama, method, prompt, lengths, tokens, on_step=on_step)
    assert counted == [1, 2, 1, 2, 3]
    assert after_reset == [(0, 0, 0, None)]
