"""FullKV: plain attention over the whole cache, all on the compute device. The reference for every method."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from scoutbench.kernels.attention import StepLengths, decode_attention
from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.methods.base import (
    AttentionMethod,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
)
from scoutbench.methods.work_model import LayerTerms, LayerWork
from scoutbench.runtime.offload import device_zeros


@dataclass
class FullKV(AttentionMethod):
    """Vanilla decode attention. The cache is preallocated for the whole run (no per-step growth); a step's new
    token is written at each sequence's device position and attention reads each row's leading tokens by the step's
    lengths (StepLengths, written once per step), so a layer is three calls and a captured graph of it serves every
    step."""

    name = "fullkv"
    display_name = "FullKV"
    reference = True

    @classmethod
    def for_layers(cls, ctx: MethodContext, num_layers: int) -> FullKV:
        """FullKV storage bound to the first `num_layers` layers of ctx's model: the dense layers that the sparse
        methods keep on the device (their layer indices are the same)."""
        dense = cls()
        dense.bind(dataclasses.replace(ctx, num_layers=num_layers))
        return dense

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        # rows of whole flashinfer pages (16 tokens): its pages tile a row, and a capacity such as 65555 would
        # leave only 1-token pages
        shape = (ctx.batch, ctx.num_kv_heads, page_aligned(ctx.max_len), ctx.head_dim)
        # zeros, not empty: in a ragged batch a shorter sequence's masked tail covers slots it never wrote, and a
        # masked NaN still poisons attention (NaN + -inf = NaN, 0 * NaN = NaN)
        layers = range(ctx.num_layers)
        cache = device_zeros({(kind, layer): (shape, ctx.dtype) for kind in "kv" for layer in layers}, ctx.device)
        self.keys = [cache["k", layer] for layer in layers]
        self.values = [cache["v", layer] for layer in layers]
        self._batch_index = torch.arange(ctx.batch, device=ctx.device)
        self._step_lengths = StepLengths(ctx.batch, shape[2], ctx.dtype, ctx.device, with_host=not ctx.graphs)

    def ingest_prefill(self, layer, q_obs, k, v, lengths):
        num_tokens = k.shape[2]
        self.keys[layer][:, :, :num_tokens].copy_(k)
        self.values[layer][:, :, :num_tokens].copy_(v)

    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        self._step_lengths.update(step.positions + 1, [p + 1 for p in step.positions_host])
        self._count_attended(step)

    def _count_attended(self, step: StepInfo) -> None:
        """Every layer attends every cached token (one count per step stands for all layers: they are equal)."""
        self.counters.attended.add_host([p + 1 for p in step.positions_host], self.ctx.num_kv_heads)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new token k/v `[B, Hkv, D]` at each sequence's device position (two calls)."""
        self.keys[layer][self._batch_index, :, self.step.positions] = k
        self.values[layer][self._batch_index, :, self.step.positions] = v

    def decode(self, layer, q, k, v):
        self.append(layer, k, v)
        return decode_attention(q, self.keys[layer], self.values[layer], self.ctx.scale, lengths=self._step_lengths)

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        return Footprint(shape.num_layers * page_aligned(context_len) * shape.kv_bytes_per_token_layer(elem_bytes), 0)

    def stats(self):
        ctx = self.ctx
        return {"device_kv_bytes": ctx.num_layers * ctx.batch * page_aligned(ctx.max_len) * ctx.kv_bytes_per_token(),
                "attended_tokens_per_head": self.counters.attended.stats(None),
                **self.counters.transfer()}  # everything stays on the device: zeros

    # ------------------------------------------------------------------ work model (project, gate --counters)
    def work_dense_layers(self, num_layers: int) -> int:
        return num_layers  # dense everywhere

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        return terms.dense
