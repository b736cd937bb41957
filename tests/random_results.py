"""Random result files for the property-based tests of the commands that read results (gate, report,
project): templates (the committed CI baseline's results, the result factory's, an accuracy result and a
projection) with random fields replaced by odd values (every JSON type, non-finite floats, zeros, huge numbers) or
deleted, and `scoutbench ARGS` run in-process."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck
from hypothesis import strategies as st
from result_factory import SCOUT_CONFIG, make_accuracy, make_result

from scoutbench.results import load_results

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu-ci"
PROPERTY_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI_RUNS = load_results([BASELINE / "run1"])  # real throughput results, method_stats and all (fullkv, scout)
# what a field may be replaced with: every JSON type, non-finite floats (as literals and as scoutbench writes them),
# zeros, negatives, huge numbers, empty and odd strings
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(min_value=2**40, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["nan", "inf", "-inf", "", "auto", "x", "1"]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.sampled_from(["a", "median", "len"]),
                                                              st.integers(0, 3), max_size=2))


FIELDS = [("schema_version",), ("kind",), ("method",), ("status",), ("error",), ("method_config",),
          ("method_config", "budget"), ("method_config", "block_size"), ("method_config", "dense_layers"),
          ("model",), ("model", "name"), ("model", "dtype"), ("model", "num_layers"), ("model", "num_kv_heads"),
          ("workload",), ("workload", "len"), ("workload", "batch"), ("workload", "steps"), ("workload", "warmup"),
          ("workload", "seed"), ("workload", "kv_skew"), ("device",), ("device", "class"), ("env",),
          ("decode_throughput_tok_s",), ("decode_step_ms",), ("decode_step_ms", "median"), ("gpu_idle_frac",),
          ("main_thread_wait_frac",), ("latency_breakdown_ms",), ("latency_breakdown_ms", "idle"), ("batch_plan",),
          ("batch_plan", "mode"), ("method_stats",), ("method_stats", "cpu_compute_ratio"),
          ("method_stats", "recall"), ("results",), ("results", "qasper"), ("results", "qasper", "score"),
          ("projections",), ("projections", 0), ("projections", 0, "len"), ("projections", 0, "method"),
          ("projections", 0, "decode_throughput_tok_s"), ("hardware",), ("dense_layers",)]


def _templates() -> list[dict]:
    from scoutbench.analysis.hardware import load_hardware
    from scoutbench.analysis.projection import Target, projection_document

    projection = projection_document(copy.deepcopy(CI_RUNS), load_hardware("h200"), Target())
    return [*CI_RUNS, make_result("fullkv", 100.0), make_result("scout", 300.0, config=SCOUT_CONFIG, idle_frac=0.1),
            make_result("quest", 120.0, length=8192, batch=2), make_result("hgca", status="failed", error="oom"),
            make_accuracy("scout", {"qasper": 40.0, "samsum": 0.0}), projection]


TEMPLATES = _templates()


def _mutate(result: dict, path: tuple, value, delete: bool) -> dict:
    out = copy.deepcopy(result)
    parent = out
    for step in path[:-1]:
        if isinstance(parent, dict) and step in parent:
            parent = parent[step]
        elif isinstance(parent, list) and isinstance(step, int) and step < len(parent):
            parent = parent[step]
        else:
            return out
    last = path[-1]
    if isinstance(parent, dict) or (isinstance(parent, list) and isinstance(last, int) and last < len(parent)):
        if delete and isinstance(parent, dict):
            parent.pop(last, None)
        elif isinstance(parent, dict) or last < len(parent):
            parent[last] = value
    return out


@st.composite
def result_files(draw) -> list:
    """A few result documents, each a template with up to three random mutations, or a raw JSON value."""
    files = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 9)) == 0:
            files.append(draw(ODD_VALUES))  # not a result at all
            continue
        result = draw(st.sampled_from(TEMPLATES))
        for _ in range(draw(st.integers(0, 3))):
            result = _mutate(result, draw(st.sampled_from(FIELDS)), draw(ODD_VALUES), draw(st.booleans()))
        files.append(result)
    return files


def write_documents(folder: Path, documents: list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, document in enumerate(documents):
        (folder / f"{index}.json").write_text(json.dumps(document, default=str), encoding="utf-8")  # NaN literals
    return folder


def run_main(*args) -> tuple[int, str, str]:
    """`scoutbench ARGS` in-process (no pytest fixtures: hypothesis reruns the body many times). A fault the tool
    does not classify (a bug, one `internal error` line with exit 1) fails the test whatever the exit code."""
    from scoutbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.object(sys, "argv", ["scoutbench", *map(str, args)]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
    assert "internal error" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()
