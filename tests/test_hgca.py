"""HGCA against its invariants (methods.md §6.7): FullKV with every CPU token selected (H1) or a 100% window (H3),
window and host partitions that hold every token exactly once across migrations (H2), the CPU selection (sinks,
then the top tokens by moving average, per query head) merged exactly with the window, and the documented
moving-average rule."""

import math

import pytest
import torch
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
    """Wait for the CPU worker (it owns the host side: moving averages, migrated tokens)."""
    method.pool.submit(lambda: None).result()


# ragged lengths select in score order per row; equal lengths take the faster unordered top-k
@pytest.mark.parametrize(("model_name", "lengths"), [("tiny_qwen3", [50, 31]), ("tiny_llama", [50, 31]),
                                                     ("tiny_mha", [44, 44])])
def test_every_cpu_token_equals_fullkv(model_name, lengths, request):
    model = request.getfixturevalue(model_name)
    prompt, lengths = ragged_prompt(model.config.vocab_size, lengths)
    reference, tokens = fullkv_reference(model, prompt, lengths, steps=10)
    method = HGCA(cpu_topk_frac=1.0, migrate_block=4)
    ours = run_engine(model, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert method.split != [n - math.ceil(n / 4) for n in lengths.tolist()]  # tokens migrated during the run
    assert 0.5 < method.stats()["cpu_pair_fraction"] < 1.0


def test_full_window_equals_fullkv_with_an_empty_cpu_part(tiny_qwen3):
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [40, 23])
    reference, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, steps=5)
    method = HGCA(window_frac=1.0)
    ours = run_engine(tiny_qwen3, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert method.split == [0, 0] and method.stats()["cpu_tokens_per_layer"] == [0.0] * 4


def test_window_and_host_hold_every_token_exactly_once(tiny_llama):
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [50, 31])
    _, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=24)
    fullkv = FullKV()
    run_engine(tiny_llama, fullkv, prompt, lengths, tokens)  # layer 0's K/V depend on the tokens only
    method = HGCA(migrate_block=4)
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
    method = HGCA(**fields)
    method.bind(ctx)
    shape = (len(lengths), num_kv_heads, max(lengths), ctx.head_dim)
    prompt = []
    for layer in range(ctx.num_layers):
        k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        q_obs = torch.randn((len(lengths), ctx.num_heads, min(lengths), ctx.head_dim), generator=generator)
        method.ingest_prefill(layer, q_obs, k, v, torch.tensor(lengths))
        prompt.append((q_obs, k, v))
    return method, ctx, prompt, generator


def test_moving_average_starts_from_the_observed_queries():
    lengths = [40, 13]
    method, ctx, prompt, _ = _bound_hgca(lengths, num_kv_heads=2)
    q_obs, k, _ = prompt[1]
    window, group = q_obs.shape[2], ctx.num_heads // ctx.num_kv_heads
    for b, length in enumerate(lengths):
        for h in range(ctx.num_heads):
            expected = torch.zeros(length)
            for w in range(window):
                position = length - window + w  # observed queries are the last W prompt tokens
                logits = k[b, h // group, : position + 1] @ q_obs[b, h, w] * ctx.scale
                expected[: position + 1] += logits.softmax(-1) / window
            host = method.split[b]  # the moving averages exist for the host part only
            torch.testing.assert_close(method.ema[1][b, h, :host], expected[:host], atol=1e-6, rtol=1e-5)
    method.close()


@pytest.mark.parametrize("num_kv_heads", [4, 2])  # GQA group 1 and 2
def test_cpu_selection_merged_attention_and_moving_average_update(num_kv_heads):
    lengths, kappa, sinks = [40, 13], 0.25, 2
    method, ctx, prompt, generator = _bound_hgca(lengths, num_kv_heads, cpu_topk_frac=kappa, sink_tokens=sinks)
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
    method = HGCA.from_args({"window_frac": "0.5", "refresh_interval": "2", "sink_tokens": "0"})
    assert (method.window_frac, method.refresh_interval, method.sink_tokens) == (0.5, 2, 0)
    with pytest.raises(UsageError, match="window_frac"):
        HGCA.from_args({"window_frac": "0"})
    method, *_ = _bound_hgca([40, 13], num_kv_heads=2, refresh_interval=2)
    method.begin_step(step_info([40, 13], index=0))
    assert method.cpu_take != method.split
    method.begin_step(step_info([40, 13], index=1))  # every 2nd step the CPU attends every host token
    assert method.cpu_take == method.split
    method.close()


def test_transfer_bytes_per_step(tiny_qwen3):
    """Issue 10 item 5: per layer and step HGCA sends the query and the device LSE to the host and gets the CPU
    part's output and LSE back (no migration within these steps: migrate_block exceeds the window's growth)."""
    prompt, lengths = ragged_prompt(tiny_qwen3.config.vocab_size, [150])
    _, tokens = fullkv_reference(tiny_qwen3, prompt, lengths, 4)
    method = HGCA(migrate_block=64)
    run_engine(tiny_qwen3, method, prompt, lengths, tokens)
    ctx = method.ctx
    per_layer = ctx.batch * ctx.num_heads * (ctx.head_dim + 1) * 4
    stats = method.stats()
    assert stats["d2h_bytes_per_step"] == stats["h2d_bytes_per_step"] == ctx.num_layers * per_layer
