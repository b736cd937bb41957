#!/usr/bin/env bash
# GPU check (issues 7 and 10), sized for one 10-minute command on a lent H200 with the machine's own packages:
#   1. nvidia-smi summary and `scoutbench env`
#   2. the CUDA tests (tests/test_gpu.py) and the CPU tests of the kernels, backends and the planner
#   3. the plan, then a throughput matrix at the paper's scale: random-weight qwen3-14b at 64k, the five methods
#      (fullkv, quest, infinigen, hgca, scout), each at --batch auto with synthetic prefill, each point under its
#      own timeout
#   4. one table (method, len, batch run, planned max batch and what limits it, tok/s, step ms, idle %, the
#      attention backends that ran, CPU ratio, GPU util); 5. the JSON results in DEST
#
# Usage: scripts/gpu_check.sh [DEST]     DEST: where results go (default: $OUT, else results/gpu_check)
# The package need not be installed: a folder of links makes methods/ and workloads/ importable as
# scoutbench.methods / scoutbench.workloads, and every python runs from that folder.
#
# SCOUTBENCH_GPU_CHECK_CPU=1 runs the same plumbing on a CPU (tiny-qwen3 at 2k, --gpu-mem 2GiB, --host-mem 256MiB).
# Knobs (environment): GPU_CHECK_MODEL, GPU_CHECK_LENS, GPU_CHECK_METHODS, GPU_CHECK_STEPS, GPU_CHECK_WARMUP,
#   GPU_CHECK_HOST_MEM (host memory planned for offloaded KV: the offloading methods pin it; the VM's
#   MemAvailable understates it), GPU_CHECK_BUDGET_S (whole script), GPU_CHECK_POINT_S (one throughput point),
#   GPU_CHECK_TEST_S (pytest), GPU_CHECK_PROFILE_S (scout's recall profile).
# Budget on an H200 (default): pytest <= 150 s, scout's recall profile <= 50 s (batch 1, 16 steps), five points
# <= 70 s each (model init, pinning the host arena, synthetic prefill of 64k tokens per sequence, 2 + 6 decode
# steps), 15 s for the table: under 570 s.
set -uo pipefail  # no -e: a failed phase is reported and the others still run

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${OUT:-$REPO/results/gpu_check}}
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
PY=${PYTHON:-python3}
START=$SECONDS

if [[ "${SCOUTBENCH_GPU_CHECK_CPU:-0}" == 1 ]]; then
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3}; LENS=${GPU_CHECK_LENS:-"2k"}
    STEPS=${GPU_CHECK_STEPS:-2}; WARMUP=${GPU_CHECK_WARMUP:-1}
    # the default budget (2048) exceeds a 2k context; the host cap keeps the CPU-bound offloading points short
    EXTRA=(--device cpu --gpu-mem 2GiB --host-mem 256MiB)
    BUDGET=(--budget 256)  # sparse methods only: --budget on FullKV is a usage error
    PLAN_MEM=(--gpu-mem 2GiB --host-mem 256MiB --dtype fp32)  # the CPU runs in fp32
    BUDGET_S=${GPU_CHECK_BUDGET_S:-900}; POINT_S=${GPU_CHECK_POINT_S:-150}; TEST_S=${GPU_CHECK_TEST_S:-400}
    PROFILE_EXTRA=(--device cpu --budget 256); PROFILE_S=${GPU_CHECK_PROFILE_S:-120}
else
    MODEL=${GPU_CHECK_MODEL:-qwen3-14b}; LENS=${GPU_CHECK_LENS:-"64k"}
    STEPS=${GPU_CHECK_STEPS:-6}; WARMUP=${GPU_CHECK_WARMUP:-2}
    HOST_MEM=${GPU_CHECK_HOST_MEM:-64GiB}
    EXTRA=(--device cuda --host-mem "$HOST_MEM")
    BUDGET=()  # each method's default: 2048, the paper's
    PLAN_MEM=(--host-mem "$HOST_MEM")
    BUDGET_S=${GPU_CHECK_BUDGET_S:-570}; POINT_S=${GPU_CHECK_POINT_S:-70}; TEST_S=${GPU_CHECK_TEST_S:-150}
    PROFILE_EXTRA=(--device cuda); PROFILE_S=${GPU_CHECK_PROFILE_S:-50}
fi
METHODS=${GPU_CHECK_METHODS:-"fullkv quest infinigen hgca scout"}

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
tests=("$REPO/tests/test_gpu.py" "$REPO/tests/test_triton.py" "$REPO/tests/test_backends.py")
[[ -f "$REPO/tests/test_kernels.py" ]] && tests+=("$REPO/tests/test_kernels.py")
timeout -k 10 "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider -rfEs "${tests[@]}" 2>&1 | tee "$DEST/gpu_check_pytest.txt" | tail -40
TEST_RC=${PIPESTATUS[0]}
echo "pytest exit code: $TEST_RC"

log "3. plan and throughput matrix: $MODEL, lens [$LENS], methods [$METHODS], steps $STEPS, warmup $WARMUP, batch auto"
for len in $LENS; do
    "$PY" -m scoutbench plan --model "$MODEL" --len "$len" "${PLAN_MEM[@]}" $(printf -- '--method %s ' $METHODS) \
        2>&1 | tee -a "$DEST/gpu_check_plan.txt"
done
# ScoutAttention runs as the paper does: periodic recall at per-layer intervals profiled offline (section 3.4).
# One profile per length (batch 1, synthetic prefill, 16 steps); if it fails, scout falls back to its fixed
# interval and the table's scout row says "fixed interval".
declare -A PROFILE
if [[ " $METHODS " == *" scout "* ]]; then
    for len in $LENS; do
        profile="$DEST/recall_profile_${len}.json"
        timeout -k 10 "$PROFILE_S" "$PY" -m scoutbench profile-recall --model "$MODEL" --len "$len" --steps 16 \
            --prefill synthetic "${PROFILE_EXTRA[@]}" -o "$profile" --overwrite > "$SCRATCH/profile_$len.txt" 2>&1
        rc=$?
        echo "recall profile $len: exit $rc; $(tail -n 2 "$SCRATCH/profile_$len.txt" | head -n 1 | cut -c1-160)"
        ((rc == 0)) && PROFILE[$len]=$profile
    done
fi
: > "$SCRATCH/points.jsonl"
for method in $METHODS; do
    for len in $LENS; do
        args=()
        [[ $method != fullkv ]] && args=("${BUDGET[@]}")
        [[ $method == scout && -n "${PROFILE[$len]:-}" ]] && args+=(--method-arg "recall_profile=${PROFILE[$len]}")
        left=$((BUDGET_S - (SECONDS - START) - 15))  # 15 s kept for the table
        limit=$((left < POINT_S ? left : POINT_S))
        point="$SCRATCH/${method}_${len}"
        if ((limit < 20)); then
            echo "skip  $method $len: the script's ${BUDGET_S}s budget is spent"
            rc=skipped; seconds=0
        else
            t0=$SECONDS
            timeout -k 10 "$limit" "$PY" -m scoutbench throughput --method "$method" --model "$MODEL" --len "$len" \
                --batch auto --prefill synthetic --steps "$STEPS" --warmup "$WARMUP" "${EXTRA[@]}" "${args[@]}" \
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
        plan = result.get("batch_plan") or {}
        used = result.get("attention_backends") or {}
        device_type = result["device"]["type"]
        backend = "+".join(key.split(":", 1)[1] for key in sorted(used, key=used.get, reverse=True)
                           if key.startswith(device_type + ":")) or "-"
        method = point["method"]
        if method == "scout" and not (result.get("method_config") or {}).get("recall_profile"):
            method += " (fixed interval)"
        rows.append([method, point["len"], str(result["workload"]["batch"]),
                     f"{plan.get('planned', '-')} ({plan.get('limited_by', '?')})",
                     f"{result['decode_throughput_tok_s']:.1f}", f"{result['decode_step_ms']['median']:.1f}",
                     f"{100 * (wait_frac(result) or 0.0):.1f}", backend, "-" if ratio is None else f"{ratio:.2f}",
                     "-" if util is None else f"{util:.0f}"])
        results.append(result)
    else:
        error = ""
        if os.path.exists(point["path"] + ".stderr"):
            lines = [l for l in open(point["path"] + ".stderr", encoding="utf-8").read().splitlines() if l.strip()]
            error = lines[-1][:200] if lines else ""
        status = "skipped" if point["rc"] == "skipped" else f"failed (exit {point['rc']})"
        rows.append([point["method"], point["len"], "-", "-", status, "", "", "", "", ""])
        results.append({"kind": "throughput", "status": status, "method": point["method"], "len": point["len"],
                        "error": error})
header = ["method", "len", "batch", "max batch (limit)", "tok/s", "step ms", "idle %", "backend", "CPU ratio",
          "GPU util %"]
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
echo "results: $DEST/gpu_check_results.json, $DEST/gpu_check_table.txt, $DEST/gpu_check_plan.txt, $DEST/gpu_check_pytest.txt"
log "done: pytest exit $TEST_RC, matrix exit $MATRIX_RC"
((TEST_RC == 0 && MATRIX_RC == 0))
