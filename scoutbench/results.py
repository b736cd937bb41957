"""Result files: provenance, atomic writes (temp file + rename), and loading for gates and reports."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scoutbench import __version__
from scoutbench.errors import ScoutbenchError, UsageError

SCHEMA_VERSION = 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """The commit of the checkout scoutbench runs from, if it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env_info() -> dict[str, Any]:
    """Versions and host facts recorded with every result."""
    import torch
    import transformers

    from scoutbench.kernels.backends import flashinfer_status, partial_backend, triton_status

    info: dict[str, Any] = {
        "scoutbench": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda, "flashinfer": flashinfer_status(), "triton": triton_status(),
        "partial_attention_backend": partial_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "cuda_graphs": False,  # the decode loop runs eagerly: Python hooks and host waits are not graph-safe
        "git_commit": git_commit(),
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name()
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf"/"nan": strict JSON has no infinities (as vLLM does)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj: Any, overwrite: bool = False) -> Path:
    """Write JSON through a temp file in the same folder and rename it into place: a reader never sees a
    partial file, and an interrupted write leaves only an ignorable `.tmp` file."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ScoutbenchError(f"{path} exists; pass --overwrite to replace it or choose another -o")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UsageError(f"cannot write results to {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(_jsonable(obj), handle, indent=2, allow_nan=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable(path: str | Path) -> None:
    """Fail before a long run, not after it, when the output location cannot be written (creates the folder)."""
    path = Path(path)
    folder = path.parent if path.suffix == ".json" else path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"cannot write results under {path}: {exc.strerror or exc}; choose another -o") from None


def unique_path(path: Path) -> Path:
    """`name.json`, or `name-1.json`, `name-2.json`, ... if taken: results are never overwritten silently."""
    if not path.exists():
        return path
    index = 1
    while (candidate := path.with_name(f"{path.stem}-{index}{path.suffix}")).exists():
        index += 1
    return candidate


def load_results(paths: Iterable[str | Path],
                 on_skip: Callable[[Path, str], None] | None = None) -> list[dict[str, Any]]:
    """Result JSON files from files and folders (recursively); sweep manifests and temp files are skipped.

    An unreadable file raises a UsageError, unless `on_skip(file, reason)` is given: then it, and any JSON file
    that is not a scoutbench result, is reported there and skipped (reports list what they left out and why).
    """
    results: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UsageError(f"no such result file or folder: {path}")
        files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
        for file in files:
            if file.name.startswith(".") or file.name == "sweep.json":
                continue
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                message = f"cannot read result {file}: {exc}"
                if on_skip is None:
                    raise UsageError(message) from None
                on_skip(file, f"unreadable ({message})")
                continue
            if isinstance(data, dict) and "schema_version" in data:
                data.setdefault("_path", str(file))
                results.append(data)
            elif on_skip is not None:
                on_skip(file, "not a scoutbench result (no schema_version)")
    return results
