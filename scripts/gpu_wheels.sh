#!/usr/bin/env bash
# Fetch, where pip works, the pure-Python wheels scripts/gpu_check.sh installs on a lent GPU machine that has no
# network when one of scoutbench's dependencies is missing there or older than pyproject's floor (its preflight
# phase checks). They go to .whl/ (ignored by git): name it in the device tool's `carry`. Under 2 MiB together.
# Versions: the ones `nox -s floors-lent-h200` tests (with the machine's transformers 5.17.0).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${GPU_WHEELS:-"click==8.5.1 rich==15.0.0 filelock==4.3.1 nvidia-ml-py==13.615.71"}
mkdir -p "$REPO/.whl"
# shellcheck disable=SC2086
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$REPO/.whl" $WHEELS
du -sh "$REPO/.whl"
