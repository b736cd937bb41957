"""Offline profiling of ScoutAttention's per-layer recall intervals (paper section 3.4, Figure 6).

Procedure. Decode `steps` tokens with periodic recall off and record, per layer and step, the selected block set
`S_t` of every (sequence, KV head). A recall issued after layer l's attention at step m leaves the pool holding
`S_m` (it copies every selected block that was not resident) and, in a pool larger than a selection
(`pool_factor`), the blocks selected most recently before it (the recall evicts the least important blocks outside
the selection; the profile takes recency for importance), `P_m`; so at step m + k the layer's CPU compute ratio is
`|S_{m+k} \\ P_m| * block_size / budget`. Averaging over every origin m and over (sequence, KV head) gives the
drift curve `d_l(k)`: the ratio k steps after a recall. The interval of layer l is the largest I such that
`d_l(k) <= beta` for every k <= I (at least 1; at most steps - 1, the longest lag measured). The expected ratio
under that interval is the mean of `d_l(1..I)`.

What it decodes: random token prompts (`--prefill real`: the model runs on them; `synthetic`: random K/V, whose
selection churns without the drift of real attention, so its intervals describe no real workload), or real
LongBench records (each prompt prefilled and decoded on its own, the curves averaged over the records). The JSON's
`measured_on` says which (the records' ids and the data's source), and a run that uses the profile reports it.

The output JSON holds `intervals` (one entry per layer, null for dense layers), which
`ScoutAttention(recall_profile=FILE)` reads, plus the drift curves and the no-recall ratio per step (Figure 6a).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.decode.engine import DecodeEngine
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


def drift_curve(masks: list[torch.Tensor], block_size: int, budget: int, pool_blocks: int | None = None
                ) -> list[float]:
    """`d(k)` for k = 1 .. len(masks) - 1: mean over origins m and (sequence, KV head) of
    `|S_{m+k} \\ P_m| * block_size / budget`, where the pool after a recall at m, `P_m`, holds the `pool_blocks`
    blocks selected most recently up to m (`S_m` first; ties: lower block id), or exactly `S_m` (None)."""
    stacked = torch.stack(masks)  # [T, B, Hkv, nB] bool
    steps = stacked.shape[0]
    if pool_blocks is None:
        pool = stacked
    else:  # the most recent selection time of every block (-1: never), then the pool_blocks latest
        times = torch.arange(steps).view(-1, 1, 1, 1)
        latest = torch.where(stacked, times, -1).cummax(0).values
        order = latest.float() - torch.arange(stacked.shape[-1]) / (stacked.shape[-1] + 1)  # ties: lower id
        top = order.topk(min(pool_blocks, stacked.shape[-1]), dim=-1).indices
        pool = torch.zeros_like(stacked).scatter_(-1, top, True) & (latest >= 0)
    curve = []
    for lag in range(1, steps):
        new = (stacked[lag:] & ~pool[:-lag]).sum(-1)  # [T - lag, B, Hkv]
        curve.append(float(new.float().mean()) * block_size / budget)
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


@dataclass(frozen=True)
class ProfilePrompts:
    """Real prompts to profile on (token ids, one per record) and what they are, for the profile's `measured_on`."""

    prompts: list[list[int]]
    measured_on: dict[str, Any]


def longbench_prompts(datasets: str | list[str], data_dir: str | None, tokenizer: Any, length: int, limit: int,
                      data: dict[str, tuple[list[dict[str, Any]], Any]] | None = None) -> ProfilePrompts:
    """The first `limit` records of each LongBench dataset whose official prompt has at least `length` tokens,
    middle-truncated to exactly `length` (`LongBenchTask`, then `truncate_middle_ids`: the drift depends on the
    context, so the profile is at the length asked for), with their ids and the data's source. Several datasets
    profile one model over several kinds of text, as the paper profiles its model once: their records are
    listed in order, each with its dataset. `data`: each dataset's records and source as
    `longbench.load_task_data` read them (before the model loaded), else read here."""
    names = [datasets] if isinstance(datasets, str) else list(datasets)
    parts = [_dataset_prompts(name, data_dir, tokenizer, length, limit, (data or {}).get(name)) for name in names]
    if len(parts) == 1:
        return parts[0]
    return ProfilePrompts([ids for part in parts for ids in part.prompts], {
        "prompts": "longbench", "dataset": ",".join(names),
        "data_source": {name: part.measured_on["data_source"] for name, part in zip(names, parts, strict=True)},
        "records": [{"dataset": name, **record} for name, part in zip(names, parts, strict=True)
                    for record in part.measured_on["records"]]})


def _dataset_prompts(dataset: str, data_dir: str | None, tokenizer: Any, length: int, limit: int,
                     data: tuple[list[dict[str, Any]], Any] | None) -> ProfilePrompts:
    from scoutbench.errors import UsageError
    from scoutbench.workloads import longbench

    rows, source = data if data is not None else longbench.load_task_data(dataset, data_dir)
    whole = longbench.LongBenchTask(dataset, rows, tokenizer, 2**62, source)
    picked = [i for i, row in enumerate(rows) if len(whole.input_ids(row)) >= length][:limit]
    if not picked:
        raise UsageError(f"no {dataset} record has {length} prompt tokens (the longest has "
                         f"{max(len(whole.input_ids(row)) for row in rows)}); lower --len")
    task = longbench.LongBenchTask(dataset, rows, tokenizer, length, source)
    prompts = [longbench.truncate_middle_ids(task.input_ids(rows[i]), length) for i in picked]
    return ProfilePrompts(prompts, {
        "prompts": "longbench", "dataset": dataset, "data_source": source,
        "records": [{"index": i, "_id": rows[i].get("_id"), "tokens": len(ids)}
                    for i, ids in zip(picked, prompts, strict=True)]})


def _decode_trace(engine: DecodeEngine, method: ScoutAttention, steps: int, batch: int, length: int, seed: int,
                  prefill: str, prompt: list[int] | None) -> list[dict[str, Any]]:
    """Prefill (a real prompt, random tokens or synthetic K/V) and decode `steps` tokens with the method traced:
    greedy on a real prefill, random tokens after a synthetic one."""
    model, device = engine.model, engine.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    if prompt is not None:
        batch, length = 1, len(prompt)
    engine.start(batch=batch, max_len=length + steps + 1)
    method.trace = []
    try:
        lengths = torch.full((batch,), length, dtype=torch.long)
        if prefill == "synthetic":
            engine.prefill_synthetic(lengths, seed)
            tokens = torch.randint(0, vocab, (batch,), generator=generator).to(device)
        else:
            ids = torch.tensor([prompt]) if prompt is not None else \
                torch.randint(0, vocab, (batch, length), generator=generator)
            tokens = engine.prefill(ids.to(device), lengths).argmax(-1)
        for _ in range(steps):
            logits = engine.decode_step(tokens)
            tokens = logits.argmax(-1) if prefill != "synthetic" else \
                torch.randint(0, vocab, (batch,), generator=generator).to(device)
        return method.trace
    finally:
        method.trace = None


def profile_recall(model_name: str = "tiny-qwen3", length: int = 4096, steps: int = 32, beta: float = 0.12,
                   batch: int = 1, device: str = "auto", dtype: str | None = None, seed: int = 0,
                   prefill: str = "real", method_args: dict[str, Any] | None = None,
                   loaded: Any = None, prompts: ProfilePrompts | None = None, force: bool = False) -> dict[str, Any]:
    """Run the profile and return the JSON-ready result (see the module docstring). With `prompts`, each real
    prompt is profiled on its own (batch 1, its own length) and the curves are averaged over them. The memory
    it will take is checked first, as a throughput run's is (`force`: run anyway)."""
    from scoutbench.bench.resolve import ThroughputConfig, check_memory
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import check_context, load_model, loaded_context_window

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    args = dict(method_args or {})
    args["pr"] = False
    method = ScoutAttention.from_args(args)
    longest = max(map(len, prompts.prompts)) if prompts is not None else length
    # a budget covering the context runs dense: nothing drifts, every layer's interval is null and sparse: false
    budget_plan = dense_if_budget_covers(method, longest + steps + 1)[1]
    if loaded is None:
        loaded = load_model(model_name, torch_device, torch_dtype, seed)
    model = loaded.model
    if prefill != "synthetic":  # real attention past the trained window is noise: nothing to profile
        check_context(model_name, loaded_context_window(loaded), longest + steps + 1, f"--len {longest} plus "
                      f"{steps} decode steps", "lower --len or --steps, or pass --prefill synthetic")
    if budget_plan.sparse:  # the free-memory check of a throughput run of the longest prompt: one line, exit 1
        run = ThroughputConfig(method="scout", method_args=args, model=model_name, length=longest,
                               batch=batch if prompts is None else 1, steps=steps + 1, warmup=0, count_steps=0,
                               device=device, dtype=dtype, seed=seed, prefill=prefill, force=force)
        check_memory(run, method, loaded, run.batch)
    started = time.time()
    traces = []
    if budget_plan.sparse:  # a dense run has no selection to profile
        for prompt in prompts.prompts if prompts is not None else [None]:
            method = ScoutAttention.from_args(args)
            with DecodeEngine(model, method) as engine:
                traces.append(_decode_trace(engine, method, steps, batch, length, seed, prefill, prompt))
    profiled = profile_intervals(traces, method, model.config.num_hidden_layers, beta)
    measured_on = prompts.measured_on if prompts is not None else {
        "prompts": "random tokens" if prefill != "synthetic" else "synthetic K/V", "seed": seed, "batch": batch}
    return {
        **envelope("scout_recall_profile"),
        "model": model_name,
        "len": longest,
        "steps": steps,
        "batch": batch if prompts is None else 1,
        "beta": beta,
        "prefill": prefill,
        "measured_on": {**measured_on, "model": model_name, "len": longest, "steps": steps},
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device": torch_device.type,
        "method": method.config(),
        "k_sel": method.k_sel,
        "pool_slots": method.pool_slots,
        **budget_plan.result_fields(),
        **profiled,
        "interval_cap": max(1, steps - 1),
        "elapsed_s": time.time() - started,
    }


def profile_intervals(traces: list[list[dict[str, Any]]], method: ScoutAttention, num_layers: int, beta: float
                      ) -> dict[str, Any]:
    """The profile of no-recall traces (one per prompt, curves averaged over them): per layer the interval
    (`choose_interval` of the drift curve at `beta`, null for dense layers), the expected ratio under it, the drift
    curve and the ratio without recall, and the means over the sparse layers."""
    dense = min(method.dense_layers, num_layers)
    masks = [selection_masks(trace, num_layers) for trace in traces]
    intervals: list[int | None] = []
    drift: list[list[float] | None] = []
    expected: list[float | None] = []
    without: list[list[float] | None] = []
    for layer in range(num_layers):
        if layer < dense or not masks or any(layer not in m for m in masks):
            intervals.append(None)
            drift.append(None)
            expected.append(None)
            without.append(None)
            continue
        curve = _mean_curves([drift_curve(m[layer], method.block_size, method.budget, method.pool_slots)
                              for m in masks])
        interval = choose_interval(curve, beta)
        intervals.append(interval)
        drift.append(curve)
        expected.append(sum(curve[:interval]) / interval if curve else 0.0)
        without.append(_mean_curves([no_recall_ratio(trace, layer, method.block_size, method.budget)
                                     for trace in traces]))
    sparse_intervals = [i for i in intervals if i is not None]
    sparse_expected = [e for e in expected if e is not None]
    return {"intervals": intervals,
            "mean_interval": sum(sparse_intervals) / len(sparse_intervals) if sparse_intervals else None,
            "expected_ratio": expected,
            "expected_ratio_mean": sum(sparse_expected) / len(sparse_expected) if sparse_expected else None,
            "drift": drift, "ratio_without_recall": without}


def _mean_curves(curves: list[list[float]]) -> list[float]:
    """The element-wise mean of equally long curves (one per profiled prompt)."""
    return [sum(values) / len(values) for values in zip(*curves, strict=True)]
