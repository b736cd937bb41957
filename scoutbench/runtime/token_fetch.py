"""Where a layer-ahead token-recall method (InfiniGen, methods/infinigen.py) attends its speculated tokens: the
host tier holds every token `[N, B, Hkv, D]` (token-major, so a step's new token is one contiguous copy), and
layer i+1's speculated tokens reach its attention while layer i computes.

`token_fetch(...)` chooses the variant for the compute device, once, at bind; the method calls one interface
(`begin_step`, `prefetch`, `wait`, `attend`, `end_step`) and supplies the speculation (`Speculation`):
- `FetchedTokens` (CUDA): graph-safe static buffers. The speculation ranks the top `capacity` tokens of each
  (sequence, KV head) into a static buffer; at a host point a worker copies the first n ids to the host, gathers
  their rows into pinned staging and copies them to the front of a double-buffered fetch target (layer i+1's fetch
  lands while layer i still reads the other slot). The current token is written after the fetched ones, so one
  attention call over the step's lengths attends both; the worker copies it from there to the host tier, handed
  over at the next fetch into the same target (two layers on) or at the step's end.
- `InPlaceTokens` (CPU): the host tier is the compute device's memory: the speculation takes the exact top n
  (host-sized spans: the compiled kernels read exact spans), and the layer attends them in place by id, the current
  token merged by LSE.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from scoutbench.kernels.attention import (
    StepLengths,
    block_sparse_attention,
    decode_attention,
    merge_output,
    partial_attention,
)
from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.runtime.offload import CopyStream, CpuWorkerPool, HostArena


class Speculation(Protocol):
    """The method's side: its speculation and its counters."""

    def speculate(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Exact: ids `[B, Hkv, n]` of the top n tokens for the query `q` `[B, Hq, D]` and n, known on the host."""

    def rank_static(self, layer: int, q: torch.Tensor, slot: int) -> None:
        """Static: the top `capacity` tokens into `FetchedTokens.ids[slot]` (and with the alpha count its mean
        into `mean_count[slot]`, each sequence's current slot and, where the device knows n, the lengths)."""

    def bind_static(self, fetch: FetchedTokens) -> None:
        """The static ranking's own buffers (at bind, where the device ranks statically)."""

    def fetch_size(self, mean_count: torch.Tensor) -> int:
        """The alpha count's n from its mean (a host sync)."""

    def count_fetch(self, layers: Sequence[int], n: int) -> None:
        """The counters of a fetch of n tokens per (sequence, KV head) in each of `layers`."""


def token_fetch(ctx: Any, speculation: Speculation, sparse_layers: Sequence[int], capacity: int,
                dynamic_count: bool) -> TokenFetch:
    """The host tier and the fetch of the compute device `ctx.device` (`ctx`: the bound method's context):
    `FetchedTokens` on CUDA, `InPlaceTokens` on a CPU."""
    kind = FetchedTokens if ctx.device.type == "cuda" else InPlaceTokens
    return kind(ctx, speculation, sparse_layers, capacity, dynamic_count)


class TokenFetch:
    """The host tier `host_k`/`host_v` per sparse layer (one exact-size arena, pinned on CUDA; zeroed: a short
    sequence of a ragged batch fetches (masked) rows it never wrote, and 0 * NaN is NaN), the worker and the copy
    stream."""

    def __init__(self, ctx: Any, speculation: Speculation, sparse_layers: Sequence[int], capacity: int,
                 dynamic_count: bool):
        self.ctx, self.speculation, self.capacity, self.dynamic_count = ctx, speculation, capacity, dynamic_count
        self.sparse_layers = list(sparse_layers)
        host_shape = (ctx.max_len, ctx.batch, ctx.num_kv_heads, ctx.head_dim)
        specs = {(kind, i): (host_shape, ctx.dtype) for kind in "kv" for i in self.sparse_layers}
        self.arena = HostArena(specs | self.staging_specs(), ctx.device)
        self.host_k = {i: self.arena["k", i] for i in self.sparse_layers}
        self.host_v = {i: self.arena["v", i] for i in self.sparse_layers}
        self.batch_index = torch.arange(ctx.batch, device=ctx.device)
        self.step: Any = None  # the engine's StepInfo of the current step
        # per sequence the most tokens a fetch may take this step (its cached tokens, or fewer under the method's
        # cap), on the host and on the device
        self.limits: list[int] = []
        self.limit: torch.Tensor | None = None
        self.wait_ms = [0.0] * ctx.num_layers  # per layer: the host's wait for its fetch (the method resets it)
        self.copy = CopyStream(ctx.device)
        self.pool = CpuWorkerPool(1, device=ctx.device)

    def staging_specs(self) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
        """Host buffers of the fetch beside the host tier, in its arena."""
        return {}

    def begin_step(self, step: Any, n: int | None, limits: list[int], limit: torch.Tensor) -> None:
        """The step's plan (`step`: the engine's StepInfo), with a fixed count its n tokens (None: the alpha
        count's n, known at each fetch), and each sequence's fetch limit (host `limits`, device `limit` `[B]`)."""
        self.step, self.limits, self.limit = step, limits, limit

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Speculate `layer`'s tokens with the query `q` `[B, Hq, D]` and start their fetch."""
        raise NotImplementedError

    def wait(self, layer: int) -> None:
        """`layer`'s speculated tokens are where its attention reads them."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of `q` `[B, Hq, D]` over `layer`'s speculated tokens and the current one (`k`, `v`, which
        join the host tier)."""
        raise NotImplementedError

    def end_step(self) -> None:
        """The step's host writes issued (the host tier holds the step's tokens)."""

    def close(self) -> None:
        self.pool.close()
        self.arena.release()
        self.speculation = None  # the method holds this runtime: no cycle outlives the run (it would wait for gc)


class InPlaceTokens(TokenFetch):
    """CPU: the exact top n attended in place in the host tier (module docstring)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        # the host tier `[N, B, Hkv, D]` seen as blocks of one token `[B, Hkv, N, 1, D]`, attended in place
        self._blocks = {i: tuple(tier[i].permute(1, 2, 0, 3).unsqueeze(3) for tier in (self.host_k, self.host_v))
                        for i in self.sparse_layers}
        self._selected: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> its speculated (ids, n)
        self._valid: torch.Tensor | None = None  # fixed count, ragged batch: valid fetched tokens [B]

    def begin_step(self, step: Any, n: int | None, limits: list[int], limit: torch.Tensor) -> None:
        super().begin_step(step, n, limits, limit)
        if n is not None:  # a short sequence has fewer valid fetched tokens
            self._valid = None if step.uniform else step.positions.clamp(max=n)

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        ids, n = self.speculation.speculate(layer, q)
        if self.dynamic_count:
            self.speculation.count_fetch([layer], n)
        self._selected[layer] = (ids, n)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx, step = self.ctx, self.step
        ids, n = self._selected.pop(layer)
        self.host_k[layer][step.positions, self.batch_index] = k  # the host tier is this device's memory
        self.host_v[layer][step.positions, self.batch_index] = v
        valid = self._valid
        if self.dynamic_count and not step.uniform:  # a short sequence has fewer tokens
            valid = self.limit.clamp(max=n)
        fetched = block_sparse_attention(q, *self._blocks[layer], ids, ctx.scale, valid)
        current = partial_attention(q, k[:, :, None], v[:, :, None], ctx.scale)
        with ctx.timer.stage("merge"):
            return merge_output(fetched, current, q.dtype)


class FetchedTokens(TokenFetch):
    """CUDA: static buffers double-buffered by layer parity (module docstring). Each (sequence, KV head) row of a
    fetch target holds the fetched tokens at its front, the current token after them, in whole flashinfer pages (a
    row of budget - 1 = 2047 tokens would leave flashinfer only 1-token pages), zeroed: a masked slot that was
    never written must not be NaN."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        ctx, capacity = self.ctx, self.capacity
        batch, kv_heads, head_dim = ctx.batch, ctx.num_kv_heads, ctx.head_dim
        width = page_aligned(capacity + 1)
        fetch_shape = (batch, kv_heads, width, head_dim)
        self.fetched = [tuple(torch.zeros(fetch_shape, dtype=ctx.dtype, device=ctx.device) for _ in "kv")
                        for _ in range(2)]
        self._staging = [(self.arena["stage_k", slot], self.arena["stage_v", slot]) for slot in range(2)]
        self._ids_host = [self.arena["ids", slot] for slot in range(2)]
        # the speculated tokens: the top `capacity` of each row (static: the count may be known on the device only)
        self.top_scores = torch.empty((batch, kv_heads, 1, capacity), dtype=torch.float32, device=ctx.device)
        self.ids = [torch.empty((batch, kv_heads, 1, capacity), dtype=torch.long, device=ctx.device)
                    for _ in range(2)]
        # host row of token 0 of each (sequence, KV head) in the token-major host tier (the worker's arithmetic)
        self._row_offset = torch.arange(batch * kv_heads).view(batch, kv_heads, 1)
        # each slot: where the current token goes in the fetch target (after the fetched ones, [B]) and the lengths
        # attended there; with a fixed count both slots share one, written once per step
        shared = not self.dynamic_count
        slots = 1 if shared else 2
        current = [torch.zeros(batch, dtype=torch.long, device=ctx.device) for _ in range(slots)]
        lengths = [StepLengths(batch, width, ctx.dtype, ctx.device, with_host=not ctx.graphs) for _ in range(slots)]
        self.current = current * 2 if shared else current
        self.lengths = lengths * 2 if shared else lengths
        self.mean_count = [torch.zeros((), dtype=torch.float32, device=ctx.device) for _ in range(2)]
        self._fetch_count = 1  # the fixed count of this step (host)
        self._layer_count = [0] * ctx.num_layers  # the fetch count of each layer in this step (host)
        self._pending: dict[int, Any] = {}  # layer -> future of its fetch (host functions only)
        self._appended: dict[int, Any] = {i: None for i in self.sparse_layers}  # event of the last host append
        self._last_store: Any = None  # future of the step's last host append (the worker issues them in order)
        # the sparse layers whose fetch slot no later layer of the step fetches into: their new tokens go to the host
        # tier at the step's end, every other layer's when the layer two ahead starts its fetch into the same slot
        self._stored_at_step_end = [layer for layer in self.sparse_layers if layer + 2 >= ctx.num_layers]
        self.speculation.bind_static(self)

    def staging_specs(self) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
        """The pinned staging of both fetch slots and their row ids."""
        ctx = self.ctx
        rows = ctx.batch * ctx.num_kv_heads * self.capacity
        specs = {(kind, slot): ((rows * ctx.head_dim,), ctx.dtype) for kind in ("stage_k", "stage_v")
                 for slot in range(2)}
        return specs | {("ids", slot): ((rows,), torch.long) for slot in range(2)}

    def begin_step(self, step: Any, n: int | None, limits: list[int], limit: torch.Tensor) -> None:
        super().begin_step(step, n, limits, limit)
        if n is None:
            return
        # where each sequence's current token goes: after its fetched tokens (min(position, n) of them)
        self._fetch_count = n
        torch.clamp(step.positions, max=self.capacity, out=self.current[0])
        self.lengths[0].update(self.current[0] + 1, [min(p, self.capacity) + 1 for p in step.positions_host])

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        self.speculation.rank_static(layer, q, layer % 2)
        if self.dynamic_count:
            with self.ctx.timer.stage("idle"):  # the host waits for the count: the GPU's idle time
                self.ctx.host(self._start_fetch, layer)
        else:
            self.ctx.host(self._start_fetch, layer)

    def _start_fetch(self, layer: int) -> None:
        """Host work: the fetch count (with the alpha count, the wait for it), the counters, and the worker's
        gather of layer `layer`'s speculated tokens."""
        slot = layer % 2
        n = self._fetch_count
        if self.dynamic_count:
            n = self.speculation.fetch_size(self.mean_count[slot])
            self.speculation.count_fetch([layer], n)
            self.lengths[slot].set_host([min(limit, n) + 1 for limit in self.limits])
        self._layer_count[layer] = n
        # the speculation is queued on the compute stream, after layer `layer - 2`'s attention that last read the
        # fetch target of this slot and wrote its new token there, which goes to the host tier first
        ready = torch.cuda.current_stream(self.ctx.device).record_event()
        if layer - 2 in self.sparse_layers:
            self._store_token(layer - 2, ready)
        self._pending[layer] = self.pool.submit(self._gather, layer, slot, n, ready)

    def _gather(self, layer: int, slot: int, n: int, ready: Any) -> Any:
        """Worker thread: the first n speculated ids of each row to the host, the host rows they select gathered
        into pinned staging, and their copy to the front of the fetch target's rows."""
        ctx = self.ctx
        rows, head_dim = ctx.batch * ctx.num_kv_heads, ctx.head_dim
        ids_host = self._ids_host[slot][: rows * n].view(ctx.batch, ctx.num_kv_heads, n)
        self.copy.copy(ids_host, self.ids[slot][:, :, 0, :n], after=ready).synchronize()
        appended = self._appended[layer]  # the previous step's new token of this layer, in host memory
        if appended is not None:
            appended.synchronize()
        host_rows = torch.add(self._row_offset, ids_host, alpha=rows).view(-1)
        numel = rows * n * head_dim
        copied = None
        for host, staging, fetched in zip((self.host_k[layer], self.host_v[layer]), self._staging[slot],
                                          self.fetched[slot], strict=True):
            torch.index_select(host.view(-1, head_dim), 0, host_rows, out=staging[:numel].view(-1, head_dim))
            target = fetched[:, :, :n]
            copied = self.copy.copy(target, staging[:numel].view(target.shape), after=ready)
        return copied

    def wait(self, layer: int) -> None:
        with self.ctx.timer.stage("idle"):
            self.ctx.host(self._finish_fetch, layer)

    def _finish_fetch(self, layer: int) -> None:
        """Host work: wait for layer `layer`'s fetch; the compute stream waits for its copy, the host not."""
        start = time.perf_counter()
        self._pending.pop(layer).result().wait()
        self.wait_ms[layer] += (time.perf_counter() - start) * 1e3

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slot = layer % 2
        fetched_k, fetched_v = self.fetched[slot]
        fetched_k[self.batch_index, :, self.current[slot]] = k
        fetched_v[self.batch_index, :, self.current[slot]] = v
        return decode_attention(q, fetched_k, fetched_v, self.ctx.scale, lengths=self.lengths[slot])

    def _store_token(self, layer: int, ready: Any) -> None:
        """Host work: the worker copies layer `layer`'s new K/V from its fetch target (where decode wrote them,
        after the fetched tokens) to host memory, once the compute stream reaches the event `ready`. The copies
        follow this slot's fetch on the copy stream and precede its next one, which may overwrite them."""
        n = self._layer_count[layer]
        current = [min(limit, n) for limit in self.limits]
        self._last_store = self.pool.submit(self._copy_to_host, layer, layer % 2, list(self.step.positions_host),
                                            current, ready)

    def _copy_to_host(self, layer: int, slot: int, positions: list[int], current: list[int], ready: Any) -> None:
        """Worker thread: the current token of each sequence into the host tier at its position."""
        fetched_k, fetched_v = self.fetched[slot]
        host_k, host_v = self.host_k[layer], self.host_v[layer]
        if min(positions) == max(positions):  # one slot, one position: one copy per tensor
            self.copy.copy(host_k[positions[0]], fetched_k[:, :, current[0]], after=ready)
            event = self.copy.copy(host_v[positions[0]], fetched_v[:, :, current[0]], after=ready)
        else:
            for b, (position, slot_b) in enumerate(zip(positions, current, strict=True)):
                self.copy.copy(host_k[position, b], fetched_k[b, :, slot_b], after=ready)
                event = self.copy.copy(host_v[position, b], fetched_v[b, :, slot_b], after=ready)
        self._appended[layer] = event  # copies on one stream: the last event covers them all

    def end_step(self) -> None:
        ready = torch.cuda.current_stream(self.ctx.device).record_event()
        for layer in self._stored_at_step_end:
            self._store_token(layer, ready)
        self._last_store.result()  # the step's host appends are issued within the step they belong to
