"""ScoutAttention on tiny random models (CPU, fp32): exactness reductions (S1 oracle mode = the same selection on the
device alone, S2 oracle mode with a covering budget = FullKV, S4 the device and CPU parts split the selection, S5 a
recall empties the CPU part, S6 recall never changes oracle outputs, S7 0 <= CPU compute ratio <= 1), the layer-ahead
pipeline, periodic recall, accounting, edge cases, the recall profile and the query-cosine tool."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch
from method_harness import assert_logits_close, fullkv_reference, ragged_prompt, run_engine

from scoutbench.errors import UsageError
from scoutbench.kernels.attention import partial_attention
from scoutbench.kernels.digest import block_digests, select_top_blocks, upper_bound_scores
from scoutbench.methods.base import ModelShape
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.scout import ScoutAttention


# ---------------------------------------------------------------------------------------------- references
@dataclasses.dataclass
class SelectionReference(FullKV):
    """Device-only Quest-style attention with ScoutAttention's selection rules and always-on blocks, computed the
    plain way: the true query's top-k_sel selectable blocks plus sink, local and tail tokens, gathered and attended
    in one partial attention per (sequence, KV head). Also records the selected sets."""

    name = "selection-reference"
    budget: int = 64
    block_size: int = 4
    dense_layers: int = 2
    sink_blocks: int = 1
    local_blocks: int = 1

    def bind(self, ctx):
        super().bind(ctx)
        self.k_sel = self.budget // self.block_size - self.sink_blocks - self.local_blocks - 1
        self.selections: list[dict] = []

    def decode(self, layer, q, k, v):
        dense_out = super().decode(layer, q, k, v)  # writes the new token
        if layer < self.dense_layers:
            return dense_out
        b, ctx = self.block_size, self.ctx
        positions = self.step.positions_host
        num_scored = max(1, max(positions) // b)
        keys, values = self.keys[layer], self.values[layer]
        kmax, kmin = block_digests(keys[:, :, : num_scored * b], b)
        scores = upper_bound_scores(q, kmax, kmin)
        limit = (torch.tensor(positions) // b - self.local_blocks).clamp(min=0)
        excluded = (torch.arange(num_scored) < self.sink_blocks)[None, None, :] if self.sink_blocks else None
        ids, count = select_top_blocks(scores, limit, self.k_sel, excluded)
        count = count.expand(ctx.batch, ctx.num_kv_heads)
        out = torch.zeros(q.shape, dtype=torch.float32)
        group = ctx.num_heads // ctx.num_kv_heads
        record = []
        for s, p in enumerate(positions):
            tail = p // b
            row = []
            for h in range(ctx.num_kv_heads):
                chosen = sorted(int(j) for j in ids[s, h, : int(count[s, h])])
                row.append(set(chosen))
                always = [j for j in range(min(self.sink_blocks, tail))]
                always += [j for j in range(max(self.sink_blocks, tail - self.local_blocks), tail)]
                blocks = sorted(set(chosen) | set(always))
                assert len(blocks) == len(chosen) + len(always)  # disjoint
                tokens = [j * b + t for j in blocks for t in range(b)] + list(range(tail * b, p + 1))
                idx = torch.tensor(tokens)
                heads = slice(h * group, (h + 1) * group)
                state = partial_attention(q[s:s + 1, heads], keys[s:s + 1, h:h + 1, idx], values[s:s + 1, h:h + 1, idx],
                                          ctx.scale)
                out[s, heads] = state.o[0]
            record.append(row)
        self.selections.append({"layer": layer, "step": self.step.index, "selected": record})
        return out.to(q.dtype)


def tokens_for(model, prompt, lengths, steps):
    _, tokens = fullkv_reference(model, prompt, lengths, steps)
    return tokens


def scout_run(model, method, prompt, lengths, tokens, trace=False):
    if trace:
        method.trace = []
    logits = run_engine(model, method, prompt, lengths, tokens)
    return logits


def plans(method, layer=None):
    return [r for r in method.trace if r["kind"] == "plan" and (layer is None or r["layer"] == layer)]


@pytest.fixture(scope="module")
def prompt_300(tiny_qwen3):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [300], seed=3)
    return prompt, lengths, tokens_for(tiny_qwen3, prompt, lengths, 8)


REFERENCE_CFG = dict(budget=64, block_size=4, dense_layers=2, sink_blocks=1, local_blocks=1)


@pytest.fixture(scope="module")
def reference_300(tiny_qwen3, prompt_300):
    """The device-only selection reference on prompt_300 (logits and selected sets), computed once."""
    prompt, lengths, tokens = prompt_300
    method = SelectionReference(**REFERENCE_CFG)
    logits = run_engine(tiny_qwen3, method, prompt, lengths, tokens)
    return logits, {(r["layer"], r["step"]): r["selected"] for r in method.selections}


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
        before = method._h2d_bytes
        original(layer, plan, recall)
        b, rows = method.block_size, method.ctx.batch * method.ctx.num_kv_heads
        pool_k = method.store.dev_k[layer].view(-1, b, method.ctx.head_dim)
        pool_v = method.store.dev_v[layer].view(-1, b, method.ctx.head_dim)
        for bh, slot, block in zip(recall.bh.tolist(), recall.slots.tolist(), recall.blocks.tolist(), strict=True):
            assert torch.equal(pool_k[bh * method.store.n_slots + slot], method.store.host_k[layer][block * rows + bh])
            assert torch.equal(pool_v[bh * method.store.n_slots + slot], method.store.host_v[layer][block * rows + bh])
        n = recall.bh.numel()
        assert method._h2d_bytes - before == n * (2 * b * method.ctx.head_dim * 4 + 4 * 8)
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

    def slow_stage(store, layer, parity, bh, blocks):
        time.sleep(0.05)
        original(store, layer, parity, bh, blocks)
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


# ---------------------------------------------------------------------------------------------- RoPE / prediction
@pytest.fixture(scope="module")
def identity_layers_model():
    """tiny-qwen3 whose layers 0..L-2 add nothing to the residual stream (o_proj and down_proj zeroed), so the
    layer-ahead prediction with pred_norm='next' is exactly the next layer's true query."""
    from scoutbench.models import load_model

    model = load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model
    with torch.no_grad():
        for layer in model.model.layers[:-1]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _record_outputs(method):
    outputs = []
    original = method.decode

    def decode(layer, q, k, v):
        out = original(layer, q, k, v)
        outputs.append((layer, out.clone()))
        return out

    method.decode = decode
    return outputs


def test_layer_ahead_prediction_exact_when_layers_are_identities(identity_layers_model):
    model = identity_layers_model
    prompt, lengths = ragged_prompt(model.config.vocab_size, [300], seed=4)
    tokens = tokens_for(model, prompt, lengths, 6)
    cfg = dict(budget=64, block_size=4, dense_layers=1)
    oracle = ScoutAttention(**cfg, oracle=True)
    predicted = ScoutAttention(**cfg, pc=True)
    out_oracle, out_pred = _record_outputs(oracle), _record_outputs(predicted)
    scout_run(model, oracle, prompt, lengths, tokens, trace=True)
    scout_run(model, predicted, prompt, lengths, tokens, trace=True)
    assert all(r["predicted"] for r in plans(predicted))
    assert [r["selected"] for r in plans(oracle)] == [r["selected"] for r in plans(predicted)]
    for (la, a), (lb, b) in zip(out_oracle, out_pred, strict=False):
        assert la == lb
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_unrotated_prediction_breaks_the_rope_sensitive_test(identity_layers_model, monkeypatch):
    """Mutation check: the predicted query is rotated at the current position, as the digests' keys are; without
    RoPE it selects other blocks and changes the outputs, so the exactness test above would fail."""
    from scoutbench.engine import DecodeEngine

    model = identity_layers_model
    prompt, lengths = ragged_prompt(model.config.vocab_size, [300], seed=4)
    tokens = tokens_for(model, prompt, lengths, 6)
    cfg = dict(budget=64, block_size=4, dense_layers=1)
    oracle = ScoutAttention(**cfg, oracle=True)
    out_oracle = _record_outputs(oracle)
    scout_run(model, oracle, prompt, lengths, tokens, trace=True)

    def unrotated(self, target_layer, hidden, normed=None):
        layer = self.layers[target_layer]
        x = layer.input_layernorm(hidden) if normed is None else normed
        q = layer.self_attn.q_proj(x).view(x.shape[0], -1, self.head_dim)
        return layer.self_attn.q_norm(q)  # the mutation: no rotation at the current position

    monkeypatch.setattr(DecodeEngine, "predict_query", unrotated)
    mutant = ScoutAttention(**cfg, pc=True)
    out_mutant = _record_outputs(mutant)
    scout_run(model, mutant, prompt, lengths, tokens, trace=True)
    differing = sum(a["selected"] != b["selected"] for a, b in zip(plans(oracle), plans(mutant), strict=False))
    assert differing > 0
    assert any(not torch.allclose(a, b, atol=1e-5) for (_, a), (_, b) in zip(out_oracle, out_mutant, strict=False))


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


def test_pc_submits_next_layer_before_the_device_part(tiny_qwen3, prompt_300):
    """Structural overlap check: with pc on, layer l+1's CPU task is submitted before layer l's device part
    runs, and it runs on a worker thread; with pc off it is submitted within layer l+1, before its device part."""
    prompt, lengths, tokens = prompt_300
    for pc in (True, False):
        method = ScoutAttention(budget=64, block_size=4, pc=pc)
        scout_run(tiny_qwen3, method, prompt, lengths, tokens[:3], trace=True)
        events = [(r["kind"], r["step"], r["layer"], r["thread"]) for r in method.trace
                  if r["kind"] in ("submit", "device", "wait", "cpu")]
        for step in range(3):
            order = [(kind, layer) for kind, s, layer, _ in events if s == step and kind != "cpu"]
            if pc:
                assert order.index(("submit", 3)) < order.index(("device", 2))
                assert order.index(("submit", 2)) < order.index(("device", 2))  # submitted during layer 1
            else:
                assert order.index(("submit", 3)) > order.index(("wait", 2))
                assert order.index(("submit", 3)) < order.index(("device", 3))
        main = threading.current_thread().name
        assert all(thread.startswith("scoutbench-cpu") and thread != main
                   for kind, _, _, thread in events if kind == "cpu")


def test_dense_layers_zero_runs_layer_zero_synchronously(tiny_qwen3, prompt_300):
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, dense_layers=0)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens[:2], trace=True)
    assert all(not r["predicted"] for r in plans(method, 0))
    assert all(r["predicted"] for layer in (1, 2, 3) for r in plans(method, layer))
    assert [r for r in method.trace if r["kind"] == "cpu" and r["layer"] == 0][0]["thread"] == \
        threading.current_thread().name


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


# ---------------------------------------------------------------------------------------------- the device pool
def test_pool_factor_sizes_the_pool_not_the_budget():
    one = ScoutAttention(budget=64, block_size=4, pool_factor=1)
    assert one.pool_slots == one.k_sel == 13
    assert ScoutAttention(budget=64, block_size=4).pool_slots == 26  # the default: two selections
    assert ScoutAttention(budget=64, block_size=4, pool_factor=1.5).pool_slots == 20  # round(19.5): banker's
    assert ScoutAttention(budget=64, block_size=4, pool_factor=2).k_sel == 13
    for bad in ("0.5", "0"):
        with pytest.raises(UsageError, match="pool_factor"):
            ScoutAttention.from_args({"pool_factor": bad})


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


def test_the_planner_fits_fewer_sequences_as_the_pool_grows():
    from scoutbench.planning import plan_method

    shape = ModelShape(num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128, hidden_size=5120,
                       intermediate_size=17408, vocab_size=151936)
    batches = [plan_method(ScoutAttention(pool_factor=f), shape, 65536, 2, 80 * 1024**3).max_batch
               for f in (1, 2, 3, 4)]
    assert batches == sorted(batches, reverse=True) and batches[0] > batches[-1]


# ---------------------------------------------------------------------------------------------- profile, cosine
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


def test_query_cosine(tiny_qwen3, identity_layers_model):
    from scoutbench.bench.cosine import query_cosine
    from scoutbench.models import LoadedModel

    result = query_cosine("tiny-qwen3", 64, 3, device="cpu", loaded=LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
    assert result["model"] == "tiny-qwen3" and len(result["per_layer"]) == 3
    assert all(-1.0 <= c <= 1.0 for c in result["per_layer"])
    exact = query_cosine("identity", 64, 3, device="cpu",
                         loaded=LoadedModel(identity_layers_model, "identity", "preset", True))
    assert exact["per_layer"] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)


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


def test_query_prediction_is_accurate_on_a_real_model(smollm2):
    """The premise of layer-ahead pre-computation on real weights (paper Table 1: 0.93-0.97): past the first two
    layers, Q_pred^{i+1} from layer i's input is within cosine 0.9 of the true query (SmolLM2-135M)."""
    from scoutbench.bench.cosine import query_cosine

    result = query_cosine("smollm2-135m", 256, 4, device="cpu", loaded=smollm2)
    assert len(result["per_layer"]) == 29
    assert min(result["per_layer"][2:]) >= 0.9, result["per_layer"]
    assert result["mean"] > 0.85


def _license_text_prompt(tokenizer, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_tokens` tokens of real English prose (CPython's LICENSE.txt, shipped with every Python install)."""
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        pytest.skip(f"no {path} in this Python install")
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"][:num_tokens]
    assert len(ids) == num_tokens
    return torch.tensor([ids]), torch.tensor([num_tokens])


def test_budget_covering_the_context_equals_fullkv_on_a_real_model(smollm2):
    """Regression: with the default layer-ahead prediction and recall, a budget that covers the
    whole context leaves nothing to the CPU, so scout equals FullKV up to fp32 summation order. Before the fix a
    block leaving the local window became host-only and was attended on the CPU with the *predicted* query (KL
    1e-5 at each block boundary on SmolLM2). The decode crosses a block boundary at position 304."""
    model = smollm2.model
    prompt, lengths = _license_text_prompt(smollm2.tokenizer, 300)
    reference, tokens = fullkv_reference(model, prompt, lengths, 10)
    method = ScoutAttention(budget=512, block_size=16)
    ours = scout_run(model, method, prompt, lengths, tokens)
    assert method.stats()["cpu_compute_ratio"]["mean"] == 0.0
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), f"step {step}"
        kl = (b.log_softmax(-1).exp() * (b.log_softmax(-1) - a.log_softmax(-1))).sum()
        assert abs(float(kl)) < 1e-6, f"step {step}: KL {float(kl):.3g}"
    assert_logits_close(ours, reference, atol=2e-3)


def test_transfer_bytes_count_what_is_copied(tiny_qwen3, prompt_300):
    """Recall off: per sparse layer and step the query and the plan payload go to the host, each
    completed block goes to the host tier, the CPU part's output and LSE come back when it is not empty, and a
    block leaving the local window moves device-to-device (its indices are computed on the device: nothing crosses).
    tests/test_emulated_cuda.py checks the same counters against the bytes the emulated CUDA path copies."""
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
