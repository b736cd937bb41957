"""Query-prediction quality (paper Table 1): cosine similarity between ScoutAttention's predicted query
`Q_pred^{i+1}` (layer i+1's query weights applied to layer i's input, rotated at the current position) and the true
query `Q^{i+1}`, per layer, over real decode steps with exact (FullKV) attention.

The similarity is computed per (sequence, query head) on the post-RoPE vectors that block selection uses, and
averaged over heads, sequences and steps. Entry i of `per_layer` is the prediction of layer i+1 from layer i's input
(so there are num_layers - 1 entries). Both prediction variants are measured in the same run:
`next` (layer i+1's input norm applied to layer i's residual input, ScoutAttention's default) and `self`
(layer i's own normalised input, the literal `W_Q^{i+1} X^i`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from scoutbench.decode.engine import DecodeEngine
from scoutbench.methods.base import MethodContext
from scoutbench.methods.fullkv import FullKV
from scoutbench.results import envelope

VARIANTS = ("next", "self")


@dataclass
class QueryProbe(FullKV):
    """FullKV that also predicts every layer's query from the previous layer's input and scores the prediction."""

    name: ClassVar[str] = "query-probe"
    layer_ahead: ClassVar[bool] = True

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self._pred: dict[int, dict[str, torch.Tensor]] = {}
        self.sums = {v: torch.zeros(ctx.num_layers - 1, dtype=torch.float64) for v in VARIANTS}
        self.counts = torch.zeros(ctx.num_layers - 1, dtype=torch.long)

    def before_layer(self, layer: int, hidden: torch.Tensor, normed: torch.Tensor) -> None:
        target = layer + 1
        if target < self.ctx.num_layers:
            self._pred[target] = {"next": self.ctx.predict_query(target, hidden),
                                  "self": self.ctx.predict_query(target, hidden, normed)}

    def decode(self, layer, q, k, v):
        predicted = self._pred.pop(layer, None)
        if predicted is not None:
            for variant in VARIANTS:
                cos = F.cosine_similarity(predicted[variant].float(), q.float(), dim=-1)  # [B, Hq]
                self.sums[variant][layer - 1] += float(cos.double().sum())
            self.counts[layer - 1] += q.shape[0] * q.shape[1]
        return super().decode(layer, q, k, v)

    def result(self) -> dict[str, dict[str, Any]]:
        out = {}
        for variant in VARIANTS:
            per_layer = (self.sums[variant] / self.counts.clamp(min=1)).tolist()
            out[variant] = {"mean": sum(per_layer) / len(per_layer) if per_layer else None, "per_layer": per_layer}
        return out


def query_cosine(model_name: str = "tiny-qwen3", length: int = 1024, steps: int = 16, batch: int = 1,
                 device: str = "auto", dtype: str | None = None, seed: int = 0, pred_norm: str = "next",
                 loaded: Any = None, prompt_ids: torch.Tensor | None = None, force: bool = False) -> dict[str, Any]:
    """Prefill a prompt (random token ids, or `prompt_ids` `[B, N]`), decode `steps` greedy tokens, and return
    {model, len, steps, pred_norm, mean, per_layer, by_pred_norm: {next: ..., self: ...}}. The memory it will take
    is checked first, as a throughput run's is (`force`: run anyway)."""
    from scoutbench.bench.resolve import ThroughputConfig, check_memory
    from scoutbench.devices import resolve_device, resolve_dtype
    from scoutbench.models import check_context, load_model, loaded_context_window

    if pred_norm not in VARIANTS:
        raise ValueError(f"pred_norm must be one of {VARIANTS}")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if loaded is None:
        loaded = load_model(model_name, torch_device, torch_dtype, seed)
    model = loaded.model
    check_context(model_name, loaded_context_window(loaded), length + steps + 1, f"--len {length} plus {steps} "
                  "decode steps", "lower --len or --steps")  # real attention past the window is noise
    if prompt_ids is not None:
        batch, length = prompt_ids.shape
    run = ThroughputConfig(method="fullkv", model=model_name, length=length, batch=batch, steps=steps + 1, warmup=0,
                           count_steps=0, device=device, dtype=dtype, seed=seed, prefill="real", force=force)
    check_memory(run, QueryProbe(), loaded, batch)  # the probe holds FullKV's cache
    if prompt_ids is None:
        generator = torch.Generator().manual_seed(seed)
        prompt_ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
    batch, length = prompt_ids.shape
    probe = QueryProbe()
    started = time.time()
    with DecodeEngine(model, probe) as engine:
        engine.start(batch=batch, max_len=length + steps + 1)
        tokens = engine.prefill(prompt_ids.to(torch_device)).argmax(-1)
        for _ in range(steps):
            tokens = engine.decode_step(tokens).argmax(-1)
    by_variant = probe.result()
    chosen = by_variant[pred_norm]
    return {**envelope("scout_query_cosine"), "model": model_name, "len": length, "steps": steps, "batch": batch,
            "dtype": str(torch_dtype).removeprefix("torch."), "device": torch_device.type,
            "random_weights": bool(getattr(loaded, "random_weights", False)), "pred_norm": pred_norm,
            "mean": chosen["mean"], "per_layer": chosen["per_layer"], "by_pred_norm": by_variant,
            "elapsed_s": time.time() - started}
