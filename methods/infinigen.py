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

Decode on CUDA is graph-safe (methods/base.py, "CUDA graphs"): its device work has static shapes and reads only
device tensors written in place per step (the uncached-slot mask, where each sequence's current token goes, the
attended lengths). The speculation always ranks the top `budget - 1` tokens of each row into a static buffer,
sorted by score wherever the first n of them must be the top n (the dynamic count, or a sequence shorter than the
fetch: with a fixed count that is the method's `graph_key`); the host work sits at two host points (`ctx.host`) per
sparse layer: starting its fetch (the worker copies the first n ids to the host, gathers their rows and copies them
into the fetch target's front) and waiting for it. The current token is written after the fetched ones in the
fetch target, so one attention call over the step's lengths (StepLengths) attends both; the worker copies it from
there to the host tier, handed over at the next fetch into the same target (two layers on) or at the step's end.
The dynamic count is part of the fetch's host point: the host reads the count there (the documented sync) and
sizes the fetch with it, while the device derives the same n from the same count. The count, each sequence's
current slot, the attended lengths and the group max that the top-k ranks are one call (`speculation.speculate_count_`:
one launch where the fused device ops serve the device, fifteen torch calls otherwise). The
CPU path keeps host-sized spans (the compiled kernels read exact spans): the top-n by the kernel library, attention
in place over the host tier, the current token merged by LSE. The counters of a fixed count are the step's plan
(`begin_step`), those of the dynamic count the host point's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels.attention import (
    StepLengths,
    block_sparse_attention,
    decode_attention,
    merge_output,
    partial_attention,
)
from scoutbench.kernels.flashinfer_decode import page_aligned
from scoutbench.kernels.speculation import speculate_count_, top_tokens
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    AttendedTokens,
    MethodContext,
    StepInfo,
    require,
    transfer_stats,
)
from scoutbench.methods.infinigen_model import InfiniGenModel
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.runtime.offload import (
    CopyStream,
    CpuWorkerPool,
    HostArena,
    device_zeros,
    token_chunks,
)

PPM = 1_000_000  # count_cap_frac's unit in the integer arithmetic of its cap


@dataclass
class InfiniGen(InfiniGenModel, SparseLayerMethod):
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
        # zeroed: a short sequence of a ragged batch fetches (masked) rows it never wrote, and 0 * NaN is NaN
        host_shape = (ctx.max_len, batch, kv_heads, head_dim)
        self.capacity = min(self.budget - 1, ctx.max_len)
        numel = batch * kv_heads * self.capacity * head_dim
        on_cuda = ctx.device.type == "cuda"
        # host tier (+ on CUDA the pinned staging of both fetch slots and their row ids): one exact-size arena,
        # pinned on CUDA (memory_footprint counts the same bytes)
        specs = {(kind, i): (host_shape, ctx.dtype) for kind in "kv" for i in self.sparse_layers}
        if on_cuda:
            specs |= {(kind, slot): ((numel,), ctx.dtype) for kind in ("stage_k", "stage_v") for slot in range(2)}
            specs |= {("ids", slot): ((batch * kv_heads * self.capacity,), torch.long) for slot in range(2)}
        self._host_arena = arena = HostArena(specs, ctx.device)
        self.host_k = {i: arena["k", i] for i in self.sparse_layers}
        self.host_v = {i: arena["v", i] for i in self.sparse_layers}
        # CPU: the host tier `[N, B, Hkv, D]` seen as blocks of one token `[B, Hkv, N, 1, D]`, attended in place
        self._host_blocks = {i: tuple(tier[i].permute(1, 2, 0, 3).unsqueeze(3) for tier in (self.host_k, self.host_v))
                             for i in self.sparse_layers}
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
        self._layer_count = [0] * ctx.num_layers  # the fetch count of each layer in this step (host)
        self._selected: dict[int, tuple[torch.Tensor, int]] = {}  # CPU: layer -> its speculated (ids, n)
        self._cpu_valid: torch.Tensor | None = None  # CPU, fixed count, ragged batch: valid fetched tokens [B]
        self._fetched = None
        if on_cuda:
            self._bind_fetch(arena)
        self.copy = CopyStream(ctx.device)
        self.pool = CpuWorkerPool(1, device=ctx.device)
        self._pending: dict[int, Any] = {}  # layer -> future of its fetch (host functions only)
        self._appended: dict[int, Any] = {i: None for i in self.sparse_layers}  # event of the last host append
        self._last_store: Any = None  # future of the step's last host append (the worker issues them in order)
        # the sparse layers whose fetch slot no later layer of the step fetches into: their new tokens go to the host
        # tier at the step's end, every other layer's when the layer two ahead starts its fetch into the same slot
        self._stored_at_step_end = [layer for layer in self.sparse_layers if layer + 2 >= ctx.num_layers]
        self.reset_stats()

    def _bind_fetch(self, arena: HostArena) -> None:
        """The CUDA path's static buffers (module docstring: decode on CUDA). Double-buffered by layer parity:
        layer i+1's fetch lands while layer i still reads the other slot. Each (sequence, KV head) row of a fetch
        target holds the fetched tokens at its front, the current token after them, in whole flashinfer pages (a
        row of budget - 1 = 2047 tokens would leave flashinfer only 1-token pages), zeroed: a masked slot that was
        never written must not be NaN."""
        ctx = self.ctx
        batch, kv_heads, head_dim = ctx.batch, ctx.num_kv_heads, ctx.head_dim
        width = page_aligned(self.capacity + 1)
        fetch_shape = (batch, kv_heads, width, head_dim)
        self._fetched = [tuple(torch.zeros(fetch_shape, dtype=ctx.dtype, device=ctx.device) for _ in "kv")
                         for _ in range(2)]
        self._staging = [(arena["stage_k", slot], arena["stage_v", slot]) for slot in range(2)]
        self._ids_host = [arena["ids", slot] for slot in range(2)]
        # the speculated tokens: the top `capacity` of each row (static: the count may be known on the device only)
        self._top_scores = torch.empty((batch, kv_heads, 1, self.capacity), dtype=torch.float32, device=ctx.device)
        self._ids = [torch.empty((batch, kv_heads, 1, self.capacity), dtype=torch.long, device=ctx.device)
                     for _ in range(2)]
        # host row of token 0 of each (sequence, KV head) in the token-major host tier (the worker's arithmetic)
        self._row_offset = torch.arange(batch * kv_heads).view(batch, kv_heads, 1)
        # each slot: where the current token goes in the fetch target (after the fetched ones, [B]) and the lengths
        # attended there; with a fixed count both slots share one, written once per step
        shared = not self.dynamic_count
        slots = 1 if shared else 2
        current = [torch.zeros(batch, dtype=torch.long, device=ctx.device) for _ in range(slots)]
        lengths = [StepLengths(batch, width, ctx.dtype, ctx.device, with_host=not ctx.graphs) for _ in range(slots)]
        self._current = current * 2 if shared else current
        self._lengths = lengths * 2 if shared else lengths
        self._mean_count = [torch.zeros((), dtype=torch.float32, device=ctx.device) for _ in range(2)]
        # the alpha count (`speculation.speculate_count_`, one fused launch where the device has it): the group max
        # it ranks, and the fused kernel's global count and ticket (zero between launches)
        if self.dynamic_count:
            self._ranked = torch.empty((batch, kv_heads, 1, ctx.max_len), dtype=torch.float32, device=ctx.device)
            self._count_scratch = torch.zeros(2, dtype=torch.long, device=ctx.device)

    def reset_stats(self) -> None:
        self._attended = AttendedTokens()
        self._fetched_tokens = [0] * self.ctx.num_layers
        self._wait_ms = [0.0] * self.ctx.num_layers
        self._h2d_bytes = self._d2h_bytes = 0
        self._steps = 0

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
        if not self.dynamic_count:  # the fetch of every sparse layer is known now
            if self._fetched is None:  # CPU: a short sequence has fewer valid fetched tokens
                self._cpu_valid = None if step.uniform else step.positions.clamp(max=self._fetch_count)
            else:  # where each sequence's current token goes: after its fetched tokens (min(position, n) of them)
                torch.clamp(step.positions, max=self.capacity, out=self._current[0])
                self._lengths[0].update(self._current[0] + 1,
                                        [min(p, self.capacity) + 1 for p in step.positions_host])
            self._count_fetch(self.sparse_layers, self._fetch_count)
        self._d2h_bytes += len(self.sparse_layers) * ctx.batch * ctx.kv_bytes_per_token()  # new K/V to the host
        self._steps += 1

    def graph_key(self) -> Any:
        """With a fixed count, whether a sequence holds fewer tokens than the fetch takes: its valid tokens must
        then come first among its speculated ones (a sorted top-k, where an unsorted one is cheaper)."""
        return None if self.dynamic_count else self._sorted_fetch

    def end_step(self) -> None:
        if self._fetched is None:
            return
        ready = torch.cuda.current_stream(self.ctx.device).record_event()
        for layer in self._stored_at_step_end:
            self._store_token(layer, ready)
        self._last_store.result()  # the step's host appends are issued within the step they belong to

    def _count_fetch(self, layers: Sequence[int], n: int) -> None:
        """The counters of a fetch of n tokens per (sequence, KV head) in each of `layers` in this step."""
        ctx = self.ctx
        for layer in layers:
            self._layer_count[layer] = n
            self._fetched_tokens[layer] += n
        rows = ctx.batch * ctx.num_kv_heads * len(layers)
        self._d2h_bytes += rows * n * 8  # the token ids, to the worker
        self._h2d_bytes += 2 * rows * n * ctx.head_dim * ctx.dtype.itemsize  # fetched K and V
        # the speculated tokens a sequence really has, and the current one
        self._attended.add_host([min(limit, n) + 1 for limit in self._fetch_limits], ctx.num_kv_heads, len(layers))

    # ------------------------------------------------------------------ decode: the layers
    def before_layer(self, layer, hidden, normed):
        target = layer + 1
        if target in self.sparse_layers:
            self._prefetch(target, self.ctx.predict_query(target, hidden, normed))

    def _prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Speculate layer `layer`'s important tokens with the query `q` `[B, Hq, D]` and start their fetch."""
        if self._fetched is None:  # CPU: decode reads the tokens in place
            ids, n = self.speculate(layer, q)
            if self.dynamic_count:
                self._count_fetch([layer], n)
            self._selected[layer] = (ids, n)
            return
        slot = layer % 2
        self._speculate_on_device(layer, q, slot)
        if self.dynamic_count:
            # the attended lengths of the fetch target: the count wrote them on the device; on the host they are
            # set by _start_fetch, which knows n
            self._lengths[slot].set_host(None)
            with self.ctx.timer.stage("idle"):  # the host waits for the count: the GPU's idle time
                self.ctx.host(self._start_fetch, layer)
        else:
            self.ctx.host(self._start_fetch, layer)

    def speculate(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Speculated important tokens of `layer` for the query `q` `[B, Hq, D]`: (ids `[B, Hkv, n]`, n), n known on
        the host (the CPU path, whose kernels read exact spans)."""
        ctx = self.ctx
        partial_q = self._partial_query(layer, q)
        # a sequence that may fetch fewer than n tokens must have its valid ones first (decode masks the rest)
        if not self.dynamic_count:
            n = self._fetch_count
            return top_tokens(partial_q, self.partial_keys[layer], self._partial_keys_t[layer], self._uncached,
                              self.step.positions, n, ctx.scale, min(self._fetch_limits) < n), n
        scores = self._logits(layer, partial_q)  # [B, Hkv, G, max_len]
        counts = (scores > scores.amax(dim=-1, keepdim=True) - self.alpha).sum(dim=-1)
        # The method's one host sync: n sizes the fetch (the original calls .item() at the same point). The wait is
        # the GPU's idle time, not prediction work, so it is timed as `idle`.
        with ctx.timer.stage("idle"):
            mean_count = counts.float().mean().item()
        n = self._dynamic_fetch(mean_count)
        # the fetched tokens' order does not matter to their attention: only then sorted (2x slower at 32k on CPU)
        ordered = min(self._fetch_limits) < n
        return scores.amax(dim=2).topk(n, dim=-1, sorted=ordered).indices, n

    def _dynamic_fetch(self, mean_count: float) -> int:
        """n of the dynamic count: the floored mean count within the budget, `count_cap` and the longest sequence's
        limit, at least 1 (what the device derives from the same count, per sequence: `_fetch_limit`)."""
        return max(1, min(int(mean_count), self._count_cap, max(self._fetch_limits)))

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

    def _speculate_on_device(self, layer: int, q: torch.Tensor, slot: int) -> None:
        """The CUDA path's speculation, in static shapes read by a captured graph: the top `capacity` tokens of each
        (sequence, KV head) into `self._ids[slot]`, sorted by score where the first n of them must be the top n;
        with the alpha count, its mean into `self._mean_count[slot]` and the current token's slot after the n (and the
        attended lengths)."""
        partial_q = self._partial_query(layer, q)
        if self.dynamic_count:  # the count, the current token's slot and the attended lengths
            lengths = self._lengths[slot]
            # the count bounds each sequence's count by its `positions` argument: here its fetch limit
            speculate_count_(torch.matmul(partial_q, self._partial_keys_t[layer]), self._uncached, self.ctx.scale,
                             self.alpha, self._count_cap, self._fetch_limit, self._ranked, self._mean_count[slot],
                             self._current[slot], lengths.valid_len, lengths.bias, self._count_scratch)
            ranked, ordered = self._ranked, True
        else:
            # the ranking needs neither the scale nor fp32: the bias only masks the slots not cached yet
            scores = torch.matmul(partial_q, self._partial_keys_t[layer])
            ranked, ordered = torch.add(self._uncached, scores.amax(dim=2, keepdim=True)), self._sorted_fetch
        torch.topk(ranked, self.capacity, dim=-1, sorted=ordered, out=(self._top_scores, self._ids[slot]))

    def _start_fetch(self, layer: int) -> None:
        """Host work (CUDA): the fetch count (with the alpha count, the wait for it), the counters, and the
        worker's gather of layer `layer`'s speculated tokens."""
        slot = layer % 2
        n = self._fetch_count
        if self.dynamic_count:
            # The method's one host sync: n sizes the fetch (the original calls .item() at the same point)
            mean_count = self._mean_count[slot].item()
            n = self._dynamic_fetch(mean_count)
            self._count_fetch([layer], n)
            self._lengths[slot].set_host([min(limit, n) + 1 for limit in self._fetch_limits])
        # the speculation is queued on the compute stream, after layer `layer - 2`'s attention that last read the
        # fetch target of this slot and wrote its new token there, which goes to the host tier first
        ready = torch.cuda.current_stream(self.ctx.device).record_event()
        if layer - 2 in self.sparse_layers:
            self._store_token(layer - 2, ready)
        self._pending[layer] = self.pool.submit(self._gather, layer, slot, n, ready)

    def _gather(self, layer: int, slot: int, n: int, ready: Any) -> Any:
        """Worker thread (CUDA): the first n speculated ids of each row to the host, the host rows they select
        gathered into pinned staging, and their copy to the front of the fetch target's rows."""
        ctx = self.ctx
        rows, head_dim = ctx.batch * ctx.num_kv_heads, ctx.head_dim
        ids_host = self._ids_host[slot][: rows * n].view(ctx.batch, ctx.num_kv_heads, n)
        self.copy.copy(ids_host, self._ids[slot][:, :, 0, :n], after=ready).synchronize()
        appended = self._appended[layer]  # the previous step's new token of this layer, in host memory
        if appended is not None:
            appended.synchronize()
        host_rows = torch.add(self._row_offset, ids_host, alpha=rows).view(-1)
        numel = rows * n * head_dim
        copied = None
        for host, staging, fetched in zip((self.host_k[layer], self.host_v[layer]), self._staging[slot],
                                          self._fetched[slot], strict=True):
            torch.index_select(host.view(-1, head_dim), 0, host_rows, out=staging[:numel].view(-1, head_dim))
            target = fetched[:, :, :n]
            copied = self.copy.copy(target, staging[:numel].view(target.shape), after=ready)
        return copied

    def decode_sparse(self, layer, q, k, v):
        ctx = self.ctx
        if layer == 0:  # no layer ahead of it: speculate with the true query, fetch now
            with ctx.timer.stage("predict"):
                self._prefetch(layer, q)
        if self._fetched is None:
            return self._decode_in_place(layer, q, k, v)
        slot = layer % 2
        with ctx.timer.stage("idle"):
            ctx.host(self._finish_fetch, layer)
        self._append_partial_key(layer, k)
        fetched_k, fetched_v = self._fetched[slot]
        fetched_k[self._batch_index, :, self._current[slot]] = k
        fetched_v[self._batch_index, :, self._current[slot]] = v
        return decode_attention(q, fetched_k, fetched_v, ctx.scale, lengths=self._lengths[slot])

    def _finish_fetch(self, layer: int) -> None:
        """Host work (CUDA): wait for layer `layer`'s fetch; the compute stream waits for its copy, the host not."""
        start = time.perf_counter()
        self._pending.pop(layer).result().wait()
        self._wait_ms[layer] += (time.perf_counter() - start) * 1e3

    def _store_token(self, layer: int, ready: Any) -> None:
        """Host work (CUDA): the worker copies layer `layer`'s new K/V from its fetch target (where decode wrote
        them, after the fetched tokens) to host memory, once the compute stream reaches the event `ready`. The copies
        follow this slot's fetch on the copy stream and precede its next one, which may overwrite them."""
        n = self._layer_count[layer]
        current = [min(limit, n) for limit in self._fetch_limits]
        self._last_store = self.pool.submit(self._copy_to_host, layer, layer % 2, list(self.step.positions_host),
                                            current, ready)

    def _copy_to_host(self, layer: int, slot: int, positions: list[int], current: list[int], ready: Any) -> None:
        """Worker thread (CUDA): the current token of each sequence into the host tier at its position."""
        fetched_k, fetched_v = self._fetched[slot]
        host_k, host_v = self.host_k[layer], self.host_v[layer]
        if min(positions) == max(positions):  # one slot, one position: one copy per tensor
            self.copy.copy(host_k[positions[0]], fetched_k[:, :, current[0]], after=ready)
            event = self.copy.copy(host_v[positions[0]], fetched_v[:, :, current[0]], after=ready)
        else:
            for b, (position, slot_b) in enumerate(zip(positions, current, strict=True)):
                self.copy.copy(host_k[position, b], fetched_k[b, :, slot_b], after=ready)
                event = self.copy.copy(host_v[position, b], fetched_v[b, :, slot_b], after=ready)
        self._appended[layer] = event  # copies on one stream: the last event covers them all

    def _decode_in_place(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The CPU path: the speculated tokens attended in place in the host tier, and the current token, merged
        by LSE."""
        ctx, step = self.ctx, self.step
        ids, n = self._selected.pop(layer)
        self._append_partial_key(layer, k)
        self.host_k[layer][step.positions, self._batch_index] = k  # the host tier is this device's memory
        self.host_v[layer][step.positions, self._batch_index] = v
        valid = self._cpu_valid
        if self.dynamic_count and not step.uniform:  # a short sequence has fewer tokens
            valid = self._fetch_limit.clamp(max=n)
        fetched = block_sparse_attention(q, *self._host_blocks[layer], ids, ctx.scale, valid)
        current = partial_attention(q, k[:, :, None], v[:, :, None], ctx.scale)
        with ctx.timer.stage("merge"):
            return merge_output(fetched, current, q.dtype)

    def _append_partial_key(self, layer: int, k: torch.Tensor) -> None:
        """The new token's partial key `[B, Hkv, 1, r]` at each sequence's device position."""
        self._partial_key_slots[layer][self._batch_index, :, self.step.positions] = torch.matmul(
            k.unsqueeze(2), self.partial_proj[layer])

    def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
        if hasattr(self, "_host_arena"):
            self._host_arena.release()

    # ------------------------------------------------------------------ accounting (memory, work: InfiniGenModel)
    def stats(self):
        ctx = self.ctx
        steps = max(self._steps, 1)
        elem_bytes = ctx.dtype.itemsize
        bytes_per_token = ctx.batch * ctx.num_kv_heads * 2 * ctx.head_dim * elem_bytes
        fetched = [n / steps for n in self._fetched_tokens]
        return {
            "tokens_fetched_per_layer": fetched,  # per (sequence, KV head), mean per step
            "bytes_h2d_per_layer": [n * bytes_per_token for n in fetched],
            **transfer_stats(self._h2d_bytes, self._d2h_bytes, self._steps),
            "fetch_wait_ms_per_layer": [ms / steps for ms in self._wait_ms],
            "fetch_wait_ms_per_step": sum(self._wait_ms) / steps,
            "partial_dim": self.partial_dim(ctx.head_dim),
            "device_kv_bytes": self.dense.stats()["device_kv_bytes"],
            "attended_tokens_per_head": self._attended.stats(self.budget),
        }
