"""The GPU check's plumbing on a CPU (`SCOUTBENCH_GPU_CHECK_CPU=1`: emulated CUDA, a tiny model, 2k): a lent GPU
runs scripts/gpu_check.sh once, so every phase must already work here. Its preflight once demanded `tomli`, which
pyproject requires only below Python 3.11, and failed on every newer Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["preflight", "plan", "profile", "max_batch", "equal_batch", "tests", "table"]


def test_every_phase_of_the_cpu_dry_run_passes(tmp_path):
    env = {**os.environ, "SCOUTBENCH_GPU_CHECK_CPU": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    phases = {line.split()[0]: line.split()[2] for line in
              (tmp_path / "out" / "gpu_check_phases.txt").read_text(encoding="utf-8").splitlines()}
    assert phases == {name: "0" for name in PHASES}, phases
    table = (tmp_path / "out" / "gpu_check_table.txt").read_text(encoding="utf-8")
    assert all(f"{method} " in table for method in ("scout", "hgca", "infinigen", "quest", "fullkv"))
    # no recall profile of the synthetic prefill: ScoutAttention's rows say they ran its fixed interval
    assert "scout (fixed interval)" in table
