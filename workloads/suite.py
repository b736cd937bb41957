"""The contract of an accuracy suite (what `workloads/__init__.py` registers): the dataset names it answers to, how
their records are read (from the hub or a folder) or generated, the task the accuracy runner runs for each, and
the prompt limits checked against the model's window before it loads. torch-free: `accuracy --dataset list` reads
it without loading a model.

A task (`eval/accuracy.py`'s `Task`) carries the rest: its records, prompts, stop tokens, metric and score."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TaskSettings:
    """The accuracy options a suite's tasks may read."""

    max_length: int | None = None  # prompt limit of suites that truncate read prompts (LongBench's --max-length)
    length: int = 4096  # prompt length of suites that generate their prompts (passkey's --len)
    limit: int | None = None  # the first N records
    depth: float | None = None  # where a generated needle goes (passkey's --depth; None: spread)
    seed: int = 0


class Suite:
    """One accuracy suite. `usage` names its datasets in the unknown-dataset error; the defaults fit a suite that
    generates its records and has no prompt limit of its own."""

    usage: str = ""

    def datasets(self) -> tuple[str, ...]:
        """Every dataset name the suite answers to (`--dataset X`)."""
        raise NotImplementedError

    def groups(self) -> dict[str, tuple[tuple[str, ...], str]]:
        """Names that stand for several datasets: name -> (datasets, what the listing says of it)."""
        return {}

    def listing(self) -> list[dict[str, str]]:
        """`--dataset list`'s rows: name, suite and metric of each dataset."""
        raise NotImplementedError

    def load_records(self, dataset: str, data_dir: str | Path | None,
                     revision: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """(records, where they came from) for a suite that reads its data; None for one that generates it with
        its task."""
        return None

    def task(self, dataset: str, tokenizer: Any, records: list[dict[str, Any]] | None, source: dict[str, Any] | None,
             settings: TaskSettings) -> Any:
        """The task the accuracy runner runs for `dataset` (`records` and `source` from `load_records`)."""
        raise NotImplementedError

    def default_max_length(self, model_name: str, config: Any) -> int | None:
        """The prompt limit when --max-length is not given (None: the suite has none)."""
        return None

    def check_context(self, dataset: str, model: str, window: int | None, settings: TaskSettings) -> None:
        """Refuse (exit 2) prompts plus answers that do not fit the model's trained window."""
