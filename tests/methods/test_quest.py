"""Quest against its invariants (QS1-QS4): FullKV when the budget covers the context (QS1), the selected
set (QS2), sparse attention = dense attention with the other keys masked (QS3), dense layers = FullKV (QS4)."""

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
from scoutbench.methods.base import ModelShape
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.quest import Quest


@pytest.mark.parametrize("model_name", ["tiny_qwen3", "tiny_llama", "tiny_mha"])
def test_budget_covering_the_context_equals_fullkv(model_name, request):
    model = request.getfixturevalue(model_name)
    prompt, lengths = ragged_prompt(model.config.vocab_size, [37, 24])
    reference, tokens = fullkv_reference(model, prompt, lengths, steps=5)
    ours = run_engine(model, Quest(budget=64, block_size=8), prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)


def _bound_quest(lengths, num_kv_heads, budget=24, block_size=8, seed=0, per_query_head=False):
    """A Quest bound to a hand-made context after a random prefill; returns it with the full K/V per layer."""
    generator = torch.Generator().manual_seed(seed)
    ctx = hand_context(batch=len(lengths), max_len=max(lengths) + 1, num_kv_heads=num_kv_heads)
    method = Quest(budget=budget, block_size=block_size, dense_layers=1, per_query_head=per_query_head)
    fullkv = FullKV()
    method.bind(ctx)
    fullkv.bind(ctx)
    shape = (len(lengths), num_kv_heads, max(lengths), ctx.head_dim)
    keys, values = [], []
    for layer in range(ctx.num_layers):
        k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        q_obs = torch.randn((len(lengths), ctx.num_heads, 1, ctx.head_dim), generator=generator)
        method.ingest_prefill(layer, q_obs, k, v, torch.tensor(lengths))
        fullkv.ingest_prefill(layer, q_obs, k, v, torch.tensor(lengths))
        keys.append(k)
        values.append(v)
    method.begin_step(step_info(lengths))
    fullkv.begin_step(step_info(lengths))
    return method, fullkv, ctx, keys, values, generator


def _with_new_token(cache, new, lengths):
    """Per sequence: its prefill K or V up to its length, then the new token -> list of `[Hkv, n, D]`."""
    return [torch.cat([cache[b, :, :n], new[b, :, None]], dim=1) for b, n in enumerate(lengths)]


# lengths: [context shorter than a block, long]; [exact multiple of the block after the append, long]
@pytest.mark.parametrize("lengths", [[5, 70], [63, 40]])
@pytest.mark.parametrize("num_kv_heads", [4, 2])  # GQA group 1 and 2
@pytest.mark.parametrize("per_query_head", [False, True])
def test_selection_and_sparse_attention(lengths, num_kv_heads, per_query_head, cpu_backend):
    """Per KV head, the group's query heads share one selection by their max bound; per query head (the official
    code's choice), each query head selects and attends its own blocks of its KV head."""
    method, fullkv, ctx, keys, values, generator = _bound_quest(lengths, num_kv_heads, per_query_head=per_query_head)
    block, pages, group = method.block_size, method.page_budget, ctx.num_heads // num_kv_heads
    rows = ctx.num_heads if per_query_head else num_kv_heads  # selection rows per sequence
    per_row = 1 if per_query_head else group  # query heads of a row
    completed = []  # (layer, sequence, KV head, block, the block's keys): checked once the step has ended
    for layer in range(ctx.num_layers):
        q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
        k_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
        v_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
        out = method.decode(layer, q, k_new, v_new)
        full_k, full_v = _with_new_token(keys[layer], k_new, lengths), _with_new_token(values[layer], v_new, lengths)
        if layer < method.dense_layers:  # QS4: exactly FullKV
            assert torch.equal(out, fullkv.decode(layer, q, k_new, v_new))
            continue
        block_ids, valid_len = method.select(layer, q)
        assert block_ids.shape[:2] == valid_len.shape == (len(lengths), rows)
        for b, n in enumerate(lengths):
            n += 1
            tail = (n - 1) // block
            for r in range(rows):
                h = r * per_row // group  # the row's KV head
                # QS2: min(pages, blocks) blocks, the tail among them, no duplicates
                num_selected = math.ceil(int(valid_len[b, r]) / block)
                chosen = block_ids[b, r, :num_selected].tolist()
                assert num_selected == min(pages, math.ceil(n / block))
                assert chosen[-1] == tail and len(set(chosen)) == len(chosen)
                # the selected complete blocks are the top ones by the Quest bound (max over the row's heads)
                heads = q[b, r * per_row: (r + 1) * per_row]
                bound = [max(float(torch.maximum(qh * k.amax(0), qh * k.amin(0)).sum()) for qh in heads)
                         for k in full_k[b][h][: tail * block].reshape(tail, block, ctx.head_dim)]
                others = [bound[j] for j in range(tail) if j not in chosen]
                if others:
                    assert min(bound[j] for j in chosen[:-1]) >= max(others)
                if n % block == 0:
                    completed.append((layer, b, h, tail, full_k[b][h][-block:]))
                # QS3: the sparse output equals dense attention with every other key masked
                token_mask = torch.zeros(n, dtype=torch.bool)
                for j in chosen:
                    token_mask[j * block: (j + 1) * block] = True
                logits = heads @ full_k[b][h].T * ctx.scale
                probs = logits.masked_fill(~token_mask, float("-inf")).softmax(-1)
                torch.testing.assert_close(out[b, r * per_row: (r + 1) * per_row], probs @ full_v[b][h],
                                           atol=1e-5, rtol=1e-5)
    method.end_step()  # the digest of a block the new token completed equals the recomputed one
    for layer, b, h, tail, keys_of_block in completed:
        kmax, kmin = keys_of_block.amax(0), keys_of_block.amin(0)
        assert torch.equal(method.digests.center2[layer][b, h, tail], kmax + kmin)
        assert torch.equal(method.digests.radius2[layer][b, h, tail], kmax - kmin)


def test_method_args_and_validation():
    from scoutbench.methods import build_method

    assert Quest.from_args({"budget": "1k"}).budget == 1024
    official = build_method("quest-official", {})
    assert (official.block_size, official.per_query_head, official.budget) == (16, True, 2048)
    assert build_method("quest-official", {"block_size": "32"}).block_size == 32
    assert Quest.from_args({"block_size": "16", "dense_layers": "0"}) == Quest(block_size=16, dense_layers=0)
    with pytest.raises(UsageError, match="budget"):
        Quest.from_args({"budget": "16", "block_size": "32"})
    with pytest.raises(UsageError, match="unknown"):
        Quest.from_args({"topk": "4"})


def test_footprint_matches_what_bind_allocates():
    """KV and digests (center and radius of each block, in the KV dtype: fp32 here)."""
    method, _, ctx, *_ = _bound_quest([63, 40], num_kv_heads=2)
    shape = ModelShape(ctx.num_layers, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, 64, 64, 64)
    tensors = [*method.keys, *method.values, *method.digests.center2.values(), *method.digests.radius2.values()]
    allocated = sum(t.numel() * t.element_size() for t in tensors) // ctx.batch
    footprint = method.memory_footprint(shape, method.ctx.max_len, elem_bytes=4)
    assert (footprint.device_bytes_per_seq, footprint.host_bytes_per_seq) == (allocated, 0)


def test_budget_covering_the_run_proceeds_dense_and_says_so(capsys):
    """A budget >= every token the run holds is dense attention: the run uses FullKV, warns in
    one line, and the result records `sparse: false` and the effective budget (prompt + warm-up + timed steps)."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput

    common = dict(model="tiny-qwen3", length=96, steps=2, warmup=1, device="cpu", command=["test"], force=True)
    dense = run_throughput(ThroughputConfig(method="quest", method_args={"budget": "99"}, **common))
    assert (dense["budget"], dense["effective_budget"], dense["sparse"]) == (99, 99, False)
    assert "digest_bytes" not in dense["method_stats"]  # FullKV ran
    assert dense["method_config"]["budget"] == 99  # the requested method is still what the result names
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "covers the whole context (99 tokens): running dense" in warning[0]
    sparse = run_throughput(ThroughputConfig(method="quest", method_args={"budget": "64", "block_size": "16"},
                                             **common))
    assert (sparse["budget"], sparse["effective_budget"], sparse["sparse"]) == (64, 64, True)
    assert "digest_bytes" in sparse["method_stats"]
    full = run_throughput(ThroughputConfig(method="fullkv", prefill="real", **common))
    assert (full["budget"], full["effective_budget"], full["sparse"]) == (None, None, False)
    # a CPU-only run says that both tiers are the same memory and names its wait honestly
    assert full["tiers"] == {"device": "cpu", "host": "cpu", "shared_memory": True}
    assert full["gpu_idle_frac"] is None and 0.0 <= full["main_thread_wait_frac"] < 1.0
    assert full["kv_source"] == "model(tiny-qwen3, random token ids)"
    synthetic = run_throughput(ThroughputConfig(method="fullkv", kv_skew=0.5, **common))  # auto: synthetic here
    assert synthetic["kv_source"] == "synthetic(kv_skew=0.5)"


def test_budget_flag_on_methods_without_a_budget_is_a_usage_error(monkeypatch, capsys):
    """`--budget` that no selected method takes is an error (exit 2, one line), not ignored."""
    from cli_runner import run_cli

    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--budget", "2k", "--len", "64")
    assert code == 2 and "no selected method has a token budget" in err and len(err.strip().splitlines()) == 1
