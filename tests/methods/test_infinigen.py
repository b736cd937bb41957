"""InfiniGen against its invariants (I1-I5): FullKV when every token is fetched (I1), an orthogonal skew
that preserves q.k (I2), speculation = the exact scores when every channel is kept (I3), one fetch count for every
head within bounds (I4), byte counters that match it (I5), and exact attention over what was fetched."""

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

from scoutbench.decode.engine import DecodeEngine
from scoutbench.errors import UsageError
from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.methods.base import ModelShape
from scoutbench.methods.infinigen import InfiniGen
from scoutbench.runtime.token_fetch import InPlaceTokens


# dense_layers=0: layer 0 has no layer ahead of it and speculates with its own query, synchronously
@pytest.mark.parametrize("dynamic_count", [False, True])
@pytest.mark.parametrize(("model_name", "dense_layers"), [("tiny_qwen3", 2), ("tiny_llama", 0), ("tiny_mha", 2)])
def test_fetching_every_token_equals_fullkv(model_name, dense_layers, dynamic_count, request, cpu_backend):
    model = request.getfixturevalue(model_name)
    # uniform lengths: n is one count for the whole batch (the mean over sequences and heads, as the original)
    prompt, lengths = ragged_prompt(model.config.vocab_size, [40, 40])
    reference, tokens = fullkv_reference(model, prompt, lengths, steps=5)
    method = InfiniGen(alpha=float("inf"), budget=4096, dense_layers=dense_layers, dynamic_count=dynamic_count,
                       count_cap_frac=None)
    ours = run_engine(model, method, prompt, lengths, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert method.stats()["tokens_fetched_per_layer"][dense_layers:] == [40 + 2] * (4 - dense_layers)


def test_skew_is_orthogonal_and_preserves_dot_products(tiny_qwen3):
    method = InfiniGen()
    engine = DecodeEngine(tiny_qwen3, method)
    engine.start(batch=2, max_len=64)
    engine.prefill(*ragged_prompt(tiny_qwen3.config.vocab_size, [50, 33]))
    method.close()
    head_dim = engine.head_dim
    q, k = torch.randn(engine.num_kv_heads, 1, head_dim), torch.randn(engine.num_kv_heads, head_dim, 1)
    for layer in method.sparse_layers:
        skew = method.skew[layer]  # [Hkv, D, D]
        identity = torch.eye(head_dim).expand_as(skew)
        assert torch.linalg.matrix_norm(skew @ skew.transpose(1, 2) - identity).max() < 1e-3
        torch.testing.assert_close((q @ skew) @ (skew.transpose(1, 2) @ k), q @ k, atol=1e-4, rtol=1e-4)
        # the partial channels are the columns of A with the largest |q A| mass (ceil(0.2 * 32) = 7 of them)
        assert method.partial_proj[layer].shape == (engine.num_kv_heads, head_dim, math.ceil(0.2 * head_dim))


def _bound_infinigen(lengths, num_kv_heads, seed=0, **fields):
    generator = torch.Generator().manual_seed(seed)
    ctx = hand_context(batch=len(lengths), max_len=max(lengths) + 1, num_kv_heads=num_kv_heads)
    method = InfiniGen(dense_layers=1, **fields)
    method.bind(ctx)
    shape = (len(lengths), num_kv_heads, max(lengths), ctx.head_dim)
    keys, values = [], []
    for layer in range(ctx.num_layers):
        k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        q_obs = torch.randn((len(lengths), ctx.num_heads, min(lengths), ctx.head_dim), generator=generator)
        method.ingest_prefill(layer, q_obs, k, v, torch.tensor(lengths))
        keys.append(k)
        values.append(v)
    method.begin_step(step_info(lengths))
    return method, ctx, keys, values, generator


@pytest.mark.parametrize("num_kv_heads", [4, 2])  # GQA group 1 and 2
def test_speculation_with_every_channel_ranks_by_the_exact_scores(num_kv_heads):
    lengths, alpha = [30, 17], 2.0
    method, ctx, keys, _, generator = _bound_infinigen(lengths, num_kv_heads, partial_ratio=1.0, alpha=alpha,
                                                       budget=65, dynamic_count=True, count_cap_frac=None)
    group = ctx.num_heads // num_kv_heads
    q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
    ids, n = method.speculate(2, q)
    counts, top = [], []
    for b, length in enumerate(lengths):
        for h in range(num_kv_heads):
            scores = q[b, h * group: (h + 1) * group] @ keys[2][b, h, :length].T * ctx.scale  # [G, n_b]
            counts += (scores > scores.amax(-1, keepdim=True) - alpha).sum(-1).tolist()
            top.append(scores.amax(0).argsort(descending=True))
    assert n == max(1, math.floor(sum(counts) / len(counts)))
    assert ids.shape == (len(lengths), num_kv_heads, n)  # one n for every head and sequence
    for b, length in enumerate(lengths):
        for h in range(num_kv_heads):
            valid = min(n, length)
            assert set(ids[b, h, :valid].tolist()) == set(top[b * num_kv_heads + h][:valid].tolist())
    method.close()


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_attention_is_exact_over_the_fetched_tokens_and_counters_match(num_kv_heads):
    lengths, fetch = [30, 5], 8  # the short sequence has fewer cached tokens than the fetch count
    method, ctx, keys, values, generator = _bound_infinigen(lengths, num_kv_heads, budget=fetch + 1)
    group = ctx.num_heads // num_kv_heads
    for layer in range(1, ctx.num_layers):  # layers 1 and 2 are sparse, each fetched in the hook of the one before
        q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
        k_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
        v_new = torch.randn((len(lengths), num_kv_heads, ctx.head_dim), generator=generator)
        ids, n = method.speculate(layer, q)
        assert n == fetch  # budget - 1, whatever the scores
        ctx.predict_query = lambda target, hidden, normed, q=q: q  # the layer-ahead prediction: here exact
        method.before_layer(layer - 1, None, None)
        out = method.decode(layer, q, k_new, v_new)
        for b, length in enumerate(lengths):
            for h in range(num_kv_heads):
                chosen = ids[b, h, : min(n, length)]
                assert len(set(chosen.tolist())) == len(chosen) and int(chosen.max()) < length
                k = torch.cat([keys[layer][b, h, chosen], k_new[b, h, None]])
                v = torch.cat([values[layer][b, h, chosen], v_new[b, h, None]])
                heads = q[b, h * group: (h + 1) * group]
                expected = (heads @ k.T * ctx.scale).softmax(-1) @ v
                torch.testing.assert_close(out[b, h * group: (h + 1) * group], expected, atol=1e-5, rtol=1e-5)
    stats = method.stats()
    method.close()
    assert stats["tokens_fetched_per_layer"] == [0, fetch, fetch]
    token_bytes = len(lengths) * num_kv_heads * 2 * ctx.head_dim * 4
    assert stats["bytes_h2d_per_layer"] == [n * token_bytes for n in stats["tokens_fetched_per_layer"]]
    # the transfer counters: H2D = the fetched K/V; D2H = the fetched ids and each layer's new K/V (one step, 2 layers)
    assert stats["h2d_bytes_per_step"] == 2 * fetch * token_bytes
    assert stats["d2h_bytes_per_step"] == 2 * (fetch * len(lengths) * num_kv_heads * 8 + token_bytes)


@pytest.mark.parametrize(("caps", "expected"), [({"count_cap_frac": None}, (23, [23, 17])),
                                               ({"count_cap": 10, "count_cap_frac": None}, (10, [10, 10])),
                                               ({}, (6, [6, 3])),  # 20% of 30 and of 17 cached tokens
                                               ({"count_cap": 4}, (4, [4, 3]))])
def test_dynamic_count_within_the_authors_caps(caps, expected):
    """alpha = inf counts every cached token (a mean of 23.5 over sequences of 30 and 17): the fetch is that count
    within the budget, `count_cap` and each sequence's `count_cap_frac` share of its cached tokens (floor(0.2 x 30)
    = 6, floor(0.2 x 17) = 3), every bound binding over the others; each sequence's valid tokens are its own top."""
    lengths = [30, 17]
    method, ctx, keys, _, generator = _bound_infinigen(lengths, 2, partial_ratio=1.0, alpha=float("inf"), budget=65,
                                                       dynamic_count=True, **caps)
    q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
    ids, n = method.speculate(2, q)
    method.close()
    group = ctx.num_heads // 2
    assert (n, [min(limit, n) for limit in method._fetch_limits]) == expected
    for b, valid in enumerate(expected[1]):
        for h in range(2):
            scores = (q[b, h * group: (h + 1) * group] @ keys[2][b, h, : lengths[b]].T).amax(0)
            assert set(ids[b, h, :valid].tolist()) == set(scores.argsort(descending=True)[:valid].tolist())


def test_count_caps_are_checked():
    with pytest.raises(UsageError, match="count_cap must be"):
        InfiniGen.from_args({"count_cap": "0"})
    with pytest.raises(UsageError, match="count_cap_frac must be"):
        InfiniGen.from_args({"count_cap_frac": "1.5"})
    assert InfiniGen.from_args({"count_cap_frac": "none"}).count_cap_frac is None


def test_engine_run_respects_the_fetch_cap(tiny_llama):
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [60, 41])
    _, tokens = fullkv_reference(tiny_llama, prompt, lengths, steps=4)
    method = InfiniGen(budget=9, dynamic_count=True)
    logits = run_engine(tiny_llama, method, prompt, lengths, tokens)
    assert all(torch.isfinite(x).all() for x in logits)
    fetched = method.stats()["tokens_fetched_per_layer"]
    assert fetched[:2] == [0, 0] and all(1 <= n <= 8 for n in fetched[2:])


@pytest.mark.parametrize("dynamic_count", [False, True])
def test_fetch_count_and_where_its_host_sync_is_timed(dynamic_count):
    """By default n = budget - 1 (budget-matched with the other methods, no host sync); the original's alpha count
    is an option, and its `.item()` wait is timed as `idle` (the GPU waits), not `predict`."""
    lengths = [30, 30]
    method, ctx, _, _, generator = _bound_infinigen(lengths, 2, budget=9, alpha=0.01, dynamic_count=dynamic_count)
    q = torch.randn((len(lengths), ctx.num_heads, ctx.head_dim), generator=generator)
    ctx.timer.begin_step()
    with ctx.timer.stage("predict"):
        _, n = method.speculate(2, q)
    names = [name for name, *_ in ctx.timer._open]
    ctx.timer.end_step()
    method.close()
    if dynamic_count:
        assert n < 8 and "idle" in names  # alpha 0.01 counts about one token per head
    else:
        assert n == 8 and "idle" not in names


def test_method_args_and_footprint():
    method = InfiniGen.from_args({"alpha": "inf", "budget": "2k", "partial_ratio": "0.25"})
    assert (method.alpha, method.budget, method.partial_ratio) == (float("inf"), 2048, 0.25)
    with pytest.raises(UsageError, match="partial_ratio"):
        InfiniGen.from_args({"partial_ratio": "0"})
    method, ctx, *_ = _bound_infinigen([40, 40], num_kv_heads=2, budget=17)
    shape = ModelShape(ctx.num_layers, ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, 64, 64, 64)
    device = [*method.dense.keys, *method.dense.values, *method.partial_keys.values()]
    host = [*method.host_k.values(), *method.host_v.values()]
    footprint = method.memory_footprint(shape, ctx.max_len, elem_bytes=4)
    # the double-buffered fetch targets (K and V of the fetched tokens and the current one, in 16-token pages) and
    # the speculated ids (int64, both slots) and scores (fp32) exist on CUDA only: a CPU run reads the host tier in
    # place
    width = page_aligned(method.capacity + 1)
    cuda_fetch = 2 * width * 2 * ctx.num_kv_heads * ctx.head_dim * 4 + method.capacity * ctx.num_kv_heads * (2 * 8 + 4)
    assert isinstance(method.fetch, InPlaceTokens)
    assert footprint.device_bytes_per_seq == sum(t.numel() * t.element_size() for t in device) // ctx.batch + cuda_fetch
    cuda_staging = 2 * method.capacity * (2 * ctx.num_kv_heads * ctx.head_dim * 4 + ctx.num_kv_heads * 8)
    assert footprint.host_bytes_per_seq == sum(t.numel() * t.element_size() for t in host) // ctx.batch + cuda_staging
    method.close()


def _emulated_step_calls(method, lengths: list[int]) -> tuple[int, dict[tuple[str, int], int]]:
    """Torch calls of one eager decode step (the second) on emulated CUDA: in all, and in each of the method's
    per-layer hooks, by the layer it works for (`before_layer` of layer i works for layer i + 1)."""
    from emulated import small_qwen3

    from scoutbench.testing.emulated_cuda import EMULATED_DEVICE, emulated_cuda, to_emulated_device
    from scoutbench.timing import TorchCallCounter

    model = small_qwen3()
    prompt, prompt_lengths = ragged_prompt(model.config.vocab_size, lengths, seed=3)
    counter, calls = TorchCallCounter(), {}

    def counted(name, hook):
        def run(layer, *args):
            before = counter.calls
            out = hook(layer, *args)
            key = (name, layer + 1 if name == "before_layer" else layer)
            calls[key] = calls.get(key, 0) + counter.calls - before
            return out
        return run

    with emulated_cuda():
        engine = DecodeEngine(to_emulated_device(model), method)
        engine.start(len(lengths), max(lengths) + 8)
        try:
            token = engine.prefill(prompt.to(EMULATED_DEVICE), prompt_lengths).argmax(-1)
            token = engine.decode_step(token).argmax(-1)
            method.before_layer = counted("before_layer", method.before_layer)
            method.decode = counted("decode", method.decode)
            with counter:
                engine.decode_step(token)
        finally:
            method.close()
    return counter.calls, calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present (the test emulates one)")
@pytest.mark.parametrize("dynamic_count", [False, True])
@pytest.mark.parametrize("lengths", [[120, 120], [120, 50]])
def test_cuda_decode_issues_few_torch_calls_per_sparse_layer(lengths, dynamic_count):
    """The lean step: at bench-attn16 (16 layers, 14 sparse) InfiniGen's calls per step stay within 1.5x FullKV's,
    where the engine's own part of a layer is 27 calls and FullKV's attention 5: the method has 25 per sparse
    layer, its layer-ahead query prediction (7) included, with either count: the alpha count, its current token's
    slot and its attended lengths are one fused launch (`fused_ops.speculate_count_`, where the composite issues
    15 calls). Counted on emulated CUDA, eagerly, in a uniform and a ragged batch (a sequence shorter than the
    fetch); the step's plan (begin_step and end_step) adds few calls to FullKV's."""
    from scoutbench.methods.fullkv import FullKV

    method = InfiniGen(budget=64, dense_layers=1, dynamic_count=dynamic_count)
    total, calls = _emulated_step_calls(method, lengths)
    reference_total, reference_calls = _emulated_step_calls(FullKV(), lengths)
    per_layer = [calls["before_layer", layer] + calls["decode", layer] for layer in method.sparse_layers]
    assert max(per_layer) <= 25, calls
    plan = total - sum(calls.values())  # the engine's work and the step's plan
    reference_plan = reference_total - sum(reference_calls.values())
    assert plan - reference_plan <= 20, (plan, reference_plan)


def _emulated_dynamic_run(lengths: list[int], alpha: float, fused: bool, monkeypatch) -> tuple[list, list]:
    """Logits of 8 decode steps of InfiniGen's dynamic count on emulated CUDA and its fetched tokens per layer, with
    the count as the fused op (`fused_ops.speculate_count_`) or as the composite that CUDA without triton runs."""
    from emulated import small_qwen3

    from scoutbench.kernels import speculation
    from scoutbench.testing.emulated_cuda import EMULATED_DEVICE, emulated_cuda, to_emulated_device

    model = small_qwen3()
    prompt, prompt_lengths = ragged_prompt(model.config.vocab_size, lengths, seed=3)
    if not fused:
        monkeypatch.setattr(speculation, "fused_ops_available", lambda device: False)
    launches = []
    op = speculation.fused_ops.speculate_count_
    monkeypatch.setattr(speculation.fused_ops, "speculate_count_", lambda *args: launches.append(1) or op(*args))
    logits = []
    with emulated_cuda():
        method = InfiniGen(budget=24, dense_layers=1, dynamic_count=True, alpha=alpha)
        engine = DecodeEngine(to_emulated_device(model), method)
        engine.start(len(lengths), max(lengths) + 10)
        try:
            out = engine.prefill(prompt.to(EMULATED_DEVICE), prompt_lengths)
            for _ in range(8):
                out = engine.decode_step(out.argmax(-1))
                logits.append(out.cpu())
            fetched = method.stats()["tokens_fetched_per_layer"]
        finally:
            method.close()
    assert bool(launches) == fused
    monkeypatch.undo()
    return logits, fetched


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present (the test emulates one)")
@pytest.mark.parametrize(("lengths", "alpha"), [([120, 50], 1.0), ([40], 1.0), ([120, 120], float("inf"))])
def test_fused_count_is_bit_identical_to_the_composite(lengths, alpha, monkeypatch):
    """The dynamic count as one fused launch changes no result: on emulated CUDA (where the op runs its torch
    reference, as a GPU runs its kernel: tests/kernels/test_triton_speculate.py) the logits and the fetch counts equal the
    composite's bit for bit, in a ragged batch, with counts under the capacity and with every token counted."""
    fused_logits, fused_fetched = _emulated_dynamic_run(lengths, alpha, True, monkeypatch)
    logits, fetched = _emulated_dynamic_run(lengths, alpha, False, monkeypatch)
    assert fused_fetched == fetched
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, logits, strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present (the test emulates one)")
def test_capped_count_on_the_cuda_path_equals_the_cpu_path(monkeypatch):
    """Where 20% of the context binds (every token counted: 24 and 10 of 120 and 50 cached), the CUDA path's
    device-side limits (the fused count's per-sequence bound, the slot of each current token) agree with the host's
    (the fetch size, the attended lengths, the token copied back to the host tier): its logits are the CPU path's."""
    from emulated import small_qwen3

    cuda_logits, cuda_fetched = _emulated_dynamic_run([120, 50], float("inf"), True, monkeypatch)
    model = small_qwen3()
    prompt, lengths = ragged_prompt(model.config.vocab_size, [120, 50], seed=3)
    method = InfiniGen(budget=24, dense_layers=1, dynamic_count=True, alpha=float("inf"))
    engine = DecodeEngine(model, method)
    engine.start(2, 130)
    try:
        out, logits = engine.prefill(prompt, lengths), []
        for _ in range(8):
            out = engine.decode_step(out.argmax(-1))
            logits.append(out)
        fetched = method.stats()["tokens_fetched_per_layer"]
    finally:
        method.close()
    assert fetched == cuda_fetched and fetched[1:] == [23.0] * (len(fetched) - 1)  # the budget binds over 24
    for a, b in zip(cuda_logits, logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
