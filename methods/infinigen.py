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
  budget - 1) (a host sync, timed as idle). Either way n >= 1 is the same for every head and sequence (in a
  ragged batch a short sequence's fetched slots past its own length are masked), and the top-n tokens of each (sequence, KV head) are fetched from host memory one layer ahead: a worker thread
  gathers them and copies them to the device on a copy stream while layer i computes. On a CPU-only run the
  "device" is host memory: layer i+1 reads its selected tokens in place in the host tier (no fetch copy); the
  transfer counters still count what the CUDA path moves.
- layer i+1 waits for its fetch (timed as idle) and attends exactly, with its true query, over the fetched tokens
  and the current token, merged by LSE.
GQA (the original is MHA-only): A, the channels and the selection are shared by the query heads of a KV group;
A and the channels come from the group's stacked queries, tokens are ranked by the max over the group's heads,
and the count is averaged over query heads as the original does. Layers below `dense_layers` keep their full KV
on the device and run dense. With dense_layers = 0, layer 0 has no previous layer: it speculates with its own
true query and fetches synchronously.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels import cpu_attention
from scoutbench.kernels.attention import block_sparse_attention, partial_attention
from scoutbench.kernels.backends import page_aligned
from scoutbench.kernels.gather import write_tokens
from scoutbench.kernels.offload import (
    PREFILL_CHUNK_TOKENS,
    CopyStream,
    CpuWorkerPool,
    HostArena,
    device_zeros,
    token_chunks,
)
from scoutbench.kernels.partial_state import merge_states
from scoutbench.methods.base import (
    DEFAULT_DENSE_LAYERS,
    OBS_WINDOW,
    AttendedTokens,
    Footprint,
    MethodContext,
    ModelShape,
    StepInfo,
    require,
    transfer_stats,
)
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord, Transfer


@dataclass
class InfiniGen(SparseLayerMethod):
    """Partial keys on the device, full KV on the host, the next layer's important tokens prefetched."""

    name = "infinigen"
    display_name = "InfiniGen"
    layer_ahead = True
    work_fractions = {"fetch_context_frac": 0.0}  # tokens fetched per (sequence, KV head, sparse layer) / context
    partial_ratio: float = 0.2  # fraction of head_dim kept as speculation channels
    alpha: float = 5.0  # a token counts if its speculated logit is within alpha of the head's max (inf: all)
    budget: int = 2048  # tokens attended per (sequence, KV head) and layer: budget - 1 fetched + the current one
    dynamic_count: bool = False  # the original's count: n = min(mean #tokens within alpha of the max, budget - 1)
    dense_layers: int = DEFAULT_DENSE_LAYERS

    def __post_init__(self) -> None:
        require(0.0 < self.partial_ratio <= 1.0, f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        require(self.alpha > 0.0, f"alpha must be > 0 (logit units; inf fetches every token), got {self.alpha}")
        require(self.budget >= 2, f"budget must be >= 2 (one fetched token plus the current one), got {self.budget}")
        self.check_dense_layers()

    def partial_dim(self, head_dim: int) -> int:
        return math.ceil(self.partial_ratio * head_dim)

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
        self.partial_keys = device_zeros({i: ((batch, kv_heads, ctx.max_len, channels), ctx.dtype)
                                          for i in self.sparse_layers}, ctx.device)
        self.skew: dict[int, torch.Tensor] = {}  # [Hkv, D, D] fp32, orthogonal
        self.partial_proj: dict[int, torch.Tensor] = {}  # [Hkv, D, channels]: the partial columns of the skew
        # CUDA: double-buffered fetch targets (layer i+1's fetch lands while layer i still reads the other buffer),
        # gathered by the worker into pinned staging first; each (sequence, KV head) row holds whole flashinfer pages
        # (the fetch is copied into the row's front), since a row of budget - 1 = 2047 tokens would leave flashinfer
        # only 1-token pages. CPU: no fetch, the tokens are read in place.
        self._fetched = self._staging = self._ids_host = None
        if on_cuda:
            fetch_shape = (batch, kv_heads, page_aligned(self.capacity), head_dim)
            self._fetched = [(torch.empty(fetch_shape, dtype=ctx.dtype, device=ctx.device),
                              torch.empty(fetch_shape, dtype=ctx.dtype, device=ctx.device)) for _ in range(2)]
            self._staging = [(arena["stage_k", slot], arena["stage_v", slot]) for slot in range(2)]
            self._ids_host = [arena["ids", slot] for slot in range(2)]
        self._selected: dict[int, torch.Tensor] = {}  # CPU: layer -> its speculated token ids [B, Hkv, n]
        # host row of token 0 of each (sequence, KV head) in the token-major host cache
        self._row_offset = torch.arange(batch * kv_heads, device=ctx.device).view(batch, kv_heads, 1)
        self.copy = CopyStream(ctx.device)
        self.pool = CpuWorkerPool(1, device=ctx.device)
        self._pending: dict[int, tuple[Any, int]] = {}  # layer -> (future of its fetch, n)
        self._appended: dict[int, Any] = {i: None for i in self.sparse_layers}  # event of the last host append
        self.reset_stats()

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

    # ------------------------------------------------------------------ decode
    def begin_step(self, step: StepInfo) -> None:
        super().begin_step(step)
        # [B, 1, 1, max_len]: slots not cached yet. Speculation scores the whole preallocated partial-key buffer and
        # masks them: a matmul over a prefix slice of it is 5x slower on CPU (a strided batch forces a copy).
        slots = torch.arange(self.ctx.max_len, device=self.ctx.device)
        self._uncached = (slots[None, :] >= step.positions[:, None])[:, None, None, :]
        self._steps += 1

    def before_layer(self, layer, hidden, normed):
        target = layer + 1
        if target in self.sparse_layers:
            self._launch_fetch(target, self.ctx.predict_query(target, hidden, normed))

    def speculate(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Speculated important tokens of `layer` for the query `q` `[B, Hq, D]`: (ids `[B, Hkv, n]`, n)."""
        ctx = self.ctx
        batch, num_heads, head_dim = q.shape
        partial_q = torch.matmul(q.reshape(batch, ctx.num_kv_heads, ctx.group_size, head_dim),
                                 self.partial_proj[layer])
        if not self.dynamic_count:  # on a CPU (fp32), scores and top-n in one call of the kernel library
            n = max(1, min(self.capacity, max(self.step.positions_host)))
            ids = cpu_attention.top_tokens(partial_q, self.partial_keys[layer], self.step.positions, n)
            if ids is not None:
                return ids, n
        scores = torch.matmul(partial_q, self.partial_keys[layer].transpose(-1, -2)).float().mul_(ctx.scale)
        scores.masked_fill_(self._uncached, float("-inf"))  # [B, Hkv, G, max_len]
        cached = max(self.step.positions_host)
        if self.dynamic_count:
            counts = (scores > scores.amax(dim=-1, keepdim=True) - self.alpha).sum(dim=-1)
            # The method's one host sync: n sizes the fetch (the original calls .item() at the same point). The
            # wait is the GPU's idle time, not prediction work, so it is timed as `idle`.
            with ctx.timer.stage("idle"):
                mean_count = counts.float().mean().item()
            n = max(1, min(int(mean_count), self.capacity, cached))
        else:  # a fixed fetch of budget - 1 tokens + the current one = the budget every sparse method gets, no sync
            n = max(1, min(self.capacity, cached))
        # the fetched tokens' order does not matter to their attention, except that a sequence holding fewer than n
        # tokens must have its valid ones first (decode masks the rest): only then sorted (2x slower at 32k on CPU)
        ordered = min(self.step.positions_host) < n
        return scores.amax(dim=2).topk(n, dim=-1, sorted=ordered).indices, n

    def _launch_fetch(self, layer: int, q: torch.Tensor) -> None:
        ids, n = self.speculate(layer, q)
        slot = layer % 2
        rows = self.ctx.batch * self.ctx.num_kv_heads
        host_rows = (ids * rows + self._row_offset).reshape(-1)
        self._fetched_tokens[layer] += n
        self._d2h_bytes += host_rows.numel() * 8  # the token ids, to the worker
        self._h2d_bytes += 2 * host_rows.numel() * self.ctx.head_dim * self.ctx.dtype.itemsize  # fetched K and V
        if self._fetched is None:  # CPU: decode reads the tokens in place
            self._selected[layer] = ids
            self._pending[layer] = (None, n)
            return
        slot_free = ids_ready = None
        if self._ids_host is not None:
            # the fetch buffer was last read by layer `layer - 2`'s attention, already queued on this stream
            slot_free = torch.cuda.current_stream(self.ctx.device).record_event()
            ids_ready = self.copy.copy(self._ids_host[slot][: host_rows.numel()], host_rows)
            host_rows = self._ids_host[slot][: host_rows.numel()]
        future = self.pool.submit(self._gather, layer, slot, host_rows, (ids_ready, self._appended[layer]), slot_free)
        self._pending[layer] = (future, n)

    def _gather(self, layer: int, slot: int, host_rows: torch.Tensor, inputs_ready: tuple, slot_free: Any) -> Any:
        """Worker thread (CUDA): gather the selected host rows into pinned staging and start their copy to the device."""
        for event in inputs_ready:
            if event is not None:
                event.synchronize()
        numel = host_rows.numel() * self.ctx.head_dim
        head_dim = self.ctx.head_dim
        copied = None
        for host, staging, fetched in zip((self.host_k[layer], self.host_v[layer]), self._staging[slot],
                                          self._fetched[slot], strict=True):
            torch.index_select(host.view(-1, head_dim), 0, host_rows, out=staging[:numel].view(-1, head_dim))
            target = fetched[:, :, : host_rows.numel() // (self.ctx.batch * self.ctx.num_kv_heads)]
            copied = self.copy.copy(target, staging[:numel].view(target.shape), after=slot_free)
        return copied

    def decode_sparse(self, layer, q, k, v):
        ctx, step = self.ctx, self.step
        if layer not in self._pending:  # no layer ahead of it: speculate with the true query, fetch now
            with ctx.timer.stage("predict"):
                self._launch_fetch(layer, q)
        future, n = self._pending.pop(layer)
        with ctx.timer.stage("attn_device"):
            self._append(layer, k, v)
        valid = valid_host = None
        if not step.uniform:  # a short sequence has fewer tokens
            valid, valid_host = step.positions.clamp(max=n), [min(p, n) for p in step.positions_host]
        # the speculated tokens a sequence really has, and the current one
        self._attended.add_host([min(p, n) + 1 for p in step.positions_host], ctx.num_kv_heads)
        if future is None:  # CPU: the speculated tokens in place, the host tier [N, B, Hkv, D] as [B, Hkv, N, 1, D]
            with ctx.timer.stage("attn_device"):
                blocks_k = self.host_k[layer].permute(1, 2, 0, 3).unsqueeze(3)
                blocks_v = self.host_v[layer].permute(1, 2, 0, 3).unsqueeze(3)
                fetched = block_sparse_attention(q, blocks_k, blocks_v, self._selected.pop(layer), ctx.scale, valid)
                current = partial_attention(q, k[:, :, None], v[:, :, None], ctx.scale)
            with ctx.timer.stage("merge"):
                return merge_states(fetched, current).o.to(q.dtype)
        with ctx.timer.stage("idle"):
            start = time.perf_counter()
            copied = future.result()
            if copied is not None:
                copied.wait()  # the compute stream waits for the copy; the host does not
            self._wait_ms[layer] += (time.perf_counter() - start) * 1e3
        with ctx.timer.stage("attn_device"):
            fetched_k, fetched_v = (buffer[:, :, :n] for buffer in self._fetched[layer % 2])
            fetched = partial_attention(q, fetched_k, fetched_v, ctx.scale, valid, valid_host)
            current = partial_attention(q, k[:, :, None], v[:, :, None], ctx.scale)
        with ctx.timer.stage("merge"):
            return merge_states(fetched, current).o.to(q.dtype)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new token: partial key to the device tier, K/V to host memory (asynchronously on CUDA)."""
        step = self.step
        partial_key = torch.matmul(k.unsqueeze(2), self.partial_proj[layer]).squeeze(2)
        write_tokens(self.partial_keys[layer], partial_key, step.positions, step.positions_host)
        host_k, host_v = self.host_k[layer], self.host_v[layer]
        if step.uniform:
            position = step.positions_host[0]
            self.copy.copy(host_k[position], k)
            event = self.copy.copy(host_v[position], v)
        else:
            for b, position in enumerate(step.positions_host):
                self.copy.copy(host_k[position, b], k[b])
                event = self.copy.copy(host_v[position, b], v[b])
        self._appended[layer] = event  # copies on one stream: the last event covers them all
        self._d2h_bytes += 2 * k.numel() * k.element_size()

    def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
        if hasattr(self, "_host_arena"):
            self._host_arena.release()

    # ------------------------------------------------------------------ accounting
    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        kv = shape.kv_bytes_per_token_layer(elem_bytes)
        dense, sparse = self.layer_split(shape)
        partial_keys = sparse * context_len * shape.num_kv_heads * self.partial_dim(shape.head_dim) * elem_bytes
        fetch = min(self.budget - 1, context_len)
        # the dense layers' FullKV rows and (on CUDA) the double-buffered fetch rows are whole 16-token pages
        device = dense * page_aligned(context_len) * kv + partial_keys + 2 * page_aligned(fetch) * kv
        # the host arena: the sparse layers' KV, and on CUDA the pinned staging of both fetch slots and their ids
        staging = 2 * fetch * (kv + shape.num_kv_heads * 8)
        # prefill (skewing): one chunk of fp32 keys and einsum's copy of it; the observed queries in fp32, their
        # einsum copy and their skewed product
        window = min(OBS_WINDOW, context_len)
        prefill = 4 * shape.head_dim * (2 * min(PREFILL_CHUNK_TOKENS, context_len) * shape.num_kv_heads
                                         + 3 * window * shape.num_heads)
        return Footprint(device, sparse * context_len * kv + staging, prefill)

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

    # ------------------------------------------------------------------ work model (project, gate --counters)
    @classmethod
    def measure_work(cls, run: RunRecord) -> dict[str, float]:
        fetched = run.sparse_layer_mean("tokens_fetched_per_layer") or 0.0
        return {"fetch_context_frac": fetched / run.shape.context_len}

    @classmethod
    def sparse_layer_work(cls, fractions: dict[str, float], config: dict[str, Any], terms: LayerTerms) -> LayerWork:
        """Speculation over every cached token's partial key, `budget - 1` tokens fetched one layer ahead (the
        alpha count only with dynamic_count). `terms.fetch_granularity`: `gathered` (this implementation, like
        its recall): the host gathers the selected tokens into a staging buffer, then K and V go in one copy each;
        `token`: one copy per token (all KV heads), as the ScoutAttention paper describes its InfiniGen baseline
        (section 2.3: "4 KB per token per layer ... 800 MB/s")."""
        shape = terms.shape
        m, B, N, e = shape.model, shape.batch, shape.context_len, shape.elem_bytes
        cap = config["budget"] - 1
        fetched = min(fractions["fetch_context_frac"] * N, cap, N) if config.get("dynamic_count") else min(cap, N)
        # the method's own channel count (ceil, as `partial_dim` takes it), not a rounded one
        partial_dim = math.ceil(config.get("partial_ratio", 0.2) * m.head_dim)
        speculation = B * N * m.num_kv_heads * partial_dim * e
        fetch_bytes = B * fetched * shape.kv_bytes_per_token
        gathered = terms.fetch_granularity == "gathered"
        return terms.layer("prefetch", predict_weight_bytes=terms.predict_weight_bytes, select_bytes=speculation,
                           device_kv_bytes=fetch_bytes, device_tokens=B * m.num_kv_heads * (fetched + 1),  # + current
                           host_gather_bytes=fetch_bytes if gathered else 0.0, d2h=terms.new_kv,
                           h2d=Transfer(fetch_bytes, (2 if fetched else 0) if gathered else B * fetched))
