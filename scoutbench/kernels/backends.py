"""Which backend serves a call: the optional GPU libraries' availability (imported lazily: any failure on import
means "unavailable", never a crash), the dispatch rule that picks one backend per call, and the record of which
backend really ran (`USAGE`).

flashinfer's kernels run only on CUDA (sm75+); on a CPU machine the import may even succeed while every kernel
call raises, so it is probed only when a CUDA tensor asks for it. What its batch decode supports (group sizes, head
dims, dtypes), and its page tables and plans, are `flashinfer_decode`'s.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

FLASHINFER_DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE up to 0.6.17: CUDA-core decode kernels
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=2)
def _optional(module_name: str) -> tuple[Any, str | None]:
    try:
        return importlib.import_module(module_name), None
    except Exception as exc:  # noqa: BLE001 - any import failure (even a crash on CPU-only boxes) = unavailable
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def flashinfer_module() -> Any:
    """The imported flashinfer package, or None where it does not import."""
    return _optional("flashinfer")[0]


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and flashinfer_module() is not None


# How the CUDA emulation (scoutbench/testing/emulated_cuda) serves the Triton kernels while it runs (None: no
# emulation). Its device keeps its data in CPU tensors, where a compiled Triton launch would need libcuda, so:
# INTERPRETED, triton's interpreter runs the kernels on them (triton imported with TRITON_INTERPRET=1: the H200's
# path); REFERENCE, each fused op's torch reference stands for its kernel (triton absent, or imported compiled),
# so that an emulated step still issues what a GPU step issues, and every other call goes where it goes on CUDA
# without triton (the dense decode to torch).
INTERPRETED, REFERENCE = "triton-interpreter", "torch-reference"
EMULATED_TRITON: str | None = None


def triton_available() -> bool:
    """Whether the Triton kernels serve the CUDA device: where triton is installed, and on emulated CUDA only in
    triton's interpreter (never a compiled launch there)."""
    if EMULATED_TRITON is not None:
        return EMULATED_TRITON == INTERPRETED
    return torch.cuda.is_available() and _optional("triton")[0] is not None


def fused_ops_available(device: torch.device) -> bool:
    """Whether the fused device ops (one launch each: scoutbench/kernels/fused_ops.py) serve `device`: CUDA where
    triton is installed to compile their kernels, and emulated CUDA (their kernels interpreted, or their
    references). Elsewhere a caller issues the ops the fused one stands for (on a CPU its compiled kernels, on CUDA
    without triton the torch composite)."""
    return device.type == "cuda" and (EMULATED_TRITON is not None or triton_available())


def _status(module_name: str) -> str:
    module, reason = _optional(module_name)
    if module is None:
        return f"unavailable ({reason})"
    version = getattr(module, "__version__", "?")
    if module_name == "triton" and EMULATED_TRITON is not None:
        return f"installed {version}; emulated CUDA runs " + (
            "its kernels in triton's interpreter" if EMULATED_TRITON == INTERPRETED else
            "their torch references (triton was imported without TRITON_INTERPRET=1)")
    if not torch.cuda.is_available():
        return f"installed {version} but no CUDA device"
    return f"available {version}"


def decode_group_sizes(version: str) -> tuple[int, ...]:
    """The GQA group sizes flashinfer `version`'s CUDA-core decode kernel is compiled for (DISPATCH_GQA_GROUP_SIZE)."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())
    sizes = FLASHINFER_DECODE_GROUP_SIZES
    if release >= (0, 6, 18):
        sizes = (1, 2, 3, 4, 6, 8)
    if release >= (0, 7, 1):
        sizes = (*sizes, 16)
    return sizes


def installed_decode_group_sizes() -> tuple[int, ...]:
    module = flashinfer_module()
    return decode_group_sizes(str(getattr(module, "__version__", "0"))) if module is not None \
        else FLASHINFER_DECODE_GROUP_SIZES


def flashinfer_status() -> str:
    return _status("flashinfer")


def triton_status() -> str:
    return _status("triton")


# ---------------------------------------------------------------------------------------------- dispatch
def select_backend(device_type: str, dtype: torch.dtype, group_size: int, head_dim: int, *,
                   flashinfer: bool, triton: bool, lengths_on_host: bool,
                   decode_groups: tuple[int, ...] = FLASHINFER_DECODE_GROUP_SIZES) -> str:
    """The backend of one partial-attention call (a pure function of the call, so it is tested on CPU).

    "flashinfer" (CUDA-core decode) for the group sizes the installed release compiles it for (`decode_groups`),
    "flashinfer-tc" (tensor-core decode) for the others; fp32, other head dims, or lengths known only on the device
    skip flashinfer; then the Triton kernel (any dtype, group and head_dim), then torch.
    """
    if device_type != "cuda":
        return "torch"
    if flashinfer and lengths_on_host and dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS:
        return "flashinfer" if group_size in decode_groups else "flashinfer-tc"
    return "triton" if triton else "torch"


def backend_for(q: torch.Tensor, num_kv_heads: int, lengths_on_host: bool) -> str:
    batch, num_heads, head_dim = q.shape
    flashinfer = q.device.type == "cuda" and flashinfer_available()
    return select_backend(q.device.type, q.dtype, num_heads // num_kv_heads, head_dim, flashinfer=flashinfer,
                          triton=q.device.type == "cuda" and triton_available(), lengths_on_host=lengths_on_host,
                          decode_groups=installed_decode_group_sizes() if flashinfer else FLASHINFER_DECODE_GROUP_SIZES)


def partial_backend(device: torch.device) -> str:
    """The best backend installed for `device` (for `scoutbench env` and every result's `env`); each call's own
    choice is `select_backend` (CUDA) or `cpu_attention.supports` (CPU: the compiled kernel, e.g.
    `native-avx512-bf16`, or `torch`)."""
    if device.type != "cuda":
        from scoutbench.kernels.cpu_attention import backend_name  # noqa: PLC0415

        return backend_name()
    if flashinfer_available():
        return "flashinfer"
    return "triton" if triton_available() else "torch"


# the stage of a call made outside every stage of the stage timer (on the decode loop's thread: embedding, lm_head)
UNSTAGED = "other"


class _Usage:
    """Calls per `device:backend` since the last reset, per stage of the decode step: the result records what
    really ran, per method and stage. A call's stage is its thread's (`enter_stage`: the stage timer's innermost
    open stage on the decode loop's thread, `cpu_worker` on a CPU worker's), else UNSTAGED."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # CPU workers attend concurrently with the main thread
        self._counts: Counter[tuple[str, str]] = Counter()  # (stage, "device:backend") -> calls
        self._thread = threading.local()

    def enter_stage(self, name: str | None) -> str | None:
        """Book this thread's calls under stage `name` from now on; returns the stage to restore (`exit_stage`)."""
        previous = getattr(self._thread, "stage", None)
        self._thread.stage = name
        return previous

    def exit_stage(self, previous: str | None) -> None:
        self._thread.stage = previous

    def add(self, device_type: str, backend: str) -> None:
        stage = getattr(self._thread, "stage", None) or UNSTAGED
        with self._lock:
            self._counts[stage, f"{device_type}:{backend}"] += 1

    def add_counts(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Calls made again without their Python: a CUDA graph's replay adds what its capture recorded
        (`records()`)."""
        with self._lock:
            self._counts.update(counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def records(self) -> dict[tuple[str, str], int]:
        """Calls per (stage, `device:backend`)."""
        with self._lock:
            return dict(self._counts)

    def snapshot(self) -> dict[str, int]:
        """Calls per `device:backend`, over every stage."""
        totals: Counter[str] = Counter()
        for (_, backend), calls in self.records().items():
            totals[backend] += calls
        return dict(sorted(totals.items()))

    def by_stage(self) -> dict[str, dict[str, int]]:
        """Calls per `device:backend` in each stage that made any."""
        stages: dict[str, dict[str, int]] = {}
        for (stage, backend), calls in sorted(self.records().items()):
            stages.setdefault(stage, {})[backend] = calls
        return stages


USAGE = _Usage()
