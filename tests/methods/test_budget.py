"""One budget, one meaning: every method and ablation attends at most `budget` tokens per
(sequence, KV head, sparse layer, decode step), the always-on ones included, and says so in its statistics and
work counters. The trace that found the overrun: tiny-qwen3, a 600-token prompt, budget 256, block 16, 24 steps
(ScoutAttention's old default attended 304 tokens on average, 368 at most)."""

from __future__ import annotations

import pytest
from method_harness import fullkv_reference, ragged_prompt, run_engine

from scoutbench.methods import METHODS

BUDGET, BLOCK, STEPS = 256, 16, 24
LENGTHS = [600, 537]  # a ragged batch: the shorter sequence crosses block boundaries at other steps


def build(name: str, **extra):
    cls = METHODS.load(name)
    fields = {"budget": BUDGET, **({"block_size": BLOCK} if "block_size" in cls.__dataclass_fields__ else {}), **extra}
    return cls.from_args({}, {**METHODS.preset(name), **fields})


@pytest.fixture(scope="module")
def run(tiny_qwen3):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, LENGTHS)
    _, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, STEPS)

    def attended(method):
        stats = {}
        run_engine(tiny_qwen3, method, prompt, lengths, tokens,
                   on_step=lambda engine: stats.update(method.stats()))  # before close() releases the method
        return stats

    return attended


@pytest.mark.parametrize("name", [n for n in METHODS.names() if n != "fullkv"])
def test_every_method_and_ablation_attends_at_most_the_budget(run, name):
    stats = run(build(name))["attended_tokens_per_head"]
    assert stats["budget"] == BUDGET
    assert 0 < stats["mean"] <= stats["max"] <= BUDGET
    assert stats["within_budget"] is True


@pytest.mark.parametrize("name", ["quest", "scout"])
def test_block_methods_fill_the_budget_when_the_tail_block_is_full(run, name):
    """Selected blocks + always-on blocks + a full tail block are exactly `budget` tokens: the budget is used, not
    only respected (so a method that silently attended less would fail here)."""
    stats = run(build(name, pr=False) if name == "scout" else build(name))["attended_tokens_per_head"]
    assert stats["max"] == BUDGET


@pytest.mark.parametrize("name", ["infinigen", "hgca"])
def test_token_methods_attend_exactly_the_budget(run, name):
    """InfiniGen fetches budget - 1 tokens plus the current one; HGCA's window + CPU tokens = budget."""
    stats = run(build(name))["attended_tokens_per_head"]
    assert stats["mean"] == stats["max"] == BUDGET


def test_the_resident_variant_exceeds_the_budget_and_says_so(run):
    """`device_blocks="resident"` (every resident block on the device, the CPU part on top) is kept as a variant;
    its results report the overrun instead of hiding it."""
    stats = run(build("scout", device_blocks="resident"))["attended_tokens_per_head"]
    assert stats["max"] > BUDGET and stats["within_budget"] is False


def test_fullkv_attends_the_whole_context(run):
    stats = run(METHODS.load("fullkv")())["attended_tokens_per_head"]
    assert stats["budget"] is None and stats["within_budget"] is None
    assert stats["max"] == max(LENGTHS) + STEPS  # the last step's token sees the prompt and every decoded token
