"""Hand-made throughput/accuracy result dicts in the runner's schema, for the gate, report and sweep tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scoutbench.result_schema import SCHEMA_VERSION

TEST_DEVICE = "cpu:Test CPU:2t"
SCOUT_CONFIG = {"budget": 1024, "block_size": 32, "pc": True, "pr": True}


def make_result(method: str = "fullkv", tok_s: float = 100.0, *, length: int = 4096, batch: int = 1,
                config: dict[str, Any] | None = None, step_ms: float | None = None, idle_frac: float = 0.0,
                device_class: str = TEST_DEVICE, model: str = "tiny-qwen3", status: str = "ok",
                error: str | None = None, torch_version: str = "2.13.0+cpu", spread: float = 0.0,
                steps: int = 8, warmup: int = 2, prefill: str = "synthetic") -> dict[str, Any]:
    """A throughput result; the step time and the breakdown follow from the throughput unless given. `spread`
    spreads the timed steps evenly over +-spread of the step (their mean and median stay the step)."""
    step = step_ms if step_ms is not None else 1000.0 * batch / tok_s
    offsets = [(i - (steps - 1) / 2) / ((steps - 1) / 2 or 1) for i in range(steps)]
    timed = [step * (1 + spread * offset) for offset in offsets]
    rest = step * (1 - idle_frac)
    breakdown = {"qkv_proj": 0.1 * rest, "predict": 0.05 * rest, "attn_device": 0.4 * rest, "idle": step * idle_frac,
                 "merge": 0.05 * rest, "o_proj": 0.1 * rest, "mlp": 0.2 * rest, "other": 0.1 * rest}
    result = {
        "schema_version": SCHEMA_VERSION, "kind": "throughput", "scoutbench_version": "0.1.0",
        "created_at": "2026-11-29T08:30:00+00:00", "command": ["scoutbench", "throughput"], "status": status,
        "error": error, "method": method, "method_config": dict(config or {}), "method_repr": f"{method}()",
        "model": {"name": model, "random_weights": True, "dtype": "float32", "num_layers": 4},
        "workload": {"name": "synthetic", "len": length, "batch": batch, "steps": steps, "warmup": warmup,
                     "prefill": prefill, "seed": 0},
        "device": {"type": "cpu", "name": "Test CPU", "class": device_class, "threads": 2},
        "env": {"python": "3.11.7", "torch": torch_version, "transformers": "5.24.0"},
    }
    if status == "ok":
        result.update({
            "decode_throughput_tok_s": tok_s, "decode_time_s": steps * step / 1000, "step_ms": timed,
            "decode_step_ms": {"median": step, "p90": step, "mean": step, "min": min(timed), "max": max(timed)},
            "latency_breakdown_ms": breakdown,
            "latency_breakdown_frac": {k: v / step for k, v in breakdown.items()}, "gpu_idle_frac": idle_frac,
        })
    return result


def sweep_results(points: list[Any], settings: Any, tok_s_scale: float = 1.0) -> list[dict[str, Any]]:
    """The results a sweep of `points` (bench.sweep_grid.SweepPoint) with `settings` would write, without decoding:
    each method's full config as the runner records it, the resolved prefill, the sweep's steps, and for `--batch
    auto` a planned batch of its own per method. Throughputs differ per method, length, batch and config, so that
    a figure that drew one point over another would show it."""
    import zlib

    from scoutbench.bench.resolve import resolve_prefill
    from scoutbench.methods import build_method

    out = []
    for point in points:
        config = build_method(point.method, point.args).config()
        identity = json.dumps([point.method, config], sort_keys=True, default=str)
        batch = point.batch if isinstance(point.batch, int) else 2 + zlib.crc32(point.method.encode()) % 7
        tok_s = tok_s_scale * batch * (50 + zlib.crc32(identity.encode()) % 50) * 4096 / point.length
        result = make_result(point.method, tok_s, length=point.length, batch=batch, config=config,
                             model=settings.model, steps=settings.steps, warmup=settings.warmup,
                             prefill=resolve_prefill(settings.prefill, settings.model), spread=0.05)
        result["dense_layers"] = config.get("dense_layers")
        if point.batch == "auto":
            result["batch_plan"] = {"mode": "auto", "planned": batch}
        out.append(result)
    return out


def make_accuracy(method: str, scores: dict[str, float], model: str = "smollm2-135m") -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kind": "accuracy", "scoutbench_version": "0.1.0",
            "created_at": "2026-11-29T08:30:00+00:00", "command": ["scoutbench", "accuracy"],
            "env": {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0"}, "status": "ok", "method": method, "method_config": {},
            "model": {"name": model, "dtype": "float32"}, "device": {"type": "cpu", "class": TEST_DEVICE},
            "max_length": 4096, "results": {task: {"score": value, "n": 20, "metric": "qa_f1", "max_new_tokens": 128}
                                            for task, value in scores.items()}}


def write_results(folder: Path, results: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, result in enumerate(results):
        (folder / f"{index:02d}_{result['method']}.json").write_text(json.dumps(result), encoding="utf-8")
    return folder
