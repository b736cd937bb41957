"""Workloads (installed as `scoutbench.workloads`): one file each.

The text suites that `scoutbench accuracy` runs (LongBench, passkey) register here, lazily like the method registry
(`methods/__init__.py`, lm-eval style): a name maps to a "module:SUITE" string imported on first use. A suite
follows the small contract of `workloads/suite.py` (the dataset names it answers to, how it reads or generates
its records, the task it builds, its prompt limits); `accuracy --dataset X` resolves X through this registry, so a
suite registered here (or, in a test, inside `SUITES.scoped()`) runs through `accuracy` and the Python API without
a change anywhere else."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from scoutbench.errors import UsageError
from scoutbench.registry import Registry

if TYPE_CHECKING:
    from scoutbench.workloads.suite import Suite

SUITES = Registry("suite")
SUITES.register("longbench", "scoutbench.workloads.longbench:SUITE")
SUITES.register("passkey", "scoutbench.workloads.passkey:SUITE")


def suites() -> list[Suite]:
    """Every registered suite, in registration order (their modules are torch-free: listing loads no torch)."""
    return [SUITES.load(name) for name in SUITES.names()]


def suite_for(dataset: str, flag: str = "dataset") -> Suite:
    """The suite that answers to `dataset`; an unknown name is a one-line usage error (exit 2) with a "did you
    mean" hint and every suite's names."""
    for suite in suites():
        if dataset in suite.datasets():
            return suite
    raise _unknown(dataset, flag)


def resolve_datasets(names: list[str] | tuple[str, ...], flag: str = "--dataset") -> list[str]:
    """`names` with each suite's groups expanded (LongBench's `all`), duplicates dropped, in order; an unknown
    name is a one-line usage error."""
    groups = {group: members for suite in suites() for group, (members, _) in suite.groups().items()}
    expanded: list[str] = []
    for name in names:
        if name in groups:
            members = list(groups[name])
        else:
            suite_for(name, flag)
            members = [name]
        expanded += [item for item in members if item not in expanded]
    return expanded


def _unknown(name: str, flag: str) -> UsageError:
    known = [dataset for suite in suites() for dataset in suite.datasets()]
    known += [group for suite in suites() for group in suite.groups()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return UsageError(f"unknown {flag} {name!r}{hint} ({'; or '.join(suite.usage for suite in suites())})")
