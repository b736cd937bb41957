"""HGCA (arXiv 2507.03153): same-layer hybrid GPU-CPU attention over a recent window and offloaded older tokens.

What the seed says: the newest 25% of the tokens stay on the device with full attention there; the older 75% live
in host memory, where the CPU runs sparse attention over the tokens with the highest moving-average attention
weights; device and CPU run in parallel within the same layer and the two parts are merged exactly. The paper
leaves the rest open (and we found no public code); our choices, all fields:
- budget (default 2048, the default of every sparse baseline, so that they compare at one budget): every attended token
  counts, per (sequence, KV head): the window (the current token included) + the sinks + the CPU-selected host tokens =
  `budget`. The window keeps the most recent `window_tokens = round(budget * window_share)` tokens (between steps within
  [window_tokens, window_tokens + migrate_block); with the new token it reaches the upper end before a block migrates);
  the CPU attends the sinks plus the top `budget - window` host tokens per KV head, ranked by the moving average
  aggregated over the group's query heads by max (Quest's GQA convention: the score stays an upper bound for every head
  of the group, so a token that one head needs is not lost to the others), and reads the selected tokens of each KV head
  in place for the whole group (packed-GQA attention by token ids, no gather copy).
- `score_read` (budget policy): "all" ranks every host token's moving average each step, as written above;
  "selected" keeps the selection from step to step and reads only the selected tokens' averages, the same tokens
  (methods/hgca_selection.py says why), without the read of every host token's fp32 average per query head.
- `budget=None` keeps the original fraction policy below (the paper's behaviour):
- window: relative, `ceil(window_frac * n)` of a sequence's n tokens; it grows with decode and its oldest
  `migrate_block` tokens move to host memory whenever it exceeds the target by a whole block. Within a step the
  partition is fixed (host [0, split), window [split, n)); a migration of layer l starts after layer l's merge
  and the split moves at the end of the step, and no reader touches the moved tokens before their copy has
  landed (the worker that owns the host side waits for the copy event first).
- CPU sparsity: per query head, the top `ceil(cpu_topk_frac * N_host)` host tokens by moving average, plus the
  first `sink_tokens` tokens, always. `refresh_interval` > 0 makes every N-th step dense on the CPU, so that stale
  tokens can come back (fraction policy only: a dense step would break a budget).
  In both policies the CPU metric counts (query head, token) pairs.
- moving average: a <- ema_decay * a + (1 - ema_decay) * p, where p is the probability renormalised to the whole
  context, exp(logit - lse_merged) = p_cpu * exp(lse_cpu - lse_merged), for the computed tokens and 0 for the others. It
  starts, for prompt tokens on the host, as the mean attention of the last `observed_queries` prompt queries (their
  causal softmax over the prompt; 32, SnapKV's observation window: the engine observes 256, and all 256 made HGCA's
  prefill 8x the cost, 80 s of a 16-layer 32k run on 2 cores); a token that migrates to the host enters at its row's
  current maximum, so the CPU computes it at least once before the average judges it. The update, and the admission of
  migrated tokens, are deferred: they reach the worker only after the next sparse layer's CPU attention was submitted,
  so that attention never queues behind them; they run in the worker's slack while the device finishes that layer. Work
  of layer l itself is always submitted before layer l's next CPU attention, which reads it (with a single sparse layer
  the next sparse layer is l itself, so there it cannot be deferred past it), and a migration waits for the previous
  admission of its layer before reusing the staging buffer. One worker keeps them in order with the CPU attention that
  reads them (a second thread measured slower on a few cores: its intra-op threads compete with the attention's).
- layers below `dense_layers` keep full KV on the device: 2 by default, the one default of every sparse method, so that
  a comparison compares the same sparse layers (the paper says nothing of dense first layers; to treat layers 0 and 1
  like the others, HGCA being window + CPU, not query-aware: `dense_layers=0`, or `--dense-layers 0` for every method).

The decode step is graph-safe (methods/base.py, "CUDA graphs"): `begin_step` writes the step's window slots and
lengths in place, so a sparse layer's device work (the new token written at its slot, the window attention over the
whole window buffer with the step's lengths, the CPU part's results copied in and merged) reads only static buffers;
the hand-off to the worker, the wait for it and the migrations are host points (`ctx.host`). Whether the CPU attends
anything in a step is the graph variant. The statistics are the step's, once per step: every sparse layer attends
alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels.attention import (
    StepLengths,
    block_sparse_attention_probs,
    merge_output,
    partial_attention,
)
from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    MethodContext,
    StepInfo,
    require,
)
from scoutbench.methods.hgca_scores import observed_weights
from scoutbench.methods.hgca_selection import TrackedSelection
from scoutbench.methods.hgca_work import HGCAWorkModel
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.runtime.cpu_part import cpu_part
from scoutbench.runtime.offload import (
    CopyStream,
    CpuWorkerPool,
    HostArena,
    device_zeros,
)

SCORE_READS = ("all", "selected")


@dataclass
class HGCA(HGCAWorkModel, SparseLayerMethod):
    """Recent window on the device, older tokens on the host attended sparsely by the CPU in the same layer."""

    name = "hgca"
    display_name = "HGCA"
    budget: int | None = 2048  # tokens attended per (sequence, KV head): window + sinks + CPU-selected; None: fractions
    window_share: float = 0.5  # with a budget: share of it held by the device window
    window_frac: float = 0.25  # without a budget: share of each sequence's tokens kept on the device
    cpu_topk_frac: float = 0.1  # without a budget: kappa, share of the host tokens the CPU attends, per query head
    ema_decay: float = 0.9  # gamma of the moving-average attention weights
    sink_tokens: int = 4  # first tokens always attended on the CPU
    migrate_block: int = 32  # tokens moved from the window to the host at once
    refresh_interval: int = 0  # every N-th step the CPU attends every host token (0 = never)
    observed_queries: int = 32  # last prompt queries whose mean attention starts the moving average
    dense_layers: int = DEFAULT_DENSE_LAYERS  # as every sparse method: a comparison keeps the same layers dense
    # with a budget, the CPU's ranking: "all" reads every host token's average per query head each step, "selected"
    # keeps the selection and reads the selected tokens' (the same tokens: methods/hgca_selection.py); the fraction
    # policy (budget=None) reads all
    score_read: str = "selected"

    # the settings its defaults are chosen over (docs/methods.md, "One rule for every method's defaults")
    # the kept selection came after the LongBench table's runs began, which read every host token's average
    added_fields = {"score_read": "all"}
    settings_grid = {f"window {share:g}, {read} read": {"window_share": share, "score_read": read}
                     for share in (0.25, 0.5, 0.75) for read in SCORE_READS}
    paper_setting = ("window 0.25, all read", "the ScoutAttention paper's HGCA: 25% of the tokens in a GPU window, "
                     "75% on the CPU, selected by their moving-average scores")

    def __post_init__(self) -> None:
        require(0.0 < self.window_share < 1.0, f"window_share must be in (0, 1), got {self.window_share}")
        if self.budget is not None:
            # in a step the window holds up to a whole block over its target (with the new token) before migrating
            largest_window = self.window_tokens + self.migrate_block
            require(self.window_tokens >= 1 and self.budget >= largest_window + self.sink_tokens,
                    f"budget ({self.budget}) must hold the window at its largest (window_share x budget + "
                    f"migrate_block = {largest_window} tokens) and the {self.sink_tokens} sink tokens")
            require(self.refresh_interval == 0, "refresh_interval (dense CPU steps) exceeds a budget: set budget=none")
        require(0.0 < self.window_frac <= 1.0, f"window_frac must be in (0, 1], got {self.window_frac}")
        require(0.0 < self.cpu_topk_frac <= 1.0, f"cpu_topk_frac must be in (0, 1], got {self.cpu_topk_frac}")
        require(0.0 <= self.ema_decay < 1.0, f"ema_decay must be in [0, 1), got {self.ema_decay}")
        require(self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}")
        require(self.migrate_block >= 1, f"migrate_block must be >= 1, got {self.migrate_block}")
        require(self.refresh_interval >= 0, f"refresh_interval must be >= 0 (0 = never), got {self.refresh_interval}")
        self.check_dense_layers()
        require(self.observed_queries >= 1, f"observed_queries must be >= 1, got {self.observed_queries}")
        require(self.score_read in SCORE_READS, f"score_read must be one of {', '.join(SCORE_READS)}, got "
                f"{self.score_read!r}")

    @property
    def window_tokens(self) -> int:
        """With a budget: the recent tokens the device window holds at least (once the sequence has them)."""
        return round(self.budget * self.window_share) if self.budget is not None else 0

    def window_target(self, num_tokens: int) -> int:
        """Tokens of a sequence of `num_tokens` that stay on the device (it migrates a block when it exceeds this)."""
        if self.budget is not None:
            return min(num_tokens, self.window_tokens)
        return math.ceil(self.window_frac * num_tokens)

    def cpu_tokens(self, host_tokens: int, window_tokens: int, refresh: bool) -> int:
        """Host tokens the CPU attends per selection row, sinks included: what the budget leaves after the window,
        or the fraction policy's sinks + ceil(cpu_topk_frac * host)."""
        if self.budget is not None:
            return max(0, min(host_tokens, self.budget - window_tokens))
        if refresh:
            return host_tokens
        return min(host_tokens, min(self.sink_tokens, host_tokens) + math.ceil(self.cpu_topk_frac * host_tokens))

    # ------------------------------------------------------------------ setup
    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        batch, kv_heads, head_dim = ctx.batch, ctx.num_kv_heads, ctx.head_dim
        # the window never exceeds its target by a whole block (it migrates then)
        # in whole flashinfer pages (16 tokens): its pages tile a row of the window
        self.window_capacity = page_aligned(min(ctx.max_len, self.window_target(ctx.max_len) + self.migrate_block))
        window_shape = (batch, kv_heads, self.window_capacity, head_dim)
        # the host holds tokens [0, split): split = n - window <= max_len - window_target(max_len) (the window never
        # falls below its target, and n - window_target(n) grows with n)
        self.host_capacity = ctx.max_len - self.window_target(ctx.max_len)
        host_shape = (batch, kv_heads, self.host_capacity, head_dim)
        staging_shape = (batch, kv_heads, self.migrate_block, head_dim)
        # host tier, moving averages (fp32) and migration staging: one exact-size arena, pinned on CUDA
        # (memory_footprint counts the same bytes); zeroed: masked slots of a ragged batch are read, and a masked NaN
        # still poisons attention
        specs = {}
        for i in self.sparse_layers:
            specs |= {("k", i): (host_shape, ctx.dtype), ("v", i): (host_shape, ctx.dtype),
                      ("ema", i): ((batch, ctx.num_heads, self.host_capacity), torch.float32),
                      ("stage_k", i): (staging_shape, ctx.dtype), ("stage_v", i): (staging_shape, ctx.dtype)}
            if self.tracks_selection:  # the kept selection: token ids per KV head, averages per query head
                specs |= {("sel_ids", i): ((batch, kv_heads, self.tracked_capacity()), torch.long),
                          ("sel_scores", i): ((batch, ctx.num_heads, self.tracked_capacity()), torch.float32)}
        self.host_arena = HostArena(specs, ctx.device)
        arena = self.host_arena
        window = device_zeros({(kind, i): (window_shape, ctx.dtype) for kind in "kv" for i in self.sparse_layers},
                              ctx.device)
        self.window_k, self.window_v, self.host_k, self.host_v, self.ema, self._staging = {}, {}, {}, {}, {}, {}
        for i in self.sparse_layers:
            self.window_k[i], self.window_v[i] = window["k", i], window["v", i]
            self.host_k[i], self.host_v[i], self.ema[i] = arena["k", i], arena["v", i], arena["ema", i]
            self._staging[i] = (arena["stage_k", i], arena["stage_v", i])
        self._shift_scratch = torch.empty(window_shape[1:], dtype=ctx.dtype, device=ctx.device)
        # the step's plan (begin_step), in place: each sequence's window slot of its new token, the window's valid
        # lengths (and the torch path's mask) for every layer's window attention
        self._batch_index = torch.arange(batch, device=ctx.device)
        self._window_slots = torch.zeros(batch, dtype=torch.long, device=ctx.device)
        self._window_lengths = StepLengths(batch, self.window_capacity, ctx.dtype, ctx.device,
                                           with_host=not ctx.graphs)
        # the CPU part per layer: q (and the device LSE, for the moving average) to the host, its output and LSE
        # back; the worker refills a layer's result buffer only once the previous step's copy from it has run
        # (`_results_read`)
        self.cpu_part = cpu_part(self.sparse_layers, batch, ctx.num_heads, head_dim, ctx.dtype, ctx.device,
                                 with_lse=True)
        self._results_read: dict[int, Any] = {}
        self._futures: dict[int, Future] = {}
        self._selections: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.copy = CopyStream(ctx.device)
        # on a CPU-only run one intra-op thread: HGCA's host part runs beside the main thread's window attention
        # and merge; with torch's 2 threads its steps were slower (bench-attn16 16k, docs/platform.md)
        self.pool = CpuWorkerPool(1, device=ctx.device, cpu_run_threads=1)
        # per layer: moving-average updates and admissions of migrated tokens, held back until the next CPU
        # attention is queued, and the future of the last one submitted (a migration waits for it)
        self._deferred: list[tuple[int, Callable[..., None], tuple[Any, ...]]] = []
        self._host_writes: dict[int, Future] = {}
        self.split: list[int] = [0] * batch  # per sequence: tokens [0, split) on the host, the rest in the window
        self._split_device = torch.zeros(batch, dtype=torch.long, device=ctx.device)  # kept in step with `split`
        # score_read="selected": each sparse layer's selection, kept by the worker from step to step
        self._tracked = {i: TrackedSelection(arena["sel_ids", i], arena["sel_scores", i], self.sink_tokens)
                         for i in self.sparse_layers} if self.tracks_selection else {}
        self.reset_stats()

    @property
    def tracks_selection(self) -> bool:
        """Whether the CPU keeps its selection (`score_read="selected"`, budget policy: the fraction policy's per-head
        share of a growing host ranks every host token each step)."""
        return self.score_read == "selected" and self.budget is not None

    def tracked_capacity(self) -> int:
        """Entries of a kept selection per (sequence, KV head): the most the CPU takes (the budget less the window
        with its new token) and a migrated block admitted before the next step drops its lowest."""
        return self.budget - self.window_tokens + self.migrate_block

    def reset_stats(self) -> None:
        self.drain()  # the workers add to the timers: let them finish first
        super().reset_stats()
        # (query head, token) pairs of every sparse layer (each attends alike in a step: counted once per step)
        self._cpu_pairs = self._device_pairs = 0
        self._cpu_ms = self._ema_ms = self._wait_ms = 0.0

    def drain(self) -> None:
        """Run the deferred host updates and wait for the worker (the host side is then consistent)."""
        self._submit_deferred()
        self.pool.submit(lambda: None).result()

    def _submit_deferred(self, layer: int | None = None) -> None:
        """Hand the deferred host updates to the worker: those of `layer` only, or all of them."""
        kept = []
        for owner, fn, args in self._deferred:
            if layer is None or owner == layer:
                self._host_writes[owner] = self.pool.submit(fn, *args)
            else:
                kept.append((owner, fn, args))
        self._deferred = kept

    def ingest_sparse_prefill(self, layer, q_obs, k, v, lengths):
        lengths_host = [int(n) for n in lengths.tolist()]
        self.split = [n - self.window_target(n) for n in lengths_host]
        self._split_device = torch.tensor(self.split, device=self.ctx.device)
        for b, (n, split) in enumerate(zip(lengths_host, self.split, strict=True)):
            for host, window, source in ((self.host_k, self.window_k, k), (self.host_v, self.window_v, v)):
                # one copy per KV head: a head's first `split` rows are contiguous in the host tier, a sequence's
                # are not (rows of `host_capacity` per head), and torch stages a copy into a strided host view
                # through a fresh pageable buffer and a CPU copy (~190 ms per 132 MB at the paper's shape)
                for head in range(source.shape[1]):
                    host[layer][b, head, :split].copy_(source[b, head, :split])
                window[layer][b, :, : n - split].copy_(source[b, :, split:n])
        observed_weights(q_obs[:, :, -self.observed_queries:], k, lengths, self.ctx.scale, out=self.ema[layer])

    # ------------------------------------------------------------------ decode
    def begin_step(self, step: StepInfo) -> None:
        """The step's plan: the window slots and lengths on the device (in place, read by every layer's captured
        work), what the CPU attends and which sequences migrate (host), and the step's statistics, equal for every
        sparse layer."""
        super().begin_step(step)
        lengths = [p + 1 for p in step.positions_host]
        self.window_len = [n - s for n, s in zip(lengths, self.split, strict=True)]
        torch.sub(step.positions, self._split_device, out=self._window_slots)  # device arithmetic: no copy
        self._window_lengths.update(self._window_slots + 1, self.window_len)
        refresh = self.refresh_interval > 0 and step.index % self.refresh_interval == self.refresh_interval - 1
        self.cpu_take = [self.cpu_tokens(host, window, refresh)
                         for host, window in zip(self.split, self.window_len, strict=True)]
        self._cpu_active = max(self.cpu_take) > 0
        self._migrating = [b for b, (n, w) in enumerate(zip(lengths, self.window_len, strict=True))
                           if w - self.window_target(n) >= self.migrate_block]
        ctx, layers, counters = self.ctx, len(self.sparse_layers), self.counters
        self._cpu_pairs += layers * ctx.num_heads * sum(self.cpu_take)
        self._device_pairs += layers * ctx.num_heads * sum(self.window_len)
        counters.attended.add_host([w + c for w, c in zip(self.window_len, self.cpu_take, strict=True)],
                                   ctx.num_kv_heads, layers)
        if self._cpu_active:  # per layer: q and the device LSE to the host, the CPU part's output and LSE back
            counters.d2h_bytes += layers * ctx.batch * ctx.num_heads * (ctx.head_dim * ctx.dtype.itemsize + 4)
            counters.h2d_bytes += layers * ctx.batch * ctx.num_heads * (ctx.head_dim + 1) * 4
        counters.d2h_bytes += layers * len(self._migrating) * self.migrate_block * ctx.kv_bytes_per_token()

    def graph_key(self) -> bool:
        """Whether the CPU attends anything this step (its hand-off, wait and merge are device work too)."""
        return self._cpu_active

    def block_cycle(self) -> int | None:
        """With a budget the window migrates a block every `migrate_block` steps; the fraction policy's window
        grows with the context, so its migrations come every migrate_block / (1 - window_frac) steps, rounded."""
        if self.budget is None and self.window_frac == 1.0:  # nothing ever migrates
            return None
        return self.migrate_block if self.budget is not None else round(self.migrate_block / (1 - self.window_frac))

    def block_events(self, positions: list[int]) -> tuple[str, ...]:
        due = any(p + 1 - split - self.window_target(p + 1) >= self.migrate_block
                  for p, split in zip(positions, self.split, strict=True))
        return ("migrate",) if due and self.sparse_layers else ()

    def decode_sparse(self, layer, q, k, v):
        """The window attention and the merge are device work on static buffers (the new token at its device
        slot, the window's lengths of the step); the CPU part's hand-off, wait and the migrations are host work
        (`ctx.host`)."""
        ctx = self.ctx
        window_k, window_v = self.window_k[layer], self.window_v[layer]
        window_k[self._batch_index, :, self._window_slots] = k
        window_v[self._batch_index, :, self._window_slots] = v
        if self._cpu_active:
            self.cpu_part.send(layer, q)
            ctx.host(self._submit_cpu_attention, layer, q)
        device_part = partial_attention(q, window_k, window_v, ctx.scale, lengths=self._window_lengths)
        if not self._cpu_active:  # nothing on the host yet (or window_frac = 1)
            ctx.host(self._finish_layer, layer, None)
            return device_part.o.to(q.dtype)
        with ctx.timer.stage("idle"):
            ctx.host(self._wait_cpu_attention, layer)
        with ctx.timer.stage("merge"):  # one captured piece: the CPU part's results to the device, and the merge
            self.cpu_part.copy_in(layer)
            out = merge_output(device_part, self.cpu_part.result(layer), q.dtype)
            self.cpu_part.send_lse(layer, device_part.lse)  # the device LSE to the moving-average update
        ctx.host(self._finish_layer, layer, device_part.lse)
        return out

    def _submit_cpu_attention(self, layer: int, q: torch.Tensor) -> None:
        """Host work: this layer's deferred updates (its CPU attention reads them), its CPU attention, then the
        other layers' deferred updates (behind it, ahead of the next one)."""
        self._submit_deferred(layer)
        q_host, q_ready = self.cpu_part.query(layer, q)
        self._futures[layer] = self.pool.submit(self._cpu_attention, layer, q_host, q_ready, list(self.split),
                                                list(self.cpu_take), self._results_read.get(layer))
        self._submit_deferred()

    def _wait_cpu_attention(self, layer: int) -> None:
        """Host work: wait for the layer's CPU part (its output is in the layer's buffer, its selection kept for the
        moving-average update)."""
        start = time.perf_counter()
        self._selections[layer] = self._futures.pop(layer).result()
        self._wait_ms += (time.perf_counter() - start) * 1e3

    def _finish_layer(self, layer: int, lse_device: torch.Tensor | None) -> None:
        """Host work after the layer's merge: the moving-average update of its CPU part (deferred), or without one
        the deferred updates of every layer (no CPU attention to queue them behind), and the migrations due this
        step."""
        if lse_device is None:
            self._submit_deferred()
        else:
            ready = self.cpu_part.read_event()  # after the copies from the result buffer and of the device LSE
            self._results_read[layer] = ready
            lse_device = self.cpu_part.lse(layer, lse_device)
            ids, probs, lse_cpu = self._selections.pop(layer)
            self._deferred.append((layer, self._update_ema,
                                   (layer, max(self.split), ids, probs, lse_cpu, lse_device, ready)))
        for b in self._migrating:
            self._migrate(layer, b)

    def cpu_select(self, layer: int, split: list[int], take: list[int]) -> torch.Tensor:
        """Host tokens the CPU attends: ids `[B, H, max(take)]`, the first `take[b]` of row b valid: the sinks and
        the top tokens by moving average. With a budget H = Hkv (the group's averages aggregated by max), else H = Hq."""
        span = max(split)
        position = torch.arange(span)
        host_tokens = torch.tensor(split)[:, None, None]
        scores = self.ema[layer][:, :, :span]
        if self.budget is not None:
            batch, num_heads, _ = scores.shape
            scores = scores.view(batch, self.ctx.num_kv_heads, num_heads // self.ctx.num_kv_heads, span).amax(dim=2)
        scores = scores.masked_fill(position >= host_tokens, float("-inf"))
        scores.masked_fill_(position < host_tokens.clamp(max=self.sink_tokens), float("inf"))
        # ordered only when the rows keep different counts (a third faster unordered, measured at 24k tokens)
        return scores.topk(max(take), dim=-1, sorted=min(take) != max(take)).indices

    def _select(self, layer: int, split: list[int], take: list[int]) -> torch.Tensor:
        """Worker thread: this step's CPU selection (`cpu_select`), or with score_read="selected" the kept one (its
        first step: `cpu_select`'s)."""
        tracked = self._tracked.get(layer)
        if tracked is not None and tracked.started:
            return tracked.select(split, take)
        ids = self.cpu_select(layer, split, take)
        if tracked is not None:
            tracked.start(ids, self.ema[layer], split, take)
        return ids

    def _cpu_attention(self, layer: int, q: torch.Tensor, q_ready: Any, split: list[int], take: list[int],
                       results_read: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Worker thread: sparse attention of every query head over its selection's host tokens, read in place by
        token id (per KV head with a budget, the group's query heads packed against it; else one row per query
        head), into the layer's result buffer, once `results_read` (the previous copy from it) has run. Returns
        (ids, probs, the LSE for the moving average: its own tensor, which no later step overwrites)."""
        q_ready.synchronize()
        start = time.perf_counter()
        ids = self._select(layer, split, take)
        valid = None if min(take) == ids.shape[-1] else torch.tensor(take)
        # the host tier [B, Hkv, N, D] as blocks of one token: [B, Hkv, N, 1, D]
        state, probs = block_sparse_attention_probs(q, self.host_k[layer].unsqueeze(3), self.host_v[layer].unsqueeze(3),
                                                    ids, self.ctx.scale, valid)
        if results_read is not None:
            results_read.synchronize()
        self.cpu_part.hand_over(layer, state)
        self._cpu_ms += (time.perf_counter() - start) * 1e3
        return ids, probs, state.lse

    def _update_ema(self, layer: int, span: int, ids: torch.Tensor, probs: torch.Tensor, lse_cpu: torch.Tensor,
                    lse_device: torch.Tensor, ready: Any) -> None:
        """Worker thread, deferred past the next CPU attention: a <- gamma a + (1 - gamma) p over the host tokens (p = 0 if not computed)."""
        ready.synchronize()
        start = time.perf_counter()
        cpu_share = torch.exp(lse_cpu - torch.logaddexp(lse_cpu, lse_device))  # [B, Hq]: CPU part of the mass
        if layer in self._tracked:
            self._tracked[layer].update(probs, cpu_share * (1.0 - self.ema_decay), self.ema_decay)
            self._ema_ms += (time.perf_counter() - start) * 1e3
            return
        ema = self.ema[layer][:, :, :span]
        ema.mul_(self.ema_decay)
        if ids.shape[1] != ema.shape[1]:  # one selection per KV head: each of the group's query heads read it
            ids = ids.repeat_interleave(ema.shape[1] // ids.shape[1], dim=1)
        ema.scatter_add_(2, ids, probs * (cpu_share * (1.0 - self.ema_decay))[..., None])
        self._ema_ms += (time.perf_counter() - start) * 1e3

    def _migrate(self, layer: int, b: int) -> None:
        """Move the oldest `migrate_block` window tokens of sequence b to the host (the split moves at end_step)."""
        block, length = self.migrate_block, self.window_len[b]
        last_write = self._host_writes.pop(layer, None)
        if last_write is not None:  # the previous admission of this layer still reads the staging buffer
            last_write.result()
        for window, staging in zip((self.window_k[layer], self.window_v[layer]), self._staging[layer], strict=True):
            copied = self.copy.copy(staging[b], window[b, :, :block])
            copied.wait()  # the compute stream shifts the window only after the copy has read it
            scratch = self._shift_scratch[:, : length - block]
            scratch.copy_(window[b, :, block:length])
            window[b, :, : length - block].copy_(scratch)
        self._deferred.append((layer, self._admit, (layer, b, self.split[b], copied)))

    def _admit(self, layer: int, b: int, start: int, copied: Any) -> None:
        """Worker thread, deferred like the moving average: the migrated tokens join the host cache, their moving average at the row's maximum."""
        copied.synchronize()
        stop = start + self.migrate_block
        self.host_k[layer][b, :, start:stop].copy_(self._staging[layer][0][b])
        self.host_v[layer][b, :, start:stop].copy_(self._staging[layer][1][b])
        if layer in self._tracked:
            self._tracked[layer].admit(b, start, self.migrate_block)
            return
        ema = self.ema[layer][b]
        ema[:, start:stop] = ema[:, :start].amax(dim=-1, keepdim=True) if start else 1.0

    def end_step(self) -> None:
        for b in self._migrating:
            self.split[b] += self.migrate_block
            self._split_device[b] += self.migrate_block

    def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
            self._deferred.clear()  # its bound methods hold this method: no reference cycle outlives the run
            self._host_writes.clear()
            self._futures.clear()
            self._selections.clear()
        if self.host_arena is not None:
            self.host_arena.release()

    # ------------------------------------------------------------------ accounting (memory, work: HGCAWorkModel)
    def stats(self):
        steps = max(self.counters.steps, 1)
        cpu, device = self._cpu_pairs, self._device_pairs
        per_layer = cpu / max(len(self.sparse_layers), 1) / steps  # (query head, token) pairs, whole batch
        return {
            "cpu_tokens_per_layer": [per_layer if i in self.sparse_layers else 0.0 for i in range(self.ctx.num_layers)],
            "cpu_pair_fraction": cpu / max(cpu + device, 1),
            "cpu_attention_ms_per_step": self._cpu_ms / steps,
            "ema_update_ms_per_step": self._ema_ms / steps,
            "wait_ms_per_step": self._wait_ms / steps,
            "window_tokens_mean": sum(self.window_len) / len(self.window_len) if self.counters.steps else 0.0,
            "host_tokens_mean": sum(self.split) / len(self.split),
            "attended_tokens_per_head": self.counters.attended.stats(self.budget),
            **self.counters.transfer(),
        }

