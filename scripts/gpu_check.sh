#!/usr/bin/env bash
# The GPU check, for a lent H200 as it is: the machine's python3 (torch 2.11/CUDA 13, triton 3.6,
# transformers 5.17, nvidia-ml-py, no flashinfer), no network, one command of at most 10 minutes. Phases, each
# under its own time limit; the limits add up to at most 6 minutes of the device's 15 (checked below, before
# anything runs), which leaves the machine's start and a second try:
#   preflight    machine, packages against pyproject's floors (carried wheels in .whl/ if one is missing or old)
#   host         how fast fresh host memory fills and cudaHostRegister pins it here (a VM whose RAM grows on
#                demand fills at 0.13-0.3 GiB/s), and the host cap whose kept buffer fills within setup's limit
#                (if it measures nothing, the cap that fills in time at the slowest documented rate)
#   plan         `scoutbench plan` at the check's shape and that cap: each method's max batch, its limit; the equal batch
#   profile      none: the prefill is synthetic (no drift to profile), ScoutAttention keeps its fixed interval
#   setup        } one process (scripts/gpu_check.py compare), each phase under its own limit: the model, and one
#   max_batch    } host buffer of the cap, filled and registered once, that each offloading method's host tier
#   equal_batch  } takes in turn; each method at its planned max batch (--batch auto), ScoutAttention first; then
#                  at the equal batch (the smallest batch max_batch ran at) each method whose max_batch run was not
#   tests        tests/emulation/test_gpu.py and the backend/kernel tests on CUDA
#   table        one table: method, run, len, batch, planned max batch (limit), tok/s, step ms, idle %, the backend
#                that ran, CPU compute ratio, CUDA graphs, GPU util and energy per token (marked when their NVML
#                window was too short to trust)
# A method's result is written as soon as it finishes, and a method that fails (or is cut by its phase's limit)
# gets a failed result while the next one runs. Every phase's stdout/stderr, every result and the pytest log are
# kept (DEST/gpu_check_raw.tar.gz, refreshed after each phase; the raw folder itself too).
#
# Usage: scripts/gpu_check.sh [DEST]    DEST: default $OUT (the device tool's folder), else results/gpu_check.
#   DEST receives at most 8 files (what the device tool brings back): gpu_check_table.txt, gpu_check_results.json,
#   gpu_check_pytest.txt, gpu_check_plan.txt, gpu_check_host.json, gpu_check_phases.txt, gpu_check_raw.tar.gz.
# SCOUTBENCH_GPU_CHECK_CPU=1: the dry run, the same plumbing on a CPU through emulated CUDA
#   (scoutbench/testing/emulated_cuda, SCOUTBENCH_EMULATE_CUDA=1): tiny-qwen3 at 2k, `--device cuda`, explicit
#   --gpu-mem/--host-mem. Where triton is installed it takes the H200's path: the Triton kernels and fused ops in
#   triton's interpreter (TRITON_INTERPRET=1, unless set; docs/gpu.md), at 1k and batches of 3-4 with 1 counted
#   step (the interpreter runs a key tile in ~3 ms of CPU).
#   SCOUTBENCH_HOST_FILL_GIBS=0.2 fills fresh host memory no faster than the lent machine does.
# Knobs (environment): GPU_CHECK_MODEL, GPU_CHECK_LEN, GPU_CHECK_METHODS, GPU_CHECK_STEPS, GPU_CHECK_WARMUP,
#   GPU_CHECK_HOST_MEM (the host-memory cap asked for: the host phase lowers it to what fills in time),
#   GPU_CHECK_GPU_MEM, GPU_CHECK_LIMITS (phase limits to override, e.g. "host=1 setup=200"; the sum is still
#   checked).
set -uo pipefail  # no -e: a failed phase is reported and the others still run

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${OUT:-$REPO/results/gpu_check}}
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
PY=${PYTHON:-python3}
START=$SECONDS
COUNT_STEPS=8  # untimed steps after the timed ones that count the host's torch calls per step

if [[ "${SCOUTBENCH_GPU_CHECK_CPU:-0}" == 1 ]]; then
    export SCOUTBENCH_EMULATE_CUDA=1 SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES=$((8 * 1024**3))
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3}; LEN=${GPU_CHECK_LEN:-2k}
    STEPS=${GPU_CHECK_STEPS:-2}; WARMUP=${GPU_CHECK_WARMUP:-1}
    HOST_MEM=${GPU_CHECK_HOST_MEM:-24MiB}; GPU_MEM=${GPU_CHECK_GPU_MEM:-1.2GiB}  # batches 4 to 11, both limits
    BUDGET=(--budget 256)  # the default 2048 covers a 2k context (it would run dense)
    DTYPE=(--dtype fp32)
    HOST_PROBE=(--probe 16MiB --probe-chunk 1MiB)
    # the plumbing: a few of test_gpu.py's tests on emulated CUDA (the suite runs all of them)
    TESTS=("$REPO/tests/emulation/test_gpu.py" -k "arena or digest or partial_attention")
    LIMITS=(preflight=60 host=60 plan=60 profile=10 setup=150 max_batch=240 equal_batch=150 tests=200 table=30)
    TOTAL_S=1050
    if "$PY" -c 'import triton' 2> /dev/null; then
        export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
    fi
    if [[ "${TRITON_INTERPRET:-0}" == 1 ]]; then
        echo "dry run: the Triton kernels and fused ops in triton's interpreter (TRITON_INTERPRET=1)"
        LEN=${GPU_CHECK_LEN:-1k}; HOST_MEM=${GPU_CHECK_HOST_MEM:-5MiB}; GPU_MEM=${GPU_CHECK_GPU_MEM:-1.145GiB}
        COUNT_STEPS=1
        LIMITS+=(max_batch=420 equal_batch=300 tests=300)  # the later entry of a phase is its limit
        TOTAL_S=1400
    else
        echo "dry run: the Triton kernels' torch references (triton not installed, or TRITON_INTERPRET=0)"
    fi
else
    MODEL=${GPU_CHECK_MODEL:-qwen3-14b}; LEN=${GPU_CHECK_LEN:-64k}
    STEPS=${GPU_CHECK_STEPS:-6}; WARMUP=${GPU_CHECK_WARMUP:-2}
    HOST_MEM=${GPU_CHECK_HOST_MEM:-64GiB}; GPU_MEM=${GPU_CHECK_GPU_MEM:-}
    BUDGET=()  # each method's default: 2048, the paper's
    DTYPE=()  # bf16 on CUDA
    HOST_PROBE=(--probe 512MiB --probe-chunk 16MiB)  # 4 s at 0.13 GiB/s
    TESTS=("$REPO/tests/emulation/test_gpu.py" "$REPO/tests/kernels/test_backends.py" "$REPO/tests/kernels/test_partial_state.py"
           "$REPO/tests/kernels/test_attention.py" "$REPO/tests/kernels/test_digest.py" "$REPO/tests/kernels/test_top_tokens.py"
           "$REPO/tests/runtime/test_block_table.py")
    # seconds per phase (H200). setup: CUDA, the model's random init on the GPU, the kept host buffer (its fill and
    # registration get 75% of the limit: the host phase sizes the cap for that; 105 s hold one sequence of every
    # offloading method at 64k even at 0.13 GiB/s); max_batch: per method a 64k synthetic prefill + 2 + 6 steps
    # (+ the counted steps and a graph capture); equal_batch: FullKV and Quest
    LIMITS=(preflight=15 host=15 plan=10 profile=5 setup=105 max_batch=100 equal_batch=50 tests=50 table=10)
    TOTAL_S=360  # 6 minutes of the device's 15: the machine's start and a rerun fit beside it
fi
METHODS=${GPU_CHECK_METHODS:-"scout hgca infinigen quest fullkv"}  # ScoutAttention first
declare -A LIMIT
for entry in "${LIMITS[@]}"; do LIMIT[${entry%%=*}]=${entry#*=}; done
for entry in ${GPU_CHECK_LIMITS:-}; do
    [[ -v "LIMIT[${entry%%=*}]" ]] || { echo "gpu_check: GPU_CHECK_LIMITS: no phase ${entry%%=*}" >&2; exit 2; }
    LIMIT[${entry%%=*}]=${entry#*=}
done
sum=0
for name in "${!LIMIT[@]}"; do sum=$((sum + LIMIT[$name])); done
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

# -- host: the fill and registration rates of fresh host memory here, and the cap whose kept buffer fills in time
run_phase host "$PY" "$REPO/scripts/gpu_check.py" host --requested "$HOST_MEM" "${HOST_PROBE[@]}" \
    --setup-limit "${LIMIT[setup]}" --out "$RAW/host.json"
cat "$RAW/host.stdout"
cp "$RAW/host.json" "$DEST/gpu_check_host.json" 2>/dev/null
if SIZED=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["host_mem_bytes"])' "$RAW/host.json" \
        2>/dev/null); then
    HOST_MEM=$SIZED
elif SIZED=$("$PY" "$REPO/scripts/gpu_check.py" fallback --requested "$HOST_MEM" --setup-limit "${LIMIT[setup]}"); then
    echo "host: not measured; the cap falls back to $SIZED bytes of the $HOST_MEM asked (its kept buffer fills" \
         "within setup's limit at the slowest documented rate)" | tee -a "$RAW/host.stderr"
    HOST_MEM=$SIZED
else
    echo "host: not measured, nor its fallback; the cap stays $HOST_MEM"
fi

# -- plan: the max batch of each method and what limits it; the equal batch is the smallest of them
#    (the check's budget is a preset: `plan-flags` gives it only where one of the methods has a token budget)
read -r -a PLAN_BUDGET <<< "$("$PY" "$REPO/scripts/gpu_check.py" plan-flags --methods "$METHODS" "${BUDGET[@]}")"
run_phase plan "$PY" -m scoutbench plan --model "$MODEL" --len "$LEN" --host-mem "$HOST_MEM" "${GPU_MEM_ARGS[@]}" \
    "${DTYPE[@]}" $(printf -- '--method %s ' $METHODS) "${PLAN_BUDGET[@]}" --json
cp "$RAW/plan.stdout" "$DEST/gpu_check_plan.txt"
EQUAL=$("$PY" -c 'import json, sys; plans = json.load(open(sys.argv[1])); print(max(1, min(p["max_batch"] for p in plans)))' \
    "$RAW/plan.stdout" 2>/dev/null || echo 1)
echo "host-memory cap: $HOST_MEM bytes (the offloading methods pin their host tier in it; $(grep MemTotal /proc/meminfo))"
echo "equal batch: $EQUAL (the smallest planned maximum batch of: $METHODS; compare uses the smallest batch"\
     "max_batch ran at, which also counts the decode steps and an out-of-memory back-off)"

# -- no recall profile: the comparisons' prefill is synthetic, whose keys churn with no drift to profile (on it
#    profile-recall picks interval 1 in every layer), so ScoutAttention keeps its fixed interval and the table says so
run_phase profile echo "skipped: a synthetic prefill has no drift to profile; ScoutAttention keeps its fixed interval"

# -- setup, max_batch, equal_batch: one process (the model loads once, the kept host buffer fills once), each phase
#    under its own limit (the process writes their lines); `timeout` bounds the whole in case it hangs
COMPARE=(setup max_batch equal_batch)
COMPARE_S=$((LIMIT[setup] + LIMIT[max_batch] + LIMIT[equal_batch]))
printf '\n== %s: one process (limits %s s, t=%ds)\n' "${COMPARE[*]}" \
    "$(for name in "${COMPARE[@]}"; do printf '%s ' "${LIMIT[$name]}"; done)" "$((SECONDS - START))"
timeout -k 5 "$((COMPARE_S + 15))" "$PY" "$REPO/scripts/gpu_check.py" compare --raw "$RAW" \
    --phases "$DEST/gpu_check_phases.txt" \
    --limits "$(for name in "${COMPARE[@]}"; do printf '%s=%s,' "$name" "${LIMIT[$name]}"; done | sed 's/,$//')" \
    --methods "$METHODS" --model "$MODEL" --len "$LEN" --host-mem "$HOST_MEM" "${GPU_MEM_ARGS[@]}" \
    --steps "$STEPS" --warmup "$WARMUP" --count-steps "$COUNT_STEPS" "${DTYPE[@]}" "${BUDGET[@]}" --equal "$EQUAL" \
    > "$RAW/compare.stdout" 2> "$RAW/compare.stderr"
rc=$?
for name in "${COMPARE[@]}"; do  # a phase the process never reached (it failed or was killed before)
    grep -q "^$name " "$DEST/gpu_check_phases.txt" \
        || printf '%-12s exit %-3s %4ss (limit %ss) not reached\n' "$name" "$rc" 0 "${LIMIT[$name]}" \
        >> "$DEST/gpu_check_phases.txt"
done
grep -E "^(setup|max_batch|equal_batch) " "$DEST/gpu_check_phases.txt"
tail -n 5 "$RAW/compare.stderr" | cut -c1-200
pack

# -- the CUDA tests (on a CPU: test_gpu.py on emulated CUDA, and the backend tests)
run_phase tests "$PY" -m pytest -q -p no:cacheprovider -rfEs "${TESTS[@]}"
cp "$RAW/tests.stdout" "$DEST/gpu_check_pytest.txt"
tail -n 15 "$RAW/tests.stdout"

# -- one table from every result (and a row for each method that failed or did not run)
run_phase table "$PY" "$REPO/scripts/gpu_check.py" table --raw "$RAW" --dest "$DEST" --methods "$METHODS" \
    --len "$LEN" --equal "$EQUAL" --host-mem "$HOST_MEM"
cat "$RAW/table.stdout"
pack
printf '\n== done in %ds (budget %ss): %s\n' "$((SECONDS - START))" "$TOTAL_S" "$DEST"
cat "$DEST/gpu_check_phases.txt"
! grep -qvE ' exit 0 ' "$DEST/gpu_check_phases.txt"
