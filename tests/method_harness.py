"""Helpers shared by the method tests: teacher-forced engine runs against FullKV, ragged prompts, a G=1 model,
and a hand-made MethodContext for calling a method's hooks directly."""

from __future__ import annotations

import functools

import torch

from scoutbench.decode.engine import DecodeEngine
from scoutbench.methods.base import AttentionMethod, MethodContext, StepInfo
from scoutbench.methods.fullkv import FullKV
from scoutbench.timing import StageTimer


def ragged_prompt(vocab_size: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random right-padded prompts `[B, max(lengths)]` and their lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(lengths), max(lengths)), generator=generator)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    return ids, torch.tensor(lengths)


def run_engine(model: torch.nn.Module, method: AttentionMethod, prompt: torch.Tensor, lengths: torch.Tensor,
               tokens: list[torch.Tensor], on_step=None) -> list[torch.Tensor]:
    """Logits of the prefill and of one decode step per entry of `tokens` (teacher forcing, so that two methods
    see the same inputs); `on_step(engine)` runs after each decode step."""
    engine = DecodeEngine(model, method)
    engine.start(batch=prompt.shape[0], max_len=int(lengths.max()) + len(tokens))
    try:
        logits = [engine.prefill(prompt, lengths)]
        for token in tokens:
            logits.append(engine.decode_step(token))
            if on_step is not None:
                on_step(engine)
    finally:
        method.close()
    return logits


def fullkv_reference(model: torch.nn.Module, prompt: torch.Tensor, lengths: torch.Tensor,
                     steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FullKV logits of a greedy run and the tokens it chose (the teacher-forcing inputs for other methods)."""
    engine = DecodeEngine(model, FullKV())
    engine.start(batch=prompt.shape[0], max_len=int(lengths.max()) + steps)
    logits, tokens = [engine.prefill(prompt, lengths)], []
    for _ in range(steps):
        tokens.append(logits[-1].argmax(-1))
        logits.append(engine.decode_step(tokens[-1]))
    return logits, tokens


def assert_logits_close(ours: list[torch.Tensor], reference: list[torch.Tensor], atol: float = 1e-5) -> None:
    assert len(ours) == len(reference)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@functools.lru_cache(maxsize=1)
def hand_context(batch: int, max_len: int, num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int = 16, predict_query=None) -> MethodContext:
    """A fp32 CPU context for calling a method's hooks with hand-made tensors."""
    return MethodContext(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         scale=head_dim ** -0.5, batch=batch, max_len=max_len, device=torch.device("cpu"),
                         dtype=torch.float32, timer=StageTimer("cpu"), predict_query=predict_query)


def step_info(positions: list[int], index: int = 0) -> StepInfo:
    return StepInfo(torch.tensor(positions), list(positions), index)
