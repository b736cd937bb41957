"""ScoutAttention's periodic recall and device pool on tiny random models: S5 a recall empties the CPU part, S6
recall never changes oracle outputs, staging and copies, the paper's split of the selection, the pool's size, and
the offline recall profile (drift curve, interval choice, `profile-recall`)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from method_harness import assert_logits_close, ragged_prompt, run_engine
from scout_harness import REFERENCE_CFG, plans, scout_run
from scout_harness import prompt_300 as make_prompt_300

from scoutbench.errors import UsageError
from scoutbench.methods.scout import ScoutAttention


@pytest.fixture(scope="module")
def prompt_300(tiny_qwen3):
    return make_prompt_300(tiny_qwen3)


# ---------------------------------------------------------------------------------------------- S6: recall
def test_recall_never_changes_oracle_outputs(tiny_qwen3, prompt_300):
    prompt, lengths, tokens = prompt_300
    off = ScoutAttention(budget=64, block_size=4, oracle=True, pr=False, device_blocks="selected")
    on = ScoutAttention(budget=64, block_size=4, oracle=True, pr=True, recall_interval=1, device_blocks="selected")
    logits_off = scout_run(tiny_qwen3, off, prompt, lengths, tokens)
    logits_on = scout_run(tiny_qwen3, on, prompt, lengths, tokens)
    assert on.stats()["recall"]["issued"] > 0 and off.stats()["recall"]["issued"] == 0
    assert on.stats()["cpu_compute_ratio"]["mean"] < off.stats()["cpu_compute_ratio"]["mean"]
    assert_logits_close(logits_on, logits_off, atol=1e-5)


def test_recall_empties_the_cpu_part_for_the_same_selection(tiny_qwen3, prompt_300):
    """S5: after a recall at step t, the blocks the CPU computed at t are resident (and ready) at t+1."""
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, oracle=True, pr=True, recall_interval=1, beta=1.0)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    by_key = {(r["layer"], r["step"]): r for r in plans(method)}
    recalls = [r for r in method.trace if r["kind"] == "recall"]
    assert recalls
    for recall in recalls:
        before = by_key[(recall["layer"], recall["step"])]
        after = by_key.get((recall["layer"], recall["step"] + 1))
        if after is None:
            continue
        cpu_blocks = {(s, h, j) for s, row in enumerate(before["selected"]) for h, sel in enumerate(row)
                      for j in sel - before["device"][s][h]}
        assert set(map(tuple, recall["blocks"])) == cpu_blocks
        for s, h, j in cpu_blocks:
            assert j in after["resident"][s][h]
            if j in after["selected"][s][h]:
                assert j in after["device"][s][h]


def test_recall_copies_the_recalled_blocks_from_the_host_tier(tiny_qwen3, prompt_300, cpu_backend):
    """The CPU part attends in place (no gather buffer), so the worker stages only the recalled blocks from the host
    tier: after each recall the pool slots hold exactly those host blocks, and the bytes counted to the device are
    theirs (K and V) plus four int64 index lists, on both CPU attention backends."""
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, pr=True, recall_interval=2)
    recalls = []
    original = method._recall

    def checked(layer, plan, recall):
        before = method.counters.h2d_bytes
        original(layer, plan, recall)
        b, rows = method.block_size, method.ctx.batch * method.ctx.num_kv_heads
        pool_k = method.store.dev_k[layer].view(-1, b, method.ctx.head_dim)
        pool_v = method.store.dev_v[layer].view(-1, b, method.ctx.head_dim)
        for bh, slot, block in zip(recall.bh.tolist(), recall.slots.tolist(), recall.blocks.tolist(), strict=True):
            assert torch.equal(pool_k[bh * method.store.n_slots + slot], method.store.host_k[layer][block * rows + bh])
            assert torch.equal(pool_v[bh * method.store.n_slots + slot], method.store.host_v[layer][block * rows + bh])
        n = recall.bh.numel()
        assert method.counters.h2d_bytes - before == n * (2 * b * method.ctx.head_dim * 4 + 4 * 8)
        recalls.append(n)

    method._recall = checked
    scout_run(tiny_qwen3, method, prompt, lengths, tokens)
    assert recalls and sum(recalls) == method.stats()["recall"]["blocks"] > 0


def test_the_decode_waits_for_the_cpu_attention_not_the_recall_staging(tiny_qwen3, prompt_300, monkeypatch):
    """The worker stages a recall after it has handed over its attention result: the layer's wait ends before the
    staging does (a slow staging here: 50 ms), and the recall is still issued before the layer's next split."""
    from scoutbench.runtime.block_store import TieredBlockStore

    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, pr=True, recall_interval=2)
    original = TieredBlockStore.stage
    staged = []

    def slow_stage(store, layer, parity, bh, slots, blocks):
        time.sleep(0.05)
        original(store, layer, parity, bh, slots, blocks)
        staged.append(len(method.trace))  # where in the trace the staging ended

    monkeypatch.setattr(TieredBlockStore, "stage", slow_stage)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    recalls = [i for i, r in enumerate(method.trace) if r["kind"] == "recall"]
    assert 0 < len(recalls) <= len(staged) <= len(recalls) + 2  # the last step's may still be pending at the end
    waits = {(r["layer"], r["step"]): i for i, r in enumerate(method.trace) if r["kind"] == "wait"}
    for i, end in zip(recalls, staged, strict=False):  # recalls are issued in the order they were staged
        recall = method.trace[i]
        assert waits[(recall["layer"], recall["step"])] < end  # the layer's wait ended before its staging did
        nxt = [j for j, r in enumerate(method.trace) if r["kind"] == "plan" and r["layer"] == recall["layer"]
               and r["step"] == recall["step"] + 1]
        assert not nxt or i < nxt[0]  # issued before the layer's next selection


@pytest.mark.parametrize("device_blocks", [None, "resident"])
def test_device_part_reads_the_selected_resident_blocks_by_default(tiny_qwen3, prompt_300, device_blocks):
    """The paper's split (the default): the device part attends the resident blocks of this step's selection,
    the CPU part the selected blocks the pool does not hold, so the two together are the selection.
    `device_blocks="resident"` (the variant that exceeds the budget) attends every resident block on the device."""
    prompt, lengths, tokens = prompt_300
    mode = {} if device_blocks is None else {"device_blocks": device_blocks}
    method = ScoutAttention(budget=64, block_size=4, pr=True, recall_interval=2, **mode)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    extra = 0
    for record in plans(method):
        for s, row in enumerate(record["pool"]):
            for h, pool in enumerate(row):
                resident, selected = record["resident"][s][h], record["selected"][s][h]
                expected = resident if device_blocks == "resident" else resident & selected
                assert pool == expected
                extra += len(pool - selected)
    assert (extra > 0) == (device_blocks == "resident")  # the modes really differ on this run


@pytest.mark.parametrize("beta_trigger", [False, True])
def test_recall_is_periodic_unless_the_beta_trigger_is_on(tiny_qwen3, prompt_300, beta_trigger):
    """The paper recalls every I_l steps (intervals profiled offline from beta); the reactive beta trigger is an
    option. With beta 0 every step with CPU work would recall reactively."""
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, pr=True, recall_interval=4, beta=0.0, beta_trigger=beta_trigger)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
    steps = {(r["layer"], r["step"]) for r in method.trace if r["kind"] == "recall"}
    assert steps
    if not beta_trigger:
        assert all(step % 4 == 3 for _, step in steps), steps  # the 4th, 8th, ... visit of each layer
    else:
        assert any(step % 4 != 3 for _, step in steps)


# ---------------------------------------------------------------------------------------------- the device pool
def test_a_larger_pool_holds_more_blocks_and_leaves_less_to_the_cpu(tiny_qwen3, prompt_300):
    """The same selections (oracle), pools of 1 and 3 selections: the larger pool starts full (the top blocks of
    the last prompt query), keeps more than a selection resident, never more than its slots, evicts only within
    itself (a recall leaves the CPU's blocks resident), and leaves a smaller share of the budget to the CPU; the
    device bytes grow by exactly the pool's slots."""
    prompt, lengths, tokens = prompt_300
    runs = {}
    for factor in (1, 3):
        method = ScoutAttention(**REFERENCE_CFG, oracle=True, pr=True, recall_interval=2, pool_factor=factor)
        scout_run(tiny_qwen3, method, prompt, lengths, tokens, trace=True)
        runs[factor] = method
        resident = [len(res) for r in plans(method) for row in r["resident"] for res in row]
        assert max(resident) <= method.pool_slots
        by_key = {(r["layer"], r["step"]): r for r in plans(method)}
        for recall in (r for r in method.trace if r["kind"] == "recall"):
            after = by_key.get((recall["layer"], recall["step"] + 1))
            for s, h, j in (after and recall["blocks"]) or []:
                assert j in after["resident"][s][h]
    small, large = runs[1].stats(), runs[3].stats()
    assert small["blocks_resident_per_head"] <= runs[1].k_sel < large["blocks_resident_per_head"]
    assert large["cpu_compute_ratio"]["mean"] < small["cpu_compute_ratio"]["mean"]
    assert large["recall"]["blocks"] < small["recall"]["blocks"]
    # 2 * k_sel more slots in each sparse layer (2 of 4), for K and V, every KV head (2), of 4 tokens x 32 fp32
    k_sel = runs[1].k_sel
    assert large["device_kv_bytes"] - small["device_kv_bytes"] == 2 * 2 * 2 * (2 * k_sel) * 4 * 32 * 4


# ---------------------------------------------------------------------------------------------- recall profile
def test_drift_curve_and_interval_choice():
    from scoutbench.bench.recall import choose_interval, drift_curve

    masks = [torch.zeros(1, 1, 10, dtype=torch.bool) for _ in range(4)]
    for t, mask in enumerate(masks):
        mask[0, 0, t:t + 4] = True  # the selection slides by one block per step
    curve = drift_curve(masks, block_size=4, budget=32)
    assert curve == pytest.approx([1 * 4 / 32, 2 * 4 / 32, 3 * 4 / 32])
    assert choose_interval(curve, 0.26) == 2
    assert choose_interval(curve, 0.01) == 1
    assert choose_interval(curve, 1.0) == 3
    assert drift_curve(masks, block_size=4, budget=32, pool_blocks=4) == curve  # a pool of one selection


def test_a_pool_of_two_selections_keeps_an_alternating_selection():
    """The selection alternates between two disjoint sets A, B: a pool of one selection misses the other set
    at every odd lag; a pool of two holds both once both have been selected (from origin 1 on)."""
    from scoutbench.bench.recall import drift_curve

    masks = [torch.zeros(1, 1, 10, dtype=torch.bool) for _ in range(4)]
    for t, mask in enumerate(masks):
        mask[0, 0, (0, 1, 2, 3) if t % 2 == 0 else (5, 6, 7, 8)] = True
    block = 4 / 32  # one block of 4 tokens over the budget
    assert drift_curve(masks, 4, 32) == pytest.approx([4 * block, 0.0, 4 * block])
    assert drift_curve(masks, 4, 32, pool_blocks=8) == pytest.approx([4 / 3 * block, 0.0, 4 * block])


def test_profile_recall_writes_a_profile_scout_accepts(tmp_path, tiny_qwen3):
    from scoutbench.bench.recall import profile_recall
    from scoutbench.models import LoadedModel

    loaded = LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True)
    result = profile_recall("tiny-qwen3", 200, 8, 0.3, device="cpu", method_args={"budget": "64", "block_size": "4"},
                            loaded=loaded)
    intervals = result["intervals"]
    assert intervals[:2] == [None, None] and all(1 <= i <= 7 for i in intervals[2:])
    assert len(result["drift"][2]) == 7 and len(result["ratio_without_recall"][2]) == 8
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(result))
    method = ScoutAttention(budget=64, block_size=4, recall_profile=str(path), oracle=True)
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [120], seed=0)
    run_engine(tiny_qwen3, method, prompt, lengths, [torch.tensor([1])] * 3)
    assert method.stats()["recall"]["intervals"] == intervals
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"intervals": [None, 3]}))
    with pytest.raises(UsageError):
        run_engine(tiny_qwen3, ScoutAttention(budget=64, block_size=4, recall_profile=str(wrong)), prompt, lengths,
                   [torch.tensor([1])])


def test_profile_recall_on_real_records_says_what_it_measured(smollm2, tmp_path, monkeypatch, capsys):
    """`profile-recall --dataset` profiles real LongBench records (each on its own, curves averaged), records
    which in the profile, and a run that uses the profile reports it."""
    from cli_runner import run_cli

    from scoutbench.bench.recall import longbench_prompts, profile_recall
    from scoutbench.workloads import longbench

    data = "tests/data/longbench"
    out = tmp_path / "profile.json"
    monkeypatch.setattr("scoutbench.models.load_model", lambda *a, **k: smollm2)
    code, stdout, stderr = run_cli(monkeypatch, capsys, "profile-recall", "--model", "smollm2-135m", "--dataset",
                                   "qasper", "--data-dir", data, "--limit", "2", "--len", "240", "--steps", "3",
                                   "--budget", "128", "--block-size", "8", "--method-arg", "pool_factor=2",
                                   "--device", "cpu", "--dtype", "fp32", "-o", out)
    assert code == 0, stderr
    profile = json.loads(out.read_text())
    measured = profile["measured_on"]
    rows, source = longbench.load_task_data("qasper", data)
    assert measured["prompts"] == "longbench" and measured["dataset"] == "qasper"
    assert [r["_id"] for r in measured["records"]] == [row["_id"] for row in rows[:2]]
    assert measured["data_source"] == source and all(r["tokens"] == 240 for r in measured["records"])
    assert profile["pool_slots"] == 2 * profile["k_sel"] and "measured on longbench (qasper: 2" in stdout
    method = ScoutAttention(budget=128, block_size=8, recall_profile=str(out))
    prompt, lengths = ragged_prompt(smollm2.model.config.vocab_size, [200], seed=0)
    run_engine(smollm2.model, method, prompt, lengths, [torch.tensor([1])])
    assert method.stats()["recall"]["profile"] == {"path": str(out), "measured_on": measured}
    random = profile_recall("smollm2-135m", 200, 2, 0.3, device="cpu", method_args={"budget": "128", "block_size": "8"},
                            loaded=smollm2)
    assert random["measured_on"]["prompts"] == "random tokens"
    code, _, stderr = run_cli(monkeypatch, capsys, "profile-recall", "--dataset", "qasper", "--prefill", "synthetic",
                              "-o", tmp_path / "x.json")
    assert code == 2 and "drop --prefill synthetic" in stderr
    # only records of at least --len tokens (qasper's have 257, 243 and 216 with this tokenizer)
    assert [r["index"] for r in longbench_prompts("qasper", data, smollm2.tokenizer, 250, 2).measured_on["records"]
            ] == [0]
    with pytest.raises(UsageError, match="no qasper record has 1000000 prompt tokens"):
        longbench_prompts("qasper", data, smollm2.tokenizer, 10**6, 1)
    # several datasets: one profile over each one's first --limit records, listed in order with their dataset
    both = longbench_prompts(["qasper", "2wikimqa"], data, smollm2.tokenizer, 150, 1)
    alone = [longbench_prompts(name, data, smollm2.tokenizer, 150, 1) for name in ("qasper", "2wikimqa")]
    assert both.prompts == [p for part in alone for p in part.prompts]
    assert both.measured_on["dataset"] == "qasper,2wikimqa"
    assert both.measured_on["records"] == [{"dataset": name, **part.measured_on["records"][0]}
                                           for name, part in zip(("qasper", "2wikimqa"), alone, strict=True)]
    assert both.measured_on["data_source"] == {name: part.measured_on["data_source"]
                                               for name, part in zip(("qasper", "2wikimqa"), alone, strict=True)}


def test_cli_commands(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from scoutbench.cli import cli

    runner = CliRunner()
    out = tmp_path / "p.json"
    result = runner.invoke(cli, ["profile-recall", "--len", "160", "--steps", "4", "--budget", "64", "--block-size",
                                 "4", "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["intervals"][:2] == [None, None]
    result = runner.invoke(cli, ["cosine", "--len", "48", "--steps", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"model", "mean", "per_layer"} <= set(data) and len(data["per_layer"]) == 3
    bad = runner.invoke(cli, ["profile-recall", "--len", "160", "--method-arg", "budget=8", "-o", str(out)])
    assert bad.exit_code != 0
