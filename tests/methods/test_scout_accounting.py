"""ScoutAttention's accounting and configuration: S4 the device part is selected and resident, S7 0 <= CPU compute
ratio <= 1, the ratio, recall and transfer counters against the traced sets, field validation, registry aliases,
the memory footprint and the pool's size in the planner."""

from __future__ import annotations

import json

import pytest
from scout_harness import plans, scout_run
from scout_harness import prompt_300 as make_prompt_300

from scoutbench.errors import UsageError
from scoutbench.methods.base import ModelShape
from scoutbench.methods.scout import ScoutAttention


@pytest.fixture(scope="module")
def prompt_300(tiny_qwen3):
    return make_prompt_300(tiny_qwen3)


# ---------------------------------------------------------------------------------------------- accounting (S4, S7)
def test_ratio_and_byte_counters_match_the_sets(tiny_qwen3, prompt_300):
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, pr=True, recall_interval=3, beta=0.5)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    stats = method.stats()
    b, budget, k_sel = method.block_size, method.budget, method.k_sel
    for layer in range(4):
        records = plans(method, layer)
        if layer < 2:
            assert not records and stats["cpu_compute_ratio"]["per_layer"][layer] is None
            continue
        ratios = []
        for r in records:
            cpu_tokens = []
            for srow, drow, rrow in zip(r["selected"], r["device"], r["resident"], strict=False):
                for sel, dev, res in zip(srow, drow, rrow, strict=False):
                    assert dev <= sel and dev <= res  # S4: device part = selected and resident
                    assert len(sel) <= k_sel and len(sel) * b + (1 + 1 + 1) * b <= budget
                    assert len(res) <= method.pool_slots
                    cpu_tokens.append(len(sel - dev) * b)
            ratio = sum(cpu_tokens) / len(cpu_tokens) / budget
            assert 0.0 <= ratio <= 1.0  # S7
            ratios.append(ratio)
        assert stats["cpu_compute_ratio"]["per_layer"][layer] == pytest.approx(sum(ratios) / len(ratios))
    recalled = [r for r in method.trace if r["kind"] == "recall"]
    blocks = sum(len(r["blocks"]) for r in recalled)
    assert stats["recall"]["issued"] == len(recalled) > 0
    assert stats["recall"]["blocks"] == blocks
    assert stats["recall"]["bytes"] == blocks * 2 * b * 32 * 4  # K+V, head_dim 32, fp32
    assert stats["cpu_attention_ms"] > 0 and stats["idle_ms"] >= 0
    assert stats["blocks_selected_per_head"] <= k_sel


def test_transfer_bytes_count_what_is_copied(tiny_qwen3, prompt_300):
    """Recall off: per sparse layer and step the query and the plan payload go to the host, each
    completed block goes to the host tier, the CPU part's output and LSE come back when it is not empty, and a
    block leaving the local window moves device-to-device (its indices are computed on the device: nothing crosses).
    tests/emulation/test_emulated_cuda.py checks the same counters against the bytes the emulated CUDA path copies."""
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, pr=False)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    ctx, k = method.ctx, method.k_sel
    B, H, Hkv, D = ctx.batch, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim
    sparse = ctx.num_layers - method.dense_layers
    records = plans(method)
    positions = [300 + i for i in range(len(tokens))]
    completed = sum((p + 1) % 4 == 0 for p in positions)
    d2h = len(records) * (B * H * D * 4 + B * Hkv * (3 * k + 4) * 8) + sparse * completed * B * Hkv * 4 * D * 4 * 2
    cpu_parts = sum(any(s - d for srow, drow in zip(r["selected"], r["device"], strict=True)
                        for s, d in zip(srow, drow, strict=True)) for r in records)
    h2d = cpu_parts * B * H * (D + 1) * 4
    stats = method.stats()
    assert stats["d2h_bytes_per_step"] * len(tokens) == d2h
    assert stats["h2d_bytes_per_step"] * len(tokens) == h2d
    assert cpu_parts > 0


# ---------------------------------------------------------------------------------------------- fields, footprint
def test_field_validation_and_from_args(tmp_path):
    method = ScoutAttention.from_args({"budget": "1k", "pc": "off", "pred_norm": "self", "beta": "0.2"})
    assert (method.budget, method.pc, method.pred_norm, method.beta) == (1024, False, "self", 0.2)
    assert method.k_sel == 1024 // 32 - 3
    for bad in ({"nope": "1"}, {"budget": "64"}, {"pred_norm": "prev"}, {"beta": "2"}, {"block_size": "0"},
                {"recall_profile": str(tmp_path / "missing.json")}, {"cpu_workers": "0"}):
        with pytest.raises(UsageError):
            ScoutAttention.from_args(bad)
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text(json.dumps({"intervals": [0, "x"]}))
    with pytest.raises(UsageError):
        ScoutAttention.from_args({"recall_profile": str(bad_profile)})


def test_registry_aliases():
    from scoutbench.methods import METHODS

    assert METHODS.load("scout") is ScoutAttention
    base = ScoutAttention.from_args({}, METHODS.preset("scout-base"))
    assert (base.pc, base.pr) == (False, False)
    assert (ScoutAttention().pc, ScoutAttention().pr) == (True, True)


def test_memory_footprint_formula():
    shape = ModelShape(num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128, hidden_size=5120,
                       intermediate_size=17408, vocab_size=151936)
    method = ScoutAttention(pool_factor=1)  # a pool of one selection: the region is the budget's blocks
    fp = method.memory_footprint(shape, 65536, 2)
    kv = 2 * 8 * 128 * 2
    n_blocks = 65536 // 32
    k_sel = 2048 // 32 - 3
    block_table = 8 * ((n_blocks + 1) * 8 + (k_sel + 1) * 9)  # per KV head: block -> slot, slot -> block + ready
    staging_and_mask = k_sel * 32 * kv + 8 * 64 * 8  # + the region's open tokens per slot (int64)
    assert fp.device_bytes_per_seq == (2 * 65536 * kv + 38 * (n_blocks * 2 * 8 * 128 * 2 + 2048 * kv + block_table)
                                       + staging_and_mask)
    assert fp.host_bytes_per_seq == 38 * 65536 * kv + 2 * k_sel * 32 * kv  # + the recall's two staging buffers
    assert fp.prefill_bytes_per_seq == (4096 + k_sel * 32) * kv // 2
    odd = method.memory_footprint(shape, 100, 2)
    assert odd.device_bytes_per_seq == (2 * 100 * kv + 38 * (4 * 2 * 8 * 128 * 2 + 2048 * kv + 8 * (5 * 8 + 62 * 9))
                                        + staging_and_mask)
    with pytest.raises(UsageError, match="nothing would run sparse"):  # every layer dense: refused, not planned
        ScoutAttention(dense_layers=50).memory_footprint(shape, 1000, 2)
    # a pool of 3 selections: 2 * k_sel more slots per sparse layer (K/V, their table entries, their open tokens);
    # the host tier and the recall's staging (one selection) do not change
    pooled = ScoutAttention(pool_factor=3).memory_footprint(shape, 65536, 2)
    extra_slots = 2 * k_sel
    assert pooled.device_bytes_per_seq - fp.device_bytes_per_seq == (
        38 * (extra_slots * 32 * kv + 8 * extra_slots * 9) + 8 * extra_slots * 8)
    assert pooled.host_bytes_per_seq == fp.host_bytes_per_seq


def test_pool_factor_sizes_the_pool_not_the_budget():
    one = ScoutAttention(budget=64, block_size=4, pool_factor=1)
    assert one.pool_slots == one.k_sel == 13
    assert ScoutAttention(budget=64, block_size=4).pool_slots == 39  # the default: three selections
    assert ScoutAttention(budget=64, block_size=4, pool_factor=1.5).pool_slots == 20  # round(19.5): banker's
    assert ScoutAttention(budget=64, block_size=4, pool_factor=2).k_sel == 13
    for bad in ("0.5", "0"):
        with pytest.raises(UsageError, match="pool_factor"):
            ScoutAttention.from_args({"pool_factor": bad})


def test_the_planner_fits_fewer_sequences_as_the_pool_grows():
    from scoutbench.planning import plan_method

    shape = ModelShape(num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128, hidden_size=5120,
                       intermediate_size=17408, vocab_size=151936)
    batches = [plan_method(ScoutAttention(pool_factor=f), shape, 65536, 2, 80 * 1024**3).max_batch
               for f in (1, 2, 3, 4)]
    assert batches == sorted(batches, reverse=True) and batches[0] > batches[-1]
