"""The decode engine: an explicit layer loop over a Hugging Face decoder, with attention delegated to a method.

Per layer: input norm -> q/k/v projections -> q/k norm (Qwen3) -> RoPE -> method attention -> o_proj ->
residual -> post-attention norm -> MLP -> residual; then final norm -> lm_head. The prefill runs HF's modules in
HF's order and layout. A decode step's work around attention runs in one of the forms of `decode.ops`: the CPU
kernel's, a fused torch form with few calls per layer (CUDA), or HF's modules (`SCOUTBENCH_DECODE_OPS=hf`), with
which and the same attention function the logits are bit-identical to `model(...)` (tests/engine/test_engine.py).

Before a layer's attention the engine offers the method the layer's residual input (`before_layer`), which is where
ScoutAttention and InfiniGen predict the next layer's query.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from scoutbench.decode.graphs import GraphRunner
from scoutbench.decode.ops import DecodeOps, choose_form
from scoutbench.kernels import cpu_attention, hf_forward
from scoutbench.kernels.attention import decode_attention, prefill_attention
from scoutbench.methods.base import OBS_WINDOW, AttentionMethod, MethodContext, StepInfo
from scoutbench.timing import StageTimer
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW
from scoutbench.workloads.synthetic_kv import SyntheticKVCache, SyntheticPrefill


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
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.timer = timer or StageTimer(self.device)
        self.ops: DecodeOps | None = None  # the decode step's model work (decode/ops.py), made by `start`
        self.graphs: GraphRunner | None = None  # when the decode steps replay captured CUDA graphs
        self.graphs_failure: str | None = None  # why graphs were asked for and not used
        self._cos = self._sin = None
        self.positions: torch.Tensor | None = None
        self.positions_host: list[int] = []
        self.step_index = 0

    # ------------------------------------------------------------------ setup
    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The end of a `with DecodeEngine(...)` block closes the method (its workers, copy streams and host
        memory), on every path: a run that fails still releases them."""
        self.method.close()

    @contextlib.contextmanager
    def closed_on_failure(self) -> Iterator[DecodeEngine]:
        """For an engine set up here and handed on to a caller who ends it with `with` (`api.decode_engine`,
        `SharedPrefill.engine`): a setup that raises (start, prefill) closes the method; one that does not leaves
        it open for the caller's `with`."""
        try:
            yield self
        except BaseException:
            self.method.close()
            raise

    def start(self, batch: int, max_len: int, cuda_graphs: bool = False) -> None:
        """Bind the method to this model and run shape; storage for `max_len` tokens per sequence. With
        `cuda_graphs` (a CUDA device) the decode steps replay captured graphs (scoutbench/decode/graphs.py)."""
        # the method keeps its context, so a bound `self.predict_query` would make engine -> method -> engine a
        # reference cycle, which would keep a finished run's KV storage (GBs) until the next full garbage collection
        predict_query = weakref.WeakMethod(self.predict_query)
        host = weakref.WeakMethod(self.host)
        ctx = MethodContext(
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, scale=self.scale, batch=batch, max_len=max_len, device=self.device,
            dtype=self.dtype, timer=self.timer,
            predict_query=lambda *args, **kwargs: predict_query()(*args, **kwargs),
            host=lambda *args: host()(*args), graphs=cuda_graphs,
        )
        self.ops = DecodeOps(self.model, choose_form(self.device), max_len)
        self.method.bind(ctx)
        self.graphs, self.graphs_failure = None, None
        if cuda_graphs:
            try:
                self.graphs = GraphRunner(self, batch)
            except Exception as exc:  # noqa: BLE001 - graphs unavailable here (a torch without them): eager, and why
                self.graphs_failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"scoutbench: warning: CUDA graphs unavailable ({self.graphs_failure}); decoding eagerly",
                      file=sys.stderr)
        cpu_attention.library()  # built (first use: seconds) or found now, never inside a timed step
        self.step_index = 0

    def host(self, fn: Callable[..., None], *args: Any) -> None:
        """Host work inside the decode step (a hand-off to the CPU worker, a wait, a recall): run now, or with
        CUDA graphs recorded as a point between captured pieces and run there at every replay
        (`MethodContext.host`)."""
        if self.graphs is not None and self.graphs.capturing:
            self.graphs.host(fn, args)
        else:
            fn(*args)

    def predict_query(self, target_layer: int, hidden: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Rotated query `[B, Hq, D]` of `target_layer` for the current token, from another layer's input
        `[B, hidden]`.

        With `normed=None` the target layer's own input norm is applied to `hidden` (the default prediction
        Q_pred^{i+1} = RoPE(q_norm(W_Q^{i+1} Norm_{i+1}(h^i)))); otherwise `normed` is used as is.
        """
        ops = self.ops
        if normed is None:
            normed = ops.norm(self.layers[target_layer].input_layernorm, hidden)
        return ops.query(target_layer, normed, self._cos, self._sin)

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
            q, k, v = hf_forward.attention_prologue(layer.self_attn, layer.input_layernorm(x), cos, sin)
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
        """Skip the prompt's forward pass: ingest the synthetic workload's random K/V for every layer
        (`workloads/synthetic_kv.py`; decode-only benchmarks). True when they came from `shared_kv` rather than
        drawn here."""
        prefill = SyntheticPrefill(tuple(lengths.tolist()), self._obs_index(lengths, int(lengths.max())).shape[1],
                                   self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                                   self.device, seed, key_skew, skew_block)
        layers, reused = prefill.layers(shared_kv)
        self.adopt_prefill(layers, lengths, on_layer)
        return reused

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
        """One decode step for every sequence: tokens `[B]` -> next-token logits `[B, vocab]`.

        The method's `begin_step` (its per-step plan: host arithmetic, device metadata written in place) and
        `end_step` run eagerly; the layer loop between them (`forward_step`) runs eagerly or, with CUDA graphs,
        as the replay of its captured pieces (scoutbench/decode/graphs.py). `self.positions` is updated in place: the
        captured pieces read that buffer."""
        method = self.method
        step = StepInfo(self.positions, list(self.positions_host), self.step_index)
        method.begin_step(step)
        logits = self.forward_step(tokens) if self.graphs is None else self.graphs.step(tokens, method.graph_key())
        method.end_step()
        self.positions.add_(1)
        self.positions_host = [p + 1 for p in self.positions_host]
        self.step_index += 1
        return logits

    def forward_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The layer loop of a decode step: tokens `[B]` -> logits `[B, vocab]`. Everything per step that it reads
        comes from device tensors (tokens, positions, the method's metadata), so that a captured replay of it is
        that step (tests/emulation/test_graphs.py)."""
        method, timer, ops = self.method, self.timer, self.ops
        x = self.inner.embed_tokens(tokens)  # [B, hidden]
        self._cos, self._sin = ops.rotary(self.positions)
        for i, layer in enumerate(self.layers):
            residual = x
            with timer.stage("qkv_proj"):
                normed = ops.norm(layer.input_layernorm, x)
            if method.layer_ahead:
                with timer.stage("predict"):
                    method.before_layer(i, x, normed)
            with timer.stage("qkv_proj"):
                q, k, v = ops.prologue(i, normed, self._cos, self._sin)
            with timer.stage("attn_device"):  # a method's own stages inside (idle, merge) count as theirs
                o = method.decode(i, q, k, v)
            with timer.stage("o_proj"):
                x = ops.residual_linear(residual, layer.self_attn.o_proj, o)
            with timer.stage("mlp"):
                x = ops.mlp_residual(layer, x)
        self.last_hidden = x
        return ops.linear(self.model.lm_head, ops.norm(self.inner.norm, x))


def _gather_positions(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q `[B, H, L, D]`, index `[B, W]` -> `[B, H, W, D]`."""
    batch, heads, _, dim = q.shape
    idx = index[:, None, :, None].expand(batch, heads, index.shape[1], dim)
    return torch.gather(q, 2, idx)


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
