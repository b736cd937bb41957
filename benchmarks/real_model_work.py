"""Work counters of every method on a real model decoding real LongBench records: the projection's real-drift input.

The paper-scale projection (docs/projection.md) carries each method's measured selection behaviour (ScoutAttention's
CPU share of its budget and recall volume, Quest's attended tokens, InfiniGen's fetch, HGCA's CPU tokens) to the
paper's shape. On synthetic KV that behaviour is set by `kv_skew`; here it comes from real attention: a real model
(default qwen2.5-0.5b, bf16) prefills each record's official LongBench prompt once (`SharedPrefill`), and every
method greedily decodes `--warmup` + `--steps` tokens from that prefill; its `method_stats` of the timed steps go into
a result file of kind `throughput` (the fields the projection and the counter gate read; the decode time is the
median of the timed steps, with this script's own clock, not `scoutbench throughput`'s stage timer).

Prompts: the record's filled template, middle-truncated at text level to `--len` tokens as the official pred.py
does (`--max-length`), wrapped in the chat template, then middle-truncated at token level to exactly `--len` tokens
so that every record is one point of the projection (repeats of a point are merged by the median of their
fractions). Records shorter than `--len` tokens are skipped. Every result names its record in `kv_source`.

    python benchmarks/real_model_work.py --data-dir LONGBENCH_DIR \
        --record passage_retrieval_en:0 --record gov_report:0 --len 8k --budget 512 -o results/projection/qwen-8k

A finished file is kept (a rerun resumes); each file is written atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from scoutbench.devices import device_description  # noqa: E402
from scoutbench.eval.generation import SharedPrefill, method_spec  # noqa: E402
from scoutbench.models import load_model  # noqa: E402
from scoutbench.results import envelope, write_json_atomic  # noqa: E402
from scoutbench.units import format_length, parse_length  # noqa: E402
from scoutbench.workloads import longbench  # noqa: E402

METHODS = ("fullkv", "quest", "infinigen", "hgca", "scout", "scout-base", "scout-pc")


@torch.no_grad()
def decode_counters(shared: SharedPrefill, name: str, budget: int | None, dense_layers: int, warmup: int,
                    steps: int, method_args: dict[str, Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """(method description, method_stats of the timed steps, step times in ms) of greedy decode from `shared`."""
    spec = method_spec(name, method_args, budget=None if name == "fullkv" else budget,
                       dense_layers=None if name == "fullkv" else dense_layers)
    described = spec.describe()
    method = spec.build_for(len(shared.prompt_ids) + warmup + steps)
    step_ms: list[float] = []
    with shared.engine(method, warmup + steps) as engine:
        token = shared.logits.argmax(-1)
        for index in range(warmup + steps):
            if index == warmup:
                method.reset_stats()
            start = time.perf_counter()
            token = engine.decode_step(token).argmax(-1)
            if index >= warmup:
                step_ms.append((time.perf_counter() - start) * 1e3)
        stats = method.stats()
    return described, stats, step_ms


def result_document(described: dict[str, Any], stats: dict[str, Any], step_ms: list[float], loaded: Any,
                    dtype: torch.dtype, length: int, warmup: int, steps: int, record_label: str,
                    data_source: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """A throughput-kind result (the fields docs/results.md names that the projection and counter gate read)."""
    median_ms = statistics.median(step_ms)
    return {
        **envelope("throughput", command), "status": "ok", "error": None, **described,
        "model": loaded.describe(dtype),
        "workload": {"name": "longbench", "len": length, "batch": 1, "steps": steps, "warmup": warmup, "seed": 0,
                     "prefill": "real"},
        "kv_source": f"longbench({record_label}, official prompt middle-truncated to {length} tokens, "
                     f"{loaded.name} prefill)",
        "data_source": data_source, "device": device_description(torch.device("cpu")),
        "decode_step_ms": {"median": median_ms, "min": min(step_ms), "max": max(step_ms)},
        "decode_throughput_tok_s": 1e3 / median_ms, "method_stats": stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--data-dir", required=True, help="folder of official LongBench <name>.jsonl files")
    parser.add_argument("--record", action="append", required=True, metavar="DATASET:INDEX",
                        help="a record (repeatable), e.g. passage_retrieval_en:0")
    parser.add_argument("--len", dest="length", default="8k", help="prompt tokens, exactly (default 8k)")
    parser.add_argument("--budget", default="512", help="sparse methods' token budget (default 512: 1/16 of 8k)")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--method", action="append", help=f"method (repeatable; default {', '.join(METHODS)})")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of every selected method (repeatable), e.g. recall_interval=1")
    parser.add_argument("-o", "--output", required=True, help="folder of result files")
    args = parser.parse_args()
    length, budget = parse_length(args.length), parse_length(args.budget, "--budget")
    methods = args.method or list(METHODS)
    method_args = dict(item.split("=", 1) for item in args.method_arg)
    records = []
    for item in args.record:
        dataset, _, index = item.partition(":")
        rows, source = longbench.load_task_data(dataset, args.data_dir)
        records.append((dataset, int(index or 0), rows, source))
    out = Path(args.output)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    loaded = load_model(args.model, "cpu", dtype)
    for dataset, index, rows, source in records:
        record = rows[index]
        label = f"{dataset}#{index} {record.get('_id', '')}".strip()
        files = {m: out / f"{m}_{args.model}_len{format_length(length)}_{dataset}-{index}.json" for m in methods}
        if all(f.exists() for f in files.values()):
            print(f"{label}: done already")
            continue
        task = longbench.LongBenchTask(dataset, [record], loaded.tokenizer, length, source)
        prompt = task.input_ids(record)
        if len(prompt) < length:
            print(f"{label}: {len(prompt)} tokens < --len {length}: skipped", file=sys.stderr)
            continue
        prompt = longbench.truncate_middle_ids(prompt, length)
        cpu_start = time.process_time()
        shared = SharedPrefill(loaded.model, prompt)
        print(f"{label}: prefill of {length} tokens, {time.process_time() - cpu_start:.0f} s CPU", flush=True)
        for name in methods:
            if files[name].exists():
                continue
            cpu_start = time.process_time()
            described, stats, step_ms = decode_counters(shared, name, budget, args.dense_layers, args.warmup,
                                                        args.steps, method_args)
            write_json_atomic(files[name], result_document(described, stats, step_ms, loaded, dtype, length,
                                                           args.warmup, args.steps, label, source, sys.argv))
            ratio = (stats.get("cpu_compute_ratio") or {}).get("mean")
            shown = f", CPU share of budget {ratio:.3f}" if ratio is not None else ""
            print(f"  {name}: step {statistics.median(step_ms):.1f} ms{shown} "
                  f"({time.process_time() - cpu_start:.0f} s CPU)", flush=True)
        del shared


if __name__ == "__main__":
    main()
