"""ScoutAttention's work model (`project`, `gate --counters`; methods/work_model.py has the vocabulary): what one
sparse layer of methods/scout.py reads, attends, copies and computes per decode step, from the shape-free
fractions a measured run gives."""

from __future__ import annotations

import math
from typing import ClassVar

from scoutbench.methods.declarations import WorkModel
from scoutbench.methods.work_model import INDEX_BYTES, LayerTerms, LayerWork, RunRecord, Transfer


class ScoutWorkModel(WorkModel):
    """The work model half of `ScoutAttention` (a mixin ahead of its method base, reading its fields)."""

    work_fractions: ClassVar[dict[str, float]] = {
        "cpu_budget_frac": 0.0,  # share of the budget attended on the CPU
        "recall_budget_frac": 0.0,  # tokens recalled per (sequence, KV head, sparse layer, step) / budget
        "attended_budget_frac": 1.0,  # tokens attended per (sequence, KV head, sparse layer), both tiers / budget
    }

    def measure_work(self, run: RunRecord) -> dict[str, float]:
        stats, m = run.stats, run.shape.model
        ratio = (stats.get("cpu_compute_ratio") or {}).get("mean") or 0.0
        recall = stats.get("recall") or {}
        steps = stats.get("steps") or run.steps or 1
        sparse = max(m.num_layers - run.dense_layers(), 1)
        rows = steps * run.shape.batch * m.num_kv_heads * sparse
        recalled_tokens = (recall.get("blocks") or 0) * self.block_size / rows
        attended = run.attended_budget_frac("mean")
        return {"cpu_budget_frac": float(ratio), "recall_budget_frac": recalled_tokens / self.budget,
                "attended_budget_frac": 1.0 if attended is None else attended}

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        """Digests read to select; the device attends its share of the budget, the CPU the rest (its query and
        block ids go down, its partial state comes back, merged on the device), one layer ahead with PC; the
        periodic recall gathers blocks on the host and copies them off the critical path."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        kv = shape.kv_bytes_per_token
        budget, block_size = self.budget, self.block_size
        cpu_tokens = fractions["cpu_budget_frac"] * min(budget, N)
        attended = min(fractions["attended_budget_frac"] * budget, N)  # both tiers
        digests = B * m.num_kv_heads * math.ceil(N / block_size) * 2 * m.head_dim * e
        indices = Transfer(B * m.num_kv_heads * math.ceil(cpu_tokens / block_size) * INDEX_BYTES, 0)  # rides with q
        recalled = fractions["recall_budget_frac"] * budget if self.pr else 0.0
        recall_bytes = B * recalled * kv
        return terms.layer(
            "layer_ahead" if self.pc else "same_layer",
            predict_weight_bytes=terms.predict_weight_bytes if self.pc else 0.0,
            select_bytes=digests, device_kv_bytes=B * (attended - cpu_tokens) * kv, device_page_tokens=block_size,
            device_tokens=B * m.num_kv_heads * (attended - cpu_tokens), host_kv_bytes=B * cpu_tokens * kv,
            cpu_tokens=B * m.num_kv_heads * cpu_tokens, merge_bytes=terms.merge_bytes,
            d2h=Transfer(terms.query_bytes, 1) + indices + terms.new_kv, h2d=terms.result_back,
            host_gather_bytes=recall_bytes, h2d_async=Transfer(recall_bytes, 2 if recall_bytes else 0))
