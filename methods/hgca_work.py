"""HGCA's model beside its runtime (methods/hgca.py): its memory at a shape and length, and its work model
(what `project` and `gate --counters` count), from its config alone (methods/declarations.py)."""

from __future__ import annotations

from typing import ClassVar

from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.methods.declarations import Footprint, MemoryPlan, ModelShape, WorkModel
from scoutbench.methods.work_model import FP32_BYTES, LayerTerms, LayerWork, RunRecord, Transfer


class HGCAWorkModel(MemoryPlan, WorkModel):
    """HGCA's memory plan and work model (a mixin of `HGCA`, whose fields and window arithmetic they read)."""

    # fraction policy: tokens the CPU attends per (sequence, query head) / host tokens
    work_fractions: ClassVar[dict[str, float]] = {"cpu_host_frac": 0.0}

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        dense, sparse = self.layer_split(shape)
        window = self.window_target(context_len)
        # the window's capacity: it may exceed its target by up to a migration block before it migrates
        device = (dense * page_aligned(context_len) * kv
                  + sparse * page_aligned(min(context_len, window + self.migrate_block)) * kv)
        # the host arena: K/V and fp32 moving averages of the host part, migration staging (the CPU attention reads
        # the host tier in place: no gather buffers)
        host = sparse * (context_len - window) * (kv + shape.num_heads * 4) + sparse * self.migrate_block * kv
        if self.tracks_selection:  # each layer's kept selection: token ids per KV head, averages per query head
            host += sparse * self.tracked_capacity() * (shape.num_kv_heads * 8 + shape.num_heads * 4)
        return Footprint(device, host)

    # ------------------------------------------------------------------ work model (project, gate --counters)
    def measure_work(self, run: RunRecord) -> dict[str, float]:
        pairs = run.sparse_layer_mean("cpu_tokens_per_layer")  # (query head, token) pairs of the whole batch
        host_tokens = run.stats.get("host_tokens_mean") or 0.0
        per_head = pairs / (run.shape.batch * run.shape.model.num_heads) if pairs is not None else 0.0
        return {"cpu_host_frac": per_head / host_tokens if host_tokens else 0.0}

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        """The device window, and the CPU's selected host tokens in the same layer, merged on the device; the CPU
        reads every query head's fp32 score average of every host token (`score_read="all"`) or, keeping its
        selection, of the selected tokens only."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        if self.budget is not None:  # window + CPU tokens = budget, one selection per KV head
            # the window grows a migration block past its target and drops back: half a block over it on average
            window = min(self.window_tokens + self.migrate_block / 2, N)
            host = N - window
            cpu_per_head = self.cpu_tokens(host, window, refresh=False)
            selection_heads = m.num_kv_heads
        else:  # fraction policy (budget=None): each query head selects its own
            window = self.window_target(N)
            host = N - window
            cpu_per_head = min(fractions["cpu_host_frac"] * host, host)
            selection_heads = m.num_heads
        # K and V of the selected tokens per selection row, and the fp32 score averages of every query head
        scored = cpu_per_head if self.tracks_selection else host
        host_bytes = B * selection_heads * cpu_per_head * 2 * m.head_dim * e + B * m.num_heads * scored * FP32_BYTES
        return terms.layer("same_layer", device_kv_bytes=B * window * shape.kv_bytes_per_token,
                           device_tokens=B * m.num_kv_heads * window, host_kv_bytes=host_bytes,
                           cpu_tokens=B * m.num_heads * cpu_per_head / (m.num_heads // m.num_kv_heads),
                           merge_bytes=terms.merge_bytes, d2h=Transfer(terms.query_bytes, 1) + terms.new_kv,
                           h2d=terms.result_back)
