"""Where a sweep's points run: in this process, one after another (`local`), or as Ray tasks on a local Ray
instance or a cluster (`ray`).

An executor only runs points; the driver (`scoutbench.bench.sweep.run_sweep`) writes every result file and the manifest
itself, atomically, as each point comes back. So resume, `--retry-failed` and the manifest behave the same with
either executor: a point whose task never returned has no file and runs again on the next invocation.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from scoutbench.errors import ScoutbenchError, UsageError, error_text

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Job:
    point_id: str
    where: str  # "[3/8] point-id", for log lines
    cfg: Any  # ThroughputConfig


# A point's outcome: its result dict, or the exception it raised (the driver records it as a failed point).
Outcome = dict[str, Any] | BaseException
Log = Callable[[str], None]


class LocalExecutor:
    """Points in order, in this process, with one runner (the model is loaded once for the whole sweep)."""

    def run(self, jobs: list[Job], runner: Callable[[Any], dict[str, Any]], log: Log) -> Iterator[tuple[Job, Outcome]]:
        for job in jobs:
            log(f"{job.where}: running")
            try:
                outcome: Outcome = runner(job.cfg)
            except Exception as exc:  # noqa: BLE001 - recorded as a failed point; Ctrl-C is not an Exception
                outcome = exc
            yield job, outcome


Runner = Callable[[Any], dict[str, Any]]  # ThroughputConfig -> result dict (the sweep's points)


class ThroughputRunner:
    """Runs points with `run_throughput`, loading the model once for the whole sweep. With `share_kv`, consecutive
    points on one synthetic prefill (a method sweep at one length) draw its K/V once (`SyntheticKVCache`); a Ray
    worker does not, since the workers on one host would each keep a copy beside the others' runs."""

    def __init__(self, share_kv: bool) -> None:
        from scoutbench.workloads.synthetic_kv import SyntheticKVCache

        self._loaded: Any = None
        self._shared_kv = SyntheticKVCache() if share_kv else None

    def __call__(self, cfg: Any) -> dict[str, Any]:
        from scoutbench.bench.throughput import run_throughput
        from scoutbench.devices import resolve_device, resolve_dtype
        from scoutbench.models import load_model

        if self._loaded is None:
            device = resolve_device(cfg.device)
            self._loaded = load_model(cfg.model, device, resolve_dtype(cfg.dtype, device), cfg.seed)
        try:
            return run_throughput(cfg, self._loaded, shared_kv=self._shared_kv)
        finally:
            _release_memory()


def _release_memory() -> None:
    """Free the previous point's KV storage before the next one allocates (matters after an out-of-memory)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_worker_runner: Any = None  # one per Ray worker process: the model loads once per worker, not once per point


def _run_point(cfg: Any) -> tuple[bool, Any]:
    """Body of a Ray task: (True, result) or (False, error message). Errors are formatted in the worker so that
    the driver records exactly what the local executor would."""
    global _worker_runner
    if _worker_runner is None:
        _worker_runner = ThroughputRunner(share_kv=False)
    try:
        return True, _worker_runner(cfg)
    except Exception as exc:  # noqa: BLE001 - the driver records the point as failed
        return False, error_text(exc)


class PointFailed(ScoutbenchError):
    """A Ray task's point raised; str() is the error exactly as the local executor records it."""


@dataclass
class RayExecutor:
    """Each point a Ray task with its resource request (one GPU per point on CUDA); results come back to the
    driver in completion order."""

    address: str | None = None  # None: a local Ray instance (or the one already initialised)
    cpus_per_point: float = 1.0
    device: str = "auto"  # the sweep's --device: cuda asks one GPU per point, auto does when the cluster has GPUs

    def gpus_per_point(self, cluster_gpus: float) -> float:
        """One GPU per point on CUDA; with `auto`, one when the cluster has GPUs (the driver may have none)."""
        if self.device.startswith("cuda"):
            return 1.0
        return 1.0 if self.device == "auto" and cluster_gpus >= 1 else 0.0

    def run(self, jobs: list[Job], runner: Callable[[Any], dict[str, Any]], log: Log) -> Iterator[tuple[Job, Outcome]]:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False,
                     **({} if self.address else {"num_cpus": os.cpu_count() or 1}))
        gpus = self.gpus_per_point(ray.cluster_resources().get("GPU", 0.0))
        task = ray.remote(num_cpus=self.cpus_per_point, num_gpus=gpus, max_retries=0)(_run_point)
        refs = {task.remote(job.cfg): job for job in jobs}
        if jobs:
            log(f"submitted {len(jobs)} points to Ray ({self.cpus_per_point:g} CPU, {gpus:g} GPU each)")
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                job = refs.pop(ready[0])
                try:
                    ok, value = ray.get(ready[0])
                    outcome: Outcome = value if ok else PointFailed(value)
                except Exception as exc:  # noqa: BLE001 - a crashed worker or lost node fails only this point
                    outcome = PointFailed(f"ray task failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                yield job, outcome
        finally:
            for ref in refs:  # interrupted: the unfinished points have no file and run again on resume
                ray.cancel(ref, force=True)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'scoutbench[ray]' (on every node)") from None
    return ray


def make_executor(name: str, address: str | None, device: str = "auto", cpus_per_point: float | None = None) -> Any:
    """`local` or `ray`; `--address` only makes sense with Ray."""
    if name not in EXECUTORS:
        raise UsageError(f"unknown --executor {name!r}: use {' or '.join(EXECUTORS)}")
    if name == "local":
        if address:
            raise UsageError("--address is for --executor ray")
        return LocalExecutor()
    import_ray()
    return RayExecutor(address, cpus_per_point if cpus_per_point is not None else 1.0, device)
