#!/usr/bin/env bash
# GPU check (issue 7), sized for one 10-minute command on a lent H200 with the machine's own packages:
#   1. nvidia-smi summary and `scoutbench env`
#   2. the CUDA tests (tests/test_gpu.py) and the CPU tests of the kernels and the planner
#   3. a throughput matrix: random-weight qwen3-8b at 8k and 32k, fullkv, scout, infinigen, hgca and the ablation
#      variants, each at --batch auto with synthetic prefill, each point under its own timeout
#   4. one compact table; 5. the JSON results in DEST
#
# Usage: scripts/gpu_check.sh [DEST]     DEST: where results go (default: $OUT, else results/gpu_check)
# The package need not be installed: a folder of links makes methods/ and workloads/ importable as
# scoutbench.methods / scoutbench.workloads, and every python runs from that folder.
#
# SCOUTBENCH_GPU_CHECK_CPU=1 runs the same plumbing on a CPU (tiny-qwen3 at 1k/2k, --gpu-mem 2GiB, --host-mem 256MiB).
# Knobs (environment): GPU_CHECK_MODEL, GPU_CHECK_LENS, GPU_CHECK_METHODS, GPU_CHECK_STEPS, GPU_CHECK_WARMUP,
#   GPU_CHECK_HOST_MEM (host memory planned for offloaded KV; the VM's MemAvailable understates it),
#   GPU_CHECK_BUDGET_S (whole script), GPU_CHECK_POINT_S (one throughput point), GPU_CHECK_TEST_S (pytest).
set -uo pipefail  # no -e: a failed phase is reported and the others still run

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${OUT:-$REPO/results/gpu_check}}
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
PY=${PYTHON:-python3}
START=$SECONDS

if [[ "${SCOUTBENCH_GPU_CHECK_CPU:-0}" == 1 ]]; then
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3}; LENS=${GPU_CHECK_LENS:-"1k 2k"}
    STEPS=${GPU_CHECK_STEPS:-2}; WARMUP=${GPU_CHECK_WARMUP:-1}
    # the default budget (2048) exceeds a 1k context; the host cap keeps the CPU-bound offloading points short
    EXTRA=(--device cpu --gpu-mem 2GiB --host-mem 256MiB --budget 256)
    BUDGET_S=${GPU_CHECK_BUDGET_S:-900}; POINT_S=${GPU_CHECK_POINT_S:-120}; TEST_S=${GPU_CHECK_TEST_S:-400}
else
    MODEL=${GPU_CHECK_MODEL:-qwen3-8b}; LENS=${GPU_CHECK_LENS:-"8k 32k"}
    STEPS=${GPU_CHECK_STEPS:-16}; WARMUP=${GPU_CHECK_WARMUP:-3}
    EXTRA=(--device cuda --host-mem "${GPU_CHECK_HOST_MEM:-64GiB}")
    BUDGET_S=${GPU_CHECK_BUDGET_S:-470}; POINT_S=${GPU_CHECK_POINT_S:-100}; TEST_S=${GPU_CHECK_TEST_S:-200}
fi
METHODS=${GPU_CHECK_METHODS:-"fullkv scout infinigen hgca scout-base scout-pc"}

# -- the import path: $PKG/scoutbench holds links to the package's files plus methods/ and workloads/
PKG=$(mktemp -d)
SCRATCH=$(mktemp -d)
trap 'rm -rf "$PKG" "$SCRATCH"' EXIT
mkdir "$PKG/scoutbench"
for entry in "$REPO"/scoutbench/*; do ln -s "$entry" "$PKG/scoutbench/"; done
ln -s "$REPO/methods" "$PKG/scoutbench/methods"
ln -s "$REPO/workloads" "$PKG/scoutbench/workloads"
cd "$PKG" || exit 1  # python puts the working directory first on sys.path: this folder, not the checkout
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

log() { printf '\n== %s (t=%ds)\n' "$*" "$((SECONDS - START))"; }

log "1. machine"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pstate --format=csv 2>/dev/null \
    || echo "nvidia-smi: not available"
"$PY" -c 'import scoutbench, scoutbench.methods as m; print("scoutbench from", scoutbench.__file__, "| methods from", m.__file__)'
"$PY" -m scoutbench env

log "2. tests (limit ${TEST_S}s)"
tests=("$REPO/tests/test_gpu.py" "$REPO/tests/test_triton.py" "$REPO/tests/test_plan.py")
[[ -f "$REPO/tests/test_kernels.py" ]] && tests+=("$REPO/tests/test_kernels.py")
timeout -k 10 "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider -rfEs "${tests[@]}" 2>&1 | tee "$DEST/gpu_check_pytest.txt" | tail -40
TEST_RC=${PIPESTATUS[0]}
echo "pytest exit code: $TEST_RC"

log "3. throughput matrix: $MODEL, lens [$LENS], methods [$METHODS], steps $STEPS, warmup $WARMUP, batch auto"
: > "$SCRATCH/points.jsonl"
for method in $METHODS; do
    for len in $LENS; do
        left=$((BUDGET_S - (SECONDS - START) - 15))  # 15 s kept for the table
        limit=$((left < POINT_S ? left : POINT_S))
        point="$SCRATCH/${method}_${len}"
        if ((limit < 30)); then
            echo "skip  $method $len: the script's ${BUDGET_S}s budget is spent"
            rc=skipped; seconds=0
        else
            t0=$SECONDS
            timeout -k 10 "$limit" "$PY" -m scoutbench throughput --method "$method" --model "$MODEL" --len "$len" \
                --batch auto --prefill synthetic --steps "$STEPS" --warmup "$WARMUP" "${EXTRA[@]}" \
                -o "$point.json" --overwrite --json > "$point.stdout" 2> "$point.stderr"
            rc=$?; seconds=$((SECONDS - t0))
            ((rc == 124 || rc == 137)) && echo "point timed out after ${limit}s" >> "$point.stderr"
            echo "point $method $len: exit $rc in ${seconds}s $(tail -n 1 "$point.stderr" | cut -c1-160)"
        fi
        printf '{"method": "%s", "len": "%s", "rc": "%s", "seconds": %d, "path": "%s"}\n' \
            "$method" "$len" "$rc" "$seconds" "$point" >> "$SCRATCH/points.jsonl"
    done
done

log "4. results"
"$PY" - "$SCRATCH/points.jsonl" "$DEST" <<'PYTHON'
"""One table from the points' result files, and every result (or its failure) in one JSON file."""
import json
import os
import sys

from scoutbench.tiers import wait_frac

points_file, dest = sys.argv[1], sys.argv[2]
rows, results = [], []
for line in open(points_file, encoding="utf-8"):
    point = json.loads(line)
    path = point["path"] + ".json"
    if point["rc"] == "0" and os.path.exists(path):
        result = json.load(open(path, encoding="utf-8"))
        stats = result.get("method_stats") or {}
        ratio = (stats.get("cpu_compute_ratio") or {}).get("mean") if isinstance(stats.get("cpu_compute_ratio"), dict) \
            else stats.get("cpu_pair_fraction")
        util = ((result.get("nvml") or {}).get("gpu_util_pct") or {}).get("mean")
        rows.append([point["method"], point["len"], str(result["workload"]["batch"]),
                     f"{result['decode_throughput_tok_s']:.1f}", f"{result['decode_step_ms']['median']:.1f}",
                     f"{100 * (wait_frac(result) or 0.0):.1f}", "-" if ratio is None else f"{ratio:.2f}",
                     "-" if util is None else f"{util:.0f}"])
        results.append(result)
    else:
        error = ""
        if os.path.exists(point["path"] + ".stderr"):
            lines = [l for l in open(point["path"] + ".stderr", encoding="utf-8").read().splitlines() if l.strip()]
            error = lines[-1][:200] if lines else ""
        status = "skipped" if point["rc"] == "skipped" else f"failed (exit {point['rc']})"
        rows.append([point["method"], point["len"], "-", status, "", "", "", ""])
        results.append({"kind": "throughput", "status": status, "method": point["method"], "len": point["len"],
                        "error": error})
header = ["method", "len", "batch", "tok/s", "step ms", "idle %", "CPU ratio", "GPU util %"]
widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
table = "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                  for r in [header, *rows])
print(table)
with open(os.path.join(dest, "gpu_check_table.txt"), "w", encoding="utf-8") as handle:
    handle.write(table + "\n")
with open(os.path.join(dest, "gpu_check_results.json"), "w", encoding="utf-8") as handle:
    json.dump(results, handle, indent=1)
failed = [r for r in results if r.get("status") not in ("ok", "skipped")]
for r in failed:
    print(f"{r['method']} {r['len']}: {r['error']}")
sys.exit(1 if failed else 0)
PYTHON
MATRIX_RC=$?
echo "results: $DEST/gpu_check_results.json, $DEST/gpu_check_table.txt, $DEST/gpu_check_pytest.txt"
log "done: pytest exit $TEST_RC, matrix exit $MATRIX_RC"
((TEST_RC == 0 && MATRIX_RC == 0))
