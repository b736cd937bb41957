"""InfiniGen's model beside its runtime (methods/infinigen.py): its memory at a shape and length, and its work
model (what `project` and `gate --counters` count), from its config alone (methods/declarations.py)."""

from __future__ import annotations

from typing import ClassVar

from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.methods.base import OBS_WINDOW
from scoutbench.methods.declarations import Footprint, MemoryPlan, ModelShape, WorkModel
from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord, Transfer
from scoutbench.runtime.offload import PREFILL_CHUNK_TOKENS


class InfiniGenWorkModel(MemoryPlan, WorkModel):
    """InfiniGen's memory plan and work model (a mixin of `InfiniGen`, whose fields and `partial_dim` they read)."""

    # tokens fetched per (sequence, KV head, sparse layer) / context
    work_fractions: ClassVar[dict[str, float]] = {"fetch_context_frac": 0.0}

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        dense, sparse = self.layer_split(shape)
        partial_keys = sparse * context_len * shape.num_kv_heads * self.partial_dim(shape.head_dim) * elem_bytes
        fetch = min(self.budget - 1, context_len)
        # the dense layers' FullKV rows and (on CUDA) the double-buffered fetch rows (the fetched tokens and the
        # current one) are whole 16-token pages; on CUDA the speculated ids of both slots and their scores, and with
        # the fused alpha count the group max of every slot that its top-k ranks (fp32)
        speculated = fetch * shape.num_kv_heads * (2 * 8 + 4)
        if self.dynamic_count:
            speculated += context_len * shape.num_kv_heads * 4
        device = dense * page_aligned(context_len) * kv + partial_keys + 2 * page_aligned(fetch + 1) * kv + speculated
        # the host arena: the sparse layers' KV, and on CUDA the pinned staging of both fetch slots and their ids
        staging = 2 * fetch * (kv + shape.num_kv_heads * 8)
        # prefill (skewing): one chunk of fp32 keys and einsum's copy of it; the observed queries in fp32, their
        # einsum copy and their skewed product
        window = min(OBS_WINDOW, context_len)
        prefill = 4 * shape.head_dim * (2 * min(PREFILL_CHUNK_TOKENS, context_len) * shape.num_kv_heads
                                         + 3 * window * shape.num_heads)
        return Footprint(device, sparse * context_len * kv + staging, prefill)

    # ------------------------------------------------------------------ work model (project, gate --counters)
    def measure_work(self, run: RunRecord) -> dict[str, float]:
        fetched = run.sparse_layer_mean("tokens_fetched_per_layer") or 0.0
        return {"fetch_context_frac": fetched / run.shape.context_len}

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        """Speculation over every cached token's partial key, `budget - 1` tokens fetched one layer ahead (with
        dynamic_count the measured alpha count as a share of the context, within `count_cap` and `count_cap_frac`
        of the context where set). `terms.fetch_granularity`: `gathered` (this implementation, like
        its recall): the host gathers the selected tokens into a staging buffer, then K and V go in one copy each;
        `token`: one copy per token (all KV heads), as the ScoutAttention paper describes its InfiniGen baseline
        (section 2.3: "4 KB per token per layer ... 800 MB/s")."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        cap = self.budget - 1
        if self.dynamic_count:  # the measured count, within the budget and the authors' caps where set
            caps = [cap, self.count_limit(N)]
            if self.count_cap is not None:
                caps.append(self.count_cap)
            fetched = min(fractions["fetch_context_frac"] * N, *caps)
        else:
            fetched = min(cap, N)
        speculation = B * N * m.num_kv_heads * self.partial_dim(m.head_dim) * e
        fetch_bytes = B * fetched * shape.kv_bytes_per_token
        gathered = terms.fetch_granularity == "gathered"
        return terms.layer("prefetch", predict_weight_bytes=terms.predict_weight_bytes, select_bytes=speculation,
                           device_kv_bytes=fetch_bytes, device_tokens=B * m.num_kv_heads * (fetched + 1),  # + current
                           host_gather_bytes=fetch_bytes if gathered else 0.0, d2h=terms.new_kv,
                           h2d=Transfer(fetch_bytes, (2 if fetched else 0) if gathered else B * fetched))
