"""HGCA against its invariants (H1-H3): FullKV with every CPU token selected (H1), a budget covering the
context, or a 100% window (H3), window and host partitions that hold every token exactly once across migrations (H2),
the CPU selection (sinks, then the top tokens by moving average: per KV head by the group's maximum with a budget,
per query head without) merged exactly with the window, the budget attended exactly, the documented moving-average
rule, and a moving-average update that the next layer's CPU attention never waits for."""

import json
import math
import threading
import time

import pytest
import torch
from cli_runner import run_cli
from method_harness import (
    fullkv_reference,
    hand_context,
    ragged_prompt,
    run_engine,
    step_info,
)

from scoutbench.errors import UsageError
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.hgca import HGCA


def _drain(method):
    """Wait for both workers (CPU attention; moving averages and migrated tokens)."""
    method.drain()


# ragged lengths select in score order per row; equal lengths take the faster unordered top-k
@pytest.mark.parametrize(("model_name", "lengths"), [("tiny_qwen3", [50, 31]), ("tiny_llama", [50, 31]),
                                                     ("tiny_mha", [44, 44])])
def test_every_cpu_token_equals_fullkv(model_name, lengths, request, cpu_backend):
    model = request.getfixturevalue(model_name)
    prompt, lengths = ragged_prompt(model.config.vocab_size, lengths)
    reference, tokens = fullkv_reference(model, prompt, lengths, steps=10)
    method = HGCA(budget=None, cpu_topk_frac=1.0, migrate_block=4, dense_layers=0)
    ours = run_engine(model, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert method.split != [n - math.ceil(n / 4) for n in lengths.tolist()]  # tokens migrated during the run
    assert 0.5 < method.stats()["cpu_pair_fraction"] < 1.0


def test_one_sparse_layer_reads_only_admitted_tokens(tiny_llama):
    """With a single sparse layer the next sparse layer is the same layer, so its deferred
    moving-average update and admission must reach the worker before its next CPU attention (queued behind it,
    the attention read 2 host tokens not yet admitted and the logits moved by 0.065)."""
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [50, 31])
    reference, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=10)
    method = HGCA(budget=None, cpu_topk_frac=1.0, migrate_block=4, dense_layers=tiny_llama.config.num_hidden_layers - 1)
    ours = run_engine(tiny_llama, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert list(method.sparse_layers) == [3] and method.split != [n - math.ceil(n / 4) for n in lengths.tolist()]


def test_a_migration_waits_for_the_previous_admission_of_its_layer(tiny_llama):
    """A budget that leaves the CPU nothing to attend migrates a token every step and never waits on the worker:
    the next migration must not overwrite the staging buffer before the worker admitted the previous one (a slow
    worker is simulated by delaying every admission)."""
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [20])
    _, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=6)
    fullkv = FullKV()
    run_engine(tiny_llama, fullkv, prompt, lengths, tokens)
    # cpu_take 0 and a migration every step
    method = HGCA(budget=8, window_share=0.875, migrate_block=1, sink_tokens=0, dense_layers=0)
    admit = method._admit
    method._admit = lambda *args: (time.sleep(0.05), admit(*args))

    def drain_at_the_end(engine):
        if engine.step_index == len(tokens):
            method.drain()

    run_engine(tiny_llama, method, prompt, lengths, tokens, on_step=drain_at_the_end)
    split = method.split[0]
    assert split == 20 - 7 + 6 and max(method.cpu_take) == 0
    for layer in method.sparse_layers:
        assert torch.equal(method.host_k[layer][0, :, :split], fullkv.keys[layer][0, :, :split])
        assert torch.equal(method.host_v[layer][0, :, :split], fullkv.values[layer][0, :, :split])


def test_full_window_equals_fullkv_with_an_empty_cpu_part(tiny_qwen3):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [40, 23])
    reference, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, steps=5)
    method = HGCA(budget=None, window_frac=1.0, dense_layers=0)
    ours = run_engine(tiny_qwen3, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert method.split == [0, 0] and method.stats()["cpu_tokens_per_layer"] == [0.0] * 4


def test_window_and_host_hold_every_token_exactly_once(tiny_llama):
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [50, 31])
    _, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=24)
    fullkv = FullKV()
    run_engine(tiny_llama, fullkv, prompt, lengths, tokens)  # layer 0's K/V depend on the tokens only
    method = HGCA(budget=None, migrate_block=4, dense_layers=0)
    splits = []

    def check(engine):
        _drain(method)
        for b, num_tokens in enumerate(engine.positions_host):
            split = method.split[b]
            window = num_tokens - split
            assert 0 < window <= method.window_capacity
            assert 0 <= window - method.window_target(num_tokens) < method.migrate_block
            for host, recent, full in ((method.host_k[0], method.window_k[0], fullkv.keys[0]),
                                       (method.host_v[0], method.window_v[0], fullkv.values[0])):
                assert torch.equal(host[b, :, :split], full[b, :, :split])
                assert torch.equal(recent[b, :, :window], full[b, :, split:num_tokens])
        splits.append(list(method.split))

    run_engine(tiny_llama, method, prompt, lengths, tokens, on_step=check)
    assert all(len({s[b] for s in splits}) >= 4 for b in range(2))  # several migrations per sequence


def _bound_hgca(lengths, num_kv_heads, seed=0, **fields):
    generator = torch.Generator().manual_seed(seed)
    ctx = hand_context(batch=len(lengths), max_len=max(lengths) + 1, num_kv_heads=num_kv_heads)
    method = HGCA(**{"dense_layers": 0, **fields})  # every layer sparse
    method.bind(ctx)
    shape = (len(lengths), num_kv_heads, max(lengths), ctx.head_dim)
    prompt = []
    for layer in range(ctx.num_layers):
        k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        q_obs = torch.randn((len(lengths), ctx.num_heads, min(lengths), ctx.head_dim), generator=generator)
        method.ingest_prefill(layer, q_obs, k, v, torch.tensor(lengths))
        prompt.append((q_obs, k, v))
    return method, ctx, prompt, generator


@pytest.mark.parametrize("observed_queries", [32, 5])  # all 13 the engine observed, or the last 5 of them
def test_moving_average_starts_from_the_observed_queries(observed_queries):
    lengths = [40, 13]
    method, ctx, prompt, _ = _bound_hgca(lengths, num_kv_heads=2, observed_queries=observed_queries)
    q_obs, k, _ = prompt[1]
    observed, group = q_obs.shape[2], ctx.num_heads // ctx.num_kv_heads
    window = min(observed, observed_queries)
    for b, length in enumerate(lengths):
        for h in range(ctx.num_heads):
            expected = torch.zeros(length)
            for w in range(window):
                position = length - window + w  # observed queries are the last W prompt tokens
                logits = k[b, h // group, : position + 1] @ q_obs[b, h, observed - window + w] * ctx.scale
                expected[: position + 1] += logits.softmax(-1) / window
            host = method.split[b]  # the moving averages exist for the host part only
            torch.testing.assert_close(method.ema[1][b, h, :host], expected[:host], atol=1e-6, rtol=1e-5)
    method.close()


@pytest.mark.parametrize("num_kv_heads", [4, 2])  # GQA group 1 and 2
def test_fraction_policy_cpu_selection_merged_attention_and_moving_average_update(num_kv_heads):
    lengths, kappa, sinks = [40, 13], 0.25, 2
    method, ctx, prompt, generator = _bound_hgca(lengths, num_kv_heads, budget=None, cpu_topk_frac=kappa,
                                                 sink_tokens=sinks)
    method.begin_step(step_info(lengths))
    group, layer = ctx.num_heads // num_kv_heads, 0
    split, take = list(method.split), list(method.cpu_take)
    assert take == [min(s, min(sinks, s) + math.ceil(kappa * s)) for s in split]
    ema = method.ema[layer].clone()
    ids = method.cpu_select(layer, split, take)
    q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
    k_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
    v_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
    out = method.decode(layer, q, k_new, v_new)
    _drain(method)
    _, k, v = prompt[layer]
    for b, length in enumerate(lengths):
        for h in range(ctx.num_heads):
            chosen = ids[b, h, : take[b]]
            assert len(set(chosen.tolist())) == take[b] and int(chosen.max()) < split[b]
            assert set(range(sinks)) <= set(chosen.tolist())
            rest = torch.ones(split[b], dtype=torch.bool)
            rest[chosen] = False
            rest[:sinks] = False
            picked = chosen[chosen >= sinks]
            if rest.any() and len(picked):
                assert ema[b, h, picked].min() >= ema[b, h, :split[b]][rest].max()
            # exact attention over the chosen host tokens and the whole window (with the new token)
            attended = torch.cat([chosen, torch.arange(split[b], length)])
            keys = torch.cat([k[b, h // group, attended], k_new[b, h // group, None]])
            values = torch.cat([v[b, h // group, attended], v_new[b, h // group, None]])
            logits = keys @ q[b, h] * ctx.scale
            torch.testing.assert_close(out[b, h], logits.softmax(-1) @ values, atol=1e-5, rtol=1e-5)
            # moving average: gamma * a + (1 - gamma) * probability renormalised to the whole attended context
            expected = ema[b, h, : split[b]] * method.ema_decay
            expected[chosen] += (1 - method.ema_decay) * (logits[: take[b]] - logits.logsumexp(-1)).exp()
            torch.testing.assert_close(method.ema[layer][b, h, : split[b]], expected, atol=1e-6, rtol=1e-5)
    method.close()


def test_method_args_and_refresh():
    method = HGCA.from_args({"budget": "none", "window_frac": "0.5", "refresh_interval": "2", "sink_tokens": "0"})
    assert (method.budget, method.window_frac, method.refresh_interval, method.sink_tokens) == (None, 0.5, 2, 0)
    assert HGCA.from_args({"budget": "1k", "window_share": "0.25"}).window_tokens == 256
    with pytest.raises(UsageError, match="window_frac"):
        HGCA.from_args({"window_frac": "0"})
    with pytest.raises(UsageError, match="refresh_interval"):
        HGCA.from_args({"refresh_interval": "2"})  # a dense CPU step would exceed the budget
    with pytest.raises(UsageError, match="must hold the window"):
        HGCA.from_args({"budget": "64", "window_share": "0.9"})
    method, *_ = _bound_hgca([40, 13], num_kv_heads=2, budget=None, refresh_interval=2)
    method.begin_step(step_info([40, 13], index=0))
    assert method.cpu_take != method.split
    method.begin_step(step_info([40, 13], index=1))  # every 2nd step the CPU attends every host token
    assert method.cpu_take == method.split
    method.close()


@pytest.mark.parametrize("policy", [{"budget": None}, {"budget": 128, "window_share": 0.25}])
def test_transfer_bytes_per_step(tiny_qwen3, policy):
    """Per layer and step HGCA sends the query and the device LSE to the host and gets the CPU
    part's output and LSE back (no migration within these steps: migrate_block exceeds the window's growth)."""
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [150])
    _, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, 4)
    method = HGCA(migrate_block=64, dense_layers=0, **policy)
    run_engine(tiny_qwen3, method, prompt, lengths, tokens)
    ctx = method.ctx
    per_layer = ctx.batch * ctx.num_heads * (ctx.head_dim + 1) * 4
    stats = method.stats()
    assert stats["d2h_bytes_per_step"] == stats["h2d_bytes_per_step"] == ctx.num_layers * per_layer


# --------------------------------------------------------------------------- budget: every attended token counts
SMALL_BUDGET = {"budget": 24, "window_share": 0.25, "migrate_block": 4, "sink_tokens": 2}  # window of 6 tokens


@pytest.mark.parametrize("model_name", ["tiny_qwen3", "tiny_llama"])
def test_budget_covering_the_context_equals_fullkv(model_name, request):
    """Window + sinks + selection reduce to every token when the budget covers them, with most of them on the CPU."""
    model = request.getfixturevalue(model_name)
    prompt, lengths = ragged_prompt(model.config.vocab_size, [50, 31])
    reference, tokens = fullkv_reference(model, prompt, lengths, steps=10)
    method = HGCA(budget=64, window_share=0.25, migrate_block=4, dense_layers=0)
    ours = run_engine(model, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert 0.5 < method.stats()["cpu_pair_fraction"] < 1.0


def _reference_budget_attention(method, ctx, layer, ema, split, window_len, q, k, v, k_new, v_new, b):
    """Straightforward per (sequence, KV head) reference: sinks, then the top host tokens by the group's maximum
    moving average, up to the budget less the window; attention over them, the window and the new token."""
    group = ctx.num_heads // ctx.num_kv_heads
    take = min(split, method.budget - window_len)
    outputs, selections = [], []
    for kv_head in range(ctx.num_kv_heads):
        sinks = list(range(min(method.sink_tokens, split, take)))
        score = ema[b, kv_head * group:(kv_head + 1) * group, :split].amax(dim=0)
        score[sinks] = float("-inf")
        chosen = sinks + score.topk(take - len(sinks)).indices.tolist()
        selections.append(set(chosen))
        attended = torch.tensor(chosen + list(range(split, split + window_len - 1)), dtype=torch.long)
        keys = torch.cat([k[b, kv_head, attended], k_new[b, kv_head, None]])
        values = torch.cat([v[b, kv_head, attended], v_new[b, kv_head, None]])
        for h in range(kv_head * group, (kv_head + 1) * group):
            outputs.append((keys @ q[b, h] * ctx.scale).softmax(-1) @ values)
    return torch.stack(outputs), selections


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # GQA groups of 2 and 4 query heads
def test_budget_selection_per_kv_head_equals_reference(num_kv_heads):
    lengths, layer = [40, 13], 1
    method, ctx, prompt, generator = _bound_hgca(lengths, num_kv_heads, **SMALL_BUDGET)
    method.begin_step(step_info(lengths))
    split, window_len, take = list(method.split), list(method.window_len), list(method.cpu_take)
    assert [w + t for w, t in zip(window_len, take, strict=True)] == [min(method.budget, n + 1) for n in lengths]
    ema = method.ema[layer].clone()
    ids = method.cpu_select(layer, split, take)
    assert ids.shape[:2] == (len(lengths), num_kv_heads)  # one selection per KV head, shared by its group
    q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
    k_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
    v_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
    out = method.decode(layer, q, k_new, v_new)
    _, k, v = prompt[layer]
    for b in range(len(lengths)):
        expected, selections = _reference_budget_attention(method, ctx, layer, ema, split[b], window_len[b], q, k, v,
                                                           k_new, v_new, b)
        assert [set(ids[b, h, : take[b]].tolist()) for h in range(num_kv_heads)] == selections
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
    method.close()


def test_budget_attended_tokens_per_kv_head_equal_the_budget(tiny_llama):
    """Across decode and migrations: window (the new token included) + CPU tokens = the budget, once the context
    exceeds it; between steps the window stays within [window_tokens, window_tokens + migrate_block)."""
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [50, 31])
    _, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=12)
    method = HGCA(**SMALL_BUDGET, dense_layers=0)
    attended = []

    def check(engine):
        for b, num_tokens in enumerate(engine.positions_host):
            stored_window = num_tokens - method.split[b]  # after this step's migrations
            assert method.window_tokens <= stored_window < method.window_tokens + method.migrate_block
            attended.append(method.window_len[b] + method.cpu_take[b])
            assert attended[-1] == min(method.budget, num_tokens)

    run_engine(tiny_llama, method, prompt, lengths, tokens, on_step=check)
    assert method.budget in attended
    pairs_per_step = method.ctx.num_heads * sum(method.cpu_take)
    assert method.stats()["cpu_tokens_per_layer"] == [pytest.approx(pairs_per_step, rel=0.2)] * method.ctx.num_layers


def test_moving_average_update_is_off_the_critical_path():
    """A held-up moving-average update of layer 0 delays neither layer 1's CPU attention nor its decode; layer 0's
    next CPU attention waits for it (it reads the averages)."""
    lengths = [40, 13]
    method, ctx, _, generator = _bound_hgca(lengths, num_kv_heads=2, **SMALL_BUDGET)
    release, order = threading.Event(), []
    update_ema = method._update_ema

    def held_update(layer, *args):
        if layer == 0 and not order:
            assert release.wait(timeout=30)
            order.append("layer 0 moving average updated")
        update_ema(layer, *args)

    method._update_ema = held_update

    def decode(layer):
        q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
        kv = torch.randn((2, len(lengths), ctx.num_kv_heads, ctx.head_dim), generator=generator)
        return method.decode(layer, q, kv[0], kv[1])

    method.begin_step(step_info(lengths))
    decode(0)
    decode(1)
    order.append("layer 1 decoded")
    method.end_step()
    method.begin_step(step_info([n + 1 for n in lengths], index=1))
    threading.Timer(0.2, release.set).start()
    started = time.perf_counter()
    decode(0)
    assert time.perf_counter() - started >= 0.15  # layer 0's next CPU attention waited for its update
    assert order == ["layer 1 decoded", "layer 0 moving average updated"]
    method.close()


def test_budget_option_reaches_hgca(monkeypatch, capsys):
    """`--budget` sets HGCA's budget (no usage error) and the plan follows it: each of the 38 sparse layers holds a
    window of budget x window_share tokens plus one migration block on the device, the 2 dense ones all 64k
    tokens (Qwen3-14B: 40 layers, 40 query and 8 KV heads of 128 dims, 4096 KV bytes per token and layer)."""
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem",
                             "80GiB", "--method", "hgca", "--budget", "4k", "--json")
    assert code == 0, err
    [row] = json.loads(out)
    assert row["device_bytes_per_seq"] == 2 * 65536 * 4096 + 38 * (2048 + 32) * 4096
    # host: K/V and fp32 moving averages of the rest, 32 tokens of migration staging and the kept selection (budget
    # - window + a migration block entries: ids per KV head, averages per query head; the CPU part reads the host
    # tier in place: no gather buffers)
    assert row["host_bytes_per_seq"] == (38 * (65536 - 2048) * (4096 + 40 * 4) + 38 * 32 * 4096
                                         + 38 * (4096 - 2048 + 32) * (8 * 8 + 40 * 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present")
def test_replayed_steps_with_and_without_a_cpu_part_give_the_eager_logits():
    """Prompts shorter than the window: the first steps attend the window alone (no CPU part: one graph variant),
    migrations then give the host its first tokens and the CPU part starts (the other variant), one sequence after
    the other; every replayed step gives the eager CPU path's logits (tests/emulation/test_graphs.py's check, both variants)."""
    from emulated import run_emulated, small_qwen3

    model = small_qwen3()
    prompt, lengths = ragged_prompt(model.config.vocab_size, [46, 36], seed=3)  # the first migrations: steps 34, 44
    run = run_emulated(model, lambda: HGCA(budget=96, dense_layers=1), prompt, lengths, 48, cuda_graphs=True)
    assert run.graphs["captured"] and run.graphs["variants"] == 2, run.graphs
    assert run.graphs["replayed_steps"] >= 48 - 4
    assert max(run.max_diff()) <= 2e-4, run.max_diff()
    assert run.unexpected_syncs() == []
    assert run.cuda_stats["host_tokens_mean"] > 0 and min(run.cuda_stats["cpu_tokens_per_layer"][1:]) > 0


@pytest.mark.parametrize(("model_name", "lengths"), [("tiny_llama", [50, 31]), ("tiny_qwen3", [44, 44])])
def test_selected_score_read_selects_the_tokens_of_the_full_read(model_name, lengths, request):
    """score_read="selected" keeps the selection instead of ranking every host token's average each step: over
    migrations (a block enters at its row's maximum) and the shrinking CPU share between them, every step's
    selection is the full read's, token for token, and so are the logits (fp32 summation order aside)."""
    model = request.getfixturevalue(model_name)
    prompt, lengths = ragged_prompt(model.config.vocab_size, lengths)
    _, tokens = fullkv_reference(model, prompt, lengths, steps=24)
    runs = {}
    for read in ("all", "selected"):
        method = HGCA(**SMALL_BUDGET, dense_layers=0, score_read=read)
        chosen = []
        select = method._select

        def spy(layer, split, take, select=select, chosen=chosen):
            ids = select(layer, split, take)
            chosen.append([[sorted(row[: take[b]].tolist()) for row in ids[b]] for b in range(len(take))])
            return ids

        method._select = spy
        logits = run_engine(model, method, prompt, lengths, tokens)
        runs[read] = (logits, chosen, list(method.split))
    (full_logits, full_ids, full_split), (kept_logits, kept_ids, kept_split) = runs["all"], runs["selected"]
    assert full_split == kept_split and full_split != [n - 6 for n in lengths.tolist()]  # blocks migrated
    assert len(full_ids) == len(kept_ids) > 0 and kept_ids == full_ids
    for a, b in zip(kept_logits, full_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_score_read_is_a_budget_setting():
    with pytest.raises(ValueError, match="score_read must be one of"):
        HGCA(score_read="some")
    assert HGCA().tracks_selection and not HGCA(score_read="all").tracks_selection
    assert not HGCA(budget=None).tracks_selection  # the fraction policy ranks every host token
