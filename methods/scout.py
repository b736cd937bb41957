"""ScoutAttention (arXiv 2603.27138): block-sparse GPU-CPU co-attention. The device keeps Quest digests of every
block and a pool of important blocks; each layer's top-k selection is split between the device (the blocks the pool
holds) and the CPU (the rest, attended in place in host memory), and the two partial results are merged by LSE.
Layer-ahead CPU pre-computation (PC) starts layer i+1's CPU part during layer i, from a predicted query; periodic
recall (PR) copies the blocks the CPU computed into the pool so its share stays small.

The file reads as the paper does: Algorithm 1's decode step first (its line numbers in the comments) and the
periodic recall, then the step's plan, prefill and setup. Lines 5-6 (fused or torch, chosen at bind) are
`runtime/scout_selection.py`, the step's trace (tests, profiling) `methods/scout_trace.py`, its statistics
`methods/scout_stats.py`, storage `runtime/block_store`, the CPU part's transport (pinned copies, worker hand-offs,
recall staging) `runtime/scout_transport`, the work model `methods/scout_work.py`. The choices the paper leaves
open, and why: docs/methods.md ("ScoutAttention choices")."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from scoutbench.errors import UsageError
from scoutbench.input_files import UnusableFile, read_json_file
from scoutbench.kernels.attention import block_sparse_attention, merge_output, region_attention
from scoutbench.kernels.digest import CandidateBlocks
from scoutbench.kernels.partial_state import PartialState
from scoutbench.methods import SCOUT_ABLATION, SCOUT_ABLATION_FIELDS
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
    require,
)
from scoutbench.methods.scout_stats import ScoutStatistics
from scoutbench.methods.scout_trace import NO_TRACE, TraceRecorder
from scoutbench.methods.scout_work import ScoutWorkModel
from scoutbench.runtime.block_store import NUM_COUNTS, RECALL_INDEX_ROWS, SplitPlan, TieredBlockStore
from scoutbench.runtime.scout_selection import select_and_split_for, top_blocks
from scoutbench.runtime.scout_transport import CoAttentionTransport, CpuResult, CpuTask, DeviceSplit, Recall


def _next_layer_norm(normed: torch.Tensor) -> None:
    """pred_norm "next": line 4 applies layer i+1's input norm to X^i (`predict_query` without `normed`)."""


def _own_norm(normed: torch.Tensor) -> torch.Tensor:
    """pred_norm "self": line 4 projects layer i's normalised input."""
    return normed


PRED_NORMS = {"next": _next_layer_norm, "self": _own_norm}  # line 4's input, chosen once
DEVICE_BLOCKS = ("resident", "selected")


@dataclass
class ScoutAttention(ScoutWorkModel, ScoutStatistics):
    """Quest block selection split between a device pool and CPU attention over host blocks (module docstring;
    the fields: docs/methods.md). `pc=False` is the paper's parallel co-attention baseline (selection with the true
    query inside the layer); `oracle=True` uses the true query everywhere (the exactness tests);
    `device_blocks="resident"` attends every resident block on the device (over the budget)."""

    name: ClassVar[str] = "scout"
    display_name: ClassVar[str] = "ScoutAttention"
    layer_ahead: ClassVar[bool] = True
    attended_on_device: ClassVar[bool] = True  # each sparse layer's count is captured device work (`end_step`)
    # the ablation (paper Figure 12), declared in methods/__init__.py (SCOUT_ABLATION)
    ablation_fields: ClassVar[tuple[str, ...]] = SCOUT_ABLATION_FIELDS
    ablation_variants: ClassVar[dict[tuple[Any, ...], str]] = {v.values: v.label for v in SCOUT_ABLATION}
    artefact_fields: ClassVar[tuple[str, ...]] = ("recall_profile",)
    file_fields: ClassVar[tuple[str, ...]] = ("recall_profile",)

    budget: int = 2048
    block_size: int = 32
    dense_layers: int = DEFAULT_DENSE_LAYERS
    sink_blocks: int = 1
    local_blocks: int = 1
    pc: bool = True
    pr: bool = True
    recall_interval: int = 8
    pool_factor: float = 3.0  # device pool slots per selection (docs/methods.md: the one rule chose 3)
    beta: float = 0.12  # the reactive trigger's threshold (beta_trigger); profile-recall takes its own --beta
    beta_trigger: bool = False
    device_blocks: str = "selected"
    recall_profile: str | None = None
    oracle: bool = False
    pred_norm: str = "next"
    cpu_workers: int = 1

    # the pool came after results were made, which held one selection
    added_fields = {"pool_factor": 1.0}
    # the settings its defaults are chosen over (docs/methods.md, "One rule for every method's defaults"): the pool,
    # which the paper leaves open ("a small set of important blocks"), at the paper's blocks of 32
    settings_grid = {f"pool {pool}": {"pool_factor": float(pool)} for pool in (1, 2, 3, 4)}
    paper_setting = ("pool 1", "the paper's pool of important blocks, read as one selection (the counters it reports)")

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1 (got {self.block_size})")
        self.check_dense_layers()
        require(self.sink_blocks >= 0, f"sink_blocks must be >= 0 (got {self.sink_blocks})")
        require(self.local_blocks >= 0, f"local_blocks must be >= 0 (got {self.local_blocks})")
        require(self.k_sel >= 1, f"budget {self.budget} leaves no selectable block: need budget >= block_size * "
                f"(sink_blocks + local_blocks + 2) = {self.block_size * (self.sink_blocks + self.local_blocks + 2)}")
        require(self.recall_interval >= 1, f"recall_interval must be >= 1 (got {self.recall_interval})")
        require(self.pool_factor >= 1.0, f"pool_factor must be >= 1: the pool holds a selection (got {self.pool_factor})")
        require(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1] (got {self.beta})")
        require(self.pred_norm in PRED_NORMS, f"pred_norm must be one of {', '.join(PRED_NORMS)} (got {self.pred_norm!r})")
        require(self.device_blocks in DEVICE_BLOCKS, f"device_blocks must be one of {', '.join(DEVICE_BLOCKS)} "
                f"(got {self.device_blocks!r})")
        require(self.cpu_workers >= 1, f"cpu_workers must be >= 1 (got {self.cpu_workers})")
        self._profile_intervals: list[int | None] | None = None
        self._profile_measured_on: dict[str, Any] | None = None
        if self.recall_profile is not None:
            self._profile_intervals, self._profile_measured_on = load_recall_profile(self.recall_profile)
        self._pred_input = PRED_NORMS[self.pred_norm]
        self.trace = None
        self.transport: CoAttentionTransport | None = None

    @property
    def k_sel(self) -> int:
        """Selectable blocks per (sequence, KV head): the budget minus sink, local and tail blocks."""
        return self.budget // self.block_size - self.sink_blocks - self.local_blocks - 1

    @property
    def pool_slots(self) -> int:
        """Device pool slots per (sequence, KV head): `pool_factor` selections (at least `k_sel`). The pool is
        device memory, not budget: each step attends at most `k_sel` of the blocks it holds."""
        return max(self.k_sel, round(self.pool_factor * self.k_sel))

    @property
    def layer_ahead_active(self) -> bool:
        return self.pc and not self.oracle

    @property
    def trace(self) -> list[dict[str, Any]] | None:
        """What the step computed (methods/scout_trace.py): assign a list to record into it, None to stop."""
        return self._trace.records

    @trace.setter
    def trace(self, records: list[dict[str, Any]] | None) -> None:
        self._trace = NO_TRACE if records is None else TraceRecorder(records)

    # ================================================================== Algorithm 1: one decode step of layer i
    def before_layer(self, layer: int, X: torch.Tensor, normed: torch.Tensor) -> None:
        """Lines 3-7 (with PC): trigger layer i+1's CPU-side pre-computation from this layer's input X^i."""
        if layer + 1 in self._ahead:
            # line 4: Q_pred^{i+1} = W_Q^{i+1} X^i, rotated at the current position as the digests' keys are
            Q_pred = self.ctx.predict_query(layer + 1, X, self._pred_input(normed))
            self._trigger(layer + 1, Q_pred)

    def _trigger(self, layer: int, Q_pred: torch.Tensor) -> None:
        """Lines 5-7 for `layer` (for a layer not planned ahead, with its true query)."""
        self.ctx.host(self.store.tables[layer].poll)  # B_gpu: the pool's blocks whose recall copy has completed
        B_pred = self._select.top_k(layer, Q_pred, self._eviction_order_due(layer))  # line 5
        split = self._splits[layer] = self._select.split(layer, B_pred)  # line 6: B_cpu = B_pred minus B_gpu
        B_cpu = split.split  # the selected blocks, B_cpu's first
        self.transport.send(layer, Q_pred, B_cpu)  # on CUDA, Q_pred and B_cpu start for the host
        self.ctx.host(self._spawn, layer, Q_pred, B_cpu)  # line 7: spawn CPUAttn(B_cpu)

    def decode_sparse(self, layer: int, Q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Lines 8-12: layer i's attention with its true query Q^i (line 9, the engine's), merged with the CPU part
        spawned during layer i-1, or now (lines 5-7 with Q^i) for a layer not planned ahead."""
        if layer not in self._ahead:
            self._trigger(layer, Q)
        self.store.append(layer, k, v, self._ring_rows, self.step.positions_host if self._short else None)
        B_gpu = self._splits[layer].pool_use
        A_gpu = self._gpu_attn(layer, Q, B_gpu)  # line 10: A_gpu^i = GPUAttn(Q^i, B_gpu^i)
        with self.ctx.timer.stage("idle"):
            self.ctx.host(self._wait, layer)  # line 11: A_cpu^i, the device idle while it waits
        with self.ctx.timer.stage("merge"):
            A_cpu = self._cpu_state(layer)
            A = A_gpu.o.to(Q.dtype) if A_cpu is None else merge_output(A_gpu, A_cpu, Q.dtype)  # line 12
        self.ctx.host(self._after_merge, layer)  # the statistics, and PR: a due recall issued after the attention
        return A

    # ------------------------------------------------------------------ the functions it calls
    def _eviction_order_due(self, layer: int) -> bool:
        """Whether `layer`'s split packs a recall's eviction order: a periodic recall is known in advance, the
        reactive trigger decides after the CPU part, and with CUDA graphs whether a recall is due is the host's."""
        return self.ctx.graphs or self.pr and (self.beta_trigger or self._since[layer] + 1 >= self._intervals[layer])

    def _spawn(self, layer: int, q: torch.Tensor, B_cpu: SplitPlan) -> None:
        """Line 7 (host): spawn CPUAttn(B_cpu) on the worker pool (for a layer planned inline with PC, keep it: the
        worker is busy with the next layer's pre-computation, the wait runs it)."""
        recall_periodic = self.pr and self._since[layer] + 1 >= self._intervals[layer]
        predicted = layer in self._ahead
        task, d2h = self.transport.task(layer, self.step.index, q, B_cpu, predicted, recall_periodic)
        self.counters.d2h_bytes += d2h
        self._trace.plan(layer, task.step, predicted, self._splits[layer], self.store.tables[layer],
                         self.step.positions_host)
        self._tasks[layer] = task
        if layer not in self._inline:
            task.future = self.transport.pool.submit(self._run_cpu, task)
            self._trace.event("submit", layer, self.step.index)

    def _run_cpu(self, task: CpuTask) -> Recall | None:
        """The worker's task: CPUAttn, then on a recall step the staging of the recalled blocks."""
        return self.transport.run(task, self._attend_cpu)

    def _attend_cpu(self, task: CpuTask) -> CpuResult:
        """CPUAttn(B_cpu) (worker thread): the task's query over its CPU blocks, read in place in the host tier."""
        self.transport.wait_inputs(task)
        t0 = time.perf_counter()
        b, B_cpu = self.block_size, task.split
        # the counts read once as Python ints: each torch call on this thread trades the GIL with the main thread,
        # and their means (the statistics) are taken here, off the main thread's path
        counts = B_cpu.counts.reshape(-1, NUM_COUNTS).tolist()
        rows = [row[0] for row in counts]
        means = tuple(sum(column) / len(counts) for column in zip(*counts, strict=True))
        width = max(rows)
        recall_due = task.recall_periodic or (self.pr and self.beta_trigger and
                                              sum(rows) * b / (self.budget * len(rows)) > self.beta)
        if width == 0:
            return CpuResult(None, 0, (time.perf_counter() - t0) * 1e3, means, recall_due)
        blocks_k, blocks_v = self.store.blocked_host(task.layer)
        valid_len = None if min(rows) == width else B_cpu.n_cpu * b
        A_cpu = block_sparse_attention(task.q, blocks_k, blocks_v, B_cpu.ids[..., :width], self.ctx.scale, valid_len)
        A_cpu = self.transport.hand_over(task, A_cpu)
        ms = (time.perf_counter() - t0) * 1e3
        self._trace.event("cpu", task.layer, self.step.index)
        return CpuResult(A_cpu, width, ms, means, recall_due)

    def _gpu_attn(self, layer: int, Q: torch.Tensor, B_gpu: torch.Tensor) -> PartialState:
        """Exact attention of Q^i over the pool slots `B_gpu` and the always-on blocks (sink, local, tail)."""
        store = self.store
        store.open_pool(B_gpu)
        self._trace.event("device", layer, self.step.index)
        # what this layer attends per (sequence, KV head): the device region's open tokens and the CPU part's blocks
        torch.add(store.slot_tokens.sum(-1), self._splits[layer].n_cpu, alpha=self.block_size,
                  out=self._attended_row[layer])
        return region_attention(Q, store.dev_k[layer], store.dev_v[layer], self.ctx.scale, store.slot_tokens)

    def _wait(self, layer: int) -> None:
        """Host: the CPU part's result (computed now for a layer planned inline); the time waited for it is the
        device's idle."""
        task, inline = self._tasks.pop(layer), layer in self._inline
        if inline:
            self._issue_recalls()  # this thread stages now: no staging buffer may stay taken
        self._idle_ms += self.transport.collect(task, self._run_cpu if inline else None)
        if not inline:
            self._trace.event("wait", layer, self.step.index)
        self._done[layer] = task

    def _cpu_state(self, layer: int) -> PartialState | None:
        """A_cpu^i where the merge reads it (runtime/cpu_part: on CUDA the static device buffers its result goes to
        at a host point, on a CPU the worker's state; None: nothing attended on the CPU)."""
        self.ctx.host(self._result_to_device, layer)
        return self.transport.merge_input(layer)

    def _result_to_device(self, layer: int) -> None:  # host
        self.counters.h2d_bytes += self.transport.result_to_device(self._done[layer])

    # ------------------------------------------------------------------ periodic recall (section 3.4)
    def _after_merge(self, layer: int) -> None:
        """Host, after layer i's attention: its statistics; with PR, record its due recall (periodic, or the
        reactive trigger) and issue those of the layers before it, whose staging ran before this layer's
        attention on the worker (no wait). A recall is issued at this fixed point, never "when its staging is
        done": the step a block becomes resident changes the output, which must not depend on thread timing."""
        task = self._done.pop(layer)
        result: CpuResult = task.result
        self._account(layer, result)
        if self.pr:
            self._since[layer] += 1
            self._issue_recalls(before_layer=layer)
            if result.recall_due:
                self._since[layer] = 0
                self.transport.pending_recalls.append(task)

    def _issue_recalls(self, before_layer: int | None = None) -> None:
        """Issue the pending recalls in order (all of them, or those of the layers before `before_layer`), each
        once its staging is done."""
        for task, recall in self.transport.staged_recalls(before_layer):
            self._recall(task.layer, task, recall)

    def _recall(self, layer: int, task: CpuTask, recall: Recall) -> None:
        """Copy the blocks the worker staged into their pool slots (readable once their copy event completed)."""
        b, Hkv, D = self.block_size, self.ctx.num_kv_heads, self.ctx.head_dim
        bh, blocks = recall.bh, recall.blocks
        n = bh.numel()
        self.transport.load(task, recall)
        element_size = self.store.host_k[layer].element_size()
        self._recalls[layer] += 1
        # the recalled blocks (K and V) go to the device, with their staged indices (RECALL_INDEX_ROWS of n)
        self._recall_bytes += 2 * n * b * D * element_size
        self.counters.h2d_bytes += 2 * n * b * D * element_size + RECALL_INDEX_ROWS * n * 8
        self._recall_blocks[layer] += int(n)
        self._trace.recall(layer, task.step, bh, blocks, Hkv)

    # ================================================================== the step's plan (eager)
    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        if self.sparse_layers:
            pos, b = step.positions, self.block_size
            self.store.keep_leaving_blocks(step.positions_host, pos, self._prompt_len, self._prompt_len_device)
            self.store.step_slots(pos)
            # selectable: complete blocks j with sink_blocks <= j < tail - local_blocks
            self._candidates.update((pos // b - self.local_blocks).clamp(min=0))
            self._valid.copy_(self._arange_k[None, None, :] < self._candidates.count[:, :, None])
            torch.add((pos // b) % self.store.n_ring * b + pos % b, self.store.ring_base, out=self._ring_rows)
            # a context shorter than the sink region fills its sink slot token by token: its own graph variant
            self._short = min(step.positions_host) < self.sink_blocks * b
            self.counters.attended.count_rows(len(self.sparse_layers) * self.ctx.batch * self.ctx.num_kv_heads)

    def graph_key(self) -> Any:
        return self._short if self.sparse_layers else None

    def block_cycle(self) -> int | None:
        return self.block_size

    def block_events(self, positions: list[int]) -> tuple[str, ...]:
        """A block completes with its last token (its digests, its copy to the host tier: `end_step`); the block
        leaving the local window is handed over to the pool when the next block starts (`begin_step`)."""
        if not self.sparse_layers:
            return ()
        b, ring = self.block_size, self.store.n_ring
        events = ("complete",) if any((p + 1) % b == 0 for p in positions) else ()
        if any(p % b == 0 and p > prompt and p // b - ring >= self.sink_blocks
               for p, prompt in zip(positions, self._prompt_len, strict=True)):
            events += ("hand-over",)
        return events

    def end_step(self) -> None:
        self._issue_recalls()  # the last layers' recalls
        if self.sparse_layers:  # what every sparse layer attended this step, in four calls rather than four a layer
            self.counters.attended.accumulate(self._attended_rows)
        # the blocks this step's tokens completed: their digests, and their copy to the host tier (asynchronous on
        # CUDA); a completed block is the tail this step, selectable only once it has left the local window
        for layer in self.sparse_layers:
            self.counters.d2h_bytes += self.store.complete_blocks(layer, self.step.positions_host, self.step.uniform)
        if self._tasks:  # a task nobody consumed (never in a well-formed loop): do not leak its future
            for task in self._tasks.values():
                if task.future is not None:
                    task.future.result()
            self._tasks.clear()

    # ================================================================== prefill
    def ingest_sparse_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lengths: torch.Tensor) -> None:
        lengths_host = [int(n) for n in lengths.tolist()]
        self._prompt_len = lengths_host
        self._prompt_len_device = lengths.to(self.ctx.device)
        self.store.ingest_prompt(layer, k, v, lengths_host)
        # initial resident set: the top pool_slots selectable blocks for the last prompt query (a full pool)
        selectable = self.store.selectable(self._prompt_len_device, max(lengths_host), self.pool_slots)
        candidates, valid = selectable
        ids, _ = top_blocks(self.store, layer, q_obs[:, :, -1], candidates, valid.shape[-1])
        self.store.load_resident(layer, ids, self._initial_selection(layer, ids, valid))

    def _initial_selection(self, layer: int, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Which of the selected blocks `ids` (`valid` entries) go into the pool at prefill: all of them (a hook:
        the tests vary the residency split through it). Returns a bool mask like `valid`."""
        return valid

    # ================================================================== setup
    def check_model(self, shape: ModelShape) -> None:
        super().check_model(shape)
        self._check_profile_layers(shape.num_layers)

    def _check_profile_layers(self, num_layers: int) -> None:
        if self._profile_intervals is not None and len(self._profile_intervals) != num_layers:
            raise UsageError(f"recall_profile {self.recall_profile!r} has {len(self._profile_intervals)} layers, "
                             f"the model has {num_layers}: profile this model (scoutbench profile-recall --model "
                             "...) or drop recall_profile")

    def bind(self, ctx: MethodContext) -> None:
        self.close()
        super().bind(ctx)
        B, Hkv, dev = ctx.batch, ctx.num_kv_heads, ctx.device
        self._L = ctx.num_layers
        self._check_profile_layers(ctx.num_layers)
        self._intervals = [
            max(1, int(self._profile_intervals[i])) if self._profile_intervals is not None
            and self._profile_intervals[i] is not None else self.recall_interval
            for i in range(ctx.num_layers)]
        self.store = TieredBlockStore(self.sparse_layers, B, Hkv, ctx.head_dim, self.block_size, ctx.max_len,
                                      self.pool_slots, self.sink_blocks, self.local_blocks, ctx.dtype, dev,
                                      recall_blocks=self.k_sel)
        self.transport = CoAttentionTransport(self.store, B, ctx.num_heads, self.k_sel, self.cpu_workers, ctx.dtype,
                                              dev)
        self._arange_k = torch.arange(self.k_sel, device=dev)
        # the step's plan, written in place by begin_step (what every sparse layer and a captured graph read): the
        # selectable blocks over every block the store holds, which of the k_sel selections are valid, and the
        # ring row of each sequence's new token
        max_blocks = self.store.max_blocks
        excluded = (torch.arange(max_blocks, device=dev) < self.sink_blocks)[None, None, :] if self.sink_blocks \
            else None
        self._candidates = CandidateBlocks.static(B, max_blocks, self.k_sel, excluded, dev)
        self._valid = torch.zeros((B, Hkv, self.k_sel), dtype=torch.bool, device=dev)
        # lines 5-6: one fused launch where the fused ops serve the device, else torch ops (runtime/scout_selection)
        self._select = select_and_split_for(self.store, self._candidates, self._valid, self.k_sel, self.device_blocks,
                                            dev)
        # the sparse layers whose lines 3-7 run during the layer before (PC), and those that, with PC, run them
        # inline (the first layer): their CPU part runs in the wait, the worker being busy with the next layer's
        self._ahead = frozenset(i for i in self.sparse_layers if self.layer_ahead_active and i >= 1)
        self._inline = frozenset(i for i in self.sparse_layers if self.layer_ahead_active and i not in self._ahead)
        self._ring_rows = torch.zeros(B, dtype=torch.long, device=dev)
        # per sparse layer, its device split, recorded when its selection is issued (at capture with CUDA graphs:
        # the tensors a replay rewrites)
        # tokens each sparse layer attends per (sequence, KV head) this step, one row per layer (views made once)
        self._attended_rows = torch.zeros((len(self.sparse_layers), B, Hkv), dtype=torch.long, device=dev)
        self._attended_row = dict(zip(self.sparse_layers, self._attended_rows, strict=True))
        self._splits: dict[int, DeviceSplit] = {}
        self._tasks: dict[int, CpuTask] = {}  # spawned, until the layer's wait
        self._done: dict[int, CpuTask] = {}  # tasks whose result the host has, until the layer's statistics
        self._short = False
        self._since = [0] * ctx.num_layers
        self.reset_stats()

    @property
    def host_arena(self):  # the store's, once bound (AttentionMethod.host_arena)
        store = getattr(self, "store", None)
        return None if store is None else store.arena

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close(list(getattr(self, "_tasks", {}).values()))
            self.transport = None
        if hasattr(self, "store"):
            self.store.release()

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        dense, sparse = self.layer_split(shape)
        device, host, prefill = TieredBlockStore.bytes_per_sequence(
            sparse, context_len, shape.num_kv_heads, shape.head_dim, elem_bytes, self.block_size, self.pool_slots,
            self.sink_blocks, self.local_blocks, recall_blocks=self.k_sel)
        return Footprint(dense * context_len * shape.kv_bytes_per_token_layer(elem_bytes) + device, host, prefill)


def load_recall_profile(path: str) -> tuple[list[int | None], dict[str, Any] | None]:
    """Per-layer recall intervals from a `scoutbench profile-recall` JSON (`intervals`: one entry per layer,
    null for dense layers) and what they were measured on (`measured_on`; None in a profile that does not say)."""
    if not os.path.exists(path):
        raise ValueError(f"recall_profile {path!r} does not exist")
    try:
        data = read_json_file(path)  # a regular file, bounded in size and nesting (a FIFO would block here)
    except UnusableFile as exc:
        raise ValueError(f"recall_profile {path!r} cannot be used: {exc}") from None
    intervals = data.get("intervals") if isinstance(data, dict) else None
    if not isinstance(intervals, list) or not all(i is None or (isinstance(i, int) and not isinstance(i, bool)
                                                               and i >= 1) for i in intervals):
        raise ValueError(f"recall_profile {path!r} is not a profile-recall JSON with an 'intervals' list "
                         "of positive integers (null for dense layers)")
    return intervals, data.get("measured_on")
