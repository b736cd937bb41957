"""`scoutbench export`: result files in the formats people already keep numbers in (mappings: docs/results.md).

- `csv`: one row per result, every scalar field as a dotted column (`decode_step_ms.median`, `model.name`); lists
  and objects inside a cell as JSON; `read_csv` gives the values back, so a sweep round-trips.
- `sglang`: SGLang `bench_one_batch`'s `result.jsonl` records (seconds and tok/s, the decode step by its median).
- `vllm`: `vllm bench latency`'s `--output-json` object, one per result, with the timed decode steps as its
  latencies (seconds) and a `scoutbench` section that says so (vLLM's latency is one whole generate call);
  `pytorch`: the PyTorch OSS benchmark-database records vLLM writes beside it (`<name>.pytorch.json`, one record
  per metric), named by the method, so that a dashboard never draws two methods as one series.

Every result keeps its own output: files are named by the result file's name, or, where results from several
folders share one, by its path from the folders' common root (`runA__scout_....json`); nothing is written until
every name is known to be free (or `overwrite` is given). The module imports no torch: exporting a folder of
results is instant.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.results import _jsonable, load_results
from scoutbench.step_stats import percentile

FORMATS = ("csv", "sglang", "vllm", "pytorch")
# Left out of CSV cells (multi-line, kilobytes per row); the JSON result keeps them.
CSV_OMITTED = ("env.torch_env_summary",)
VLLM_PERCENTILES = (10, 25, 50, 75, 90, 99)  # the ones `vllm bench latency` reports


# ---------------------------------------------------------------------------------------------- reading
# what each per-result format reads of a throughput result beyond what every ok one has (result_schema.result_problem)
FORMAT_FIELDS = {"sglang": ("decode_time_s", "workload.steps", "prefill_ms"),
                 "vllm": ("step_ms", "decode_time_s"), "pytorch": ("step_ms", "decode_time_s")}


def format_problem(result: dict[str, Any], fmt: str | None) -> str | None:
    """Why `result` cannot be written as `fmt` (a field the format reads is missing or not numbers), or None."""
    synthetic = (result.get("workload") or {}).get("prefill") == "synthetic"
    for name in FORMAT_FIELDS.get(fmt or "", ()):
        if name == "prefill_ms" and synthetic:  # a synthetic prefill's time is not SGLang's prefill
            continue
        section, _, field = name.rpartition(".")
        value = (result.get(section) if isinstance(result.get(section), dict) else {}).get(field) if section \
            else result.get(name)
        numbers = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            return f"no {name} as {'a list of numbers' if name == 'step_ms' else 'a number'}, which {fmt} reads"
    return None


def collect(paths: Iterable[str | Path], kinds: tuple[str, ...] | None = None,
            fmt: str | None = None) -> tuple[list[dict], list[str]]:
    """Results under `paths` (files, folders, sweep folders), ok ones of `kinds` (all kinds when None) that have what
    `fmt` reads, and what was left out and why. Files that are not scoutbench results are listed, never fatal."""
    skipped: list[str] = []
    found = load_results(paths, on_skip=lambda file, why: skipped.append(f"{file}: {why}"))
    chosen = []
    for result in found:  # each file once: load_results reads a file reached twice (or a copy of it) once
        if kinds is not None and result.get("kind") not in kinds:
            kind = str(result.get("kind"))
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            skipped.append(f"{result['_path']}: {article} {kind} result ({'/'.join(kinds)} only here)")
        elif result.get("status", "ok") != "ok":
            skipped.append(f"{result['_path']}: status {result.get('status')} ({result.get('error')})")
        elif (problem := format_problem(result, fmt)) is not None:
            skipped.append(f"{result['_path']}: {problem}")
        else:
            chosen.append(result)
    return chosen, skipped


def run_name(result: dict[str, Any]) -> str:
    """The result file's stem (unique within a folder and descriptive: method, model, length, batch, args)."""
    path = result.get("_path")
    return Path(path).stem if path else f"{result.get('method')}_{(result.get('model') or {}).get('name')}"


def run_names(results: list[dict[str, Any]]) -> list[str]:
    """One distinct name per result: its file's stem, or, for stems that several results share (two sweeps of
    one grid), the file's path below the deepest folder the sharing files have in common, joined by `__`
    (`runA__scout_tiny-qwen3_len2k_b1`); results without a file get a `-2`, `-3`... suffix."""
    names = [run_name(r) for r in results]
    sharing: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(names):
        sharing[name].append(index)
    for indices in sharing.values():
        if len(indices) < 2:
            continue
        paths = [results[i].get("_path") for i in indices]
        if all(isinstance(p, str) for p in paths):
            resolved = [Path(os.path.realpath(p)).with_suffix("") for p in paths]
            root = Path(os.path.commonpath([str(p.parent) for p in resolved]))
            for i, path in zip(indices, resolved, strict=True):
                names[i] = "__".join(path.relative_to(root).parts)
    taken: dict[str, int] = defaultdict(int)
    for index, name in enumerate(names):
        taken[name] += 1
        if taken[name] > 1:
            names[index] = f"{name}-{taken[name]}"
    return names


def result_sha256(result: dict[str, Any]) -> str:
    """The identity of a result's content (its JSON without where it was read from): what a tracker is told, so
    that exporting the same result again finds the run it already logged."""
    content = json.dumps(_jsonable({k: v for k, v in result.items() if k != "_path"}), sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- CSV
def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys for nested objects; scalars and lists as leaves (`_path` becomes `source_file`)."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if name == "_path":
            out["source_file"] = value
        elif isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        return json.dumps(_jsonable(value), ensure_ascii=False)
    if isinstance(value, float):
        return repr(value)  # shortest exact form: float(cell) == value
    return str(value)


def parse_cell(text: str) -> Any:
    """Inverse of the CSV cell encoding: '' -> None, JSON (numbers, true/false, lists, objects) -> value, else str."""
    if text == "":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def to_csv(results: list[dict[str, Any]]) -> str:
    rows = [{k: v for k, v in flatten(r).items() if k not in CSV_OMITTED} for r in results]
    columns = list(dict.fromkeys(column for row in rows for column in row))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(column)) for column in columns])
    return buffer.getvalue()


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of an exported CSV with their values decoded; an empty cell of a column a row lacks reads as None."""
    with open(path, newline="", encoding="utf-8") as handle:
        return [{k: parse_cell(v) for k, v in row.items()} for row in csv.DictReader(handle)]


# ---------------------------------------------------------------------------------------------- SGLang
def sglang_record(result: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """One `bench_one_batch` result.jsonl record. SGLang's output_len counts the prefill's token too, so it is the
    timed steps + 1; its decode latencies are our timed steps (warm-up excluded: SGLang warms up in a separate run).
    `median_decode_throughput` is scoutbench's one throughput, tokens over the total timed time (SGLang divides the
    batch by its median step; the median step stays `median_decode_latency`), so that the export, the tables and
    the figures give one number for one point. A synthetic prefill ran no model over the prompt: its prefill and
    total fields are null, not fake numbers (`synthetic_prefill_note` says so when exporting)."""
    workload, batch = result["workload"], result["workload"]["batch"]
    input_len, output_len = workload["len"], workload["steps"] + 1
    median_s = result["decode_step_ms"]["median"] / 1e3
    real_prefill = workload.get("prefill") != "synthetic"
    prefill_s = result["prefill_ms"] / 1e3 if real_prefill else None
    total_s = prefill_s + result["decode_time_s"] if prefill_s is not None else None
    return {
        "run_name": name or run_name(result), "batch_size": batch, "input_len": input_len, "output_len": output_len,
        "prefill_latency": prefill_s,
        "prefill_throughput": input_len * batch / prefill_s if prefill_s else None,
        "median_decode_latency": median_s, "median_decode_throughput": result["decode_throughput_tok_s"],
        "total_latency": total_s,
        "overall_throughput": (input_len + output_len) * batch / total_s if total_s else None,
    }


def synthetic_prefill_note(results: list[dict[str, Any]]) -> str | None:
    """The line `export --format sglang` prints when records carry nulls for a synthetic prefill, or None."""
    synthetic = sum((r.get("workload") or {}).get("prefill") == "synthetic" for r in results)
    if not synthetic:
        return None
    return (f"note: {synthetic} of {len(results)} results had a synthetic prefill (no model ran over the prompt): "
            "their prefill_latency, prefill_throughput, total_latency and overall_throughput are null; rerun them "
            "with --prefill real (a real model, or a preset's random prompt) for those numbers")


def to_sglang_jsonl(results: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(_jsonable(sglang_record(r, name))) + "\n"
                   for r, name in zip(results, run_names(results), strict=True))


# ---------------------------------------------------------------------------------------------- vLLM
LATENCY_MEANING = ("one decode step of the whole batch, in seconds (vllm bench latency's latency is one generate "
                   "call: prefill and every output token)")


def vllm_latency(result: dict[str, Any]) -> dict[str, Any]:
    """`vllm bench latency --output-json`'s object. Its latency is one generate call of the whole batch; ours, one
    decode step of the batch (the field that compares with a decode benchmark), in seconds, which the object's
    `scoutbench` section says, with what ran. std is numpy's (population) std, percentiles numpy's linear ones,
    as vLLM computes them."""
    latencies = [ms / 1e3 for ms in result["step_ms"]]
    return {"avg_latency": statistics.fmean(latencies), "std_latency": statistics.pstdev(latencies),
            "latencies": latencies,
            "percentiles": {str(p): percentile(latencies, p / 100) for p in VLLM_PERCENTILES},
            "scoutbench": {"latency": LATENCY_MEANING, **run_args(result)}}


def run_args(result: dict[str, Any]) -> dict[str, Any]:
    """What the run was (`benchmark.extra_info.args` of the PyTorch records): the knobs that change a number."""
    workload, model = result["workload"], result["model"]
    return {"method": result["method"], "method_config": result.get("method_config"), "model": model["name"],
            "dtype": model.get("dtype"), "input_len": workload["len"], "batch_size": workload["batch"],
            "num_iters": workload.get("steps"), "num_iters_warmup": workload.get("warmup"), "seed": workload.get("seed"),
            "prefill": workload.get("prefill"), "device": (result.get("device") or {}).get("class"),
            "scoutbench_version": result.get("scoutbench_version"),
            "git_commit": (result.get("env") or {}).get("git_commit")}


def pytorch_records(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The PyTorch OSS benchmark-database records `vllm bench latency` writes with SAVE_TO_PYTORCH_BENCHMARK_FORMAT
    (vllm/benchmarks/lib/utils.py: one record per metric). What a dashboard keys a series by says what ran: the
    benchmark's name carries the method (`scoutbench decode: scout`) and its dtype and mode are set, as the
    database's format has them; every other setting is in `extra_info.args`. The step latency is named for what it
    is (`decode_step_latency_s`, not vLLM's `latency` of a whole generate call); the throughput is a second metric."""
    latency = vllm_latency(result)
    metrics = {"decode_step_latency_s": (latency["latencies"],
                                         {**{k: latency[k] for k in ("avg_latency", "std_latency", "percentiles")},
                                          "unit": "s", "meaning": LATENCY_MEANING}),
               "decode_throughput_tok_s": ([result["decode_throughput_tok_s"]],
                                           {"decode_time_s": result["decode_time_s"], "unit": "tok/s"})}
    benchmark = {"name": f"scoutbench decode: {result['method']}", "mode": "inference",
                 "dtype": result["model"].get("dtype"), "extra_info": {"args": run_args(result)}}
    return [{"benchmark": benchmark, "model": {"name": result["model"]["name"]},
             "metric": {"name": name, "benchmark_values": values, "extra_info": extra}}
            for name, (values, extra) in metrics.items()]


# ---------------------------------------------------------------------------------------------- writing
def write_text(path: Path, text: str, overwrite: bool) -> Path:
    """Whole file or nothing (temp file + rename); an existing file only with `overwrite`."""
    return write_texts({path: text}, overwrite)[0]


def write_texts(files: dict[Path, str], overwrite: bool) -> list[Path]:
    """Every file or none: all names are checked first (an existing one without `overwrite` is a usage error
    before anything is written), then each file is written to a temp file beside it, and the temp files are
    moved into place only once all of them are complete. UTF-8 always: a byte of a file name that is not UTF-8
    (0xe9 of a Latin-1 `café`, which Python holds as the lone surrogate U+DCE9) is written as `\udce9`, where
    encoding it failed (a traceback)."""
    for path in files:
        if path.is_dir():
            raise ScoutbenchError(f"cannot write {path}: it is a folder; choose a file name for -o")
        if path.exists() and not overwrite:
            raise UsageError(f"{path} exists; pass --overwrite to replace it or choose another -o")
    written: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            written.append((tmp, path))
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="") as handle:
                handle.write(text)
            os.chmod(tmp, 0o644)
        for tmp, path in written:
            os.replace(tmp, path)
    finally:
        for tmp, _ in written:
            Path(tmp).unlink(missing_ok=True)
    return list(files)


def export(results: list[dict[str, Any]], fmt: str, output: str | Path, overwrite: bool = False) -> list[Path]:
    """Write `results` as `fmt` to `output` (a file; for vllm/pytorch a folder of one file per result, or a file
    when there is exactly one). Returns the files written: one per result, never two results into one file."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}: use {', '.join(FORMATS)}")
    if not results:
        raise UsageError("nothing to export: no ok results of a kind this format takes")
    output = Path(output)
    if fmt == "csv":
        return [write_text(output, to_csv(results), overwrite)]
    if fmt == "sglang":
        return [write_text(output, to_sglang_jsonl(results), overwrite)]
    render = vllm_latency if fmt == "vllm" else pytorch_records
    suffix = ".json" if fmt == "vllm" else ".pytorch.json"
    if output.suffix == ".json":
        if len(results) > 1:
            raise UsageError(f"-o {output} is one file but there are {len(results)} results; pass a folder")
        return [write_text(output, json.dumps(_jsonable(render(results[0])), indent=2) + "\n", overwrite)]
    files = {output / f"{name}{suffix}": json.dumps(_jsonable(render(r)), indent=2) + "\n"
             for r, name in zip(results, run_names(results), strict=True)}
    return write_texts(files, overwrite)
