#!/usr/bin/env python3
"""Check that a flashinfer release has the API scoutbench's adapter calls (scoutbench/kernels/flashinfer_decode.py), without
a GPU and without installing it: the wheel's Python source is read with `ast`, its CUDA header as text.

    pip download --no-deps flashinfer-python==0.6.13 -d /tmp/fi && python scripts/check_flashinfer_api.py /tmp/fi/*.whl
    python scripts/check_flashinfer_api.py            # the installed flashinfer

The `gpu` extra's range (pyproject.toml) is the range whose ends pass this check; exit 1 names what is missing.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from pathlib import Path

WRAPPER = "BatchDecodeWithPagedKVCacheWrapper"
# What flashinfer_decode.py passes: the constructor's layout and tensor-core switch, plan()'s seven positional arguments
# and three keywords, run()'s query, paged cache and return_lse.
INIT_PARAMS = ("float_workspace_buffer", "kv_layout", "use_tensor_cores")
PLAN_POSITIONAL = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
PLAN_KEYWORDS = ("q_data_type", "kv_data_type", "sm_scale")
RUN_POSITIONAL = ("q", "paged_kv_cache")
RUN_KEYWORDS = ("return_lse",)
DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)  # backends.FLASHINFER_DECODE_GROUP_SIZES


def _params(function: ast.FunctionDef) -> tuple[list[str], list[str], bool]:
    """(positional names without self, keyword-capable names, accepts **kwargs)."""
    args = function.args
    positional = [a.arg for a in [*args.posonlyargs, *args.args]][1:]
    return positional, [*positional, *(a.arg for a in args.kwonlyargs)], args.kwarg is not None


def api_problems(decode_source: str, utils_cuh: str | None = None) -> list[str]:
    """What the adapter needs and this flashinfer's `decode.py` (and `utils.cuh`) lack; empty when compatible."""
    classes = [node for node in ast.parse(decode_source).body
               if isinstance(node, ast.ClassDef) and node.name == WRAPPER]
    if not classes:
        return [f"no class {WRAPPER} in flashinfer/decode.py"]
    methods = {f.name: f for f in classes[0].body if isinstance(f, ast.FunctionDef)}
    problems = []
    for name in ("__init__", "plan", "run"):
        if name not in methods:
            problems.append(f"{WRAPPER}.{name} is missing")
    if problems:
        return problems
    _, init_names, _ = _params(methods["__init__"])
    problems += [f"{WRAPPER}() has no parameter {p!r}" for p in INIT_PARAMS if p not in init_names]
    plan_positional, plan_names, plan_kwargs = _params(methods["plan"])
    if tuple(plan_positional[:len(PLAN_POSITIONAL)]) != PLAN_POSITIONAL:
        problems.append(f"plan() positional arguments are {plan_positional[:7]}, expected {list(PLAN_POSITIONAL)}")
    if plan_kwargs and "_plan_impl" in methods:  # newer releases forward **kwargs to a keyword-only _plan_impl
        plan_names = [*plan_names, *_params(methods["_plan_impl"])[1]]
    problems += [f"plan() takes no keyword {p!r}" for p in PLAN_KEYWORDS if p not in plan_names]
    run_positional, run_names, _ = _params(methods["run"])
    if tuple(run_positional[:2]) != RUN_POSITIONAL:
        problems.append(f"run() positional arguments are {run_positional[:2]}, expected {list(RUN_POSITIONAL)}")
    problems += [f"run() takes no keyword {p!r}" for p in RUN_KEYWORDS if p not in run_names]
    if utils_cuh is not None:
        sizes = compiled_group_sizes(utils_cuh)
        if not set(DECODE_GROUP_SIZES) <= set(sizes):  # more sizes only means a faster kernel is left unused
            problems.append(f"DISPATCH_GQA_GROUP_SIZE compiles group sizes {sizes}, the dispatch sends "
                            f"{DECODE_GROUP_SIZES} to that kernel (update backends.FLASHINFER_DECODE_GROUP_SIZES)")
    return problems


def compiled_group_sizes(utils_cuh: str) -> tuple[int, ...]:
    """The GQA group sizes `DISPATCH_GQA_GROUP_SIZE` instantiates CUDA-core decode kernels for."""
    macro = utils_cuh[utils_cuh.find("#define DISPATCH_GQA_GROUP_SIZE"):]
    end = macro.find("#define", 10)
    return tuple(int(v) for v in re.findall(r"group_size == (\d+)", macro[:end] if end > 0 else macro))


def _sources(target: str | None) -> tuple[str, str, str | None]:
    """(label, decode.py text, utils.cuh text or None) of a wheel file, or of the installed package."""
    if target is None:
        import importlib.util

        spec = importlib.util.find_spec("flashinfer")
        if spec is None or spec.origin is None:
            raise SystemExit("flashinfer is not installed; pass a wheel file")
        root = Path(spec.origin).parent
        cuh = root / "data" / "include" / "flashinfer" / "utils.cuh"
        return (f"installed flashinfer at {root}", (root / "decode.py").read_text("utf-8"),
                cuh.read_text("utf-8") if cuh.is_file() else None)
    with zipfile.ZipFile(target) as wheel:
        names = wheel.namelist()
        cuh = next((n for n in names if n.endswith("include/flashinfer/utils.cuh")), None)
        return (Path(target).name, wheel.read("flashinfer/decode.py").decode("utf-8"),
                wheel.read(cuh).decode("utf-8") if cuh else None)


def main(argv: list[str]) -> int:
    failed = False
    for target in argv or [None]:
        label, decode, cuh = _sources(target)
        problems = api_problems(decode, cuh)
        print(f"{label}: {'compatible' if not problems else 'INCOMPATIBLE'}")
        for problem in problems:
            print(f"  - {problem}")
        extra = sorted(set(compiled_group_sizes(cuh)) - set(DECODE_GROUP_SIZES)) if cuh else []
        if extra:
            print(f"  note: CUDA-core decode also compiled for groups {extra}; those run on the tensor-core path")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
