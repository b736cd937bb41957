"""InfiniGen (OSDI 2024): recall-based KV offloading with a speculated, layer-ahead prefetch of important tokens.

Faithful to the official code (snu-comparch/InfiniGen, `speedup/` and `accuracy/`), with the Llama-style runtime
skew (RoPE forbids folding the skew into W_Q):
- prefill, per sparse layer and KV group: an orthogonal skewing matrix A from the SVD of the prompt's post-RoPE
  queries (the last <= 256 prompt queries the engine observes) and keys; the columns of A are Q's right singular
  vectors ordered by sigma_q * sigma_k, as the original orders them. The partial channels are the
  `ceil(partial_ratio * head_dim)` skewed channels with the largest sum of |q A|. The device keeps the partial
  keys (those channels of k A); the full KV lives in host memory (pinned on CUDA), token-major `[N, B, Hkv, D]`
  like the original, so each step's new token is one contiguous asynchronous device-to-host copy.
- decode, before layer i: layer i+1's query is predicted from layer i's normalised input with layer i+1's weights
  (rotated at the current position), skewed and cut to the partial channels; every cached token of layer i+1 is
  scored with the partial keys (scaled logits); n = budget - 1 by default, so that InfiniGen attends `budget`
  tokens like every other sparse method (the paper fixes 2048 for all baselines). `dynamic_count=True` is the
  original's count: per query head the tokens above `max - alpha` are counted and n = min(floor(mean count),
  budget - 1) (a host sync, timed as idle), bounded further by the authors' caps where set: `count_cap` tokens
  (their speedup code: alpha 4, at most 400) and `count_cap_frac` of each sequence's cached tokens (their accuracy
  code: alpha 5, at most 20% of the context, the default); the budget binds over both. Either way n >= 1 is the same
  for every head and sequence (in a ragged batch a sequence fetches at most its own length, and its own share of it
  under `count_cap_frac`: its fetched slots past that are masked), and the top-n tokens of each
  (sequence, KV head) are fetched from host memory one layer ahead: a worker thread gathers them and copies them to
  the device on a copy stream while layer i computes. On a CPU-only run the "device" is host memory: layer i+1
  reads its selected tokens in place in the host tier (no fetch copy); the transfer counters still count what the
  CUDA path moves.
- layer i+1 waits for its fetch (timed as idle) and attends exactly, with its true query, over the fetched tokens
  and the current token.
GQA (the original is MHA-only): A, the channels and the selection are shared by the query heads of a KV group;
A and the channels come from the group's stacked queries, tokens are ranked by the max over the group's heads,
and the count is averaged over query heads as the original does. Layers below `dense_layers` keep their full KV
on the device and run dense. With dense_layers = 0, layer 0 has no previous layer: it speculates with its own
true query and fetches synchronously.

Where the speculated tokens are attended is the runtime's (`runtime/token_fetch`, chosen at bind). On CUDA
(`FetchedTokens`, graph-safe: methods/base.py, "CUDA graphs") the speculation ranks the top `budget - 1` tokens of
each row into a static buffer (`rank_static`), sorted by score wherever the first n of them must be the top n (the
dynamic count, or a sequence shorter than the fetch: with a fixed count that is the method's `graph_key`), and a
worker gathers the first n into a double-buffered fetch target at a host point; the dynamic count is read there
(`fetch_size`, the documented sync) while the device derives the same n from the same count. The count, each
sequence's current slot, the attended lengths and the group max that the top-k ranks are one call
(`speculation.speculate_count_`: one launch where the fused device ops serve the device, fifteen torch calls
otherwise). On a CPU (`InPlaceTokens`) the speculation keeps host-sized spans (`speculate`: the compiled kernels
read exact spans) and the layer attends them in place over the host tier, the current token merged by LSE. The
counters of a fixed count are the step's plan (`begin_step`), those of the dynamic count the fetch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels.speculation import speculate_count_, top_tokens
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    MethodContext,
    StepInfo,
    require,
)
from scoutbench.methods.infinigen_work import InfiniGenWorkModel
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.runtime.offload import device_zeros, token_chunks
from scoutbench.runtime.token_fetch import FetchedTokens, token_fetch

PPM = 1_000_000  # count_cap_frac's unit in the integer arithmetic of its cap


@dataclass
class InfiniGen(InfiniGenWorkModel, SparseLayerMethod):
    """Partial keys on the device, full KV on the host, the next layer's important tokens prefetched."""

    name = "infinigen"
    display_name = "InfiniGen"
    layer_ahead = True
    infinite_fields = ("alpha",)  # alpha=inf: every token counts (docs/methods.md)
    partial_ratio: float = 0.2  # fraction of head_dim kept as speculation channels
    alpha: float = 5.0  # a token counts if its speculated logit is within alpha of the head's max (inf: all)
    budget: int = 2048  # tokens attended per (sequence, KV head) and layer: budget - 1 fetched + the current one
    dynamic_count: bool = False  # the original's count: n = min(mean #tokens within alpha of the max, budget - 1)
    # the dynamic count's caps besides the budget (None: none): at most `count_cap` tokens, and at most
    # `count_cap_frac` of a sequence's cached tokens (the authors' speedup code: 400; their accuracy code: 0.2)
    count_cap: int | None = None
    count_cap_frac: float | None = 0.2

    # the settings its defaults are chosen over (docs/methods.md, "One rule for every method's defaults"): its fixed
    # fetch and its authors' two counts (snu-comparch/InfiniGen: speedup/ counts within alpha 4 of the max, at most
    # 400 tokens; accuracy/ within alpha 5, at most 20% of the context); a point's fields left out do not act in it
    # the caps came after the LongBench table's runs began, which fetched without them
    added_fields = {"count_cap": None, "count_cap_frac": None}
    settings_grid = {"fixed fetch": {"dynamic_count": False},
                     "alpha 4, cap 400": {"dynamic_count": True, "alpha": 4.0, "count_cap": 400, "count_cap_frac": None},
                     "alpha 5, cap 20%": {"dynamic_count": True, "alpha": 5.0, "count_cap": None, "count_cap_frac": 0.2}}
    paper_setting = ("fixed fetch", "the ScoutAttention paper gives every baseline the budget of 2048 tokens")
    dense_layers: int = DEFAULT_DENSE_LAYERS

    def __post_init__(self) -> None:
        require(0.0 < self.partial_ratio <= 1.0, f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        require(self.alpha > 0.0, f"alpha must be > 0 (logit units; inf fetches every token), got {self.alpha}")
        require(self.budget >= 2, f"budget must be >= 2 (one fetched token plus the current one), got {self.budget}")
        require(self.count_cap is None or self.count_cap >= 1, f"count_cap must be >= 1 or none, got {self.count_cap}")
        require(self.count_cap_frac is None or 0.0 < self.count_cap_frac <= 1.0,
                f"count_cap_frac must be in (0, 1] or none, got {self.count_cap_frac}")
        self.check_dense_layers()

    def partial_dim(self, head_dim: int) -> int:
        return math.ceil(self.partial_ratio * head_dim)

    def count_limit(self, cached: int) -> int:
        """The most tokens the dynamic count fetches for a sequence of `cached` tokens under `count_cap_frac` (its
        cached tokens where unset): floor(frac x cached), at least 1, in integer arithmetic, so that the host and
        the device (`_fetch_limit`) agree to the token."""
        if self.count_cap_frac is None:
            return cached
        return min(cached, max(1, cached * self._cap_ppm // PPM))

    @property
    def _cap_ppm(self) -> int:
        """`count_cap_frac` in parts per million (the integer arithmetic of the cap)."""
        return round(self.count_cap_frac * PPM)

    # ------------------------------------------------------------------ setup
    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        batch, kv_heads, head_dim = ctx.batch, ctx.num_kv_heads, ctx.head_dim
        channels = self.partial_dim(head_dim)
        self.capacity = min(self.budget - 1, ctx.max_len)
        # the host tier and the fetch (runtime/token_fetch: in place on a CPU, fetched on CUDA)
        self.fetch = token_fetch(ctx, self, self.sparse_layers, self.capacity, self.dynamic_count)
        self.host_arena = self.fetch.arena
        self.host_k, self.host_v = self.fetch.host_k, self.fetch.host_v
        self.partial_keys = device_zeros({i: ((batch, kv_heads, ctx.max_len, channels), ctx.dtype)
                                          for i in self.sparse_layers}, ctx.device)
        # views made once: the keys transposed for the scores, and [B, Hkv, max_len, 1, r] where a new token's
        # partial key `[B, Hkv, 1, r]` is written at its sequence's device position in one call
        self._partial_keys_t = {i: keys.transpose(-1, -2) for i, keys in self.partial_keys.items()}
        self._partial_key_slots = {i: keys.unsqueeze(3) for i, keys in self.partial_keys.items()}
        self.skew: dict[int, torch.Tensor] = {}  # [Hkv, D, D] fp32, orthogonal
        self.partial_proj: dict[int, torch.Tensor] = {}  # [Hkv, D, channels]: the partial columns of the skew
        self._batch_index = torch.arange(batch, device=ctx.device)
        # the step's speculation mask, written in place by begin_step: 0 where a slot holds a cached token, -inf
        # after. The whole preallocated partial-key buffer is scored and masked: a matmul over a prefix slice of it
        # is 5x slower on CPU (a strided batch forces a copy), and a captured graph needs the static shape.
        self._slot_row = torch.arange(ctx.max_len, device=ctx.device)[None, :]
        self._uncached = torch.zeros((batch, 1, 1, ctx.max_len), dtype=torch.float32, device=ctx.device)
        self._uncached_rows = self._uncached.view(batch, ctx.max_len)
        self._masked, self._kept = (torch.tensor(x, device=ctx.device) for x in (float("-inf"), 0.0))
        self._fetch_count = 1  # the fixed fetch count of this step (host)
        # the dynamic count's bound over every sequence (the budget and count_cap), and per sequence the most tokens
        # it may fetch this step (its cached tokens, or its count_cap_frac share of them): on the host and, where a
        # share caps it, on the device (written in begin_step; otherwise the positions themselves)
        self._count_cap = min(self.capacity, self.count_cap or self.capacity)
        self._fetch_limits: list[int] = []
        self._fetch_limit_device = torch.zeros(batch, dtype=torch.long, device=ctx.device) \
            if self.dynamic_count and self.count_cap_frac is not None else None
        self._sorted_fetch = True  # CUDA, fixed count: the step's top-n is sorted (graph_key)
        self.reset_stats()

    def bind_static(self, fetch: FetchedTokens) -> None:
        """The static ranking's buffers: for the alpha count (`speculation.speculate_count_`, one fused launch
        where the device has it) the group max it ranks, and the fused kernel's global count and ticket (zero
        between launches)."""
        ctx = self.ctx
        if self.dynamic_count:
            self._ranked = torch.empty((ctx.batch, ctx.num_kv_heads, 1, ctx.max_len), dtype=torch.float32,
                                       device=ctx.device)
            self._count_scratch = torch.zeros(2, dtype=torch.long, device=ctx.device)

    def reset_stats(self) -> None:
        super().reset_stats()
        self._fetched_tokens = [0] * self.ctx.num_layers
        self.fetch.wait_ms = [0.0] * self.ctx.num_layers

    def ingest_sparse_prefill(self, layer, q_obs, k, v, lengths):
        skew, channels = self.skewing(q_obs, k, lengths)
        self.skew[layer] = skew
        proj = skew.gather(2, channels[:, None, :].expand(-1, skew.shape[1], -1))
        self.partial_proj[layer] = proj.to(self.ctx.dtype)
        # in chunks of tokens: the projection and the permuted (made-contiguous) D2H copies of a whole prompt
        # would each be a prompt-sized device transient
        for tokens in token_chunks(k.shape[2]):
            self.partial_keys[layer][:, :, tokens].copy_(torch.matmul(k[:, :, tokens], self.partial_proj[layer]))
            self.host_k[layer][tokens].copy_(k[:, :, tokens].permute(2, 0, 1, 3))
            self.host_v[layer][tokens].copy_(v[:, :, tokens].permute(2, 0, 1, 3))

    def skewing(self, q_obs: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A `[Hkv, D, D]` fp32 orthogonal, partial channels `[Hkv, r]`) for one layer, from the observed prompt
        queries `[B, Hq, W, D]` and the keys `[B, Hkv, N, D]` (valid up to `lengths`), all sequences together.

        Q's right singular vectors and singular values are the eigenvectors and square-rooted eigenvalues of QᵀQ
        (a D x D problem: always a full orthogonal basis, even with fewer observed queries than channels).
        """
        batch, num_heads, window, head_dim = q_obs.shape
        kv_heads = k.shape[1]
        queries = q_obs.float().reshape(batch, kv_heads, num_heads // kv_heads * window, head_dim)
        valid = torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None]
        key_gram = torch.zeros((kv_heads, head_dim, head_dim), dtype=torch.float64, device=k.device)
        for tokens in token_chunks(k.shape[2]):  # an fp32 copy of every key would be twice the prompt's K
            keys = k[:, :, tokens].float() * valid[:, None, tokens, None]
            key_gram += torch.einsum("bhnd,bhne->hde", keys, keys).double()
        q_eigenvalues, q_vectors = torch.linalg.eigh(torch.einsum("bhnd,bhne->hde", queries, queries).double())
        k_eigenvalues = torch.linalg.eigvalsh(key_gram)
        sigma_q = q_eigenvalues.clamp(min=0).sqrt().flip(-1)  # descending, as an SVD returns them
        sigma_k = k_eigenvalues.clamp(min=0).sqrt().flip(-1)
        order = torch.argsort(sigma_q * sigma_k, dim=-1, descending=True, stable=True)
        skew = q_vectors.flip(-1).gather(2, order[:, None, :].expand(-1, head_dim, -1)).float()
        mass = torch.matmul(queries, skew).abs().sum(dim=(0, 2))  # [Hkv, D]
        return skew, mass.topk(self.partial_dim(head_dim), dim=-1).indices

    # ------------------------------------------------------------------ decode: the step's plan
    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        ctx = self.ctx
        torch.where(self._slot_row >= step.positions[:, None], self._masked, self._kept, out=self._uncached_rows)
        # the fixed count: budget - 1 tokens + the current one = the budget every sparse method gets, no sync
        self._fetch_count = max(1, min(self.capacity, max(step.positions_host)))
        self._sorted_fetch = min(step.positions_host) < self.capacity
        if self._fetch_limit_device is None:
            self._fetch_limits = list(step.positions_host)
        else:  # floor(frac x cached) >= 1, at most the cached tokens: the integer arithmetic of `count_limit`
            self._fetch_limits = [self.count_limit(p) for p in step.positions_host]
            limit = torch.div(step.positions * self._cap_ppm, PPM, rounding_mode="floor").clamp_(min=1)
            torch.minimum(limit, step.positions, out=self._fetch_limit_device)
        self.fetch.begin_step(step, None if self.dynamic_count else self._fetch_count, self._fetch_limits,
                              self._fetch_limit)
        if not self.dynamic_count:  # the fetch of every sparse layer is known now
            self.count_fetch(self.sparse_layers, self._fetch_count)
        self.counters.d2h_bytes += len(self.sparse_layers) * ctx.batch * ctx.kv_bytes_per_token()  # new K/V to the host

    def graph_key(self) -> Any:
        """With a fixed count, whether a sequence holds fewer tokens than the fetch takes: its valid tokens must
        then come first among its speculated ones (a sorted top-k, where an unsorted one is cheaper)."""
        return None if self.dynamic_count else self._sorted_fetch

    def end_step(self) -> None:
        self.fetch.end_step()

    def count_fetch(self, layers: Sequence[int], n: int) -> None:
        """The counters of a fetch of n tokens per (sequence, KV head) in each of `layers` in this step."""
        ctx = self.ctx
        for layer in layers:
            self._fetched_tokens[layer] += n
        rows = ctx.batch * ctx.num_kv_heads * len(layers)
        self.counters.d2h_bytes += rows * n * 8  # the token ids, to the worker
        self.counters.h2d_bytes += 2 * rows * n * ctx.head_dim * ctx.dtype.itemsize  # fetched K and V
        # the speculated tokens a sequence really has, and the current one
        self.counters.attended.add_host([min(limit, n) + 1 for limit in self._fetch_limits], ctx.num_kv_heads,
                                        len(layers))

    # ------------------------------------------------------------------ decode: the layers
    def before_layer(self, layer, hidden, normed):
        target = layer + 1
        if target in self.sparse_layers:
            self._prefetch(target, self.ctx.predict_query(target, hidden, normed))

    def _prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Speculate layer `layer`'s important tokens with the query `q` `[B, Hq, D]` and start their fetch."""
        self.fetch.prefetch(layer, q)

    def speculate(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Speculated important tokens of `layer` for the query `q` `[B, Hq, D]`: (ids `[B, Hkv, n]`, n), n known on
        the host (where the kernels read exact spans: `InPlaceTokens`)."""
        ctx = self.ctx
        partial_q = self._partial_query(layer, q)
        # a sequence that may fetch fewer than n tokens must have its valid ones first (decode masks the rest)
        if not self.dynamic_count:
            n = self._fetch_count
            return top_tokens(partial_q, self.partial_keys[layer], self._partial_keys_t[layer], self._uncached,
                              self.step.positions, n, ctx.scale, min(self._fetch_limits) < n), n
        scores = self._logits(layer, partial_q)  # [B, Hkv, G, max_len]
        counts = (scores > scores.amax(dim=-1, keepdim=True) - self.alpha).sum(dim=-1)
        with ctx.timer.stage("idle"):  # the wait for the count is the device's idle time, not prediction work
            n = self.fetch_size(counts.float().mean())
        # the fetched tokens' order does not matter to their attention: only then sorted (2x slower at 32k on CPU)
        ordered = min(self._fetch_limits) < n
        return scores.amax(dim=2).topk(n, dim=-1, sorted=ordered).indices, n

    def fetch_size(self, mean_count: torch.Tensor) -> int:
        """n of the dynamic count: the floored mean count within the budget, `count_cap` and the longest sequence's
        limit, at least 1 (what the device derives from the same count, per sequence: `_fetch_limit`). The method's
        one host sync: n sizes the fetch (the original calls .item() at the same point)."""
        return max(1, min(int(mean_count.item()), self._count_cap, max(self._fetch_limits)))

    @property
    def _fetch_limit(self) -> torch.Tensor:
        """Per sequence `[B]` on the device, the most tokens the dynamic count may fetch this step."""
        return self.step.positions if self._fetch_limit_device is None else self._fetch_limit_device

    def _partial_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The query `[B, Hq, D]` skewed and cut to the partial channels, by KV group: `[B, Hkv, G, r]`."""
        ctx = self.ctx
        return torch.matmul(q.view(ctx.batch, ctx.num_kv_heads, ctx.group_size, ctx.head_dim),
                            self.partial_proj[layer])

    def _logits(self, layer: int, partial_q: torch.Tensor) -> torch.Tensor:
        """Speculated logits `[B, Hkv, G, max_len]` fp32 (scaled; -inf where no token is cached yet)."""
        scores = torch.matmul(partial_q, self._partial_keys_t[layer])
        return torch.add(self._uncached, scores, alpha=self.ctx.scale)  # fp32(score) * scale, exactly

    def rank_static(self, layer: int, q: torch.Tensor, slot: int) -> None:
        """The speculation in static shapes read by a captured graph (`FetchedTokens`): the top `capacity` tokens of
        each (sequence, KV head) into `fetch.ids[slot]`, sorted by score where the first n of them must be the top
        n; with the alpha count, its mean into `fetch.mean_count[slot]` and the current token's slot after the n,
        and the attended lengths (on the device; on the host set at the fetch, which knows n)."""
        fetch, partial_q = self.fetch, self._partial_query(layer, q)
        if self.dynamic_count:  # the count, the current token's slot and the attended lengths
            lengths = fetch.lengths[slot]
            # the count bounds each sequence's count by its `positions` argument: here its fetch limit
            speculate_count_(torch.matmul(partial_q, self._partial_keys_t[layer]), self._uncached, self.ctx.scale,
                             self.alpha, self._count_cap, self._fetch_limit, self._ranked, fetch.mean_count[slot],
                             fetch.current[slot], lengths.valid_len, lengths.bias, self._count_scratch)
            ranked, ordered = self._ranked, True
        else:
            # the ranking needs neither the scale nor fp32: the bias only masks the slots not cached yet
            scores = torch.matmul(partial_q, self._partial_keys_t[layer])
            ranked, ordered = torch.add(self._uncached, scores.amax(dim=2, keepdim=True)), self._sorted_fetch
        torch.topk(ranked, self.capacity, dim=-1, sorted=ordered, out=(fetch.top_scores, fetch.ids[slot]))
        if self.dynamic_count:
            lengths.set_host(None)

    def decode_sparse(self, layer, q, k, v):
        if layer == 0:  # no layer ahead of it: speculate with the true query, fetch now
            with self.ctx.timer.stage("predict"):
                self._prefetch(layer, q)
        self.fetch.wait(layer)
        self._append_partial_key(layer, k)
        return self.fetch.attend(layer, q, k, v)

    def _append_partial_key(self, layer: int, k: torch.Tensor) -> None:
        """The new token's partial key `[B, Hkv, 1, r]` at each sequence's device position."""
        self._partial_key_slots[layer][self._batch_index, :, self.step.positions] = torch.matmul(
            k.unsqueeze(2), self.partial_proj[layer])

    def close(self) -> None:
        if hasattr(self, "fetch"):
            self.fetch.close()

    # ------------------------------------------------------------------ accounting (memory, work: InfiniGenWorkModel)
    def stats(self):
        ctx = self.ctx
        steps = max(self.counters.steps, 1)
        elem_bytes = ctx.dtype.itemsize
        bytes_per_token = ctx.batch * ctx.num_kv_heads * 2 * ctx.head_dim * elem_bytes
        fetched = [n / steps for n in self._fetched_tokens]
        return {
            "tokens_fetched_per_layer": fetched,  # per (sequence, KV head), mean per step
            "bytes_h2d_per_layer": [n * bytes_per_token for n in fetched],
            **self.counters.transfer(),
            "fetch_wait_ms_per_layer": [ms / steps for ms in self.fetch.wait_ms],
            "fetch_wait_ms_per_step": sum(self.fetch.wait_ms) / steps,
            "partial_dim": self.partial_dim(ctx.head_dim),
            "device_kv_bytes": self.dense.stats()["device_kv_bytes"],
            "attended_tokens_per_head": self.counters.attended.stats(self.budget),
        }
