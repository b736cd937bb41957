"""`throughput --profile DIR`: torch.profiler over a few decode steps run after the timed ones, so the trace never
perturbs a measured step, written as a gzipped Chrome trace (`.trace.json.gz`) that Perfetto (ui.perfetto.dev) and
chrome://tracing open as they are. Each step is a `decode_step#N` range and every StageTimer stage (`qkv_proj`,
`predict`, `attn_device`, `idle`, `merge`, `o_proj`, `mlp`) a named range inside it; on CUDA the kernels appear on
their streams. Nsight Systems users get the same stages as NVTX ranges with `--nvtx`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TRACE_SUFFIX = ".trace.json.gz"


def trace_path(folder: str | Path, stem: str) -> Path:
    """`folder/stem.trace.json.gz`, or `stem-1...` when taken (profiles of reruns are kept, never replaced)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = 0
    while True:
        path = folder / f"{stem if index == 0 else f'{stem}-{index}'}{TRACE_SUFFIX}"
        if not path.exists():
            return path
        index += 1


def profile_decode(engine: Any, tokens: torch.Tensor, steps: int, folder: str | Path, stem: str) -> dict[str, Any]:
    """Run `steps` more decode steps of `engine` under torch.profiler with its stages annotated; returns the
    result's `profile` field (the trace's path, steps and activities)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    timer = engine.timer
    timer.annotate = True
    try:
        with profile(activities=activities) as profiler:
            for index in range(steps):
                timer.begin_step()
                with record_function(f"decode_step#{index}"):
                    tokens = engine.decode_step(tokens).argmax(-1)
                timer.end_step()
    finally:
        timer.annotate = False
    path = trace_path(folder, stem)
    profiler.export_chrome_trace(str(path))
    return {"trace": str(path), "steps": steps, "activities": [a.name.lower() for a in activities],
            "format": "chrome-trace-json (gzip)", "timed": False}
