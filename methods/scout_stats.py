"""ScoutAttention's statistics, as `stats()` reports them (docs/results.md): the CPU compute ratio per layer, the
blocks selected and resident, the recalls and their bytes, CPU time, idle time and transfers. A mixin of
`ScoutAttention` (methods/scout.py), apart so that the method's file reads as the paper's algorithm."""

from __future__ import annotations

from typing import Any

from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.runtime.scout_transport import CpuResult


class ScoutStatistics(SparseLayerMethod):
    """The counters `ScoutAttention` accumulates beside every method's (`_account` per CPU part, the recalls in its
    own file)."""

    def reset_stats(self) -> None:
        """Zero the statistics (e.g. after warm-up steps); the method state is untouched."""
        super().reset_stats()
        L = self._L
        self._ratio_sum, self._ratio_n, self._sel_sum, self._res_sum = [0.0] * L, [0] * L, [0.0] * L, [0.0] * L
        self._recalls, self._recall_blocks = [0] * L, [0] * L
        self._recall_bytes = 0  # K/V bytes the recalls copied to the device
        self._cpu_ms = self._idle_ms = 0.0
        self._cpu_tasks = 0

    def _account(self, layer: int, result: CpuResult) -> None:
        """CPU compute ratio = tokens attended on the CPU / budget, averaged over (sequence, KV head)."""
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
            "attended_tokens_per_head": self.counters.attended.stats(self.budget),
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
            **self.counters.transfer(),
            "steps": self.counters.steps,
            "device_kv_bytes": sum(t.numel() * t.element_size() for t in (*self.dense.keys, *self.dense.values))
            + self.store.device_bytes(),
            "host_kv_bytes": self.store.host_bytes(),
        }
