"""What ScoutAttention's step computed, for tests and profiling (`ScoutAttention.trace`): a diagnostics hook that
the step calls at fixed points, so the step itself has no switch per diagnostic. `NO_TRACE`, the default, records
nothing; `TraceRecorder` appends one dict per point to a list: "plan" (a layer's split, as sets: `split_record`),
"submit", "cpu", "device", "wait" (where and on which thread the pipeline ran) and "recall" (the blocks a recall
copied). A recorded plan reads the split back from the device (a sync): traced timings are not the method's."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from scoutbench.runtime.block_table import BlockTable
from scoutbench.runtime.scout_transport import DeviceSplit, split_record


class NoTrace:
    """Records nothing (the production step)."""

    records: list[dict[str, Any]] | None = None

    def plan(self, layer: int, step: int, predicted: bool, split: DeviceSplit, table: BlockTable,
             positions: Sequence[int]) -> None:
        """A layer's split, made with the predicted query (`predicted`) or the true one."""

    def event(self, kind: str, layer: int, step: int) -> None:
        """A point of the pipeline (submit, cpu, device, wait), on the thread that calls it."""

    def recall(self, layer: int, step: int, bh: torch.Tensor, blocks: torch.Tensor, kv_heads: int) -> None:
        """The blocks a recall copied into the pool: rows `bh` (b * Hkv + h) and block ids."""


NO_TRACE = NoTrace()


class TraceRecorder(NoTrace):
    """Appends what the step computed to `records`."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def plan(self, layer: int, step: int, predicted: bool, split: DeviceSplit, table: BlockTable,
             positions: Sequence[int]) -> None:
        self.records.append({"kind": "plan", "layer": layer, "step": step, "predicted": predicted,
                             **split_record(split, table), "positions": list(positions)})

    def event(self, kind: str, layer: int, step: int) -> None:
        self.records.append({"kind": kind, "layer": layer, "step": step, "thread": threading.current_thread().name})

    def recall(self, layer: int, step: int, bh: torch.Tensor, blocks: torch.Tensor, kv_heads: int) -> None:
        self.records.append({"kind": "recall", "layer": layer, "step": step, "blocks": [
            (int(x) // kv_heads, int(x) % kv_heads, int(j)) for x, j in zip(bh, blocks, strict=False)]})
