"""ScoutAttention (arXiv 2603.27138): block-sparse GPU-CPU co-attention with layer-ahead CPU pre-computation (PC)
and asynchronous periodic recall (PR), after the paper's Algorithm 1 (layer-ahead CPU pre-computation); the choices
the paper leaves open are listed in docs/methods.md ("ScoutAttention choices")."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from scoutbench.errors import UsageError
from scoutbench.kernels.attention import block_sparse_attention, region_attention
from scoutbench.kernels.digest import CandidateBlocks
from scoutbench.kernels.partial_state import PartialState, merge_states
from scoutbench.methods import SCOUT_ABLATION, SCOUT_ABLATION_FIELDS
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    AttendedTokens,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
    require,
    transfer_stats,
)
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.methods.work_model import INDEX_BYTES, LayerTerms, LayerWork, RunRecord, Transfer
from scoutbench.runtime.block_store import NUM_COUNTS, SplitPlan, TieredBlockStore
from scoutbench.runtime.block_table import BlockTable, pad_last
from scoutbench.runtime.offload import DONE, PREFILL_CHUNK_TOKENS, CopyStream, CpuWorkerPool, host_empty

PRED_NORMS = ("next", "self")
DEVICE_BLOCKS = ("resident", "selected")


@dataclass
class _Plan:
    """One layer's split for one step: what the device reads and what the CPU worker computes."""

    layer: int
    step: int
    parity: int  # which set of host buffers (consecutive layers alternate)
    q: torch.Tensor  # host query of the CPU part [B, Hq, D] (predicted, or the true one)
    split: SplitPlan  # on the host: the selected blocks (CPU ones first), in-flight flags, victims, counts
    event: Any  # completes when `q` and `split` are on the host
    predicted: bool
    recall_periodic: bool = False  # this layer's periodic recall is due after this step's attention
    wait_events: tuple = ()  # events the worker waits for before reusing this parity's host buffers
    attention: Future = field(default_factory=Future)  # the CPU part's result (_CpuResult): what decode waits for
    future: Future | None = None  # the whole task: then its recall, staged (_Recall or None)
    result: Any = None


@dataclass
class _DeviceSplit:
    """One layer's split on the device (`_split`): what its device part reads, and what its host points send."""

    split: SplitPlan  # device: the selected blocks (CPU ones first), in-flight flags, victims, counts
    pool_use: torch.Tensor  # bool [B, Hkv, pool_slots]: pool slots read by the device part
    trace: tuple | None = None  # (ids, valid, on_device) of the selection when tracing (tests, profiling)


@dataclass
class _Recall:
    """The blocks a recall copies into the pool, in (row, rank) order (on CUDA staged by the worker in this plan's
    parity's staging buffers, rows [0, n)): host rows read, pool slots written."""

    bh: torch.Tensor  # [n] (sequence, KV head) row b * Hkv + h
    slots: torch.Tensor  # [n] pool slot of each recalled block
    blocks: torch.Tensor  # [n] block index


@dataclass
class _CpuResult:
    state: PartialState | None  # None: nothing attended on the CPU
    width: int  # CPU blocks per (sequence, KV head) row (the widest row)
    ms: float
    count_means: tuple[float, ...]  # the split's counts (n_cpu, n_selected, n_available, n_resident), mean per row
    recall_due: bool = False  # periodic, or the reactive trigger fired


@dataclass
class ScoutAttention(SparseLayerMethod):
    """ScoutAttention: Quest block selection split between a device pool and CPU attention over host blocks.

    Storage (`TieredBlockStore`, scoutbench/runtime/block_store.py). Layers `< dense_layers` are FullKV on the
    device. A sparse layer keeps every complete block in host memory (pinned on CUDA), which the CPU kernel reads
    in place; on the device it keeps Quest digests (kmax/kmin of post-RoPE keys) of every complete block and one
    contiguous region per (sequence, KV head): `pool_slots` pool slots (`pool_factor` selections of `k_sel`
    blocks), `sink_blocks` sink slots and a ring of `local_blocks + 1` slots holding the local blocks and the tail
    (the partial block with the current token). `BlockTable` records which block sits in which pool slot.

    Budget. `budget` counts every attended token, the always-on ones included (Quest convention): per
    (sequence, KV head) the method attends `k_sel = budget // block_size - sink_blocks - local_blocks - 1`
    selected blocks, plus the sink blocks, the local blocks and the tail (the remainder of `budget` modulo
    `block_size` is unused). Only complete blocks that are neither sink nor local can be selected; top-k per
    (sequence, KV head) with the group's query heads max-aggregated (GQA). The pool is not budget: a pool larger
    than a selection (`pool_factor > 1`) only keeps more candidate blocks on the device, so that a block the
    selection drops and picks again a few steps later is still there (the selection churns by about a third of
    its blocks per step on real text, docs/methods.md); the device still attends only the selected ones.

    Prefill. Everything goes to the host tier; digests, sink/local/tail blocks and the initial resident set (the
    top `pool_slots` blocks for the last prompt query) go to the device.

    Decode (Algorithm 1), `pc=True`: `before_layer(i)` predicts layer i+1's query from layer i's input
    (`pred_norm="next"`: layer i+1's input norm applied to layer i's residual input; `"self"`: layer i's
    normalised input, the literal `W_Q^{i+1} X^i`), rotated at the current position; scores layer i+1's digests,
    selects top-k, and submits the CPU partial attention of the selected blocks that are not resident (`B_cpu`) to
    the worker pool. `decode(i)` appends k/v, computes the device part with the true query over the resident
    blocks of this step's selection plus sink/local/tail (which hold the current token), waits for layer i's CPU
    result (timed as `idle`) and merges the two by LSE: the top-k selection is split between the device (resident
    blocks) and the CPU (the others), so the two parts together attend at most `budget` tokens (the paper's
    split). `device_blocks="resident"` is a variant that reads Algorithm 1 line 10 (`A_gpu = GPUAttn(Q^i,
    B_gpu^i)`) literally: the device attends every resident block, selected or not, and the CPU part comes on
    top, so it attends more than `budget` tokens (up to pool_slots blocks more); its stats say so
    (`attended_tokens_per_head.within_budget: false`). The first sparse layer is predicted from layer
    `dense_layers - 1`; with `dense_layers == 0`, layer 0's CPU part runs synchronously with the true query.
    `pc=False` is the parallel co-attention baseline: selection with the true query inside `decode(i)`, the CPU
    part submitted and run while the device part of the same layer runs. `oracle=True` behaves like `pc=False`
    (true query everywhere): the exactness tests use it.

    Periodic recall (`pr=True`): after layer l's attention, every `recall_interval` steps (per layer from
    `recall_profile`, a `scoutbench profile-recall` JSON, when given; the paper sets these intervals offline from
    beta and recalls purely periodically), and with `beta_trigger=True` also whenever the layer's CPU compute
    ratio exceeds `beta` (a reactive variant, not the paper's), the blocks the CPU just computed are copied into the
    pool, evicting free slots first, then resident blocks outside the latest selection, lowest score first. The CPU
    part attends its blocks in place in the host tier (no gather), so on a recall step the worker also stages the
    recalled blocks (only those): on CUDA from the host tier into this parity's staging buffer, from which the recall
    copies them into the pool on a copy stream with an event; on a CPU the recall copies them from the host tier
    into the pool in one pass. The staging comes after the CPU part's result is handed over (`_Plan.attention`):
    `decode` waits for attention results only. A layer's recall is issued at a fixed point, once the next layer's
    result is in (the one worker staged it before attending that layer, so nothing waits; the last layer's at the
    end of the step): a fixed point, not "whenever the staging is done", because the CPU part attends with the
    predicted query and the device part with the true one, so the step a recalled block becomes resident changes
    the output, and it must not depend on thread timing (the CUDA path then equals the CPU path, run after run). A
    recalled slot is readable only after its copy event has completed, and victims are never selected or in-flight
    blocks, so the layer's next use never reads a half-copied slot.

    CPU compute ratio = tokens attended on the CPU / `budget` per layer, averaged over (sequence, KV head).
    `stats()` reports it (mean and per layer) with the tokens attended per (sequence, KV head) in the sparse
    layers (mean and max, against the budget), blocks selected/resident, recall counters, CPU attention time and
    idle time. On CUDA the worker gets the query and block ids by a non-blocking D2H copy and an event; its
    result returns by H2D; the decode loop has no `.item()`/`.cpu()` sync. On a CPU-only machine both tiers are
    CPU memory and the worker thread still runs concurrently with the main thread (torch ops release the GIL).
    """

    name: ClassVar[str] = "scout"
    display_name: ClassVar[str] = "ScoutAttention"
    layer_ahead: ClassVar[bool] = True
    # the ablation (paper Figure 12), declared in methods/__init__.py (SCOUT_ABLATION)
    ablation_fields: ClassVar[tuple[str, ...]] = SCOUT_ABLATION_FIELDS
    ablation_variants: ClassVar[dict[tuple[Any, ...], str]] = {v.values: v.label for v in SCOUT_ABLATION}
    artefact_fields: ClassVar[tuple[str, ...]] = ("recall_profile",)
    work_fractions: ClassVar[dict[str, float]] = {
        "cpu_budget_frac": 0.0,  # share of the budget attended on the CPU
        "recall_budget_frac": 0.0,  # tokens recalled per (sequence, KV head, sparse layer, step) / budget
        "attended_budget_frac": 1.0,  # tokens attended per (sequence, KV head, sparse layer), both tiers / budget
    }

    budget: int = 2048
    block_size: int = 32
    dense_layers: int = DEFAULT_DENSE_LAYERS
    sink_blocks: int = 1
    local_blocks: int = 1
    pc: bool = True
    pr: bool = True
    recall_interval: int = 8
    pool_factor: float = 2.0  # device pool slots per selection (docs/methods.md: why 2)
    beta: float = 0.12  # the reactive trigger's threshold (beta_trigger); profile-recall takes its own --beta
    beta_trigger: bool = False
    device_blocks: str = "selected"
    recall_profile: str | None = None
    oracle: bool = False
    pred_norm: str = "next"
    cpu_workers: int = 1

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1 (got {self.block_size})")
        self.check_dense_layers()
        require(self.sink_blocks >= 0, f"sink_blocks must be >= 0 (got {self.sink_blocks})")
        require(self.local_blocks >= 0, f"local_blocks must be >= 0 (got {self.local_blocks})")
        require(self.k_sel >= 1, f"budget {self.budget} leaves no selectable block: need budget >= block_size * "
                f"(sink_blocks + local_blocks + 2) = {self.block_size * (self.sink_blocks + self.local_blocks + 2)}")
        require(self.recall_interval >= 1, f"recall_interval must be >= 1 (got {self.recall_interval})")
        require(self.pool_factor >= 1.0, f"pool_factor must be >= 1: the device pool holds at least one selection "
                f"(got {self.pool_factor})")
        require(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1] (got {self.beta})")
        require(self.pred_norm in PRED_NORMS, f"pred_norm must be one of {', '.join(PRED_NORMS)} "
                f"(got {self.pred_norm!r})")
        require(self.device_blocks in DEVICE_BLOCKS, f"device_blocks must be one of {', '.join(DEVICE_BLOCKS)} "
                f"(got {self.device_blocks!r})")
        require(self.cpu_workers >= 1, f"cpu_workers must be >= 1 (got {self.cpu_workers})")
        self._profile_intervals: list[int | None] | None = None
        self._profile_measured_on: dict[str, Any] | None = None
        if self.recall_profile is not None:
            self._profile_intervals, self._profile_measured_on = load_recall_profile(self.recall_profile)
        self.trace: list[dict[str, Any]] | None = None  # tests/profiling: per layer-step records (host syncs)
        self._pool: CpuWorkerPool | None = None

    # ------------------------------------------------------------------ sizes
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

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        dense, sparse = self.layer_split(shape)
        n_blocks = math.ceil(context_len / self.block_size)
        # device tokens per (sequence, KV head): the pool's slots, the sink slots and the local/tail ring
        region = (self.pool_slots + self.sink_blocks + self.local_blocks + 1) * self.block_size
        # per sparse layer: digests, the slotted region and its BlockTable (int64 block -> slot, int64 + bool per
        # slot); once: the recall's device staging of k_sel blocks (K and V) and the region's open tokens per slot
        block_table = shape.num_kv_heads * ((n_blocks + 1) * 8 + (self.pool_slots + 1) * 9)
        device = dense * context_len * kv + sparse * (
            n_blocks * 2 * shape.num_kv_heads * shape.head_dim * elem_bytes + region * kv + block_table)
        if sparse:
            device += self.k_sel * self.block_size * kv + shape.num_kv_heads * (region // self.block_size) * 8
        # the host arena: every block of the sparse layers, and on CUDA two pinned recall staging buffers of k_sel
        # blocks (K and V; a CPU recall copies host rows into the pool directly)
        host = sparse * n_blocks * self.block_size * kv + (2 * self.k_sel * self.block_size * kv if sparse else 0)
        # prefill: one chunk of blocks made contiguous for its D2H copy, and the initial resident K (then V) blocks
        one_kv = shape.num_kv_heads * shape.head_dim * elem_bytes
        prefill = (min(PREFILL_CHUNK_TOKENS, context_len) + self.k_sel * self.block_size) * one_kv if sparse else 0
        return Footprint(device, host, prefill)

    # ------------------------------------------------------------------ setup
    def bind(self, ctx: MethodContext) -> None:
        self.close()
        super().bind(ctx)
        B, Hkv, H, D = ctx.batch, ctx.num_kv_heads, ctx.num_heads, ctx.head_dim
        dev, dtype = ctx.device, ctx.dtype
        self._L = ctx.num_layers
        self._cuda = torch.device(dev).type == "cuda"
        if self._profile_intervals is not None and len(self._profile_intervals) != ctx.num_layers:
            raise UsageError(f"recall_profile {self.recall_profile!r} has {len(self._profile_intervals)} layers, "
                             f"the model has {ctx.num_layers}")
        self._intervals = [
            max(1, int(self._profile_intervals[i])) if self._profile_intervals is not None
            and self._profile_intervals[i] is not None else self.recall_interval
            for i in range(ctx.num_layers)]
        self.store = TieredBlockStore(self.sparse_layers, B, Hkv, D, self.block_size, ctx.max_len, self.pool_slots,
                                      self.sink_blocks, self.local_blocks, dtype, dev, recall_blocks=self.k_sel)
        self._parity_free: list[list[Any]] = [[], []]
        if self._cuda:  # pinned transport of the plans (query, split) and of the CPU part's result
            self._q_host = [host_empty((B, H, D), dtype, dev) for _ in range(2)]
            self._split_host = [host_empty((B, Hkv, SplitPlan.width(self.k_sel)), torch.long, dev) for _ in range(2)]
            self._out_o = [host_empty((B, H, D), torch.float32, dev) for _ in range(2)]
            self._out_lse = [host_empty((B, H), torch.float32, dev) for _ in range(2)]
        self._copy = CopyStream(dev)
        self._arange_k = torch.arange(self.k_sel, device=dev)
        # the step's plan, written in place by begin_step (what every sparse layer and a captured graph read): the
        # selectable blocks over every block the store holds, which of the k_sel selections are valid, and the
        # ring row of each sequence's new token
        max_blocks = self.store.max_blocks
        excluded = (torch.arange(max_blocks, device=dev) < self.sink_blocks)[None, None, :] if self.sink_blocks \
            else None
        self._candidates = CandidateBlocks.static(B, max_blocks, self.k_sel, excluded, dev)
        self._valid = torch.zeros((B, Hkv, self.k_sel), dtype=torch.bool, device=dev)
        self._ring_rows = torch.zeros(B, dtype=torch.long, device=dev)
        # per sparse layer, its device split (`_split`), recorded when its selection is issued (at capture with CUDA
        # graphs: the tensors a replay rewrites); and the CPU part's result where the merge reads it: on CUDA static
        # device buffers per parity, which the host copies the result into (or the empty state), on a CPU the state
        self._attended = AttendedTokens(dev)
        self._splits: dict[int, _DeviceSplit] = {}
        self._cpu_states: dict[int, PartialState | None] = {}
        self._done: dict[int, _Plan] = {}  # plans whose result the host has, until the layer's statistics
        self._short = False
        if self._cuda:
            self._cpu_device = [PartialState(torch.zeros((B, H, D), device=dev), torch.full((B, H), float("-inf"),
                                                                                            device=dev))
                                for _ in range(2)]
        # what a plan packs as its eviction order when no recall can follow (victims, available): read-only
        self._no_victims = (torch.zeros((B, Hkv, self.k_sel), dtype=torch.long, device=dev),
                            torch.zeros((B, Hkv), dtype=torch.long, device=dev))
        self._plans: dict[int, _Plan] = {}
        # recalls whose staging may still run; per parity, whether its staging buffers are free (the recall staged
        # there has been issued) and the copy that last read them
        self._pending_recalls: list[_Plan] = []
        self._staging_free = [threading.Event() for _ in range(2)]
        for free in self._staging_free:
            free.set()
        self._staging_copy: list[Any] = [None, None]
        self._pool = CpuWorkerPool(self.cpu_workers, device=ctx.device)
        self._since = [0] * ctx.num_layers
        self.reset_stats()

    # the host arena under the name every offloading method has (the planner's checks read it)
    @property
    def _host_arena(self):
        return self.store.arena

    def reset_stats(self) -> None:
        """Zero the statistics (e.g. after warm-up steps); the method state is untouched."""
        L = self._L
        self._ratio_sum = [0.0] * L
        self._ratio_n = [0] * L
        self._sel_sum = [0.0] * L
        self._res_sum = [0.0] * L
        self._recalls = [0] * L
        self._recall_blocks = [0] * L
        self._recall_bytes = 0  # K/V bytes the recalls copied to the device
        self._cpu_ms = 0.0
        self._idle_ms = 0.0
        self._cpu_tasks = 0
        self._h2d_bytes = self._d2h_bytes = 0
        self._steps = 0
        self._attended.reset()

    def close(self) -> None:
        if self._pool is not None:
            for plan in getattr(self, "_plans", {}).values():
                if plan.future is not None:
                    plan.future.cancel()
            for free in self._staging_free:  # a worker waiting to stage must not hold the shutdown
                free.set()
            self._pool.close()
            self._pool = None
        if hasattr(self, "store"):
            self.store.release()

    # ------------------------------------------------------------------ prefill
    def ingest_sparse_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lengths: torch.Tensor) -> None:
        lengths_host = [int(n) for n in lengths.tolist()]
        self._prompt_len = lengths_host
        self._prompt_len_device = lengths.to(self.ctx.device)
        self.store.ingest_prompt(layer, k, v, lengths_host)
        # initial resident set: the top pool_slots selectable blocks for the last prompt query (a full pool)
        ids, valid, _ = self._select(layer, q_obs[:, :, -1], self._selectable(self._prompt_len_device,
                                                                              max(lengths_host), self.pool_slots))
        self.store.load_resident(layer, ids, self._initial_selection(layer, ids, valid))

    def _initial_selection(self, layer: int, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Which of the selected blocks `ids` (`valid` entries) go into the pool at prefill: all of them (a hook:
        the tests vary the residency split through it). Returns a bool mask like `valid`."""
        return valid

    # ------------------------------------------------------------------ decode
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
            self._attended.count_rows(len(self.sparse_layers) * self.ctx.batch * self.ctx.num_kv_heads)
        self._steps += 1

    def graph_key(self) -> Any:
        return self._short if self.sparse_layers else None

    def before_layer(self, layer: int, hidden: torch.Tensor, normed: torch.Tensor) -> None:
        target = layer + 1
        if not self.layer_ahead_active or target not in self.sparse_layers:
            return
        if self.pred_norm == "next":
            q_pred = self.ctx.predict_query(target, hidden)
        else:
            q_pred = self.ctx.predict_query(target, hidden, normed)
        self._plan(target, q_pred, predicted=True)

    def _planned_ahead(self, layer: int) -> bool:
        """Whether `before_layer` of the layer before planned `layer` (with PC, every sparse layer but layer 0)."""
        return self.layer_ahead_active and layer - 1 >= 0

    def decode_sparse(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx, timer = self.ctx, self.ctx.timer
        inline = False
        if not self._planned_ahead(layer):  # pc off / oracle: the true query now; or layer 0 with dense_layers=0
            with timer.stage("attn_device"):
                inline = self.layer_ahead_active  # synchronous: the worker is busy with the next layer's PC
                self._plan(layer, q, predicted=False, submit=not inline)
        split = self._splits[layer]
        with timer.stage("attn_device"):
            self._append(layer, k, v)
            device_state = self._device_partial(layer, q, split)
        with timer.stage("idle"):
            ctx.host(self._wait, layer, inline)
        with timer.stage("merge"):
            if self._cuda:
                ctx.host(self._result_to_device, layer)
                cpu_state = self._cpu_device[layer % 2]
            else:
                cpu_state = self._cpu_states.pop(layer)
            merged = device_state if cpu_state is None else merge_states(device_state, cpu_state)
            out = merged.o.to(q.dtype)
        with timer.stage("attn_device"):  # the statistics, and issuing a due recall (asynchronous on CUDA)
            ctx.host(self._after_merge, layer)
        return out

    def end_step(self) -> None:
        self._issue_recalls()  # the last layers' recalls
        # the blocks this step's tokens completed: their digests, and their copy to the host tier (asynchronous on
        # CUDA); a completed block is the tail this step, selectable only once it has left the local window
        if self.sparse_layers:
            for layer in self.sparse_layers:
                self._d2h_bytes += self.store.complete_blocks(layer, self.step.positions_host, self.step.uniform)
        if self._plans:  # a plan nobody consumed (never in a well-formed loop): do not leak its future
            for plan in self._plans.values():
                if plan.future is not None:
                    plan.future.result()
            self._plans.clear()

    # ------------------------------------------------------------------ selection and the CPU part
    def _selectable(self, positions: torch.Tensor, max_position: int, k: int | None = None
                    ) -> tuple[CandidateBlocks, torch.Tensor]:
        """The blocks a selection of `k` (default `k_sel`) may pick when the new token sits at `positions` (complete
        blocks `j` with `sink_blocks <= j < tail - local_blocks`), and which of the k selections are valid
        `[B, Hkv, k]` (the prefill's initial selection; a decode step's are `begin_step`'s, in place)."""
        k = self.k_sel if k is None else k
        b = self.block_size
        num_scored = max(1, max_position // b)
        limit = (positions // b - self.local_blocks).clamp(min=0)
        excluded = None
        if self.sink_blocks:
            excluded = (torch.arange(num_scored, device=positions.device) < self.sink_blocks)[None, None, :]
        candidates = CandidateBlocks.build(num_scored, limit, k, excluded, positions.device)
        count = candidates.count.expand(positions.shape[0], self.ctx.num_kv_heads)  # [B, 1]: nothing excluded per head
        arange = self._arange_k if k == self.k_sel else torch.arange(k, device=positions.device)
        return candidates, arange[None, None, :] < count[:, :, None]

    def _select(self, layer: int, q: torch.Tensor, selectable: tuple[CandidateBlocks, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The top `k` selectable blocks for query `q` `[B, Hq, D]` (`k`: the width of `selectable`, k_sel in
        decode). Returns ids `[B, Hkv, k]` (descending score, padding after the valid ones), valid `[B, Hkv, k]`
        and the scores `[B, Hkv, nB]`."""
        candidates, valid = selectable
        ids, scores = self.store.digests.select(layer, q, candidates)
        return pad_last(ids, valid.shape[-1]), valid, scores

    def _plan(self, layer: int, q: torch.Tensor, predicted: bool, submit: bool = True) -> None:
        """Algorithm 1's split of layer `layer` for the query `q`: the host brings the layer's recalls and copies
        up to date, the device selects and splits (`_split`), the host hands the CPU part to the worker (or, not
        `submit`, keeps the plan for an inline run)."""
        self.ctx.host(self._prepare, layer)
        split = self._splits[layer] = self._split(layer, q)
        self.ctx.host(self._submit, layer, q, split, predicted, submit)

    def _prepare(self, layer: int) -> None:
        """Host, before a layer's selection: the slots whose recall copies have completed become readable."""
        self.store.tables[layer].poll()

    def _split(self, layer: int, q: torch.Tensor) -> _DeviceSplit:
        """Device: select layer `layer`'s blocks for `q`, split them between pool and CPU, and on CUDA start the
        copy of the query and the split to the host (pinned buffers of the layer's parity)."""
        table = self.store.tables[layer]
        ids, valid, scores = self._select(layer, q, (self._candidates, self._valid))
        # the periodic recall is known in advance; the reactive trigger (beta_trigger) decides only after the CPU
        # part. With CUDA graphs the eviction order is always made: whether a recall is due is the host's to know
        if self.ctx.graphs or self.pr and (self.beta_trigger or self._since[layer] + 1 >= self._intervals[layer]):
            victims, available = table.victims(ids, valid, scores)
            # a recall copies at most the k_sel blocks the CPU computed: the first k_sel victims are all it reads
            victims, available = victims[..., : self.k_sel], available.clamp(max=self.k_sel)
        else:  # no recall will read them this step
            victims, available = self._no_victims
        fused = None
        if self.device_blocks == "selected" and self.trace is None:  # on a CPU: the next four steps in one call
            fused = table.split_selected(ids, valid, victims, available)
        on_dev = None
        if fused is not None:
            split, pool_use = SplitPlan(fused[0], self.k_sel), fused[1]
        else:
            on_dev, pending, slot = table.split(ids, valid)
            on_cpu = valid & ~on_dev
            order = torch.argsort(on_cpu.to(torch.uint8), dim=-1, descending=True, stable=True)  # CPU blocks first
            split = SplitPlan.pack(ids.gather(-1, order), pending.gather(-1, order), victims, on_cpu.sum(-1),
                                   valid.sum(-1), available, table.resident_count())
            if self.device_blocks == "resident":  # the variant: every resident block whose copy has landed
                pool = slice(0, self.pool_slots)
                pool_use = (table.slot_block[..., pool] >= 0) & table.slot_ready[..., pool]
            else:
                pool_use = table.slot_mask(on_dev, slot)
        if self._cuda:
            parity = layer % 2
            self._q_host[parity].copy_(q, non_blocking=True)
            self._split_host[parity].copy_(split.data, non_blocking=True)
        trace = (ids, valid, on_dev) if self.trace is not None else None
        return _DeviceSplit(split, pool_use, trace)

    def _submit(self, layer: int, q: torch.Tensor, split: _DeviceSplit, predicted: bool, submit: bool) -> None:
        """Host, after a layer's split was issued: the plan the worker reads (on CUDA its pinned copies, complete
        at the event recorded now), handed to the worker pool unless it runs inline."""
        parity = layer % 2
        if self._cuda:
            q_host, split_host = self._q_host[parity], SplitPlan(self._split_host[parity], self.k_sel)
            event = torch.cuda.Event()
            event.record()
        else:
            q_host, split_host, event = q, split.split, DONE
        self._d2h_bytes += q.numel() * q.element_size() + split_host.data.numel() * split_host.data.element_size()
        recall_periodic = self.pr and self._since[layer] + 1 >= self._intervals[layer]
        plan = _Plan(layer, self.step.index, parity, q_host, split_host, event, predicted, recall_periodic,
                     tuple(self._parity_free[parity]))
        self._parity_free[parity] = []
        if split.trace is not None:
            self._trace_plan(plan, split, self.store.tables[layer])
        self._plans[layer] = plan
        if submit:
            plan.future = self._pool.submit(self._run_cpu, plan)
            self._log_event("submit", layer)

    def _run_cpu(self, plan: _Plan) -> _Recall | None:
        """The CPU part (worker thread): attend the non-resident selected blocks in place in the host tier with the
        plan's query (the kernel reads them by block id) and hand the result over (`plan.attention`), then, on a
        recall step, stage the recalled blocks (returned; None when nothing is recalled)."""
        try:
            result = self._attend_cpu(plan)
            recall = self._recall_of(plan) if result.recall_due and result.width else None
        except BaseException as exc:
            plan.attention.set_exception(exc)
            raise
        plan.attention.set_result(result)
        if recall is not None:
            self._stage(plan, recall)
        return recall

    def _attend_cpu(self, plan: _Plan) -> _CpuResult:
        plan.event.synchronize()
        for event in plan.wait_events:
            event.synchronize()
        t0 = time.perf_counter()
        ctx, b = self.ctx, self.block_size
        n_cpu = plan.split.n_cpu
        # the counts read once as Python ints: each torch call on this thread trades the GIL with the main thread,
        # and their means (the statistics) are taken here, off the main thread's path
        counts = plan.split.counts.reshape(-1, NUM_COUNTS).tolist()
        rows = [row[0] for row in counts]
        means = tuple(sum(column) / len(counts) for column in zip(*counts, strict=True))
        width = max(rows)
        recall_due = plan.recall_periodic or (self.pr and self.beta_trigger and
                                              sum(rows) * b / (self.budget * len(rows)) > self.beta)
        if width == 0:
            return _CpuResult(None, 0, (time.perf_counter() - t0) * 1e3, means, recall_due)
        blocks_k, blocks_v = self.store.blocked_host(plan.layer)
        valid_len = None if min(rows) == width else n_cpu * b
        state = block_sparse_attention(plan.q, blocks_k, blocks_v, plan.split.ids[..., :width], ctx.scale, valid_len)
        if self._cuda:
            self._out_o[plan.parity].copy_(state.o)
            self._out_lse[plan.parity].copy_(state.lse)
            state = PartialState(self._out_o[plan.parity], self._out_lse[plan.parity])
        ms = (time.perf_counter() - t0) * 1e3
        self._log_event("cpu", plan.layer)
        return _CpuResult(state, width, ms, means, recall_due)

    def _recall_of(self, plan: _Plan) -> _Recall | None:
        """The blocks a recall copies (worker thread, before the result is handed over: the main thread reuses
        the plan's buffers once it has it): the ones the CPU just computed, minus in-flight ones, most important
        first, as many as the row has free slots or victims. None when no block qualifies."""
        k = self.k_sel
        split = plan.split.rows()
        ids, victims, n_cpu, available = split.ids, split.victims, split.n_cpu, split.n_available
        take = (torch.arange(k)[None, :] < n_cpu[:, None]) & ~split.pending
        rank = take.long().cumsum(-1) - 1
        take &= rank < available[:, None]
        bh, kk = take.nonzero(as_tuple=True)
        if bh.numel() == 0:
            return None
        return _Recall(bh, victims[bh, rank[bh, kk]], ids[bh, kk])

    def _stage(self, plan: _Plan, recall: _Recall) -> None:
        """Stage a recall (worker thread; `TieredBlockStore.stage`: on CUDA gathered from the host tier into this
        parity's staging buffers) once the recall staged there before has been issued and its copy has read them."""
        free = self._staging_free[plan.parity]
        free.wait()
        free.clear()
        copy_event = self._staging_copy[plan.parity]
        if copy_event is not None:
            copy_event.synchronize()
        self.store.stage(plan.layer, plan.parity, recall.bh, recall.blocks)

    # ------------------------------------------------------------------ device part
    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new token into the device ring (`TieredBlockStore.append`; a block it completes goes to the host
        tier in `end_step`)."""
        self.store.append(layer, k, v, self._ring_rows, self.step.positions_host if self._short else None)

    def _device_partial(self, layer: int, q: torch.Tensor, split: _DeviceSplit) -> PartialState:
        """Exact attention of the true query over the resident selected blocks and the always-on blocks."""
        store = self.store
        store.open_pool(split.pool_use)
        self._log_event("device", layer)
        # what this layer attends per (sequence, KV head): the device region's open tokens and the CPU part's blocks
        self._attended.accumulate(torch.add(store.slot_tokens.sum(-1), split.split.n_cpu, alpha=self.block_size))
        return region_attention(q, store.dev_k[layer], store.dev_v[layer], self.ctx.scale, store.slot_tokens)

    # ------------------------------------------------------------------ host points of a layer
    def _wait(self, layer: int, inline: bool) -> None:
        """Host: the CPU part's result (computed now when inline), the time waited for it being the device's idle
        time."""
        plan = self._plans.pop(layer)
        if inline:
            self._issue_recalls()  # this thread stages now: no staging buffer may stay taken
            plan.future = Future()
            plan.future.set_result(self._run_cpu(plan))
            plan.result = plan.attention.result()
        else:
            t0 = time.perf_counter()
            plan.result = plan.attention.result()
            self._idle_ms += (time.perf_counter() - t0) * 1e3
            self._log_event("wait", layer)
        self._done[layer] = plan
        if not self._cuda:
            self._cpu_states[layer] = plan.result.state

    def _result_to_device(self, layer: int) -> None:
        """Host (CUDA): the CPU part's output and LSE into the static device buffers the merge reads (the empty
        state when nothing was attended on the CPU), asynchronously from the pinned result buffers."""
        plan = self._done[layer]
        o, lse = self._cpu_device[plan.parity]
        state = plan.result.state
        if state is None:
            o.zero_()
            lse.fill_(float("-inf"))
            return
        o.copy_(state.o, non_blocking=True)
        lse.copy_(state.lse, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._parity_free[plan.parity].append(event)  # the H2D read the pinned output buffer
        self._h2d_bytes += state.o.numel() * 4 + state.lse.numel() * 4

    def _after_merge(self, layer: int) -> None:
        """Host: the layer's statistics, and its recall when one is due."""
        plan = self._done.pop(layer)
        result: _CpuResult = plan.result
        if not self._cuda and result.state is not None:
            self._h2d_bytes += result.state.o.numel() * 4 + result.state.lse.numel() * 4
        self._account(layer, plan, result)
        if self.pr:
            self._maybe_recall(layer, plan, result)

    # ------------------------------------------------------------------ periodic recall
    def _maybe_recall(self, layer: int, plan: _Plan, result: _CpuResult) -> None:
        """Host, after a layer's result: record its due recall, and issue those of the layers before it (their
        staging ran before this layer's attention on the worker: no wait)."""
        self._since[layer] += 1
        self._issue_recalls(before_layer=layer)
        if result.recall_due:  # decided with the plan (periodic) or by the worker (reactive trigger)
            self._since[layer] = 0
            self._pending_recalls.append(plan)

    def _issue_recalls(self, before_layer: int | None = None) -> None:
        """Issue the pending recalls in order (all of them, or those of the layers before `before_layer`), each
        once its staging is done."""
        pending = []
        for plan in self._pending_recalls:
            if before_layer is None or plan.layer < before_layer:
                recall = plan.future.result()
                if recall is not None:
                    self._recall(plan.layer, plan, recall)
            else:
                pending.append(plan)
        self._pending_recalls = pending

    def _recall(self, layer: int, plan: _Plan, recall: _Recall) -> None:
        """Copy the blocks the worker staged (`_stage`) into their pool slots and record them in the table."""
        b, Hkv, D = self.block_size, self.ctx.num_kv_heads, self.ctx.head_dim
        bh, blocks = recall.bh, recall.blocks
        n = bh.numel()
        self._staging_copy[plan.parity] = self.store.load_staged(layer, plan.parity, bh, recall.slots, blocks, self._copy)
        self._staging_free[plan.parity].set()  # the next staging there waits for this copy's event
        element_size = self.store.host_k[layer].element_size()
        self._recalls[layer] += 1
        # the recalled blocks (K and V) go to the device, plus the destination rows and the table's row/slot/block
        # lists
        self._recall_bytes += 2 * n * b * D * element_size
        self._h2d_bytes += 2 * n * b * D * element_size + 4 * n * 8
        self._recall_blocks[layer] += int(n)
        if self.trace is not None:
            self.trace.append({"kind": "recall", "layer": layer, "step": plan.step,
                               "blocks": [(int(x) // Hkv, int(x) % Hkv, int(j)) for x, j in zip(bh, blocks, strict=False)]})

    # ------------------------------------------------------------------ statistics
    def _account(self, layer: int, plan: _Plan, result: _CpuResult) -> None:
        n_cpu, n_selected, _, n_resident = result.count_means
        self._ratio_sum[layer] += n_cpu * self.block_size / self.budget
        self._sel_sum[layer] += n_selected
        self._res_sum[layer] += n_resident
        self._ratio_n[layer] += 1
        self._cpu_ms += result.ms
        self._cpu_tasks += 1

    def stats(self) -> dict[str, Any]:
        if not hasattr(self, "_ratio_n"):
            return {}
        sparse = self.sparse_layers
        per_layer = [self._ratio_sum[i] / self._ratio_n[i] if i in sparse and self._ratio_n[i] else None
                     for i in range(self._L)]
        measured = [r for r in per_layer if r is not None]
        n_steps = sum(self._ratio_n)

        def mean_of(values: list[float]) -> float | None:
            return sum(values) / n_steps if n_steps else None

        block_bytes = 2 * self.block_size * self.ctx.head_dim * self.ctx.dtype.itemsize  # K and V of one block of one KV head
        return {
            "cpu_compute_ratio": {"mean": sum(measured) / len(measured) if measured else None,
                                  "per_layer": per_layer},
            "blocks_selected_per_head": mean_of(self._sel_sum),
            "blocks_resident_per_head": mean_of(self._res_sum),
            "k_sel": self.k_sel,
            "pool_slots": self.pool_slots,
            "attended_tokens_per_head": self._attended.stats(self.budget),
            # bytes: what the recalls copied (the staged blocks, K and V); recalled_bytes: the recalled blocks'
            "recall": {"issued": sum(self._recalls), "blocks": sum(self._recall_blocks),
                       "bytes": self._recall_bytes, "recalled_bytes": sum(self._recall_blocks) * block_bytes,
                       "per_layer": list(self._recalls),
                       "intervals": [self._intervals[i] if i in sparse else None for i in range(self._L)],
                       # where the intervals come from: the profile's file and what it measured (null: fixed)
                       "profile": None if self.recall_profile is None else
                       {"path": self.recall_profile, "measured_on": self._profile_measured_on}},
            "cpu_attention_ms": self._cpu_ms,
            "cpu_attention_ms_per_call": self._cpu_ms / self._cpu_tasks if self._cpu_tasks else None,
            "idle_ms": self._idle_ms,
            **transfer_stats(self._h2d_bytes, self._d2h_bytes, self._steps),
            "steps": self._steps,
            "device_kv_bytes": self._device_bytes(),
            "host_kv_bytes": self.store.host_bytes(),
        }

    def _device_bytes(self) -> int:
        dense = sum(t.numel() * t.element_size() for t in (*self.dense.keys, *self.dense.values))
        return dense + self.store.device_bytes()

    # ------------------------------------------------------------------ tracing (tests, profiling)
    def _log_event(self, kind: str, layer: int) -> None:
        if self.trace is not None:
            self.trace.append({"kind": kind, "layer": layer, "step": self.step.index,
                               "thread": threading.current_thread().name})

    def _trace_plan(self, plan: _Plan, split: _DeviceSplit, table: BlockTable) -> None:
        ids, valid, on_dev = (t.cpu() for t in split.trace)
        B, Hkv = valid.shape[:2]
        selected = [[{int(j) for j, ok in zip(ids[s, h], valid[s, h], strict=False) if ok} for h in range(Hkv)] for s in range(B)]
        device = [[{int(j) for j, ok in zip(ids[s, h], on_dev[s, h], strict=False) if ok} for h in range(Hkv)] for s in range(B)]
        pool_blocks = table.slot_block[..., : self.pool_slots].cpu()
        pool_use = split.pool_use.cpu()
        pool = [[{int(j) for j, used in zip(pool_blocks[s, h], pool_use[s, h], strict=True) if used}
                 for h in range(Hkv)] for s in range(B)]
        self.trace.append({"kind": "plan", "layer": plan.layer, "step": plan.step, "predicted": plan.predicted,
                           "selected": selected, "device": device, "pool": pool, "resident": table.resident_sets(),
                           "positions": list(self.step.positions_host)})


    # ------------------------------------------------------------------ work model (project, gate --counters)
    @classmethod
    def work_config(cls, config: dict[str, Any], budget: int | None, block_size: int | None) -> dict[str, Any]:
        """As every method's, and a result written before the pool was a setting ran a pool of one selection: its
        measured CPU share is that pool's, and so is the memory it is planned with."""
        return {"pool_factor": 1.0, **super().work_config(config, budget, block_size)}

    @classmethod
    def measure_work(cls, run: RunRecord) -> dict[str, float]:
        stats, config, m = run.stats, run.config, run.shape.model
        ratio = (stats.get("cpu_compute_ratio") or {}).get("mean") or 0.0
        recall = stats.get("recall") or {}
        steps = stats.get("steps") or run.steps or 1
        sparse = max(m.num_layers - run.dense_layers(), 1)
        rows = steps * run.shape.batch * m.num_kv_heads * sparse
        recalled_tokens = (recall.get("blocks") or 0) * config.get("block_size", 1) / rows
        attended = run.attended_budget_frac("mean")
        return {"cpu_budget_frac": float(ratio), "recall_budget_frac": recalled_tokens / config["budget"],
                "attended_budget_frac": 1.0 if attended is None else attended}

    @classmethod
    def sparse_layer_work(cls, fractions: dict[str, float], config: dict[str, Any], terms: LayerTerms) -> LayerWork:
        """Digests read to select; the device attends its share of the budget, the CPU the rest (its query and
        block ids go down, its partial state comes back, merged on the device), one layer ahead with PC; the
        periodic recall gathers blocks on the host and copies them off the critical path."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        kv = shape.kv_bytes_per_token
        budget, block_size = config["budget"], config["block_size"]
        cpu_tokens = fractions["cpu_budget_frac"] * min(budget, N)
        attended = min(fractions["attended_budget_frac"] * budget, N)  # both tiers
        digests = B * m.num_kv_heads * math.ceil(N / block_size) * 2 * m.head_dim * e
        indices = Transfer(B * m.num_kv_heads * math.ceil(cpu_tokens / block_size) * INDEX_BYTES, 0)  # rides with q
        recalled = fractions["recall_budget_frac"] * budget if config.get("pr", True) else 0.0
        recall_bytes = B * recalled * kv
        ahead = config.get("pc", True)
        return terms.layer(
            "layer_ahead" if ahead else "same_layer", predict_weight_bytes=terms.predict_weight_bytes if ahead else 0.0,
            select_bytes=digests, device_kv_bytes=B * (attended - cpu_tokens) * kv,
            device_tokens=B * m.num_kv_heads * (attended - cpu_tokens), host_kv_bytes=B * cpu_tokens * kv,
            cpu_tokens=B * m.num_kv_heads * cpu_tokens, merge_bytes=terms.merge_bytes,
            d2h=Transfer(terms.query_bytes, 1) + indices + terms.new_kv, h2d=terms.result_back,
            host_gather_bytes=recall_bytes, h2d_async=Transfer(recall_bytes, 2 if recall_bytes else 0))


def load_recall_profile(path: str) -> tuple[list[int | None], dict[str, Any] | None]:
    """Per-layer recall intervals from a `scoutbench profile-recall` JSON (`intervals`: one entry per layer,
    null for dense layers) and what they were measured on (`measured_on`; None in a profile that does not say)."""
    if not os.path.isfile(path):
        raise ValueError(f"recall_profile {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        intervals = data["intervals"]
        if not isinstance(intervals, list) or not all(i is None or (isinstance(i, int) and i >= 1)
                                                      for i in intervals):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"recall_profile {path!r} is not a profile-recall JSON with an 'intervals' list "
                         "of positive integers (null for dense layers)") from None
    return intervals, data.get("measured_on")
