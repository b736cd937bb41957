"""benchmarks/selection_churn.py: its recorder leaves ScoutAttention's decode unchanged and records the method's own
selection, and every reading of the paper's "blocks changed per step" equals a hand count."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
from repo_paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import selection_churn as churn  # noqa: E402

from scoutbench.eval.generation import SharedPrefill, method_spec  # noqa: E402


def test_the_recorder_changes_nothing_and_records_the_methods_selection(tiny_qwen3):
    """Teacher-forced with and without the recorder: the same logits; its KV-head selection with the predicted
    query is the method's own split, every step and layer; a selection per query head has the same width."""
    torch.manual_seed(0)
    prompt = torch.randint(0, tiny_qwen3.config.vocab_size, (300,)).tolist()
    tokens = torch.randint(0, tiny_qwen3.config.vocab_size, (12,)).tolist()
    shared = SharedPrefill(tiny_qwen3, prompt)
    spec = method_spec("scout", {"block_size": 8, "pool_factor": 1, "recall_interval": 4}, budget=64,
                       dense_layers=1)
    alone = shared.forced(spec, tokens)
    recorders = []
    watched = shared.forced(spec, tokens, lambda method: recorders.append(churn.SelectionRecorder(method)))
    assert torch.equal(alone.log_probs, watched.log_probs)
    recorded = recorders[0].tensors()
    layers, steps = recorded["layers"], recorded["steps"]
    assert layers == list(range(1, tiny_qwen3.config.num_hidden_layers)) and steps == list(range(12))
    heads, kv_heads = tiny_qwen3.config.num_attention_heads, tiny_qwen3.config.num_key_value_heads
    assert recorded["q_true"].shape == (len(layers), 12, heads, recorded["k_sel"])
    assert recorded["kv_true"].shape == recorded["selected"].shape == (len(layers), 12, kv_heads, recorded["k_sel"])
    result = churn.readings(recorded)
    assert result["mean"]["recorder_matches_method"] == 1.0
    assert result["mean"]["cpu_share"] == pytest.approx(watched.method_stats["cpu_compute_ratio"]["mean"])
    # the recall profile of the recorded selections is profile-recall's of the method's own trace
    from scoutbench.bench.recall import profile_intervals

    args = argparse.Namespace(model="tiny-qwen3", dtype="fp32", budget=64, dense_layers=1, beta=0.12)
    run = {"recorded": recorded, "settings": {"record": "qasper#0", "record_id": "x", "len": 300, "steps": 12}}
    layers = tiny_qwen3.config.num_hidden_layers
    profile = churn.recall_profile([run], recorders[0].method, args, layers)
    own = profile_intervals([recorders[0].method.trace], recorders[0].method, layers, 0.12)
    assert {k: profile[k] for k in own} == own and profile["measured_on"]["records"][0]["index"] == 0


def _ids(sets: list[list[list[set[int]]]], width: int) -> torch.Tensor:
    """[layers][steps][heads] sets -> int16 ids padded with -1."""
    out = torch.full((len(sets), len(sets[0]), len(sets[0][0]), width), -1, dtype=torch.int16)
    for layer, by_step in enumerate(sets):
        for step, by_head in enumerate(by_step):
            for head, blocks in enumerate(by_head):
                out[layer, step, head, : len(blocks)] = torch.tensor(sorted(blocks))
    return out


def test_readings_equal_a_hand_count():
    """One layer, one KV head with two query heads, k = 4, three steps. Per KV head the predicted selection is
    {0,1,2,3} -> {0,1,2,4} -> {0,1,5,6}; the prefill's {0,1,2,3}; the pool holds {0,1,2,3} then {0,1,2,3,4}.
    Consecutive: (1 + 2) / 2 steps / k; vs prefill: (0 + 1 + 2) / 3 / k; the changed blocks off the pool:
    consecutive (0 + 2) / 2 / k, vs prefill (0 + 0 + 2) / 3 / k."""
    kv_pred = [[{0, 1, 2, 3}], [{0, 1, 2, 4}], [{0, 1, 5, 6}]]
    q_pred = [[{0, 1, 2, 3}, {0, 1, 2, 3}], [{0, 1, 2, 3}, {0, 1, 2, 3}], [{0, 1, 2, 3}, {0, 5, 6, 7}]]
    resident = [[{0, 1, 2, 3}], [{0, 1, 2, 3, 4}], [{0, 1, 2, 3, 4}]]
    device = [[{0, 1, 2, 3}], [{0, 1, 2, 4}], [{0, 1}]]
    recorded = {"layers": [2], "steps": [0, 1, 2], "k_sel": 4, "block_size": 8, "budget": 64, "num_kv_heads": 1,
                "num_heads": 2, "selected": _ids([kv_pred], 4), "device": _ids([device], 4),
                "resident": _ids([resident], 5), "kv_predicted": _ids([kv_pred], 4), "q_predicted": _ids([q_pred], 4),
                "kv_true": _ids([kv_pred], 4), "q_true": _ids([q_pred], 4),
                "prefill_kv": _ids([[[{0, 1, 2, 3}]]], 4)[:, 0], "prefill_q": _ids([[[{0, 1, 2, 3}] * 2]], 4)[:, 0]}
    mean = churn.readings(recorded)["mean"]
    assert mean["kv/selected/consecutive/predicted"] == pytest.approx((1 + 2) / 2 / 4)
    assert mean["kv/selected/prefill/predicted"] == pytest.approx((0 + 1 + 2) / 3 / 4)
    assert mean["kv/cpu/consecutive/predicted"] == pytest.approx((0 + 2) / 2 / 4)
    assert mean["kv/cpu/prefill/predicted"] == pytest.approx((0 + 0 + 2) / 3 / 4)
    # per query head: head 1 changes 3 blocks at step 2 (5, 6, 7), all off the pool; head 0 never changes
    assert mean["q/selected/consecutive/predicted"] == pytest.approx((0 + 3) / 2 / 2 / 4)
    assert mean["q/cpu/prefill/predicted"] == pytest.approx(3 / 3 / 2 / 4)
    # the CPU share as the method counts it: step 2 computes {5, 6} on the CPU, 2 blocks of 8 over 64 tokens
    assert mean["cpu_share"] == pytest.approx((0 + 0 + 2 * 8 / 64) / 3)
    assert mean["kv/overlap"] == 1.0 and mean["recorder_matches_method"] == 1.0


def test_a_churn_document_beside_sweep_results_is_skipped_by_their_readers(tmp_path):
    """The churn JSONs live under results/real-text-sweep/, which the projection and report read as results: a
    tool's output there is skipped, not an error."""
    from scoutbench.results import envelope, load_results, write_json_atomic

    write_json_atomic(tmp_path / "churn" / "qwen2.5-0.5b.json", {**envelope("selection_churn"), "model": "x"})
    skipped = []
    assert load_results([tmp_path]) == []
    assert load_results([tmp_path], lambda path, why: skipped.append(why)) == [] and "tool's output" in skipped[0]
