"""Offline profiling of ScoutAttention's per-layer recall intervals (paper section 3.4, Figure 6).

Procedure. Decode `steps` tokens with periodic recall off and record, per layer and step, the selected block set
`S_t` of every (sequence, KV head). A recall issued after layer l's attention at step m leaves the pool holding
`S_m` (it copies every selected block that was not resident, and the pool has room for a whole selection), so at
step m + k the layer's CPU compute ratio is `|S_{m+k} \\ S_m| * block_size / budget`. Averaging over every origin m
and over (sequence, KV head) gives the drift curve `d_l(k)`: the ratio k steps after a recall. The interval of layer
l is the largest I such that `d_l(k) <= beta` for every k <= I (at least 1; at most steps - 1, the longest lag
measured). The expected ratio under that interval is the mean of `d_l(1..I)`.

The output JSON holds `intervals` (one entry per layer, null for dense layers), which
`ScoutAttention(recall_profile=FILE)` reads, plus the drift curves and the no-recall ratio per step (Figure 6a).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from scoutbench.engine import DecodeEngine
from scoutbench.methods.scout import ScoutAttention
from scoutbench.methods.sparse import dense_if_budget_covers
from scoutbench.results import envelope


def selection_masks(trace: list[dict[str, Any]], num_layers: int) -> dict[int, list[torch.Tensor]]:
    """Per sparse layer, the step-ordered selected sets as bool masks `[B, Hkv, nB]` (from a ScoutAttention trace)."""
    plans = [r for r in trace if r["kind"] == "plan"]
    if not plans:
        return {}
    num_blocks = 1 + max((max(s) for r in plans for row in r["selected"] for s in row if s), default=0)
    out: dict[int, list[torch.Tensor]] = {}
    for record in sorted(plans, key=lambda r: (r["layer"], r["step"])):
        selected = record["selected"]
        mask = torch.zeros(len(selected), len(selected[0]), num_blocks, dtype=torch.bool)
        for b, row in enumerate(selected):
            for h, blocks in enumerate(row):
                if blocks:
                    mask[b, h, list(blocks)] = True
        out.setdefault(record["layer"], []).append(mask)
    return out


def drift_curve(masks: list[torch.Tensor], block_size: int, budget: int) -> list[float]:
    """`d(k)` for k = 1 .. len(masks) - 1: mean over origins m and (sequence, KV head) of
    `|S_{m+k} \\ S_m| * block_size / budget`."""
    stacked = torch.stack(masks).float()  # [T, B, Hkv, nB]
    steps = stacked.shape[0]
    curve = []
    for lag in range(1, steps):
        new = (stacked[lag:] * (1.0 - stacked[:-lag])).sum(-1)  # [T - lag, B, Hkv]
        curve.append(float(new.mean()) * block_size / budget)
    return curve


def choose_interval(curve: list[float], beta: float) -> int:
    """The largest I with `curve[k-1] <= beta` for every k <= I; at least 1 (recall every step)."""
    interval = 0
    for value in curve:
        if value > beta:
            break
        interval += 1
    return max(1, interval)


def no_recall_ratio(trace: list[dict[str, Any]], layer: int, block_size: int, budget: int) -> list[float]:
    """The measured CPU compute ratio per step with recall off (the pool keeps its prefill contents)."""
    out = []
    for record in sorted((r for r in trace if r["kind"] == "plan" and r["layer"] == layer), key=lambda r: r["step"]):
        cpu = [len(s - d) for srow, drow in zip(record["selected"], record["device"], strict=False) for s, d in zip(srow, drow, strict=False)]
        out.append(sum(cpu) / len(cpu) * block_size / budget)
    return out


def profile_recall(model_name: str = "tiny-qwen3", length: int = 4096, steps: int = 32, beta: float = 0.12,
                   batch: int = 1, device: str = "auto", dtype: str | None = None, seed: int = 0,
                   prefill: str = "real", method_args: dict[str, Any] | None = None,
                   loaded: Any = None) -> dict[str, Any]:
    """Run the profile and return the JSON-ready result (see the module docstring)."""
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import check_context, load_model, loaded_context_window

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    args = dict(method_args or {})
    args["pr"] = False
    method = ScoutAttention.from_args(args)
    # a budget covering the context runs dense: nothing drifts, every layer's interval is null and sparse: false
    budget_plan = dense_if_budget_covers(method, length + steps + 1)[1]
    if loaded is None:
        loaded = load_model(model_name, torch_device, torch_dtype, seed)
    model = loaded.model
    if prefill != "synthetic":  # real attention past the trained window is noise: nothing to profile
        check_context(model_name, loaded_context_window(loaded), length + steps + 1, f"--len {length} plus "
                      f"{steps} decode steps", "lower --len or --steps, or pass --prefill synthetic")
    engine = DecodeEngine(model, method)
    started = time.time()
    engine.start(batch=batch, max_len=length + steps + 1)
    method.trace = []
    try:
        if budget_plan.sparse:  # a dense run has no selection to profile
            generator = torch.Generator().manual_seed(seed)
            vocab = model.config.vocab_size
            lengths = torch.full((batch,), length, dtype=torch.long)
            if prefill == "synthetic":
                engine.prefill_synthetic(lengths, seed)
                tokens = torch.randint(0, vocab, (batch,), generator=generator).to(torch_device)
            else:
                prompt = torch.randint(0, vocab, (batch, length), generator=generator)
                tokens = engine.prefill(prompt.to(torch_device), lengths).argmax(-1)
            for _ in range(steps):
                logits = engine.decode_step(tokens)
                tokens = logits.argmax(-1) if prefill != "synthetic" else \
                    torch.randint(0, vocab, (batch,), generator=generator).to(torch_device)
        trace = method.trace
    finally:
        method.trace = None
        method.close()
    num_layers = model.config.num_hidden_layers
    dense = min(method.dense_layers, num_layers)
    masks = selection_masks(trace, num_layers)
    intervals: list[int | None] = []
    drift: list[list[float] | None] = []
    expected: list[float | None] = []
    without: list[list[float] | None] = []
    for layer in range(num_layers):
        if layer < dense or layer not in masks:
            intervals.append(None)
            drift.append(None)
            expected.append(None)
            without.append(None)
            continue
        curve = drift_curve(masks[layer], method.block_size, method.budget)
        interval = choose_interval(curve, beta)
        intervals.append(interval)
        drift.append(curve)
        expected.append(sum(curve[:interval]) / interval if curve else 0.0)
        without.append(no_recall_ratio(trace, layer, method.block_size, method.budget))
    sparse_intervals = [i for i in intervals if i is not None]
    sparse_expected = [e for e in expected if e is not None]
    return {
        **envelope("scout_recall_profile"),
        "model": model_name,
        "len": length,
        "steps": steps,
        "batch": batch,
        "beta": beta,
        "prefill": prefill,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device": torch_device.type,
        "method": method.config(),
        **budget_plan.result_fields(),
        "intervals": intervals,
        "mean_interval": sum(sparse_intervals) / len(sparse_intervals) if sparse_intervals else None,
        "interval_cap": max(1, steps - 1),
        "expected_ratio": expected,
        "expected_ratio_mean": sum(sparse_expected) / len(sparse_expected) if sparse_expected else None,
        "drift": drift,
        "ratio_without_recall": without,
        "elapsed_s": time.time() - started,
    }
