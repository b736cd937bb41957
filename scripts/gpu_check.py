"""The GPU check's Python side (scripts/gpu_check.sh runs it; docs/gpu.md, "The GPU check").

    host     how fast fresh host memory fills and cudaHostRegister pins it here, and the host cap they
             allow: the kept host buffer of `compare` must fill within its share of setup's limit
    fallback the host cap when the host phase measured nothing (it failed or was cut): the cap whose kept
             buffer fills in time at the slowest rates the lent machine is documented to have
    compare  one process for the phases that run the model: setup (the model, the kept host buffer),
             max_batch (each method at its planned maximum batch) and equal_batch (the methods whose
             max_batch run was not at the equal batch), each under its own limit; a method that fails or is
             cut gets a failed result
    table    one table of both comparisons, and every result (or its absence) in one JSON

The lent machine is a VM whose RAM grows on demand: fresh host memory fills at 0.13-0.3 GiB/s there, so an
offloading method's 47.6 GiB host tier took minutes to touch, once per method and phase, and the phases were
cut while ScoutAttention bound. Here the setup phase fills and registers one buffer of the sized cap, and
each offloading method's host tier is a view of it in turn (scoutbench.runtime.offload.keep_host_memory).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# the kept buffer's fill and registration may take this share of the setup phase's limit (the rest: imports,
# CUDA initialisation, the model)
SETUP_HOST_SHARE = 0.75
# what the table marks as telemetry from a short window (telemetry.py flags `low_confidence` under 2 s)
LOW_CONFIDENCE_MARK = "~"
GIB = 1024**3
# the slowest rates the fallback cap assumes: fresh host memory on the lent machine's kind of guest fills at
# 0.13-0.3 GiB/s (docs/gpu.md, "Host memory on the lent machine"); pinning touched pages has not been measured
# there, 10 GiB/s is assumed (the host phase measures both when it runs)
SLOWEST_FILL_GIB_S = 0.13
SLOWEST_REGISTER_GIB_S = 10.0


class PhaseCut(BaseException):
    """The running phase reached its limit (a BaseException: no `except Exception` of a run absorbs it)."""


# ---------------------------------------------------------------------------------------------- sizing
def kept_bytes(host_mem_bytes: int) -> int:
    """The kept host buffer for a host cap: every planned host tier fits in it (the planner plans the cap less
    its reserve, an arena exceeds its plan by at most HOST_PLAN_SLACK)."""
    from scoutbench.bench.throughput import HOST_PLAN_SLACK
    from scoutbench.planning import HOST_RESERVE_FRACTION

    return math.ceil(host_mem_bytes * (1 - HOST_RESERVE_FRACTION) * (1 + HOST_PLAN_SLACK))


def sized_host_cap(requested_bytes: int, fill_gib_s: float, register_gib_s: float, setup_limit_s: float
                   ) -> tuple[int, float]:
    """The host cap (bytes) whose kept buffer fills and registers within SETUP_HOST_SHARE of the setup phase's
    limit at the measured rates, at most `requested_bytes`; and the seconds its buffer is expected to take."""
    seconds_per_gib = 1 / fill_gib_s + 1 / register_gib_s
    budget_s = SETUP_HOST_SHARE * setup_limit_s
    cap = requested_bytes
    if kept_bytes(cap) / GIB * seconds_per_gib > budget_s:
        cap = int(budget_s / seconds_per_gib * GIB / (kept_bytes(GIB) / GIB))
    return cap, kept_bytes(cap) / GIB * seconds_per_gib


def fallback_host_cap(requested_bytes: int, setup_limit_s: float) -> int:
    """The host cap when the host phase measured nothing: sized at the slowest documented rates, or at the fill
    rate SCOUTBENCH_HOST_FILL_GIBS holds the dry run to where that is slower (a failed host phase must not leave
    the cap at the request: a kept buffer of the request would not fill within setup's limit, and every row
    would read "not run")."""
    from scoutbench.environment import value
    from scoutbench.runtime.offload import HOST_FILL_ENV

    fill_gib_s = min(SLOWEST_FILL_GIB_S, value(HOST_FILL_ENV) or math.inf)  # 0 or unset: as fast as it fills
    return sized_host_cap(requested_bytes, fill_gib_s, SLOWEST_REGISTER_GIB_S, setup_limit_s)[0]


def fallback_command(args: argparse.Namespace) -> int:
    from scoutbench.units import parse_bytes

    print(fallback_host_cap(parse_bytes(args.requested), args.setup_limit))
    return 0


def emulate_if_asked() -> None:
    """The dry run (SCOUTBENCH_EMULATE_CUDA=1): emulated CUDA for the whole process, as the CLI starts it."""
    from scoutbench.environment import value

    if value("SCOUTBENCH_EMULATE_CUDA"):
        from scoutbench.testing.emulated_cuda import activate_from_environment

        activate_from_environment()


def host_command(args: argparse.Namespace) -> int:
    import torch

    emulate_if_asked()
    from scoutbench.environment import value
    from scoutbench.planning import format_bytes
    from scoutbench.runtime.offload import measure_host_rates
    from scoutbench.units import parse_bytes

    requested = parse_bytes(args.requested)
    rates = measure_host_rates(parse_bytes(args.probe), torch.device(args.device),
                               parse_bytes(args.probe_chunk), max_s=args.probe_s)
    cap, expected_s = sized_host_cap(requested, rates["fill_gib_s"], rates["register_gib_s"],
                                     args.setup_limit)
    sized = {**rates, "requested_bytes": requested, "host_mem_bytes": cap, "kept_bytes": kept_bytes(cap),
             "expected_setup_s": expected_s, "setup_limit_s": args.setup_limit,
             "setup_host_share": SETUP_HOST_SHARE, "fill_env": value("SCOUTBENCH_HOST_FILL_GIBS")}
    Path(args.out).write_text(json.dumps(sized, indent=1) + "\n", encoding="utf-8")
    print(f"fresh host memory fills at {rates['fill_gib_s']:.3g} GiB/s and registers at "
          f"{rates['register_gib_s']:.3g} GiB/s ({format_bytes(rates['probe_bytes'])} probed); host cap "
          f"{format_bytes(cap)} of the {format_bytes(requested)} asked: its kept buffer "
          f"({format_bytes(kept_bytes(cap))}) takes ~{expected_s:.0f} s of setup's {args.setup_limit:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------- compare
@contextlib.contextmanager
def phase_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseCut in this (the main) thread after `seconds`."""
    def cut(signum: int, frame: Any) -> None:
        raise PhaseCut

    previous = signal.signal(signal.SIGALRM, cut)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Phases:
    """Each phase's line in gpu_check_phases.txt, as scripts/gpu_check.sh writes its own."""

    def __init__(self, path: str, limits: dict[str, float]):
        self.path, self.limits = path, limits

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[dict[str, int]]:
        """The phase under its limit; the block sets outcome["rc"] (default 0); a cut is 124 (timeout's)."""
        outcome = {"rc": 0}
        start = time.monotonic()
        print(f"\n== {name} (limit {self.limits[name]:.0f}s)", flush=True)
        try:
            with phase_limit(self.limits[name]):
                yield outcome
        except PhaseCut:
            outcome["rc"] = 124
            print(f"phase {name}: cut at its {self.limits[name]:.0f}s limit", file=sys.stderr, flush=True)
        except BaseException:
            outcome["rc"] = outcome["rc"] or 1
            raise
        finally:
            took_s = round(time.monotonic() - start)
            line = f"{name:<12} exit {outcome['rc']:<3} {took_s:>4}s (limit {self.limits[name]:.0f}s)"
            print(line, flush=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")


def preset_method_args(methods: list[str], budget: str | None) -> dict[str, dict[str, Any]]:
    """Each method's fields with the check's `--budget` as a preset: it reaches the methods that have a token budget
    and is no error for those that have none."""
    from scoutbench.method_args import BUDGET, MethodSettings, resolve_method_args
    from scoutbench.units import parse_length

    settings = MethodSettings.of({}, budget=None if budget is None else parse_length(budget),
                                 defaults=frozenset({BUDGET}))
    return resolve_method_args(methods, settings)


def plan_flags_command(args: argparse.Namespace) -> int:
    """The plan phase's `--budget` flag: given only when one of the check's methods has a token budget (FullKV alone
    has none, and `scoutbench plan` refuses a budget that reaches no method)."""
    from scoutbench.method_args import BUDGET, has_field

    if args.budget is not None and any(has_field(name, BUDGET) for name in args.methods.split()):
        print(f"--budget {args.budget}")
    return 0


def configs_for(args: argparse.Namespace, methods: list[str], batch: int | str) -> list[Any]:
    """The throughput configs of `methods` at `batch`, as `scoutbench throughput` builds them. The check's
    `--budget` is its own preset, not a user's flag: it goes to the methods that have a token budget, and a phase
    whose methods have none (FullKV alone at the equal batch) runs them without it."""
    from scoutbench.bench.throughput import ThroughputConfig
    from scoutbench.units import parse_bytes, parse_length

    per_method = preset_method_args(methods, args.budget)
    return [ThroughputConfig(method=name, method_args=per_method[name], model=args.model,
                             length=parse_length(args.len), batch=batch, gpu_mem=parse_bytes(args.gpu_mem)
                             if args.gpu_mem else None, host_mem=parse_bytes(args.host_mem), steps=args.steps,
                             warmup=args.warmup, count_steps=args.count_steps, device="cuda", dtype=args.dtype,
                             prefill="synthetic", command=["scripts/gpu_check.py", *sys.argv[1:]])
            for name in methods]


def run_phase_methods(configs: list[Any], loaded: Any, folder: Path) -> list[dict[str, Any]]:
    """Each config's result, written as it finishes; when the phase is cut, the running method and those after
    it get a failed result saying so (and the cut goes on to end the phase)."""
    from scoutbench.bench.throughput import failed_result, result_file_name, run_methods
    from scoutbench.devices import device_description
    from scoutbench.results import write_json_unique

    folder.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []

    def write(cfg: Any, result: dict[str, Any]) -> None:
        write_json_unique(folder / result_file_name(cfg, result), result)
        results.append(result)
        done = f" ({result['error']})" if result["status"] != "ok" else \
            f", batch {result['workload']['batch']}, {result['decode_throughput_tok_s']:.1f} tok/s"
        print(f"{cfg.method}: {result['status']}{done}", flush=True)

    try:
        for cfg, result in run_methods(configs, loaded, lambda line: print(line, file=sys.stderr, flush=True),
                                       raise_if_all_refused=False):
            write(cfg, result)
    except PhaseCut:
        parameter = next(loaded.model.parameters())
        for index, cfg in enumerate(configs[len(results):]):
            why = "cut at the phase's limit while it ran" if index == 0 else \
                "not run: the phase reached its limit"
            write(cfg, failed_result(cfg, why, device_description(parameter.device),
                                     str(parameter.dtype).removeprefix("torch.")))
        raise
    return results


def compare_command(args: argparse.Namespace) -> int:
    emulate_if_asked()
    limits = {name: float(limit) for name, limit in (item.split("=") for item in args.limits.split(","))}
    phases = Phases(args.phases, limits)
    methods = args.methods.split()
    raw = Path(args.raw)
    worst = 0
    with contextlib.ExitStack() as stack:
        loaded = None
        with phases.run("setup") as outcome:
            import torch

            from scoutbench.devices import resolve_dtype
            from scoutbench.models import load_model
            from scoutbench.planning import format_bytes
            from scoutbench.runtime.offload import keep_host_memory
            from scoutbench.units import parse_bytes

            device = torch.device("cuda", 0)
            loaded = load_model(args.model, device, resolve_dtype(args.dtype, device), 0)
            kept = stack.enter_context(keep_host_memory(device, kept_bytes(parse_bytes(args.host_mem))))
            print(f"host memory kept for the offloading methods: {format_bytes(kept.nbytes)}, filled in "
                  f"{kept.fill_s:.1f} s, registered in {kept.register_s:.1f} s", flush=True)
        if outcome["rc"]:
            return outcome["rc"]
        ran_at: dict[str, int] = {}  # method -> the batch its max_batch run finished at
        with phases.run("max_batch") as outcome:
            for result in run_phase_methods(configs_for(args, methods, "auto"), loaded, raw / "max_batch"):
                if result["status"] == "ok":
                    ran_at[result["method"]] = result["workload"]["batch"]
                else:
                    outcome["rc"] = 1
        worst = max(worst, outcome["rc"])
        # the smallest batch max_batch ran at (its plans count the decode steps, and a run may have backed off
        # from an out-of-memory); the plan phase's figure where nothing ran
        equal = min(ran_at.values(), default=args.equal)
        (raw / "equal_batch.json").write_text(json.dumps({"equal_batch": equal, "ran_at": ran_at}) + "\n",
                                              encoding="utf-8")
        rest = [name for name in methods if ran_at.get(name) != equal]
        with phases.run("equal_batch") as outcome:
            reused = "".join(f"; {name} ran at it in max_batch" for name in methods if name not in rest)
            runs = f"runs {' '.join(rest)}" if rest else "nothing to run"
            print(f"equal batch {equal}: {runs}{reused}", flush=True)
            if rest:
                results = run_phase_methods(configs_for(args, rest, equal), loaded, raw / "equal_batch")
                outcome["rc"] = 0 if all(r["status"] == "ok" for r in results) else 1
        worst = max(worst, outcome["rc"])
    return worst


# ---------------------------------------------------------------------------------------------- table
def _nvml_cells(result: dict[str, Any]) -> tuple[str, str]:
    """GPU utilisation and J/token, marked where their NVML window was too short to trust (low_confidence)."""
    nvml = result.get("nvml") or {}
    mark = LOW_CONFIDENCE_MARK if nvml.get("low_confidence") else ""
    util = (nvml.get("gpu_util_pct") or {}).get("mean")
    energy = nvml.get("energy_j_per_token")
    return ("-" if util is None else f"{mark}{util:.0f}", "-" if energy is None else f"{mark}{energy:.3f}")


def one_line(text: str, width: int = 120) -> str:
    """`text` as one table cell: its lines joined, its whitespace collapsed, cut to `width` characters (the whole
    error is in gpu_check_results.json)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def table_rows(raw: str, methods: list[str], length: str, equal: int, plans: dict[str, Any]
               ) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The rows of both comparisons and every result: a method's equal-batch row is its max_batch run when
    that ran at the equal batch (equal_batch does not repeat it)."""
    from scoutbench.tiers import wait_frac

    found: dict[str, dict[str, dict[str, Any]]] = {}
    for run in ("max_batch", "equal_batch"):
        found[run] = {}
        for path in sorted(glob.glob(os.path.join(raw, run, "*.json"))):
            result = json.load(open(path, encoding="utf-8"))
            found[run][result["method"]] = result
    rows, results = [], []
    for run in ("max_batch", "equal_batch"):
        for method in methods:
            plan = plans.get(method, {})
            planned = f"{plan.get('max_batch', '-')} ({plan.get('limited_by', '?')})"
            result, note = found[run].get(method), ""
            same = found["max_batch"].get(method)
            if run == "equal_batch" and result is None and same is not None and same.get("status") == "ok" \
                    and same["workload"]["batch"] == equal:
                result, note = same, " (= max)"
            if result is None or result.get("status") != "ok":
                why = "not run (its phase was cut or failed: see compare.stderr)" if result is None else \
                    one_line(f"failed: {result.get('error')}")
                rows.append([method, run, length, "-", planned, *["-"] * 8, why])
                results.append({"run": run, "method": method,
                                "status": "missing" if result is None else "failed",
                                "error": None if result is None else result.get("error")})
                continue
            stats = result.get("method_stats") or {}
            ratio = stats.get("cpu_compute_ratio")
            ratio = ratio.get("mean") if isinstance(ratio, dict) else stats.get("cpu_pair_fraction")
            used = result.get("attention_backends") or {}
            backend = "+".join(k.split(":", 1)[1] for k in sorted(used, key=used.get, reverse=True)
                               if k.startswith("cuda:")) or "-"
            graphs = result.get("cuda_graphs") or {}
            label = method
            if method == "scout" and not (result.get("method_config") or {}).get("recall_profile"):
                label += " (fixed interval)"
            util, energy = _nvml_cells(result)
            tok_s = f"{result['decode_throughput_tok_s']:.1f}" + (" L" if result.get("launch_bound") else "")
            rows.append([label, run + note, length, str(result["workload"]["batch"]), planned, tok_s,
                         f"{result['decode_step_ms']['median']:.1f}",
                         f"{100 * (wait_frac(result) or 0.0):.1f}", backend,
                         "-" if ratio is None else f"{ratio:.2f}", "yes" if graphs.get("captured") else "no",
                         util, energy, ""])
            results.append({"run": run, "same_run_as_max_batch": bool(note), **result})
    return rows, results


def table_command(args: argparse.Namespace) -> int:
    plan_path = os.path.join(args.raw, "plan.stdout")
    plans = {p["method"]: p for p in json.load(open(plan_path, encoding="utf-8"))} \
        if os.path.exists(plan_path) and os.path.getsize(plan_path) else {}
    methods = args.methods.split()
    equal_path = Path(args.raw, "equal_batch.json")  # the batch compare chose, else the plan's
    equal = args.equal
    if equal_path.exists():
        equal = json.loads(equal_path.read_text(encoding="utf-8"))["equal_batch"]
    rows, results = table_rows(args.raw, methods, args.len, equal, plans)
    header = ["method", "run", "len", "batch", "max batch (limit)", "tok/s", "step ms", "idle %", "backend",
              "CPU ratio", "graphs", "GPU util %", "J/token", "note"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 or i == len(header) - 1 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() for r in [header, *rows]]
    legend = (f"{LOW_CONFIDENCE_MARK}: GPU util and J/token from an NVML window under 2 s "
              "(nvml.low_confidence): indicative only; L: launch-bound (host issue >= 90% of the step); "
              "(= max): the max_batch run, which was at the equal batch")
    from scoutbench.planning import format_bytes
    from scoutbench.units import parse_bytes

    cap = format_bytes(parse_bytes(args.host_mem))
    triton = next((r["env"]["triton"] for r in results if "env" in r), "-")  # the path the Triton kernels took
    table = "\n".join([f"host-memory cap {cap}; equal batch {equal}; triton: {triton}", *lines, legend])
    print(table)
    Path(args.dest, "gpu_check_table.txt").write_text(table + "\n", encoding="utf-8")
    Path(args.dest, "gpu_check_results.json").write_text(json.dumps(results, indent=1) + "\n",
                                                         encoding="utf-8")
    return 1 if any(r.get("status") in ("missing", "failed") for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    host = sub.add_parser("host")
    host.add_argument("--requested", required=True, help="the host cap asked for, e.g. 64GiB")
    host.add_argument("--probe", default="512MiB", help="fresh host memory to fill at most")
    host.add_argument("--probe-chunk", default="16MiB", help="the probe's allocations (each one fresh)")
    host.add_argument("--probe-s", type=float, default=5.0, help="stop probing after this many seconds")
    host.add_argument("--setup-limit", type=float, required=True, help="the setup phase's limit (s)")
    host.add_argument("--device", default="cuda")
    host.add_argument("--out", required=True)
    fallback = sub.add_parser("fallback")
    fallback.add_argument("--requested", required=True, help="the host cap asked for, e.g. 64GiB")
    fallback.add_argument("--setup-limit", type=float, required=True, help="the setup phase's limit (s)")
    plan_flags = sub.add_parser("plan-flags")
    plan_flags.add_argument("--methods", required=True)
    plan_flags.add_argument("--budget", default=None)
    compare = sub.add_parser("compare")
    table = sub.add_parser("table")
    for command in (compare, table):
        command.add_argument("--raw", required=True)
        command.add_argument("--methods", required=True)
        command.add_argument("--len", required=True)
        command.add_argument("--equal", type=int, required=True, help="the plan's equal batch")
        command.add_argument("--host-mem", required=True)
    compare.add_argument("--phases", required=True)
    compare.add_argument("--limits", required=True, help="setup=S,max_batch=S,equal_batch=S")
    compare.add_argument("--model", required=True)
    compare.add_argument("--gpu-mem", default=None)
    compare.add_argument("--steps", type=int, required=True)
    compare.add_argument("--warmup", type=int, required=True)
    compare.add_argument("--count-steps", type=int, default=8, help="untimed steps counting the host's torch calls")
    compare.add_argument("--dtype", default=None)
    compare.add_argument("--budget", default=None)
    table.add_argument("--dest", required=True)
    args = parser.parse_args(argv)
    return {"host": host_command, "fallback": fallback_command, "plan-flags": plan_flags_command,
            "compare": compare_command,
            "table": table_command}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
