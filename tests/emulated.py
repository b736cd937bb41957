"""Helpers of the emulated-CUDA tests: a method's CUDA path (scoutbench/testing/emulated_cuda) against its CPU path on
the same weights and teacher-forced tokens, with every host-device sync and copy recorded; the flashinfer
stand-in (tests/flashinfer_standin.py) installed as `flashinfer`."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from scoutbench.decode.engine import DecodeEngine
from scoutbench.kernels import backends, flashinfer_decode
from scoutbench.methods.base import AttentionMethod
from scoutbench.testing.emulated_cuda import EMULATED_DEVICE, SyncSite, emulated_cuda, to_emulated_device

LENGTHS = [120, 83]  # the comparisons' ragged batch (tests/emulation/conftest.py's `prompt`)
ATOL = 2e-4  # fp32 logits: the CUDA branches compute attention with other (equally exact) kernels


def allowed_syncs(config: dict[str, Any]) -> list[tuple[str, str]]:
    """Host syncs a method documents, as (file suffix, source text of the line); any other sync fails:
    - InfiniGen with dynamic_count=True (the original's count): one `.item()` per sparse layer;
    - ScoutAttention with dense_layers=0 and layer-ahead prediction: layer 0 has no layer ahead of it, so its CPU
      part runs inline with the true query, and the host waits for that query's copy (and for the reuse events
      of the host buffers it fills)."""
    allowed = []
    if config.get("dynamic_count"):
        allowed.append(("methods/infinigen.py", "int(mean_count.item())"))
    if config.get("dense_layers") == 0 and config.get("pc") and not config.get("oracle"):
        allowed.append(("runtime/scout_transport.py", "event.synchronize()"))
    return allowed


@dataclass
class EmulatedRun:
    """One method decoded on the CPU and on emulated CUDA from the same prompt, token by token."""

    cpu_logits: list[torch.Tensor]
    cuda_logits: list[torch.Tensor]
    syncs: list[SyncSite]
    cpu_stats: dict[str, Any]
    cuda_stats: dict[str, Any]
    backends: dict[str, int]  # calls per device:backend over the decode steps
    transfers: dict[str, float]  # bytes per decode step the emulator saw, "h2d" and "d2h"
    side_items: int  # work items the copy streams executed
    config: dict[str, Any] = field(default_factory=dict)  # the method's fields
    copied: dict = field(default_factory=dict)  # bytes over the timed steps by (direction, stream kind, dtype)
    step_ms: list[float] = field(default_factory=list)
    graphs: dict[str, Any] | None = None  # GraphRunner.describe() of a run with CUDA graphs
    backends_by_stage: dict[str, dict[str, int]] = field(default_factory=dict)  # the same per stage

    def max_diff(self) -> list[float]:
        return [float((a - b).abs().max()) for a, b in zip(self.cpu_logits, self.cuda_logits, strict=True)]

    def unexpected_syncs(self) -> list[SyncSite]:
        allowed = allowed_syncs(self.config)
        return [s for s in self.syncs if not any(s.filename.endswith(f) and text in s.line for f, text in allowed)]


def teacher_tokens(model: torch.nn.Module, method: AttentionMethod, prompt: torch.Tensor, lengths: torch.Tensor,
                   steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
    """The CPU path: its logits at the prefill and every step, the greedy tokens it chose, its statistics."""
    engine = DecodeEngine(model, method)
    engine.start(prompt.shape[0], int(lengths.max()) + steps)
    try:
        logits = [engine.prefill(prompt, lengths)]
        method.reset_stats()
        tokens = []
        for _ in range(steps):
            tokens.append(logits[-1].argmax(-1))
            logits.append(engine.decode_step(tokens[-1]))
        return logits, tokens, method.stats()
    finally:
        method.close()


def run_emulated(model: torch.nn.Module, make_method: Callable[[], AttentionMethod], prompt: torch.Tensor,
                 lengths: torch.Tensor, steps: int, *, timed_steps: bool = True, lazy: bool = True,
                 reference: tuple | None = None, on_runtime: Callable[[Any], None] | None = None,
                 side_item_delay_s: float = 0.0, cuda_graphs: bool = False) -> EmulatedRun:
    """Decode `steps` tokens with the method's CPU path and then its CUDA path on emulated CUDA.

    `timed_steps`: each step between the StageTimer's begin/end (CUDA events, one synchronize at the end, as the
    throughput runner does); otherwise no host sync at all between steps but the read of the logits (as a
    generation loop). `reference` reuses a CPU run of `teacher_tokens`. Syncs are recorded inside decode_step.
    `cuda_graphs`: the steps replay captured graphs (the first eager, the second captured); `graphs` then holds the
    runner's record."""
    cpu_logits, tokens, cpu_stats = reference or teacher_tokens(model, make_method(), prompt, lengths, steps)
    with emulated_cuda(lazy=lazy, side_item_delay_s=side_item_delay_s) as runtime:
        if on_runtime is not None:
            on_runtime(runtime)
        cuda_model = to_emulated_device(copy.deepcopy(model))
        method = make_method()
        engine = DecodeEngine(cuda_model, method)
        engine.start(prompt.shape[0], int(lengths.max()) + steps, cuda_graphs=cuda_graphs)
        backends.USAGE.reset()
        try:
            cuda_logits = [engine.prefill(prompt.to(EMULATED_DEVICE), lengths).cpu()]
            device_tokens = [token.to(EMULATED_DEVICE) for token in tokens]
            method.reset_stats()
            runtime.transfers.clear()
            side_before = sum(s.done for s in runtime.streams if not s.is_default)
            syncs, step_ms, moved = [], [], {"h2d": 0, "d2h": 0}
            copied: dict = {}
            for token in device_tokens:
                if timed_steps:
                    engine.timer.begin_step()
                before = {d: runtime.transferred(d) for d in moved}
                detail = dict(runtime.transfers)
                with runtime.detect_syncs() as found:
                    logits = engine.decode_step(token)
                syncs += found
                for key, n in runtime.transfers.items():
                    copied[key] = copied.get(key, 0) + n - detail.get(key, 0)
                for direction in moved:
                    moved[direction] += runtime.transferred(direction) - before[direction]
                if timed_steps:
                    step_ms.append(engine.timer.end_step()["total"])
                cuda_logits.append(logits.cpu())
            transfers = {d: n / steps for d, n in moved.items()}
            torch.cuda.synchronize()
            side_items = sum(s.done for s in runtime.streams if not s.is_default) - side_before
            return EmulatedRun(cpu_logits, cuda_logits, syncs, cpu_stats, method.stats(), backends.USAGE.snapshot(),
                               transfers, side_items, method.config(), copied, step_ms,
                               engine.graphs.describe() if engine.graphs is not None else None,
                               backends.USAGE.by_stage())
        finally:
            method.close()


def emulated_model(model: torch.nn.Module) -> torch.nn.Module:
    return to_emulated_device(copy.deepcopy(model))


@contextlib.contextmanager
def flashinfer_standin(version: str | None = None) -> Iterator[Any]:
    """Install tests/flashinfer_standin.py as `flashinfer` (optionally claiming another release's version)."""
    import flashinfer_standin as standin

    saved_version = standin.__version__
    previous = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = standin
    if version is not None:
        standin.__version__ = version
    _clear_backend_caches()
    standin.BatchDecodeWithPagedKVCacheWrapper.plans = standin.BatchDecodeWithPagedKVCacheWrapper.runs = 0
    try:
        yield standin
    finally:
        standin.__version__ = saved_version
        if previous is None:
            sys.modules.pop("flashinfer", None)
        else:
            sys.modules["flashinfer"] = previous
        _clear_backend_caches()


def _clear_backend_caches() -> None:
    for module in (backends, flashinfer_decode):
        for name in dir(module):
            cached = getattr(module, name)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()


def small_qwen3(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> torch.nn.Module:
    """A 3-layer random Qwen3 small enough that 64 emulated decode steps of every method stay cheap (the
    emulator's cost is per torch call, not per FLOP)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
