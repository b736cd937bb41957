"""Greedy generation with the DecodeEngine and any attention method, matching HF `generate(do_sample=False,
num_beams=1)`: dense prefill, then argmax decode steps until `max_new_tokens` or a stop token (which, as in HF, is
part of the output; decoding with `skip_special_tokens` removes EOS but keeps a newline stop).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scoutbench.decode.engine import DecodeEngine
from scoutbench.errors import UsageError
from scoutbench.method_args import BUDGET, MethodSettings, has_field, resolve_method_args
from scoutbench.methods import METHODS, build_method
from scoutbench.methods.base import AttentionMethod, dense_layers_of
from scoutbench.methods.sparse import dense_if_budget_covers
from scoutbench.timing import StageTimer


@dataclass(frozen=True)
class MethodSpec:
    """A method name plus `--method-arg` overrides; `build()` makes a fresh instance per prompt (and the caller
    closes it), so no state or worker leaks from one prompt into the next."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def build(self) -> AttentionMethod:
        return build_method(self.name, self.args)

    def build_for(self, context_tokens: int) -> AttentionMethod:
        """A fresh method for a run that holds `context_tokens` tokens: FullKV when the budget covers them all
        (methods.sparse.dense_if_budget_covers)."""
        return dense_if_budget_covers(self.build(), context_tokens)[0]

    def describe(self) -> dict[str, Any]:
        """`method`, `method_config` and `method_repr`, as in throughput results, and `method_identity`, what names
        its folder (methods/declarations.py, `MethodArgs.identity`)."""
        method = self.build()
        try:
            return {"method": METHODS.canonical(self.name), "method_config": method.config(),
                    "method_repr": repr(method), "method_identity": method.identity(),
                    "dense_layers": dense_layers_of(method)}
        finally:
            method.close()


def method_spec(name: str, method_args: dict[str, Any] | None = None, budget: int | None = None,
                dense_layers: int | None = None, block_size: int | None = None) -> MethodSpec:
    """One method's spec: `--budget`, `--dense-layers` and `--method-arg` resolved into its fields by the rules every
    command shares (scoutbench.method_args: a flag the method has no field for, or one that a `--method-arg` also
    sets, is a usage error)."""
    return method_specs([name], method_args, None if budget is None else [budget], dense_layers, block_size)[0]


def method_specs(names: list[str], method_args: dict[str, Any] | None = None,
                 budgets: list[int] | None = None, dense_layers: int | None = None,
                 block_size: int | None = None) -> list[MethodSpec]:
    """Every configuration of a comparison, in order: each method once per budget when it has a budget field,
    once otherwise (FullKV). The fields are resolved by scoutbench.method_args for every budget; each spec is built
    once now, so that a bad value fails before any model load or output."""
    resolved = [resolve_method_args(names, MethodSettings.of(method_args, budget=budget, block_size=block_size,
                                                             dense_layers=dense_layers))
                for budget in (budgets or [None])]
    specs = []
    for name in names:
        for per_method in resolved if has_field(name, BUDGET) else resolved[:1]:
            spec = MethodSpec(name, per_method[name])
            spec.build().close()
            specs.append(spec)
    return specs


def model_eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """The stop tokens HF generate uses by default: the generation config's EOS (int or list), else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def silent_timer(device: torch.device) -> StageTimer:
    """Generation is not timed: a disabled timer keeps the engine's stage bookkeeping from piling up."""
    timer = StageTimer(device)
    timer.enabled = False
    return timer


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, method: AttentionMethod, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: frozenset[int] = frozenset(), min_new_tokens: int = 0) -> list[int]:
    """New token ids for one prompt. The first `min_new_tokens` steps cannot pick a stop token (HF min_length).
    `method` is closed at the end, on every path (a fresh one per run: `MethodSpec.build_for`)."""
    _check_max_new_tokens(max_new_tokens)
    device = next(model.parameters()).device
    with DecodeEngine(model, method, silent_timer(device)) as engine:
        engine.start(batch=1, max_len=len(prompt_ids) + max_new_tokens)
        logits = engine.prefill(torch.tensor([prompt_ids], dtype=torch.long, device=device))
        return _greedy_decode(engine, logits, max_new_tokens, stop_ids, min_new_tokens).token_ids


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


@dataclass
class Generation:
    """New token ids of one greedy run and, for its first `keep_steps` decode steps, what the model predicted
    after each fed token: log-probabilities `[steps, vocab]` (fp32) and final hidden states `[steps, hidden]`."""

    token_ids: list[int]
    log_probs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    method_stats: dict[str, Any] | None = None  # the method's `stats()` after the last step (teacher forcing)
    step_ms: list[float] | None = None  # wall time of each decode step (teacher forcing)


def _greedy_decode(engine: DecodeEngine, logits: torch.Tensor, max_new_tokens: int, stop_ids: frozenset[int],
                   min_new_tokens: int, keep_steps: int = 0) -> Generation:
    """Argmax decode from the prefill's last-token logits until a stop token or `max_new_tokens`."""
    blocked = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    generated: list[int] = []
    trace = _StepTrace()
    while True:
        if len(generated) < min_new_tokens and len(blocked):
            logits = logits.clone()  # the caller's (possibly shared) prefill logits stay untouched
            logits[:, blocked] = float("-inf")
        token = logits.argmax(-1)
        generated.append(int(token))
        if generated[-1] in stop_ids or len(generated) == max_new_tokens:
            return Generation(generated, *trace.stacked())
        logits = engine.decode_step(token)
        if len(generated) <= keep_steps:
            trace.record(logits, engine)


class _StepTrace:
    """Per decode step: log-softmax of the logits and the final hidden state (fidelity compares these)."""

    def __init__(self) -> None:
        self.log_probs: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []

    def record(self, logits: torch.Tensor, engine: DecodeEngine) -> None:
        self.log_probs.append(torch.log_softmax(logits[0].float(), dim=-1))
        self.hidden.append(engine.last_hidden[0].float())

    def stacked(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.log_probs:
            return None, None
        return torch.stack(self.log_probs), torch.stack(self.hidden)


@dataclass
class _PrefillRecorder(AttentionMethod):
    """Keeps what the dense prefill hands a method, so several methods can start from one prefill."""

    layer_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def ingest_prefill(self, layer, q_obs, k, v, lengths):
        self.layer_inputs.append((q_obs, k, v))


class SharedPrefill:
    """One dense prefill of one prompt, from which any number of methods decode: the prefill does not depend on
    the method (every method only reads the prefill's K/V), so comparing methods on a long prompt pays for it once,
    and each method still decodes exactly what its own full run decodes (tests/eval/test_passkey.py,
    tests/eval/test_accuracy.py). The recorded K/V of every layer is held until the object is dropped."""

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, prompt_ids: list[int],
                 recorded: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None):
        """Runs the prefill, unless `recorded` (logits, per-layer inputs) holds one of this prompt (`cached`)."""
        self.model = model
        self.prompt_ids = prompt_ids
        self.device = next(model.parameters()).device
        if recorded is None:
            recorder = _PrefillRecorder()
            with DecodeEngine(model, recorder, silent_timer(self.device)) as engine:
                engine.start(batch=1, max_len=len(prompt_ids))
                recorded = engine.prefill(torch.tensor([prompt_ids], dtype=torch.long, device=self.device)), \
                    recorder.layer_inputs
        self.logits, self._layer_inputs = recorded
        self._lengths = torch.tensor([len(prompt_ids)], dtype=torch.long)

    @classmethod
    def cached(cls, model: torch.nn.Module, prompt_ids: list[int], path: str | Path,
               settings: dict[str, Any]) -> SharedPrefill:
        """The prefill of `prompt_ids` from the file `path` when it was made with the same `settings` (the model,
        its dtype: whatever makes the K/V differ) and prompt, else run now and saved there atomically (a kill
        leaves no partial file). A long prompt's prefill costs minutes on a CPU; each experiment on it then
        starts from the file."""
        path = Path(path)
        key = {**settings, "prompt_sha256": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()}
        if path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("key") == key:
                device = next(model.parameters()).device
                layers = [tuple(t.to(device) for t in layer) for layer in saved["layer_inputs"]]
                return cls(model, prompt_ids, (saved["logits"].to(device), layers))
        shared = cls(model, prompt_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            torch.save({"key": key, "logits": shared.logits.cpu(),
                        "layer_inputs": [tuple(t.cpu() for t in layer) for layer in shared._layer_inputs]}, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return shared

    def engine(self, method: AttentionMethod, new_tokens: int,
               observe: Callable[[AttentionMethod], None] | None = None) -> DecodeEngine:
        """A decode engine for `method` that starts from this prefill, with room for `new_tokens` more tokens, for
        the caller's `with` (whose end closes `method`; closed here already when it cannot start). `observe(method)`
        runs first (e.g. to switch on a method's trace)."""
        engine = DecodeEngine(self.model, method, silent_timer(self.device))
        with engine.closed_on_failure():
            if observe is not None:
                observe(method)
            engine.start(batch=1, max_len=len(self.prompt_ids) + new_tokens)
            engine.adopt_prefill(self._layer_inputs, self._lengths)
        return engine

    @torch.no_grad()
    def generate(self, spec: MethodSpec, max_new_tokens: int, stop_ids: frozenset[int] = frozenset(),
                 min_new_tokens: int = 0, keep_steps: int = 0) -> Generation:
        """Greedy decode with a fresh `spec` method (dense when its budget covers the run), always closed."""
        _check_max_new_tokens(max_new_tokens)
        with self.engine(spec.build_for(len(self.prompt_ids) + max_new_tokens), max_new_tokens) as engine:
            return _greedy_decode(engine, self.logits, max_new_tokens, stop_ids, min_new_tokens, keep_steps)

    @torch.no_grad()
    def forced(self, spec: MethodSpec, token_ids: list[int],
               observe: Callable[[AttentionMethod], None] | None = None) -> Generation:
        """Teacher forcing: feed `token_ids` one decode step each to a fresh `spec` method; returns what it
        predicted after each (fidelity holds the token stream fixed, so one early disagreement does not derail
        every later step) and the method's statistics. `observe(method)` runs before the prefill is handed over
        (e.g. to switch on a method's trace)."""
        method = spec.build_for(len(self.prompt_ids) + len(token_ids))
        trace = _StepTrace()
        step_ms = []
        with self.engine(method, len(token_ids), observe) as engine:
            for token in token_ids:
                start = time.perf_counter()
                logits = engine.decode_step(torch.tensor([token], device=self.device))
                step_ms.append((time.perf_counter() - start) * 1e3)
                trace.record(logits, engine)
            stats = method.stats()
        return Generation(list(token_ids), *trace.stacked(), method_stats=stats, step_ms=step_ms)


def generate_texts_shared_prefill(model: torch.nn.Module, tokenizer: Any, specs: list[MethodSpec],
                                  prompt_ids: list[int], max_new_tokens: int, stop_ids: frozenset[int],
                                  min_new_tokens: int = 0) -> list[str]:
    """`generate_text` for several methods on one prompt, running the dense prefill once (`SharedPrefill`)."""
    shared = SharedPrefill(model, prompt_ids)
    return [tokenizer.decode(shared.generate(spec, max_new_tokens, stop_ids, min_new_tokens).token_ids,
                             skip_special_tokens=True) for spec in specs]


def generate_text(model: torch.nn.Module, tokenizer: Any, spec: MethodSpec, prompt_ids: list[int],
                  max_new_tokens: int, stop_ids: frozenset[int], min_new_tokens: int = 0) -> str:
    """Generate with a fresh method (closed by `greedy_generate`); the prediction is the decode of the new tokens
    only, special tokens skipped, not stripped (as LongBench's pred.py)."""
    new_ids = greedy_generate(model, spec.build_for(len(prompt_ids) + max_new_tokens), prompt_ids, max_new_tokens,
                              stop_ids, min_new_tokens)
    return tokenizer.decode(new_ids, skip_special_tokens=True)
