"""The synthetic prefill's K/V: the same values whatever the thread count, standard normal, and shared between the
methods of a run (`SyntheticKVCache`) without changing what any of them decodes."""

import pytest
import torch

from scoutbench.decode.engine import DecodeEngine
from scoutbench.methods import ABLATION_METHODS, ALL_METHODS, build_method, method_field_names
from scoutbench.workloads.synthetic_kv import (
    SYNTHETIC_PIECE_ELEMENTS,
    SyntheticKVCache,
    _fill_standard_normal_,
)

LENGTHS = [200, 137]
SPARSE_ARGS = {"budget": 96, "block_size": 16, "dense_layers": 1}


def test_fill_does_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    one, many = torch.empty(3, SYNTHETIC_PIECE_ELEMENTS + 5), torch.empty(3, SYNTHETIC_PIECE_ELEMENTS + 5)
    try:
        torch.set_num_threads(1)
        _fill_standard_normal_(one, torch.Generator().manual_seed(7))
        torch.set_num_threads(max(threads, 2))
        _fill_standard_normal_(many, torch.Generator().manual_seed(7))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert abs(float(one.mean())) < 0.01 and abs(float(one.std()) - 1) < 0.01
    pieces = one.view(-1).split(SYNTHETIC_PIECE_ELEMENTS)
    assert len(pieces) == 4 and not torch.equal(pieces[0][:64], pieces[1][:64])  # each piece its own stream


def _decode(model, name: str, shared: SyntheticKVCache | None, seed: int = 3, steps: int = 3) -> torch.Tensor:
    fields = method_field_names(name)
    method = build_method(name, {key: value for key, value in SPARSE_ARGS.items() if key in fields})
    engine = DecodeEngine(model, method)
    try:
        engine.start(len(LENGTHS), max(LENGTHS) + steps)
        engine.prefill_synthetic(torch.tensor(LENGTHS), seed=seed, shared_kv=shared)
        tokens, logits = torch.tensor([5, 11]), []
        for _ in range(steps):
            logits.append(engine.decode_step(tokens))
            tokens = logits[-1].argmax(-1)
    finally:
        method.close()
    return torch.stack(logits)


def test_every_method_decodes_a_shared_prefill_as_its_own(tiny_qwen3):
    """Each method after the first ingests the kept tensors: its logits equal those of a fresh draw, so no method
    changed the tensors it was handed (FullKV again at the end checks the last ones)."""
    shared = SyntheticKVCache()
    names = [*ALL_METHODS, *(name for name in ABLATION_METHODS if name not in ALL_METHODS), "fullkv"]
    for index, name in enumerate(names):
        kept_before = list(shared.layers)
        assert torch.equal(_decode(tiny_qwen3, name, shared), _decode(tiny_qwen3, name, None)), name
        assert len(shared.layers) == tiny_qwen3.config.num_hidden_layers
        if index:  # reused, not drawn again
            assert all(a[1] is b[1] for a, b in zip(kept_before, shared.layers, strict=True))


def test_another_prefill_replaces_the_kept_one(tiny_qwen3):
    shared = SyntheticKVCache()
    _decode(tiny_qwen3, "fullkv", shared, seed=3)
    first = shared.layers[0][1]
    assert torch.equal(_decode(tiny_qwen3, "quest", shared, seed=4), _decode(tiny_qwen3, "quest", None, seed=4))
    assert shared.layers[0][1] is not first and not torch.equal(shared.layers[0][1], first)


def test_nothing_is_kept_without_the_memory_for_it(tiny_qwen3, monkeypatch):
    import scoutbench.planning as planning

    monkeypatch.setattr(planning, "usable_host_bytes", lambda: 1024)
    shared = SyntheticKVCache()
    assert torch.equal(_decode(tiny_qwen3, "fullkv", shared), _decode(tiny_qwen3, "fullkv", None))
    assert shared.layers == []


@pytest.mark.parametrize("need_bytes,kept", [(10**6, True), (10**9, False)])
def test_make_room_drops_the_kept_prefill_for_a_run_that_needs_its_memory(tiny_qwen3, monkeypatch, need_bytes, kept):
    import scoutbench.planning as planning

    shared = SyntheticKVCache()
    _decode(tiny_qwen3, "fullkv", shared)
    monkeypatch.setattr(planning, "usable_host_bytes", lambda: 10**8)
    shared.make_room(need_bytes)
    assert bool(shared.layers) is kept


def test_nothing_is_kept_off_the_cpu():
    assert not SyntheticKVCache().admits(1, torch.device("meta"))


def test_a_run_that_needs_the_kept_memory_gets_it_back(tiny_qwen3, monkeypatch):
    """A sweep's next point is resolved while the previous point's prefill is kept: where it would not fit beside
    it, the kept prefill goes (a memory check that counted it would refuse the point), and `--batch auto` always
    plans without it."""
    import scoutbench.planning as planning
    from scoutbench.bench.throughput import ThroughputConfig, memory_need, resolve_run
    from scoutbench.models import load_model

    loaded = load_model("tiny-qwen3", torch.device("cpu"), torch.float32, 0)
    cfg = ThroughputConfig(method="fullkv", model="tiny-qwen3", length=256, steps=2, warmup=1, device="cpu",
                           dtype="float32", prefill="synthetic")
    need = sum(memory_need(cfg, build_method("fullkv", {}), loaded, 1).values())
    shared = SyntheticKVCache()
    _decode(tiny_qwen3, "fullkv", shared)
    monkeypatch.setattr(planning, "usable_host_bytes", lambda: need - 1 if shared.layers else need + 1)
    assert resolve_run(cfg, loaded, shared).batch == 1 and shared.layers == []

    monkeypatch.setattr(planning, "usable_host_bytes", lambda: 10**12)
    _decode(tiny_qwen3, "fullkv", shared)
    assert resolve_run(cfg, loaded, shared) and shared.layers  # fits beside it: kept
    auto = ThroughputConfig(**{**cfg.__dict__, "batch": "auto", "gpu_mem": 8 * 2**30})
    resolve_run(auto, loaded, shared)
    assert shared.layers == []
