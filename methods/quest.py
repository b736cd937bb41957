"""Quest (ICML 2024): query-aware block-sparse decode attention with every token on the device.

It is ScoutAttention's accuracy reference: the same digests and the same selection, without offloading. We follow the
official kernel path (mit-han-lab/Quest, `quest/`): the budget counts the tail block, the top `budget // block_size - 1`
complete blocks by the digest upper bound of the true query are attended together with the tail block (the possibly
partial block holding the newest token), and a layer whose context fits in the budget runs dense. GQA (the official
kernel is MHA-only): one selection per KV head, the group's query heads aggregated by max, which keeps the score an
upper bound for every head of the group. Deviation from the official HF evaluation path, on purpose: no 3-block floor
and a forced tail, as in the kernels the paper times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels.attention import block_sparse_attention, decode_attention
from scoutbench.kernels.backends import PAGE_TOKENS
from scoutbench.kernels.digest import CandidateBlocks, DigestTable, block_digests
from scoutbench.kernels.gather import gather_blocks, write_tokens
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
    require,
    sparse_layer_range,
)
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord


@dataclass
class Quest(FullKV):
    """FullKV's device cache plus block digests; sparse layers attend only the selected blocks and the tail."""

    name = "quest"
    display_name = "Quest"
    reference = False
    work_fractions = {"attended_budget_frac": 1.0}  # tokens attended per (sequence, KV head, sparse layer) / budget
    budget: int = 2048  # tokens attended per (sequence, KV head) in a sparse layer, tail block included
    block_size: int = 32
    dense_layers: int = DEFAULT_DENSE_LAYERS  # the first layers stay dense (under 10% sparsity there, Quest §3.4)

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        require(self.budget >= self.block_size,
                f"budget ({self.budget}) must hold at least one block of block_size ({self.block_size}) tokens")
        require(self.dense_layers >= 0, f"dense_layers must be >= 0, got {self.dense_layers}")

    @property
    def page_budget(self) -> int:
        """Blocks attended per (sequence, KV head), the tail block included."""
        return self.budget // self.block_size

    def bind(self, ctx: MethodContext) -> None:
        # Storage rounded up to whole blocks, so that the cache is a blocked view (read in place on CPU; on CUDA a
        # block gather is one index_select over it), and to whole flashinfer pages (FullKV's rows, which the dense
        # layers read)
        unit = math.lcm(self.block_size, PAGE_TOKENS)
        rounded = math.ceil(ctx.max_len / unit) * unit
        super().bind(dataclasses.replace(ctx, max_len=rounded))
        digest_shape = (ctx.batch, ctx.num_kv_heads, rounded // self.block_size, ctx.head_dim)
        self.digests = DigestTable(sparse_layer_range(self.name, self.dense_layers, ctx.num_layers), digest_shape,
                                   ctx.dtype, ctx.device)
        self._gathered_k = self._gathered_v = None  # CUDA: flashinfer attends a contiguous gather of the selection
        if ctx.device.type == "cuda":
            gather_shape = (ctx.batch, ctx.num_kv_heads, self.page_budget * self.block_size, ctx.head_dim)
            self._gathered_k = torch.empty(gather_shape, dtype=ctx.dtype, device=ctx.device)
            self._gathered_v = torch.empty(gather_shape, dtype=ctx.dtype, device=ctx.device)
        self.reset_stats()

    def reset_stats(self) -> None:
        super().reset_stats()
        # sum over decode steps of the mean tokens attended per (sequence, KV head); on the device, no sync
        self._attended_sum = torch.zeros(self.ctx.num_layers, device=self.ctx.device)
        self._steps = 0

    def ingest_prefill(self, layer, q_obs, k, v, lengths):
        super().ingest_prefill(layer, q_obs, k, v, lengths)
        if layer in self.digests:
            # Blocks that reach into a sequence's right padding get a wrong digest here; they are never candidates
            # before decode completes them, and completing a block recomputes its digest (_update_digests).
            self.digests.write_blocks(layer, k, self.block_size)

    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        block = self.block_size
        lengths = [p + 1 for p in step.positions_host]  # tokens per sequence once the new one is appended
        tail_block = [(n - 1) // block for n in lengths]  # = complete blocks before the tail: the candidates
        self._max_candidates = max(tail_block)
        self._fits = max(math.ceil(n / block) for n in lengths) <= self.page_budget
        # the same on the device, from the device positions (a host list would cost a synchronising copy)
        self._tail_block = torch.div(step.positions, block, rounding_mode="floor")
        self._tail_len = step.positions + 1 - self._tail_block * block
        # select()'s valid_len on the host (flashinfer plans from it): min(tail, pages - 1) selected blocks + the tail
        self._selected_len_host = [min((n - 1) // block, self.page_budget - 1) * block + (n - 1) % block + 1
                                   for n in lengths]
        # blocks that the new token completes: their digests are built after the append
        if step.uniform:
            self._completed = [(slice(None), lengths[0] // block - 1)] if lengths[0] % block == 0 else []
        else:
            self._completed = [(slice(b, b + 1), n // block - 1) for b, n in enumerate(lengths) if n % block == 0]
        self._attended_step = sum(lengths) / len(lengths)
        self._lengths = lengths
        self._steps += 1

    def _count_attended(self, step: StepInfo) -> None:
        """Counted per sparse layer in decode (the dense layers are not what the budget bounds)."""

    def decode(self, layer, q, k, v):
        if layer < self.dense_layers or self._fits:
            out = super().decode(layer, q, k, v)
            self._attended_sum[layer] += self._attended_step
            if layer >= self.dense_layers:
                self._attended.add_host(self._lengths, self.ctx.num_kv_heads)  # the context fits the budget
                with self.ctx.timer.stage("attn_device"):
                    self._update_digests(layer)
            return out
        step, keys, values = self.step, self.keys[layer], self.values[layer]
        with self.ctx.timer.stage("attn_device"):
            write_tokens(keys, k, step.positions, step.positions_host)
            write_tokens(values, v, step.positions, step.positions_host)
            self._update_digests(layer)
            block_ids, valid_len = self.select(layer, q)
            self._attended_sum[layer] += valid_len.float().mean()
            self._attended.add(valid_len)
            if self._gathered_k is None:  # CPU: the selected blocks attended in place
                batch, kv_heads, num_tokens, head_dim = keys.shape
                blocked = (batch, kv_heads, num_tokens // self.block_size, self.block_size, head_dim)
                return block_sparse_attention(q, keys.view(blocked), values.view(blocked), block_ids, self.ctx.scale,
                                              valid_len).o.to(q.dtype)
            gather_blocks(keys, block_ids, self.block_size, self._gathered_k)
            gather_blocks(values, block_ids, self.block_size, self._gathered_v)
            return decode_attention(q, self._gathered_k, self._gathered_v, self.ctx.scale, valid_len,
                                    self._selected_len_host)

    def select(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks a sparse layer attends in this step (after the append), per (sequence, KV head).

        Returns (block_ids `[B, Hkv, page_budget]`, valid_len `[B, Hkv]` in tokens): the selected complete blocks
        in descending score order, then the tail block, then padding; valid_len counts the selected blocks' tokens
        plus the tail's, so the valid tokens of a gather of these blocks come first.
        """
        pages = self.page_budget
        candidates = self._max_candidates
        selectable = CandidateBlocks.build(candidates, self._tail_block, pages - 1, None, q.device)
        ids, _ = self.digests.select(layer, q, selectable)
        count = selectable.count.expand(ids.shape[:2])
        block_ids = torch.nn.functional.pad(ids, (0, pages - ids.shape[-1]))
        slot = torch.arange(pages, device=q.device)
        block_ids = torch.where(slot == count[..., None], self._tail_block[:, None, None], block_ids)
        return block_ids, count * self.block_size + self._tail_len[:, None]

    def _update_digests(self, layer: int) -> None:
        for rows, block in self._completed:
            start = block * self.block_size
            kmax, kmin = block_digests(self.keys[layer][rows, :, start: start + self.block_size], self.block_size)
            self._store_digests(layer, rows, slice(block, block + 1), kmax, kmin)

    def _store_digests(self, layer: int, rows: slice, blocks: slice, kmax: torch.Tensor, kmin: torch.Tensor) -> None:
        self.digests.write(layer, (rows, slice(None), blocks), kmax, kmin)

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        sparse = len(sparse_layer_range(self.name, self.dense_layers, shape.num_layers))
        digest_bytes_per_block = 2 * shape.num_kv_heads * shape.head_dim * elem_bytes
        device = (shape.num_layers * context_len * kv
                  + sparse * math.ceil(context_len / self.block_size) * digest_bytes_per_block)
        return Footprint(device, 0)

    def stats(self):
        digest_bytes = self.digests.device_bytes()
        attended = (self._attended_sum / max(self._steps, 1)).tolist()
        return {**super().stats(), "digest_bytes": digest_bytes, "attended_tokens_per_layer": attended,
                "attended_tokens_per_head": self._attended.stats(self.budget)}

    # ------------------------------------------------------------------ work model (project, gate --counters)
    @classmethod
    def work_dense_layers(cls, config: dict[str, Any], num_layers: int) -> int:
        return sparse_layer_range(cls.name, int(config.get("dense_layers", 0)), num_layers).start

    @classmethod
    def measure_work(cls, run: RunRecord) -> dict[str, float]:
        attended = run.sparse_layer_mean("attended_tokens_per_layer")
        return {"attended_budget_frac": 1.0 if attended is None else attended / run.config["budget"]}

    @classmethod
    def sparse_layer_work(cls, fractions: dict[str, float], config: dict[str, Any], terms: LayerTerms) -> LayerWork:
        """Every block digest read to select, then the selected blocks' KV attended on the device."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        tokens = min(fractions["attended_budget_frac"] * config["budget"], N)
        digests = B * m.num_kv_heads * math.ceil(N / config["block_size"]) * 2 * m.head_dim * e
        return terms.layer("none", select_bytes=digests, device_kv_bytes=B * tokens * shape.kv_bytes_per_token,
                           device_tokens=B * m.num_kv_heads * tokens)
