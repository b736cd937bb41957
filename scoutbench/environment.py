"""Every environment variable scoutbench reads, declared once: what it means, the values it takes (parsed and
checked here) and whether it decides what a run computes or measures. Code reads a variable only through `value`;
tests/foundation/test_environment.py fails on a `SCOUTBENCH_*` name anywhere in the code that is not declared here, and on a
read of one that bypasses this module.

`check_environment()` runs at the start of every command and Python API run: a bad value, or a `SCOUTBENCH_*`
variable that nothing reads (a typo), is one line and exit 2 (docs/exit_codes.md: bad input) before anything
loads, never a failed run or a traceback halfway through. The variables that decide a run (`decides_run`) are
part of a sweep point's identity (`run_settings`): a resume under other values is refused, never counted as done.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scoutbench.errors import USAGE, UsageError

PREFIX = "SCOUTBENCH_"


@dataclass(frozen=True)
class Variable:
    """One environment variable: `parse` turns its text into the value code uses (raising ValueError with the
    values it takes), `unset` is the value when it is not set, `examples` are valid settings (docs and tests)."""

    name: str
    meaning: str
    parse: Callable[[str], Any]
    unset: Any
    examples: tuple[str, ...]
    decides_run: bool  # its value changes what a run computes or measures: a sweep point's identity records it
    read_by: str = "scoutbench"  # who reads it: scoutbench (the package), or a script, or the tests
    exit_code: int = USAGE  # of a bad value


def _choice(*options: str, fold_case: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower() if fold_case else text
        if value not in options:
            raise ValueError(f"use one of {', '.join(options)}")
        return value

    return parse


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("use 1 (on) or 0 (off)")
    return text == "1"


def _count(minimum: int, maximum: int = 2**31 - 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError(f"use an integer from {minimum} to {maximum}") from None
        if not minimum <= number <= maximum:
            raise ValueError(f"use an integer from {minimum} to {maximum}")
        return number

    return parse


def _rate(text: str) -> float:
    try:
        number = float(text.strip())
    except ValueError:
        raise ValueError("use a finite number >= 0 (GiB/s), e.g. 0.2") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError("use a finite number >= 0 (GiB/s), e.g. 0.2")
    return number


def _bytes(text: str) -> int:
    from scoutbench.units import parse_bytes

    try:
        number = parse_bytes(text)
    except UsageError:
        raise ValueError("use a size in bytes, e.g. 8589934592 or 8GiB") from None
    if number < 1:
        raise ValueError("use a size of at least 1 byte, e.g. 8GiB")
    return number


def _path(text: str) -> str:
    return text


def _raw(text: str) -> str:
    return text


# the values of the switches other modules name (decode.ops.FORMS, cpu_attention.BACKEND_CHOICES, the names of
# cpu_attention.ISA_PATHS after `best`)
DECODE_OPS_FORMS = ("cpu-kernel", "fused", "hf")
CPU_ATTENTION_BACKENDS = ("auto", "native", "torch")
CPU_ISA_CHOICES = ("best", "avx512-bf16", "avx512", "avx2", "portable")

_DECLARED = [
    Variable("SCOUTBENCH_CPU_ATTENTION", "the CPU attention backend: the compiled kernel (native), torch's kernels "
             "(torch), or the kernel where it builds (auto) (docs/platform.md)",
             _choice(*CPU_ATTENTION_BACKENDS, fold_case=True), "auto", CPU_ATTENTION_BACKENDS, decides_run=True),
    Variable("SCOUTBENCH_CPU_ISA", "the CPU kernel's vector path: the widest this CPU runs (best), or avx512-bf16, "
             "avx512, avx2 or portable where the CPU runs it (docs/platform.md)",
             _choice(*CPU_ISA_CHOICES, fold_case=True), "best", ("best", "portable"), decides_run=True),
    Variable("SCOUTBENCH_DECODE_OPS", "the decode step's model work around attention in one form for every engine "
             "(docs/architecture.md); unset: each device's own", _choice(*DECODE_OPS_FORMS), None, DECODE_OPS_FORMS,
             decides_run=True),
    Variable("SCOUTBENCH_KERNEL_SPIN_US", "microseconds the CPU kernel pool's helpers stay awake after a job "
             "(docs/platform.md); read by the compiled library", _count(0), 1000, ("0", "1000", "5000"),
             decides_run=True),
    Variable("SCOUTBENCH_EMULATE_CUDA", "run the whole process on emulated CUDA (docs/gpu.md: the GPU check's dry "
             "run)", _switch, False, ("0", "1"), decides_run=True),
    Variable("SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES", "the emulated device's memory", _bytes, 8 * 1024**3,
             ("8GiB", "1073741824"), decides_run=True),
    Variable("SCOUTBENCH_HOST_FILL_GIBS", "a test hook: fresh host memory fills at most this fast (GiB/s), as on a VM "
             "whose RAM grows on demand; 0: as fast as the machine fills it", _rate, 0.0, ("0", "0.2"),
             decides_run=False),
    Variable("SCOUTBENCH_TRACEBACK", "an internal error raises with its traceback instead of one line", _switch,
             False, ("0", "1"), decides_run=False),
    Variable("SCOUTBENCH_CACHE", "the on-disk cache's folder (default ~/.cache/scoutbench)", _path, None,
             ("/tmp/scoutbench-cache",), decides_run=False),
    Variable("SCOUTBENCH_GPU_CHECK_CPU", "scripts/gpu_check.sh's dry run on a CPU through emulated CUDA", _switch,
             False, ("0", "1"), decides_run=False, read_by="scripts/gpu_check.sh"),
    Variable("SCOUTBENCH_GATE_OUT", "scripts/ci_gate.sh keeps its sweep results in this folder", _path, None,
             ("results/ci",), decides_run=False, read_by="scripts/ci_gate.sh"),
    Variable("SCOUTBENCH_PROJECTION_INPUTS", "scripts/projection_inputs.sh's output folder", _path, None,
             ("results/projection",), decides_run=False, read_by="scripts/projection_inputs.sh"),
    Variable("SCOUTBENCH_LONGBENCH_DIR", "scripts/projection_inputs.sh's LongBench records", _path, None,
             ("../shared/longbench/records",), decides_run=False, read_by="scripts/projection_inputs.sh"),
    Variable("SCOUTBENCH_REQUIRE_TRITON", "a missing triton fails the interpreter tests instead of skipping them "
             "(`nox -s triton`)", _switch, False, ("0", "1"), decides_run=False, read_by="tests"),
]
VARIABLES: dict[str, Variable] = {variable.name: variable for variable in _DECLARED}

# Variables of other tools that decide what a scoutbench run computes: recorded as they are, never judged here.
FOREIGN: dict[str, Variable] = {variable.name: variable for variable in [
    Variable("TRITON_INTERPRET", "triton runs its kernels in its interpreter (on the CPU) instead of compiling them",
             _raw, None, ("1", "0"), decides_run=True, read_by="triton"),
]}


def _text(name: str) -> str | None:
    return os.environ.get(name)


def value(name: str) -> Any:
    """The variable's value as code uses it (`unset` when it is not set); a bad value raises a UsageError that
    names the variable, its text and the values it takes."""
    variable = VARIABLES.get(name) or FOREIGN.get(name)
    if variable is None:
        raise KeyError(f"{name} is not declared in scoutbench.environment")
    text = _text(name)
    if text is None:
        return variable.unset
    if name in FOREIGN:
        return text
    try:
        if text == "":
            raise ValueError(f"is set but empty: set it to a value ({', '.join(variable.examples)}) or unset it")
        return variable.parse(text)
    except ValueError as exc:
        message = f"{name} {exc}" if text == "" else f"{name}={text!r}: {exc} (or unset it)"
        error = UsageError(message)
        error.exit_code = variable.exit_code  # the registry's code for a bad value (docs/exit_codes.md: 2)
        raise error from None


def check_environment() -> None:
    """Every declared variable that is set has a valid value, and every `SCOUTBENCH_*` variable set is declared:
    one line, exit 2, before a command or an API run does anything."""
    import difflib

    for name in sorted(os.environ):
        if not name.startswith(PREFIX):
            continue
        if name not in VARIABLES:
            close = difflib.get_close_matches(name, list(VARIABLES), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UsageError(f"{name} is not a scoutbench environment variable; {hint}unset it (the variables: "
                             "docs/environment.md)")
        value(name)


def markdown_table() -> str:
    """The registry as docs/environment.md shows it (a test keeps the two equal)."""
    rows = ["| variable | values (e.g.) | decides a run | read by | exit code of a bad value | meaning |",
            "|---|---|---|---|---|---|"]
    for variable in [*VARIABLES.values(), *FOREIGN.values()]:
        examples = ", ".join(f"`{text}`" for text in variable.examples)
        code = "-" if variable.name in FOREIGN else str(variable.exit_code)
        rows.append(f"| `{variable.name}` | {examples} | {'yes' if variable.decides_run else 'no'} | "
                    f"{variable.read_by} | {code} | {variable.meaning} |")
    return "\n".join(rows)


def run_settings() -> dict[str, Any]:
    """The values of every variable that decides what a run computes or measures (ours and other tools'), by
    name: part of a sweep point's identity."""
    return {name: value(name) for name, variable in {**VARIABLES, **FOREIGN}.items() if variable.decides_run}
