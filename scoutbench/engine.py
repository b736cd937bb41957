"""The decode engine: an explicit layer loop over a Hugging Face decoder, with attention delegated to a method.

Per layer: input norm -> q/k/v projections -> q/k norm (Qwen3) -> RoPE -> method attention -> o_proj ->
residual -> post-attention norm -> MLP -> residual; then final norm -> lm_head. Every op is the HF module's own,
in HF's order and layout, so with the same attention function the logits are bit-identical to `model(...)`
(tests/test_engine.py), with one exception on a CPU: a decode step's work around attention (the attention prologue,
RMSNorms, plain `nn.Linear`s and a gated MLP's) goes through `kernels/cpu_decode` for the HF modules it knows, one
call where HF made ~45 torch ops and at the memory rate where torch's sgemv read weights at half of it; its sums
round differently (within fp32 rounding of HF's). `SCOUTBENCH_CPU_ATTENTION=torch` restores HF's modules.

Before a layer's attention the engine offers the method the layer's residual input (`before_layer`), which is where
ScoutAttention and InfiniGen predict the next layer's query.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from scoutbench import planning
from scoutbench.kernels import cpu_attention, cpu_decode
from scoutbench.kernels.attention import decode_attention, prefill_attention
from scoutbench.methods.base import OBS_WINDOW, AttentionMethod, MethodContext, StepInfo
from scoutbench.timing import StageTimer
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW


class DecodeEngine:
    def __init__(self, model: torch.nn.Module, method: AttentionMethod, timer: StageTimer | None = None):
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.method = method
        attn = self.layers[0].self_attn
        config = model.config
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")
        # per layer, the modules of a prologue `cpu_decode` reproduces, or None: resolved once, not on every call
        self._fusable = [self._fusable_prologue(layer.self_attn) for layer in self.layers]
        modeling = sys.modules[type(attn).__module__]
        self._apply_rope = modeling.apply_rotary_pos_emb
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.timer = timer or StageTimer(self.device)
        self._cos = self._sin = None
        self.positions: torch.Tensor | None = None
        self.positions_host: list[int] = []
        self.step_index = 0

    # ------------------------------------------------------------------ setup
    def start(self, batch: int, max_len: int) -> None:
        """Bind the method to this model and run shape; storage for `max_len` tokens per sequence."""
        # the method keeps its context, so a bound `self.predict_query` would make engine -> method -> engine a
        # reference cycle: a finished run's KV storage (GBs) then lived on until the next full garbage collection
        predict_query = weakref.WeakMethod(self.predict_query)
        ctx = MethodContext(
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, scale=self.scale, batch=batch, max_len=max_len, device=self.device,
            dtype=self.dtype, timer=self.timer,
            predict_query=lambda *args, **kwargs: predict_query()(*args, **kwargs),
        )
        self.method.bind(ctx)
        cpu_attention.library()  # built (first use: seconds) or found now, never inside a timed step
        self.step_index = 0

    # ------------------------------------------------------------------ projections
    def _qkv(self, layer: torch.nn.Module, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """HF's attention prologue: [B, L, hidden] -> q [B, Hq, L, D], k/v [B, Hkv, L, D], RoPE applied."""
        attn = layer.self_attn
        shape = (*normed.shape[:-1], -1, self.head_dim)
        q = _linear(attn.q_proj, normed).view(shape)
        k = _linear(attn.k_proj, normed).view(shape)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = _linear(attn.v_proj, normed).view(shape).transpose(1, 2)
        q, k = self._apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def predict_query(self, target_layer: int, hidden: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Rotated query of `target_layer` for the current token, from another layer's input `[B, hidden]`.

        With `normed=None` the target layer's own input norm is applied to `hidden` (the default prediction
        Q_pred^{i+1} = RoPE(q_norm(W_Q^{i+1} Norm_{i+1}(h^i)))); otherwise `normed` is used as is.
        """
        layer = self.layers[target_layer]
        attn = layer.self_attn
        x = (_norm(layer.input_layernorm, hidden) if normed is None else normed).reshape(hidden.shape[0], 1, -1)
        fused = self._fused_prologue(target_layer, x, with_kv=False)
        if fused is not None:
            return fused[0]
        q = _linear(attn.q_proj, x).view(x.shape[0], 1, -1, self.head_dim)
        if self.has_qk_norm:
            q = attn.q_norm(q)
        q = q.transpose(1, 2)
        q, _ = self._apply_rope(q, q[:, :1], self._cos, self._sin)
        return q[:, :, 0]

    def _fusable_prologue(self, attn: torch.nn.Module
                          ) -> tuple[torch.nn.Module, tuple[torch.nn.Module, torch.nn.Module] | None] | None:
        """(attention, its q/k norms or None) for one of `ROPE_ATTENTIONS` with plain linears (and `RMS_NORMS` q/k
        norms of one eps), else None: the HF modules `cpu_decode.attention_prologue` reproduces."""
        if type(attn).__name__ not in ROPE_ATTENTIONS:
            return None
        if any(type(p) is not torch.nn.Linear for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return None
        if not self.has_qk_norm:
            return attn, None
        q_norm, k_norm = attn.q_norm, attn.k_norm
        if not (type(q_norm).__name__ in RMS_NORMS and type(k_norm).__name__ in RMS_NORMS
                and q_norm.variance_epsilon == k_norm.variance_epsilon):
            return None
        return attn, (q_norm, k_norm)

    def _fused_prologue(self, layer: int, normed: torch.Tensor, with_kv: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """q `[B, Hq, D]` (and k, v `[B, Hkv, D]`) of layer `layer`'s decode step through
        `cpu_decode.attention_prologue`; None where it does not serve (the caller runs HF's modules)."""
        fusable = self._fusable[layer]
        if fusable is None:
            return None
        attn, norms = fusable
        qk_norm = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].variance_epsilon)
        return cpu_decode.attention_prologue(normed, attn.q_proj, (attn.k_proj, attn.v_proj) if with_kv else None,
                                             self.num_heads, self.num_kv_heads, self.head_dim, qk_norm, self._cos,
                                             self._sin)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
                on_layer: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Dense prefill of right-padded prompts `[B, L]`; hands each layer's K/V to the method.

        Returns the logits of each prompt's last token `[B, vocab]`. `on_layer(done, total)` reports progress
        (a long prefill is minutes on a CPU).
        """
        batch, seq_len = input_ids.shape
        if lengths is None:
            lengths = torch.full((batch,), seq_len, dtype=torch.long)
        lengths = lengths.to(self.device)
        x = self.inner.embed_tokens(input_ids.to(self.device))
        position_ids = torch.arange(seq_len, device=self.device).unsqueeze(0)
        cos, sin = self.inner.rotary_emb(x, position_ids)
        obs_index = self._obs_index(lengths, seq_len)
        for i, layer in enumerate(self.layers):
            residual = x
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.method.ingest_prefill(i, _gather_positions(q, obs_index), k, v, lengths)
            o = prefill_attention(q, k, v, self.scale).transpose(1, 2)
            o = o.reshape(batch, seq_len, -1).contiguous()
            x = residual + layer.self_attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            del q, k, v, o
            if on_layer is not None:
                on_layer(i + 1, self.num_layers)
        last = x[torch.arange(batch, device=self.device), lengths - 1].unsqueeze(1)
        logits = self.model.lm_head(self.inner.norm(last))[:, 0]
        self._set_positions(lengths)
        return logits

    def adopt_prefill(self, layer_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      lengths: torch.Tensor, on_layer: Callable[[int, int], None] | None = None) -> None:
        """Hand a prefill recorded by another engine (per layer: q_obs, k, v, as `ingest_prefill` got them) to this
        engine's method. The dense prefill is the same for every method, so comparing methods on one prompt needs
        it once (`generation.generate_texts_shared_prefill`, `SyntheticKVCache`)."""
        lengths = lengths.to(self.device)
        for i, (q_obs, k, v) in enumerate(layer_inputs):
            self.method.ingest_prefill(i, q_obs, k, v, lengths)
            if on_layer is not None:
                on_layer(i + 1, self.num_layers)
        self._set_positions(lengths)

    @torch.no_grad()
    def prefill_synthetic(self, lengths: torch.Tensor, seed: int = 0, key_skew: float = DEFAULT_KV_SKEW,
                          skew_block: int = 32, on_layer: Callable[[int, int], None] | None = None,
                          shared_kv: SyntheticKVCache | None = None) -> bool:
        """Skip the prompt's forward pass: fill every layer with random K/V (decode-only benchmarks). True when they
        came from `shared_kv` rather than drawn here.

        Keys and values are standard normal; with `key_skew > 0` each run of `skew_block` keys gets a log-normal
        magnitude (scale `exp(key_skew * N(0, 1))`): real KV caches have heavy-hitter regions that stay important
        across decode steps, which is the temporal locality block-sparse offloading relies on; i.i.d. keys
        (`key_skew=0`) make every step's selection independent, the worst case for ScoutAttention's resident set.
        No RoPE is applied: a standard normal vector rotated by any fixed rotation is again standard normal, so
        rotating keys and observation queries at their positions would change no statistic, at a read and write
        of every key per layer. The tensors are filled in fixed pieces, each from its own generator
        (`_fill_standard_normal_`), in parallel on a CPU.

        With `shared_kv`, a prefill it holds (same shape, lengths, seed and skew) is ingested from there, and one it
        admits is kept there for the next method. Otherwise one K and one V buffer serve every layer (methods copy
        what they keep, as the contract says): a fresh tensor per layer faulted its pages in again, 2 x 256 MB per
        layer of bench-attn16 at 32k.
        """
        batch = lengths.shape[0]
        seq_len = int(lengths.max())
        key = (tuple(lengths.tolist()), self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
               self.dtype, self.device, seed, key_skew, skew_block)
        kept = None if shared_kv is None else shared_kv.lookup(key)
        if kept is not None:
            self.adopt_prefill(kept, lengths, on_layer)
            return True
        lengths = lengths.to(self.device)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        obs_index = self._obs_index(lengths, seq_len)
        kv_shape = (batch, self.num_kv_heads, seq_len, self.head_dim)
        q_shape = (batch, self.num_heads, obs_index.shape[1], self.head_dim)
        if shared_kv is not None:
            shared_kv.clear()
        layer_bytes = (2 * math.prod(kv_shape) + math.prod(q_shape)) * self.dtype.itemsize
        keep = shared_kv is not None and shared_kv.admits(self.num_layers * layer_bytes, self.device)
        layers, k, v = [], None, None
        for i in range(self.num_layers):
            if keep or k is None:
                k = torch.empty(kv_shape, device=self.device, dtype=self.dtype)
                v = torch.empty_like(k)
            _fill_standard_normal_(k, generator)
            if key_skew > 0:
                num_runs = -(-seq_len // skew_block)
                scale = torch.exp(key_skew * torch.randn((batch, self.num_kv_heads, num_runs, 1), generator=generator,
                                                         device=self.device)).to(self.dtype)
                k.mul_(scale.repeat_interleave(skew_block, dim=2)[:, :, :seq_len])
            _fill_standard_normal_(v, generator)
            q = torch.randn(q_shape, generator=generator, device=self.device, dtype=self.dtype)
            self.method.ingest_prefill(i, q, k, v, lengths)
            if keep:
                layers.append((q, k, v))
            if on_layer is not None:
                on_layer(i + 1, self.num_layers)
        if keep:
            shared_kv.store(key, layers)
        self._set_positions(lengths)
        return False

    @staticmethod
    def _obs_index(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Positions `[B, W]` of each prompt's last W tokens (right-aligned per sequence)."""
        window = min(OBS_WINDOW, int(lengths.min()))
        offsets = torch.arange(window, device=lengths.device) - window
        return (lengths[:, None] + offsets[None, :]).clamp(min=0, max=seq_len - 1)

    def _set_positions(self, lengths: torch.Tensor) -> None:
        self.positions = lengths.clone().to(torch.long)
        self.positions_host = [int(n) for n in lengths.tolist()]
        self.step_index = 0

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for every sequence: tokens `[B]` -> next-token logits `[B, vocab]`."""
        method, timer = self.method, self.timer
        batch = tokens.shape[0]
        step = StepInfo(self.positions, list(self.positions_host), self.step_index)
        method.begin_step(step)
        x = self.inner.embed_tokens(tokens.view(batch, 1))
        self._cos, self._sin = self.inner.rotary_emb(x, self.positions.view(batch, 1))
        for i, layer in enumerate(self.layers):
            residual = x
            with timer.stage("qkv_proj"):
                normed = _norm(layer.input_layernorm, x)
            if method.layer_ahead:
                with timer.stage("predict"):
                    method.before_layer(i, x[:, 0], normed[:, 0])
            with timer.stage("qkv_proj"):
                fused = self._fused_prologue(i, normed, with_kv=True)
                if fused is None:
                    q, k, v = (t[:, :, 0] for t in self._qkv(layer, normed, self._cos, self._sin))
                else:
                    q, k, v = fused
            o = method.decode(i, q, k, v)
            with timer.stage("o_proj"):
                x = residual + _linear(layer.self_attn.o_proj, o.reshape(batch, 1, -1).contiguous())
            with timer.stage("mlp"):
                x = x + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, x))
        method.end_step()
        logits = _linear(self.model.lm_head, _norm(self.inner.norm, x))[:, 0]
        self.positions = self.positions + 1
        self.positions_host = [p + 1 for p in self.positions_host]
        self.step_index += 1
        self.last_hidden = x[:, 0]
        return logits


# HF's modules whose forward `kernels/cpu_decode` reproduces (a decode step on a CPU takes the kernel for them):
# MLPs that are exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, LlamaRMSNorm and its copies, and attentions
# whose prologue is q/k/v projections, optional q/k RMSNorms and rotate-half RoPE with the model's cos/sin
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
ROPE_ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` through `cpu_decode` (which hands what it does not serve to `F.linear`)."""
    if type(module) is torch.nn.Linear:
        return cpu_decode.linear(x, module.weight, module.bias)
    return module(x)


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; one of `RMS_NORMS` through `cpu_decode` where it serves the call."""
    if type(module).__name__ in RMS_NORMS:
        out = cpu_decode.rms_norm(x, module.weight, module.variance_epsilon)
        if out is not None:
            return out
    return module(x)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp(x)`; one of `GATED_MLPS` computed as its forward does, with its linears through `_linear`. Any other
    MLP runs as its module."""
    if type(mlp).__name__ in GATED_MLPS:
        return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
    return mlp(x)


def _gather_positions(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q `[B, H, L, D]`, index `[B, W]` -> `[B, H, W, D]`."""
    batch, heads, _, dim = q.shape
    idx = index[:, None, :, None].expand(batch, heads, index.shape[1], dim)
    return torch.gather(q, 2, idx)


class SyntheticKVCache:
    """One synthetic prefill's per-layer `(q_obs, k, v)` (DecodeEngine.prefill_synthetic), kept between the methods of
    one run on a CPU so that every method after the first ingests the very same tensors instead of drawing them
    again: random K/V come at about 1.2 GB/s on 2 cores, 4 s of each method's prefill at bench-attn16 32k (4.3 GB).

    It holds one prefill at a time, and only while host memory allows: `admits` keeps a prefill only where it fits
    in the usable host memory left once the running method has allocated its caches, and `make_room` drops it
    before a run whose planned memory would not fit beside it. On CUDA nothing is kept: drawing there takes
    milliseconds, and device memory is the scarce tier.
    """

    def __init__(self) -> None:
        self.key: Any = None
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def lookup(self, key: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """The kept layers of the prefill that `key` describes, or None."""
        return self.layers if self.layers and key == self.key else None

    def admits(self, nbytes: int, device: torch.device) -> bool:
        """Whether a prefill of `nbytes` on `device` may be kept (asked after `clear`, the run's caches allocated)."""
        usable = planning.usable_host_bytes()
        return device.type == "cpu" and usable is not None and nbytes <= usable

    def store(self, key: Any, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.key, self.layers = key, layers

    def make_room(self, need_bytes: int) -> None:
        """Drop the kept prefill if a run that will allocate `need_bytes` would not fit beside it."""
        usable = planning.usable_host_bytes()
        if self.layers and usable is not None and need_bytes > usable:
            self.clear()

    def clear(self) -> None:
        self.key, self.layers = None, []


# elements per piece of a synthetic K/V tensor, each piece from its own generator: the pieces, hence the values, do not
# depend on the thread count, and a 32k bench-attn16 tensor (134 MB in fp32) makes 16 of them
SYNTHETIC_PIECE_ELEMENTS = 1 << 21


def _fill_standard_normal_(x: torch.Tensor, generator: torch.Generator) -> None:
    """Fill contiguous `x` with N(0, 1), one seed per piece drawn from `generator`, the pieces in parallel on a CPU.

    torch's CPU `normal_` runs on one thread (a generator is sequential); at about 0.6 GB/s the random K/V were
    most of the default benchmark's wall time. Measured on 2 cores: 0.11-0.14 s instead of 0.23-0.26 s for one 134
    MB tensor.
    """
    flat = x.view(-1)
    pieces = flat.split(SYNTHETIC_PIECE_ELEMENTS)
    seeds = torch.randint(2**62, (len(pieces),), generator=generator, device=generator.device).tolist()

    def fill(piece: torch.Tensor, piece_seed: int) -> None:
        piece.normal_(generator=torch.Generator(device=x.device).manual_seed(piece_seed))

    workers = min(torch.get_num_threads(), len(pieces)) if x.device.type == "cpu" else 1
    if workers <= 1:
        for piece, piece_seed in zip(pieces, seeds, strict=True):
            fill(piece, piece_seed)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, pieces, seeds))


def register_hf_attention(name: str = "scoutbench_fullkv") -> str:
    """Register scoutbench's FullKV kernels with transformers under a namespaced name (nothing is replaced).

    Used to check the engine against `model(...)` and to time stock `generate` with the same kernels.
    """
    from transformers import AttentionInterface

    def attention(module: Any, query, key, value, attention_mask, scaling=None, **kwargs):
        scale = scaling if scaling is not None else module.scaling
        if query.shape[2] == 1:
            out = decode_attention(query[:, :, 0], key, value, scale).unsqueeze(1)
        else:
            out = prefill_attention(query, key, value, scale).transpose(1, 2)
        return out, None

    AttentionInterface.register(name, attention)
    return name
