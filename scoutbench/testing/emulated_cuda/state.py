"""Emulated CUDA's shared state: the emulated device, CUDA's error codes, the one active emulation and where
a call comes from (the first source line outside torch and the emulator).
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime

EMULATED_DEVICE = torch.device("cuda", 0)
CPU = torch.device("cpu")
CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_STRINGS = {CUDA_SUCCESS: "no error", 1: "invalid argument", CUDA_ERROR_MEMORY_ALLOCATION: "out of memory",
                      CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                          "part or all of the requested memory range is already mapped",
                      801: "operation not supported"}  # cudaGetErrorString's texts
# frames of these files are never where a call comes from: the emulator's own, torch's and the standard library's
_OWN_FILES = (os.path.dirname(__file__) + os.sep, os.sep + "torch" + os.sep, os.sep + "contextlib.py",
              os.sep + "threading.py", os.sep + "concurrent" + os.sep, os.sep + "_pytree.py")


class EmulatedCudaHazard(RuntimeError):
    """A data race the emulator proved: the host overwrote memory that a queued copy had not read yet."""


@dataclass
class SyncSite:
    """One host-device synchronisation: what kind, and the first source line outside torch and the emulator."""

    kind: str
    filename: str
    lineno: int
    line: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.filename}:{self.lineno}: {self.line}"


_RUNTIME: EmulatedRuntime | None = None


def require_active() -> EmulatedRuntime:
    """The running emulation; an emulated stream, event or graph outside one is a bug of its caller."""
    if _RUNTIME is None:
        raise RuntimeError("emulated CUDA is not active")
    return _RUNTIME


def active_runtime() -> EmulatedRuntime | None:
    """The running emulation, or None."""
    return _RUNTIME


def set_active(runtime: EmulatedRuntime | None) -> None:
    """Make `runtime` the running emulation (None: none)."""
    global _RUNTIME
    _RUNTIME = runtime


class _Site(SyncSite):
    def where(self) -> str:
        return f"at {self.filename}:{self.lineno} ({self.line})"


def call_site(kind: str) -> _Site:
    """The innermost frame outside torch and the emulator, and outside any torch function mode's handler (a call
    counter pushed above the emulator is not where a call comes from)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.name != "__torch_function__" and not any(part in frame.filename for part in _OWN_FILES):
            line = frame.line or linecache.getline(frame.filename, frame.lineno).strip()
            return _Site(kind, frame.filename, frame.lineno or 0, line)
    return _Site(kind, "?", 0, "")
