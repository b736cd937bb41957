"""How a GPU-CPU co-attention method's CPU part travels (ScoutAttention, methods/scout.py): one layer's split goes to
the CPU worker, its partial attention comes back to the device, and a periodic recall's blocks go into the pool.

- `CpuTask`: one layer's CPU part for one step, as the worker reads it (the query, the `SplitPlan`, the event that
  says both are on the host), with the futures of its attention result (`CpuResult`) and of its recall (`Recall`).
- `CoAttentionTransport`: the buffers and hand-offs behind it. Consecutive layers alternate between two sets
  ("parities") of buffers, so at most two tasks are in flight: the query and the partial state of the CPU part
  (`runtime/cpu_part`, shared with HGCA), on CUDA a pinned host copy of the split (one non-blocking device-to-host
  copy, covered by the query's event); the recall's staging buffers (`TieredBlockStore.stage`/`load_staged`), each
  free again once the recall staged there has been issued and its copy has read it; the worker pool and the copy
  stream. On a CPU-only machine the same hand-offs run with CPU tensors and completed events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from scoutbench.kernels.partial_state import PartialState
from scoutbench.runtime.block_store import SplitPlan, TieredBlockStore
from scoutbench.runtime.block_table import BlockTable
from scoutbench.runtime.cpu_part import cpu_part
from scoutbench.runtime.offload import CopyStream, CpuWorkerPool, host_empty


@dataclass
class CpuResult:
    state: PartialState | None  # None: nothing attended on the CPU
    width: int  # CPU blocks per (sequence, KV head) row (the widest row)
    ms: float
    count_means: tuple[float, ...]  # the split's counts (n_cpu, n_selected, n_available, n_resident), mean per row
    recall_due: bool = False  # periodic, or the reactive trigger fired


@dataclass
class Recall:
    """The blocks a recall copies into the pool, in (row, rank) order (on CUDA staged by the worker in its task's
    parity's staging buffers, rows [0, n)): host rows read, pool slots written."""

    bh: torch.Tensor  # [n] (sequence, KV head) row b * Hkv + h
    slots: torch.Tensor  # [n] pool slot of each recalled block
    blocks: torch.Tensor  # [n] block index


@dataclass
class CpuTask:
    """One layer's CPU part for one step: what the worker computes."""

    layer: int
    step: int
    parity: int  # which set of buffers (consecutive layers alternate)
    q: torch.Tensor  # host query of the CPU part [B, Hq, D] (predicted, or the true one)
    split: SplitPlan  # on the host: the selected blocks (CPU ones first), in-flight flags, victims, counts
    event: Any  # completes when `q` and `split` are on the host
    predicted: bool
    recall_periodic: bool = False  # this layer's periodic recall is due after this step's attention
    wait_events: tuple = ()  # events the worker waits for before reusing this parity's host buffers
    attention: Future = field(default_factory=Future)  # the CPU part's result (CpuResult): what decode waits for
    future: Future | None = None  # the whole task: then its recall, staged (Recall or None)
    result: Any = None


@dataclass
class DeviceSplit:
    """One layer's split on the device: what its device part reads."""

    split: SplitPlan  # device: the selected blocks (CPU ones first), in-flight flags, victims, counts
    pool_use: torch.Tensor  # bool [B, Hkv, pool_slots]: pool slots read by the device part
    n_cpu: torch.Tensor = field(init=False)  # [B, Hkv]: the view of split's n_cpu (made once)

    def __post_init__(self) -> None:
        self.n_cpu = self.split.n_cpu

    @classmethod
    def empty(cls, batch: int, kv_heads: int, k: int, pool_slots: int, device: torch.device) -> DeviceSplit:
        """A layer's static split, which `block_store.select_and_split` rewrites in place."""
        return cls(SplitPlan(torch.zeros((batch, kv_heads, SplitPlan.width(k)), dtype=torch.long, device=device), k),
                   torch.zeros((batch, kv_heads, pool_slots), dtype=torch.bool, device=device))


def split_record(split: DeviceSplit, table: BlockTable) -> dict[str, Any]:
    """A split as sets per (sequence, KV head) (tracing: tests, profiling; syncs): `selected` (B_pred), `device`
    (the selected blocks read on the device: those after B_cpu's n_cpu), `pool` (the blocks of the pool slots the
    device part reads) and `resident` (the pool's blocks)."""
    ids, counts = split.split.ids.cpu(), split.split.counts.cpu()
    B, Hkv = ids.shape[:2]
    rows = [[(ids[s, h].tolist(), int(counts[s, h, 0]), int(counts[s, h, 1])) for h in range(Hkv)] for s in range(B)]
    pool_blocks, pool_use = table.slot_block[..., : table.num_slots].cpu(), split.pool_use.cpu()
    pool = [[{int(j) for j, used in zip(pool_blocks[s, h], pool_use[s, h], strict=True) if used}
             for h in range(Hkv)] for s in range(B)]
    return {"selected": [[set(ids_[:n_selected]) for ids_, _, n_selected in row] for row in rows],
            "device": [[set(ids_[n_cpu:n_selected]) for ids_, n_cpu, n_selected in row] for row in rows],
            "pool": pool, "resident": table.resident_sets()}


def recall_of(split: SplitPlan) -> Recall | None:
    """The blocks a recall copies (worker thread, before the result is handed over: the main thread reuses the
    task's buffers once it has it): the ones the CPU just computed, minus in-flight ones, most important first, as
    many as the row has free slots or victims. None when no block qualifies."""
    k = split.k
    split = split.rows()
    ids, victims, n_cpu, available = split.ids, split.victims, split.n_cpu, split.n_available
    take = (torch.arange(k)[None, :] < n_cpu[:, None]) & ~split.pending
    rank = take.long().cumsum(-1) - 1
    take &= rank < available[:, None]
    bh, kk = take.nonzero(as_tuple=True)
    if bh.numel() == 0:
        return None
    return Recall(bh, victims[bh, rank[bh, kk]], ids[bh, kk])


class CoAttentionTransport:
    """The CPU part's buffers, worker pool and recall staging of one bound method (module docstring)."""

    def __init__(self, store: TieredBlockStore, batch: int, heads: int, k: int, workers: int, dtype: torch.dtype,
                 device: torch.device | str):
        B, H, Hkv, D = batch, heads, store.kv_heads, store.head_dim
        self.store, self.k = store, k
        self.cpu = cpu_part(range(2), B, H, D, dtype, device)  # the query down, the partial state back
        self.parity_free: list[list[Any]] = [[], []]  # per parity: the copies that read its host buffers
        # on CUDA the split's pinned host copy per parity (its device-to-host copy precedes the query's event)
        self.split_host = [host_empty((B, Hkv, SplitPlan.width(k)), torch.long, device) for _ in range(2)] \
            if torch.device(device).type == "cuda" else None
        self.copy = CopyStream(device)
        # recalls whose staging may still run; per parity, whether its staging buffers are free (the recall staged
        # there has been issued) and the copy that last read them
        self.pending_recalls: list[CpuTask] = []
        self.staging_free = [threading.Event() for _ in range(2)]
        for free in self.staging_free:
            free.set()
        self.staging_copy: list[Any] = [None, None]
        self.pool: CpuWorkerPool | None = CpuWorkerPool(workers, device=device)

    # ------------------------------------------------------------------ to the worker
    def send(self, layer: int, q: torch.Tensor, split: SplitPlan) -> None:
        """Device (captured): start the copy of the query and the split to the layer's host buffers (on CUDA)."""
        parity = layer % 2
        self.cpu.send(parity, q)
        if self.split_host is not None:
            self.split_host[parity].copy_(split.data, non_blocking=True)

    def task(self, layer: int, step: int, q: torch.Tensor, split: SplitPlan, predicted: bool,
             recall_periodic: bool) -> tuple[CpuTask, int]:
        """Host, after `send`: the task the worker reads (on CUDA its pinned copies, complete at the event recorded
        now) and the bytes that went to the host for it."""
        parity = layer % 2
        q_host, event = self.cpu.query(parity, q)
        split_host = split if self.split_host is None else SplitPlan(self.split_host[parity], self.k)
        d2h = q.numel() * q.element_size() + split_host.data.numel() * split_host.data.element_size()
        task = CpuTask(layer, step, parity, q_host, split_host, event, predicted, recall_periodic,
                       tuple(self.parity_free[parity]))
        self.parity_free[parity] = []
        return task, d2h

    def run(self, task: CpuTask, attend: Callable[[CpuTask], CpuResult]) -> Recall | None:
        """The worker's task: `attend`, hand the result over (`task.attention`), then, on a recall step, stage the
        recalled blocks (returned; None when nothing is recalled)."""
        try:
            result = attend(task)
            recall = recall_of(task.split) if result.recall_due and result.width else None
        except BaseException as exc:
            task.attention.set_exception(exc)
            raise
        task.attention.set_result(result)
        if recall is not None:
            self.stage(task, recall)
        return recall

    def wait_inputs(self, task: CpuTask) -> None:
        """Worker: the task's query and split are on the host, and its parity's result buffers are free."""
        task.event.synchronize()
        for event in task.wait_events:
            event.synchronize()

    def hand_over(self, task: CpuTask, state: PartialState) -> PartialState:
        """Worker: the CPU part's output and LSE into the parity's result buffers (`CpuPart.hand_over`)."""
        return self.cpu.hand_over(task.parity, state)

    # ------------------------------------------------------------------ back to the device
    def collect(self, task: CpuTask, run_inline: Callable[[CpuTask], Recall | None] | None) -> float:
        """Host: the task's result into `task.result`, computed now by `run_inline` when given, else waited for.
        Returns the milliseconds waited (0 inline)."""
        if run_inline is not None:
            task.future = Future()
            task.future.set_result(run_inline(task))
            task.result = task.attention.result()
            return 0.0
        t0 = time.perf_counter()
        task.result = task.attention.result()
        return (time.perf_counter() - t0) * 1e3

    def result_to_device(self, task: CpuTask) -> int:
        """Host: the CPU part's output and LSE to where the merge reads them (`merge_input`; the empty state when
        nothing was attended on the CPU), on CUDA asynchronously from the pinned result buffers. Returns the bytes
        copied."""
        state = task.result.state
        copied = self.cpu.result_in(task.parity, state)
        if state is not None:
            self.parity_free[task.parity].append(self.cpu.read_event())  # the copy read the result buffer
        return copied

    def merge_input(self, layer: int) -> PartialState | None:
        """Device: the CPU part's state of `layer` that the merge reads (after `result_to_device`)."""
        return self.cpu.result(layer % 2)

    # ------------------------------------------------------------------ recall
    def stage(self, task: CpuTask, recall: Recall) -> None:
        """Worker: stage a recall (`TieredBlockStore.stage`: on CUDA gathered from the host tier into this parity's
        staging buffers) once the recall staged there before has been issued and its copy has read them."""
        free = self.staging_free[task.parity]
        free.wait()
        free.clear()
        copy_event = self.staging_copy[task.parity]
        if copy_event is not None:
            copy_event.synchronize()
        self.store.stage(task.layer, task.parity, recall.bh, recall.slots, recall.blocks)

    def staged_recalls(self, before_layer: int | None = None) -> Iterator[tuple[CpuTask, Recall]]:
        """Host: the pending recalls, in order (all of them, or those of the layers before `before_layer`), each
        once its staging is done (None recalls nothing); the others stay pending."""
        pending, due = [], []
        for task in self.pending_recalls:
            (due if before_layer is None or task.layer < before_layer else pending).append(task)
        self.pending_recalls = pending
        for task in due:
            recall = task.future.result()
            if recall is not None:
                yield task, recall

    def load(self, task: CpuTask, recall: Recall) -> None:
        """Host: copy the blocks the worker staged into their pool slots and record them in the table; the next
        staging in these buffers waits for this copy's event."""
        self.staging_copy[task.parity] = self.store.load_staged(task.layer, task.parity, recall.bh, recall.slots,
                                                                recall.blocks, self.copy)
        self.staging_free[task.parity].set()

    def close(self, tasks: list[CpuTask]) -> None:
        """Cancel `tasks` not started yet and stop the worker pool (a worker waiting to stage is released)."""
        if self.pool is None:
            return
        for task in tasks:
            if task.future is not None:
                task.future.cancel()
        for free in self.staging_free:
            free.set()
        self.pool.close()
        self.pool = None
