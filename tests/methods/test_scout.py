"""ScoutAttention's exactness reductions on tiny random models (CPU, fp32): S1 oracle mode = the same selection on
the device alone (any residency, any pool size, edge lengths, ragged batches, GQA groups), S2 oracle mode with a
covering budget = FullKV, and the prediction mode staying close to the oracle."""

from __future__ import annotations

import pytest
import torch
from method_harness import assert_logits_close, fullkv_reference, ragged_prompt, run_engine
from scout_harness import REFERENCE_CFG, SelectionReference, plans, scout_run
from scout_harness import prompt_300 as make_prompt_300
from scout_harness import reference_300 as make_reference_300

from scoutbench.methods.scout import ScoutAttention


@pytest.fixture(scope="module")
def prompt_300(tiny_qwen3):
    return make_prompt_300(tiny_qwen3)


@pytest.fixture(scope="module")
def reference_300(tiny_qwen3, prompt_300):
    return make_reference_300(tiny_qwen3, prompt_300)


# ---------------------------------------------------------------------------------------------- S2: = FullKV
@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama"])
@pytest.mark.parametrize("pc,pr", [(True, True), (False, False), (True, False)])
def test_oracle_with_budget_over_context_equals_fullkv(model_fixture, pc, pr, request):
    model = request.getfixturevalue(model_fixture)
    prompt, lengths = ragged_prompt(model.config.vocab_size, [150], seed=1)
    reference, tokens = fullkv_reference(model, prompt, lengths, 8)
    method = ScoutAttention(budget=256, block_size=8, oracle=True, pc=pc, pr=pr, recall_interval=3)
    assert_logits_close(scout_run(model, method, prompt, lengths, tokens), reference, atol=1e-5)


def test_oracle_with_full_budget_and_no_dense_layers_equals_fullkv(tiny_qwen3, cpu_backend):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [97], seed=2)
    reference, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, 6)
    method = ScoutAttention(budget=128, block_size=4, dense_layers=0, oracle=True)
    assert_logits_close(scout_run(tiny_qwen3, method, prompt, lengths, tokens), reference, atol=1e-5)


# ---------------------------------------------------------------------------------------------- S1: = Quest-style
def _random_initial(seed):
    def pick(self, layer, ids, valid):
        g = torch.Generator().manual_seed(seed + layer)
        return valid & (torch.rand(valid.shape, generator=g) < 0.5)  # a random subset of the selected blocks

    return pick


def _no_initial(self, layer, ids, valid):
    return torch.zeros_like(valid)


def _half_initial(self, layer, ids, valid):
    return valid & (torch.arange(valid.shape[-1]) % 2 == 0)


@pytest.mark.parametrize("residency", ["top", "none", "half", "random"])
@pytest.mark.parametrize("pr", [False, True])
def test_oracle_equals_device_only_selection_for_any_residency(tiny_qwen3, prompt_300, reference_300, residency, pr,
                                                               monkeypatch):
    prompt, lengths, tokens = prompt_300
    reference, ref_sel = reference_300
    hooks = {"none": _no_initial, "half": _half_initial, "random": _random_initial(5)}
    if residency in hooks:
        monkeypatch.setattr(ScoutAttention, "_initial_selection", hooks[residency])
    method = ScoutAttention(**REFERENCE_CFG, oracle=True, pr=pr, recall_interval=2, device_blocks="selected")
    ours = scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    assert_logits_close(ours, reference, atol=1e-5)
    # same selections, and the split really varies
    for record in plans(method):
        assert record["selected"] == ref_sel[(record["layer"], record["step"])]
    on_cpu = sum(len(s - d) for r in plans(method) for srow, drow in zip(r["selected"], r["device"], strict=False)
                 for s, d in zip(srow, drow, strict=False))
    on_dev = sum(len(d) for r in plans(method) for drow in r["device"] for d in drow)
    assert on_cpu > 0 and (on_dev > 0 or residency == "none")


def test_oracle_equals_quest_without_sink_and_local(tiny_qwen3, prompt_300):
    from scoutbench.methods.quest import Quest

    prompt, lengths, tokens = prompt_300
    reference = run_engine(tiny_qwen3, Quest(budget=64, block_size=4), prompt, lengths, tokens)
    method = ScoutAttention(budget=64, block_size=4, sink_blocks=0, local_blocks=0, oracle=True, recall_interval=2,
                            device_blocks="selected")
    assert_logits_close(scout_run(tiny_qwen3, method, prompt, lengths, tokens), reference, atol=1e-5)


@pytest.mark.parametrize("pool_factor", [2, 3])
def test_oracle_with_a_larger_pool_equals_device_only_selection(tiny_qwen3, prompt_300, reference_300, pool_factor):
    """A pool larger than a selection changes where the selected blocks are attended, never what is attended."""
    prompt, lengths, tokens = prompt_300
    reference, ref_sel = reference_300
    method = ScoutAttention(**REFERENCE_CFG, oracle=True, pr=True, recall_interval=2, pool_factor=pool_factor)
    ours = scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    assert_logits_close(ours, reference, atol=1e-5)
    for record in plans(method):
        assert record["selected"] == ref_sel[(record["layer"], record["step"])]
    stats = method.stats()
    assert stats["pool_slots"] == pool_factor * method.k_sel
    assert stats["attended_tokens_per_head"]["within_budget"] is True


# ---------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("length", [3, 64, 67])  # shorter than a block, an exact multiple, one past it
def test_edge_lengths_match_reference_and_fullkv(tiny_qwen3, length):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [length], seed=length)
    fullkv, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, 10)
    big = ScoutAttention(budget=128, block_size=8, oracle=True, recall_interval=2)
    assert_logits_close(scout_run(tiny_qwen3, big, prompt, lengths, tokens), fullkv, atol=1e-5)
    cfg = dict(budget=32, block_size=4, dense_layers=2)
    reference = run_engine(tiny_qwen3, SelectionReference(**cfg), prompt, lengths, tokens)
    small = ScoutAttention(**cfg, oracle=True, recall_interval=2, device_blocks="selected")
    assert_logits_close(scout_run(tiny_qwen3, small, prompt, lengths, tokens), reference, atol=1e-5)


@pytest.mark.parametrize("sink,local", [(1, 1), (2, 0), (0, 2)])
def test_ragged_batch_matches_reference_and_fullkv(tiny_qwen3, sink, local):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [37, 96, 150], seed=9)
    fullkv, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, 9)
    big = ScoutAttention(budget=256, block_size=8, oracle=True, sink_blocks=sink, local_blocks=local,
                         recall_interval=2)
    assert_logits_close(scout_run(tiny_qwen3, big, prompt, lengths, tokens), fullkv, atol=1e-5)
    cfg = dict(budget=48, block_size=4, dense_layers=1, sink_blocks=sink, local_blocks=local)
    reference = run_engine(tiny_qwen3, SelectionReference(**cfg), prompt, lengths, tokens)
    small = ScoutAttention(**cfg, oracle=True, recall_interval=2, device_blocks="selected")
    assert_logits_close(scout_run(tiny_qwen3, small, prompt, lengths, tokens, trace=True), reference, atol=1e-5)
    positions = {tuple(r["positions"]) for r in plans(small)}
    assert all(len(set(p)) == 3 for p in positions)  # really ragged


@pytest.mark.parametrize("group", [1, 4])
def test_gqa_groups(request, group):
    model = request.getfixturevalue("tiny_mha" if group == 1 else "tiny_qwen3")
    assert model.config.num_attention_heads // model.config.num_key_value_heads == group
    prompt, lengths = ragged_prompt(model.config.vocab_size, [130, 101], seed=11)
    fullkv, tokens = fullkv_reference(model, prompt, lengths, 6)
    big = ScoutAttention(budget=256, block_size=8, oracle=True)
    assert_logits_close(scout_run(model, big, prompt, lengths, tokens), fullkv, atol=1e-5)
    cfg = dict(budget=40, block_size=4)
    reference = run_engine(model, SelectionReference(**cfg), prompt, lengths, tokens)
    small = ScoutAttention(**cfg, oracle=True, recall_interval=2, device_blocks="selected")
    assert_logits_close(scout_run(model, small, prompt, lengths, tokens), reference, atol=1e-5)


def test_prediction_mode_runs_and_stays_close(tiny_qwen3, prompt_300):
    """The default (predicted query on the CPU part) runs end to end and stays near the oracle."""
    prompt, lengths, tokens = prompt_300
    oracle = scout_run(tiny_qwen3, ScoutAttention(budget=64, block_size=4, oracle=True), prompt, lengths, tokens)
    method = ScoutAttention(budget=64, block_size=4, pred_norm="self")
    ours = scout_run(tiny_qwen3, method, prompt, lengths, tokens)
    for a, b in zip(ours, oracle, strict=False):
        assert torch.isfinite(a).all()
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9
