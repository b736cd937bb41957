#!/usr/bin/env bash
# The GPU check, for a lent H200 as it is: the machine's python3 (torch 2.11/CUDA 13, triton 3.6,
# transformers 5.17, nvidia-ml-py, no flashinfer), no network, one command of at most 10 minutes. Phases, each
# under its own time limit; the limits add up to at most 8 minutes (checked below, before anything runs):
#   preflight    machine, packages against pyproject's floors (carried wheels in .whl/ if one is missing or old)
#   plan         `scoutbench plan` at the check's shape: each method's max batch and its limit; the equal batch
#   profile      none: the prefill is synthetic (no drift to profile), ScoutAttention keeps its fixed interval
#   max_batch    each method at its planned maximum batch (--batch auto), ScoutAttention first, one process
#   equal_batch  every method at one equal batch (the smallest planned maximum), ScoutAttention first
#   tests        tests/test_gpu.py and the backend/kernel tests on CUDA
#   table        one table: method, len, batch, planned max batch (limit), tok/s, step ms, idle %, the backend
#                that ran, CPU compute ratio, GPU util, energy per token
# A method's result is written as soon as it finishes, so a phase cut by its limit keeps what finished (hence
# ScoutAttention first: a time-out cuts a baseline, not the headline). Every phase's stdout/stderr, every result
# and the pytest log are kept (DEST/gpu_check_raw.tar.gz, refreshed after each phase; the raw folder itself too).
#
# Usage: scripts/gpu_check.sh [DEST]    DEST: default $OUT (the device tool's folder), else results/gpu_check.
#   DEST receives at most 8 files (what the device tool brings back): gpu_check_table.txt, gpu_check_results.json,
#   gpu_check_pytest.txt, gpu_check_plan.txt, gpu_check_phases.txt, gpu_check_raw.tar.gz.
# SCOUTBENCH_GPU_CHECK_CPU=1: the dry run, the same plumbing on a CPU through emulated CUDA (scoutbench/
#   emulated_cuda.py, SCOUTBENCH_EMULATE_CUDA=1): tiny-qwen3 at 2k, `--device cuda`, explicit --gpu-mem/--host-mem.
# Knobs (environment): GPU_CHECK_MODEL, GPU_CHECK_LEN, GPU_CHECK_METHODS, GPU_CHECK_STEPS, GPU_CHECK_WARMUP,
#   GPU_CHECK_HOST_MEM (the host-memory cap: the offloading methods pin their host tier in it), GPU_CHECK_GPU_MEM.
set -uo pipefail  # no -e: a failed phase is reported and the others still run

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${OUT:-$REPO/results/gpu_check}}
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
PY=${PYTHON:-python3}
START=$SECONDS

if [[ "${SCOUTBENCH_GPU_CHECK_CPU:-0}" == 1 ]]; then
    export SCOUTBENCH_EMULATE_CUDA=1 SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES=$((8 * 1024**3))
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3}; LEN=${GPU_CHECK_LEN:-2k}
    STEPS=${GPU_CHECK_STEPS:-2}; WARMUP=${GPU_CHECK_WARMUP:-1}
    HOST_MEM=${GPU_CHECK_HOST_MEM:-24MiB}; GPU_MEM=${GPU_CHECK_GPU_MEM:-1.2GiB}  # batches 4 to 11, both limits
    BUDGET=(--budget 256)  # the default 2048 covers a 2k context (it would run dense)
    DTYPE=(--dtype fp32)
    TESTS=("$REPO/tests/test_gpu.py")  # collected and skipped: the plumbing (the suite runs the CPU tests)
    LIMITS=(preflight=60 plan=60 profile=120 max_batch=300 equal_batch=300 tests=180 table=30)
    TOTAL_S=1050
else
    MODEL=${GPU_CHECK_MODEL:-qwen3-14b}; LEN=${GPU_CHECK_LEN:-64k}
    STEPS=${GPU_CHECK_STEPS:-6}; WARMUP=${GPU_CHECK_WARMUP:-2}
    HOST_MEM=${GPU_CHECK_HOST_MEM:-64GiB}; GPU_MEM=${GPU_CHECK_GPU_MEM:-}
    BUDGET=()  # each method's default: 2048, the paper's
    DTYPE=()  # bf16 on CUDA
    TESTS=("$REPO/tests/test_gpu.py" "$REPO/tests/test_backends.py" "$REPO/tests/test_kernels.py")
    # seconds per phase (H200): model init + pinning + a 64k synthetic prefill + 2 + 6 steps per method
    LIMITS=(preflight=20 plan=15 profile=45 max_batch=150 equal_batch=120 tests=110 table=15)
    TOTAL_S=480  # 8 minutes, inside the device's 10-minute command
fi
METHODS=${GPU_CHECK_METHODS:-"scout hgca infinigen quest fullkv"}  # ScoutAttention first
declare -A LIMIT
sum=0
for entry in "${LIMITS[@]}"; do LIMIT[${entry%%=*}]=${entry#*=}; sum=$((sum + ${entry#*=})); done
if ((sum > TOTAL_S)); then
    echo "gpu_check: the phase limits add up to ${sum}s, over the ${TOTAL_S}s budget" >&2
    exit 2
fi
GPU_MEM_ARGS=(); [[ -n "$GPU_MEM" ]] && GPU_MEM_ARGS=(--gpu-mem "$GPU_MEM")

# raw files: outside DEST when DEST is the device tool's $OUT (it brings back 8 files at most), else DEST/raw
if [[ -n "${OUT:-}" && "$DEST" == "$(cd "$OUT" 2>/dev/null && pwd)" ]]; then RAW=$(mktemp -d); else RAW=$DEST/raw; fi
rm -rf "$RAW" && mkdir -p "$RAW"

# the import path: $PKG/scoutbench holds links to the package's files plus methods/ and workloads/ (the package
# is not installed; the machine's site-packages are used as they are)
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
mkdir "$PKG/scoutbench"
for entry in "$REPO"/scoutbench/*; do ln -s "$entry" "$PKG/scoutbench/"; done
ln -s "$REPO/methods" "$PKG/scoutbench/methods"
ln -s "$REPO/workloads" "$PKG/scoutbench/workloads"
cd "$PKG" || exit 1  # python puts the working directory first on sys.path: this folder, not the checkout
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

: > "$DEST/gpu_check_phases.txt"
pack() { tar -czf "$DEST/gpu_check_raw.tar.gz" -C "$RAW" . 2>/dev/null; }
# run_phase NAME CMD...: under the phase's limit, stdout/stderr to RAW/NAME.{stdout,stderr}, a line in phases.txt
run_phase() {
    local name=$1; shift
    local t0=$SECONDS rc
    printf '\n== %s (limit %ss, t=%ds)\n' "$name" "${LIMIT[$name]}" "$((SECONDS - START))"
    timeout -k 5 "${LIMIT[$name]}" "$@" > "$RAW/$name.stdout" 2> "$RAW/$name.stderr"
    rc=$?
    ((rc == 124 || rc == 137)) && echo "phase $name: cut at its ${LIMIT[$name]}s limit" >> "$RAW/$name.stderr"
    printf '%-12s exit %-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - t0))" "${LIMIT[$name]}" \
        | tee -a "$DEST/gpu_check_phases.txt"
    tail -n 3 "$RAW/$name.stderr" | cut -c1-200
    pack
    return "$rc"
}

nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,power.limit --format=csv 2>/dev/null \
    || echo "nvidia-smi: not available"
grep -E '^(MemTotal|MemAvailable)' /proc/meminfo; echo "cores: $(nproc)"
# packages against pyproject's floors; a missing or older one from the carried wheels (.whl/, no network)
run_phase preflight "$PY" - "$REPO/pyproject.toml" "$REPO/.whl" "$RAW/site" <<'PYTHON'
import importlib.metadata as md, pathlib, subprocess, sys, tomllib
from packaging.requirements import Requirement
from packaging.version import Version
pyproject, wheels, site = sys.argv[1:4]
needed = []
for line in tomllib.loads(open(pyproject).read())["project"]["dependencies"]:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate():
        continue  # not for this Python (tomli below 3.11)
    name = requirement.name
    floor = next(spec.version for spec in requirement.specifier if spec.operator == ">=")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    ok = have is not None and Version(have) >= Version(floor)
    print(f"{name:14} {have or 'missing':12} floor {floor:10} {'ok' if ok else 'NEEDS A WHEEL'}")
    if not ok:
        needed.append(name)
carried = sorted(pathlib.Path(wheels).glob("*.whl")) if pathlib.Path(wheels).is_dir() else []
if needed:
    if not carried:
        sys.exit(f"preflight: {', '.join(needed)} missing or below the floor and no wheels in {wheels} "
                 "(scripts/gpu_wheels.sh fetches them where pip works)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, *map(str, carried)], check=True)
    print("installed from carried wheels into", site)
PYTHON
[[ -d "$RAW/site" ]] && export PYTHONPATH="$PKG:$RAW/site${PYTHONPATH#"$PKG"}"
cat "$RAW/preflight.stdout"
"$PY" -m scoutbench env > "$RAW/env.txt" 2>&1; sed -n 1,40p "$RAW/env.txt"

# -- plan: the max batch of each method and what limits it; the equal batch is the smallest of them
run_phase plan "$PY" -m scoutbench plan --model "$MODEL" --len "$LEN" --host-mem "$HOST_MEM" "${GPU_MEM_ARGS[@]}" \
    "${DTYPE[@]}" $(printf -- '--method %s ' $METHODS) "${BUDGET[@]}" --json
cp "$RAW/plan.stdout" "$DEST/gpu_check_plan.txt"
EQUAL=$("$PY" -c 'import json, sys; plans = json.load(open(sys.argv[1])); print(max(1, min(p["max_batch"] for p in plans)))' \
    "$RAW/plan.stdout" 2>/dev/null || echo 1)
echo "host-memory cap: $HOST_MEM (the offloading methods pin their host tier in it; $(grep MemTotal /proc/meminfo))"
echo "equal batch: $EQUAL (the smallest planned maximum batch of: $METHODS)"

# -- no recall profile: the comparisons' prefill is synthetic, whose keys churn with no drift to profile (on it
#    profile-recall picks interval 1 in every layer), so ScoutAttention keeps its fixed interval and the table says so
SCOUT_ARGS=()
run_phase profile echo "skipped: a synthetic prefill has no drift to profile; ScoutAttention keeps its fixed interval"

# -- the two comparisons, one process each (the model loads once), ScoutAttention first
THROUGHPUT=("$PY" -m scoutbench throughput $(printf -- '--method %s ' $METHODS) --model "$MODEL" --len "$LEN"
            --host-mem "$HOST_MEM" "${GPU_MEM_ARGS[@]}" --prefill synthetic --steps "$STEPS" --warmup "$WARMUP"
            --device cuda "${DTYPE[@]}" "${BUDGET[@]}" "${SCOUT_ARGS[@]}" --overwrite --json)
run_phase max_batch "${THROUGHPUT[@]}" --batch auto -o "$RAW/max_batch"
run_phase equal_batch "${THROUGHPUT[@]}" --batch "$EQUAL" -o "$RAW/equal_batch"

# -- the CUDA tests (and, on a CPU, their collection and the backend tests)
run_phase tests "$PY" -m pytest -q -p no:cacheprovider -rfEs "${TESTS[@]}"
cp "$RAW/tests.stdout" "$DEST/gpu_check_pytest.txt"
tail -n 15 "$RAW/tests.stdout"

# -- one table from every result (and a row for each method that did not finish)
run_phase table "$PY" - "$RAW" "$DEST" "$METHODS" "$LEN" "$EQUAL" "$HOST_MEM" <<'PYTHON'
"""The check's table from the result files of both comparisons; every result (or its absence) in one JSON."""
import glob, json, os, sys

from scoutbench.tiers import wait_frac

raw, dest, methods, length, equal, host_mem = sys.argv[1:7]
plans = {p["method"]: p for p in json.load(open(os.path.join(raw, "plan.stdout")))} \
    if os.path.getsize(os.path.join(raw, "plan.stdout")) else {}
rows, results = [], []
for run in ("max_batch", "equal_batch"):
    found = {}
    for path in sorted(glob.glob(os.path.join(raw, run, "*.json"))):
        result = json.load(open(path))
        found[result["method"]] = result
    for method in methods.split():
        plan = plans.get(method, {})
        planned = f"{plan.get('max_batch', '-')} ({plan.get('limited_by', '?')})"
        result = found.get(method)
        if result is None:
            rows.append([method, run, length, "-", planned, "not run (phase cut or failed: see its stderr)",
                         "", "", "", "", "", ""])
            results.append({"run": run, "method": method, "status": "missing"})
            continue
        stats = result.get("method_stats") or {}
        ratio = stats.get("cpu_compute_ratio")
        ratio = ratio.get("mean") if isinstance(ratio, dict) else stats.get("cpu_pair_fraction")
        nvml = result.get("nvml") or {}
        util = (nvml.get("gpu_util_pct") or {}).get("mean")
        energy = nvml.get("energy_j_per_token")
        used = result.get("attention_backends") or {}
        backend = "+".join(k.split(":", 1)[1] for k in sorted(used, key=used.get, reverse=True)
                           if k.startswith("cuda:")) or "-"
        if method == "scout" and not (result.get("method_config") or {}).get("recall_profile"):
            method += " (fixed interval)"
        rows.append([method, run, length, str(result["workload"]["batch"]), planned,
                     f"{result['decode_throughput_tok_s']:.1f}", f"{result['decode_step_ms']['median']:.1f}",
                     f"{100 * (wait_frac(result) or 0.0):.1f}", backend, "-" if ratio is None else f"{ratio:.2f}",
                     "-" if util is None else f"{util:.0f}", "-" if energy is None else f"{energy:.3f}"])
        results.append({"run": run, **result})
header = ["method", "run", "len", "batch", "max batch (limit)", "tok/s", "step ms", "idle %", "backend",
          "CPU ratio", "GPU util %", "J/token"]
widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows]]
table = "\n".join([f"host-memory cap {host_mem}; equal batch {equal}", *lines])
print(table)
open(os.path.join(dest, "gpu_check_table.txt"), "w").write(table + "\n")
json.dump(results, open(os.path.join(dest, "gpu_check_results.json"), "w"), indent=1)
sys.exit(1 if any(r.get("status") == "missing" for r in results) else 0)
PYTHON
cat "$RAW/table.stdout"
pack
printf '\n== done in %ds (budget %ss): %s\n' "$((SECONDS - START))" "$TOTAL_S" "$DEST"
cat "$DEST/gpu_check_phases.txt"
! grep -qvE ' exit 0 ' "$DEST/gpu_check_phases.txt"
