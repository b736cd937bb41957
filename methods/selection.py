"""`BlockSelection`, the shared base of the block-selection methods (Quest; a sinks + recent-window toy is ten
lines on it, tests/methods/test_toy_method.py): a subclass supplies one hook, `select_blocks(layer, q)`, which complete
blocks each (sequence, selection row) attends this step; the base does everything else once.

What the base does: the device storage (FullKV's rows for every layer, rounded to whole blocks so that a row is a
table of blocks) and, where the method scores them (`keeps_digests`), the per-block digests of every sparse layer
(filled at prefill, a block at a time as decode completes one); the step's plan in `begin_step`, outside the captured
region (the candidates, i.e. the complete blocks before the tail; the tail block holding the newest token and its
tokens; the attended order; the attended lengths of a ragged batch, on the device and the host); the first
`dense_layers` layers, and every layer of a step whose context fits the budget, dense (FullKV); the append and the
attention over the selected blocks and the tail in a sparse layer (in place by block id on CPU, gathered into
contiguous rows on CUDA); the statistics (tokens attended per layer and per head); the memory footprint; and the work
model (digests read to select, the attended blocks' KV read on the device).

The budget counts the tail block: a sparse layer attends `page_budget - 1` selected complete blocks and the tail.
A selection row is a KV head, or a query head with `per_query_head` (a field where the method has it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from scoutbench.kernels.attention import StepLengths
from scoutbench.kernels.digest import CandidateBlocks, block_digests
from scoutbench.kernels.flashinfer_decode import PAGE_TOKENS
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    AttentionMethod,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
    require,
    sparse_layer_range,
)
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord
from scoutbench.runtime.digest_table import DigestTable
from scoutbench.runtime.selected_blocks import selected_blocks


@dataclass
class BlockSelection(AttentionMethod):
    """A block-selection method: its sparse layers attend the blocks `select_blocks` picks and the tail block."""

    # the shape-free fraction the work model measures: tokens attended per (sequence, KV head, sparse layer) / budget
    work_fractions: ClassVar[dict[str, float]] = {"attended_budget_frac": 1.0}
    # whether the method scores blocks by their digests (`self.digests`, kept for every sparse layer)
    keeps_digests: ClassVar[bool] = True
    per_query_head = False  # one selection row per query head instead of per KV head (a field where a method has it)

    budget: int = 2048  # tokens attended per (sequence, KV head) in a sparse layer, tail block included
    block_size: int = 32
    dense_layers: int = DEFAULT_DENSE_LAYERS  # the first layers stay dense (under 10% sparsity there, Quest §3.4)

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        require(self.budget >= self.block_size,
                f"budget ({self.budget}) must hold at least one block of block_size ({self.block_size}) tokens")
        require(self.dense_layers >= 0, f"dense_layers must be >= 0, got {self.dense_layers}")

    # ------------------------------------------------------------------ the hook
    def select_blocks(self, layer: int, q: torch.Tensor) -> None:
        """Write into `self.selection` `[B, rows, page_budget - 1]` (int64) the ids of the complete blocks that each
        (sequence, row) of sparse layer `layer` attends this step, for query q `[B, Hq, D]`: the first
        `self.candidates.count` `[B, 1]` entries of a row are used, each a distinct block below `self.tail_block`
        `[B]` (`self.candidates.blocked` `[B, 1, nB]` marks the others). Device work only (it is captured)."""
        raise NotImplementedError

    @property
    def page_budget(self) -> int:
        """Blocks attended per (sequence, KV head), the tail block included."""
        return self.budget // self.block_size

    # ------------------------------------------------------------------ storage
    def bind(self, ctx: MethodContext) -> None:
        # Storage rounded up to whole blocks, so that the cache is a blocked view (read in place on CPU; on CUDA a
        # block gather is one index_select over it), and to whole flashinfer pages (FullKV's rows, which the dense
        # layers read)
        unit = math.lcm(self.block_size, PAGE_TOKENS)
        rounded = math.ceil(ctx.max_len / unit) * unit
        super().bind(dataclasses.replace(ctx, max_len=rounded))
        self.kv = FullKV()  # every layer's rows; it runs the dense layers, and a step whose context fits the budget
        self.kv.bind(self.ctx)
        self.keys, self.values = self.kv.keys, self.kv.values
        batch, device, block, pages = ctx.batch, ctx.device, self.block_size, self.page_budget
        num_blocks = rounded // block
        self.sparse_layers = sparse_layer_range(self.name, self.dense_layers, ctx.num_layers)
        digest_layers = self.sparse_layers if self.keeps_digests else range(0)
        self.digests = DigestTable(digest_layers, (batch, ctx.num_kv_heads, num_blocks, ctx.head_dim), ctx.dtype,
                                   device)
        # the step's plan, written in place by begin_step (what every sparse layer and a captured graph read): the
        # candidates (complete blocks before the tail), the tail block and its tokens, the order that puts the tail
        # right after the valid selections, and the tokens attended
        rows = ctx.num_heads if self.per_query_head else ctx.num_kv_heads  # selection rows per sequence
        self.candidates = CandidateBlocks.static(batch, num_blocks, pages - 1, None, device)
        self.tail_block = torch.zeros(batch, dtype=torch.long, device=device)
        self._tail_len = torch.zeros(batch, dtype=torch.long, device=device)
        # [selection | tail]: the hook writes its ids into the front (`selection`), begin_step the tail at the end
        self._ids = torch.zeros((batch, rows, pages), dtype=torch.long, device=device)
        self.selection = self._ids[..., : pages - 1]
        self.top_out = (torch.empty((batch, rows, pages - 1), dtype=self.digests.score_dtype, device=device),
                        self.selection)  # (scores, ids) buffers of a top-k over the digests
        self._order = torch.zeros((batch, rows, pages), dtype=torch.long, device=device)
        self._page_slot = torch.arange(pages, device=device)
        self._attended_len = StepLengths(batch, pages * block, ctx.dtype, device, with_host=not ctx.graphs)
        # the selected blocks' attention: gathered into contiguous rows on CUDA, in place by block id on a CPU
        self._blocks = selected_blocks(self.ctx, self.keys, self.values, self.sparse_layers, rows, pages, block,
                                       num_blocks)
        self.reset_stats()

    def reset_stats(self) -> None:
        super().reset_stats()
        # sum over decode steps of the mean tokens attended per (sequence, KV head); on the device, no sync
        self._attended_sum = torch.zeros(self.ctx.num_layers, device=self.ctx.device)

    def ingest_prefill(self, layer, q_obs, k, v, lengths):
        self.kv.ingest_prefill(layer, q_obs, k, v, lengths)
        if layer in self.digests:
            # Blocks that reach into a sequence's right padding get a wrong digest here; they are never candidates
            # before decode completes them, and completing a block recomputes its digest (end_step).
            self.digests.write_blocks(layer, k, self.block_size)

    # ------------------------------------------------------------------ the step's plan (eager)
    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        self.kv.begin_step(step)
        block, pages = self.block_size, self.page_budget
        lengths = [p + 1 for p in step.positions_host]  # tokens per sequence once the new one is appended
        self._fits = max(math.ceil(n / block) for n in lengths) <= pages
        # on the device, from the device positions (a host list would cost a synchronising copy)
        torch.div(step.positions, block, rounding_mode="floor", out=self.tail_block)
        torch.sub(step.positions + 1, self.tail_block * block, out=self._tail_len)
        self.candidates.update(self.tail_block)  # the complete blocks before the tail
        count = self.candidates.count  # [B, 1]: valid selections
        self._ids[..., -1:].copy_(self.tail_block[:, None, None])
        # attended order: the valid selections, the tail (entry pages - 1 of [selection | tail]), then padding
        slot = self._page_slot[None, None, :]
        self._order.copy_(torch.where(slot < count[:, :, None], slot,
                                      torch.where(slot == count[:, :, None], pages - 1, slot - 1)))
        selected_len = count[:, 0] * block + self._tail_len
        # the same on the host, where a backend plans there (flashinfer)
        self._attended_len.update(selected_len, [min((n - 1) // block, pages - 1) * block + (n - 1) % block + 1
                                                 for n in lengths])
        # statistics: every sparse layer attends the same tokens in a step
        sparse = len(self.sparse_layers)
        mean_lengths = sum(lengths) / len(lengths)
        self._attended_sum[: self.dense_layers] += mean_lengths
        if self._fits:
            self._attended_sum[self.dense_layers:] += mean_lengths
            self.counters.attended.add_host(lengths, self.ctx.num_kv_heads, layers=sparse)
        else:
            self._attended_sum[self.dense_layers:] += selected_len.float().mean()
            self.counters.attended.add(self._attended_len.valid_len[:, None].expand(-1, self._ids.shape[1]),
                                       layers=sparse)
        # blocks that the new token completes: their digests are built once the step has appended it (end_step)
        if step.uniform:
            self._completed = [(slice(None), lengths[0] // block - 1)] if lengths[0] % block == 0 else []
        else:
            self._completed = [(slice(b, b + 1), n // block - 1) for b, n in enumerate(lengths) if n % block == 0]

    def graph_key(self) -> bool:
        """A context that fits the budget runs dense (FullKV's device work): its own variant."""
        return self._fits

    def block_cycle(self) -> int | None:
        """A block's digests are written when its last token arrives (a method that keeps none has no block work)."""
        return self.block_size if self.keeps_digests else None

    def block_events(self, positions: list[int]) -> tuple[str, ...]:
        done = self.keeps_digests and any((p + 1) % self.block_size == 0 for p in positions)
        return ("complete",) if done else ()

    def end_step(self) -> None:
        for layer in self.sparse_layers if self.keeps_digests else ():
            for rows, block in self._completed:
                start = block * self.block_size
                kmax, kmin = block_digests(self.keys[layer][rows, :, start: start + self.block_size], self.block_size)
                self.digests.write(layer, (rows, slice(None), slice(block, block + 1)), kmax, kmin)

    # ------------------------------------------------------------------ a layer (captured)
    def decode(self, layer, q, k, v):
        if layer < self.dense_layers or self._fits:
            return self.kv.decode(layer, q, k, v)
        keys, values = self.keys[layer], self.values[layer]
        self.kv.append(layer, k, v)
        block_ids = self._selected_blocks(layer, q)
        return self._blocks.attend(layer, q, keys, values, block_ids, self.ctx.scale, self._attended_len)

    def _selected_blocks(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Block ids `[B, rows, page_budget]` a sparse layer attends (after the append): the selected complete
        blocks in the hook's order, then the tail block, then padding."""
        self.select_blocks(layer, q)
        return self._ids.gather(-1, self._order)

    def select(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids `[B, rows, page_budget]`, valid tokens `[B, rows]`) of a sparse layer in this step: the
        selection and the tail block (`_selected_blocks`), and how many leading tokens of those blocks are valid."""
        block_ids = self._selected_blocks(layer, q)
        return block_ids, self._attended_len.valid_len[:, None].expand(block_ids.shape[:2])

    # ------------------------------------------------------------------ statistics and memory
    def stats(self) -> dict[str, Any]:
        attended = (self._attended_sum / max(self.counters.steps, 1)).tolist()
        return {**self.kv.stats(), "digest_bytes": self.digests.device_bytes(), "attended_tokens_per_layer": attended,
                "attended_tokens_per_head": self.counters.attended.stats(self.budget)}

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        sparse = len(sparse_layer_range(self.name, self.dense_layers, shape.num_layers)) if self.keeps_digests else 0
        digest_bytes_per_block = 2 * shape.num_kv_heads * shape.head_dim * elem_bytes
        device = (shape.num_layers * context_len * kv
                  + sparse * math.ceil(context_len / self.block_size) * digest_bytes_per_block)
        return Footprint(device, 0)

    # ------------------------------------------------------------------ work model (project, gate --counters)
    def measure_work(self, run: RunRecord) -> dict[str, float]:
        attended = run.sparse_layer_mean("attended_tokens_per_layer")
        return {"attended_budget_frac": 1.0 if attended is None else attended / self.budget}

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        """Every block digest read to select (where the method keeps them), then the selected blocks' KV attended on
        the device (per query head: each query head reads its own selection, G per KV head)."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        tokens = min(fractions["attended_budget_frac"] * self.budget, N)
        selections = m.num_heads // m.num_kv_heads if self.per_query_head else 1  # per KV head
        digests = B * m.num_kv_heads * math.ceil(N / self.block_size) * 2 * m.head_dim * e
        return terms.layer("none", select_bytes=digests if self.keeps_digests else 0,
                           device_kv_bytes=B * selections * tokens * shape.kv_bytes_per_token,
                           device_page_tokens=self.block_size,
                           device_tokens=B * m.num_kv_heads * selections * tokens)
