"""What every Triton kernel test shares: triton's interpreter runs its checks on CPU tensors.

TRITON_INTERPRET=1 must be set before triton is first imported (triton's own library functions are decorated at
import), and setting it in the test process would turn a CUDA run's compiled kernels into interpreted ones. So each
file's checks (marked `interpreted`) run in a child pytest on that file with the variable set, started by the
file's `test_kernel_checks_in_triton_interpreter` (`child_run_test`); in the parent they are skipped. A file is
skipped when triton is not installed (it is not a default dependency); `SCOUTBENCH_REQUIRE_TRITON=1`
(`nox -s triton`, run by CI) makes a missing triton a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in test_kernel_checks_in_triton_interpreter's child")


def kernel_module(name: str) -> ModuleType:
    """The Triton kernel module `name`, or the calling test file skipped where triton is not installed (a failure
    under SCOUTBENCH_REQUIRE_TRITON=1)."""
    if os.environ.get("SCOUTBENCH_REQUIRE_TRITON") == "1":
        import triton  # noqa: F401, PLC0415 - the import error is the failure
    pytest.importorskip("triton")
    return pytest.importorskip(name)


def child_run_test(test_file: str) -> Callable[[], None]:
    """The parent's test of `test_file`: its `interpreted` checks in a child pytest with TRITON_INTERPRET=1, all
    passing."""

    @pytest.mark.skipif(IN_INTERPRETER, reason="this is the child run")
    def test_kernel_checks_in_triton_interpreter() -> None:
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                               env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                               timeout=600)
        summary = child.stdout.strip().splitlines()[-1]
        assert child.returncode == 0 and " passed" in summary, child.stdout[-4000:] + child.stderr[-2000:]

    return test_kernel_checks_in_triton_interpreter
