"""How closely a method tracks FullKV, step by step, with the token stream held fixed.

FullKV generates greedily from each prompt; the method is then teacher-forced on FullKV's tokens, so step t
compares the two next-token distributions given the same history, and an early disagreement does not derail
every later step. Per decode step: top-1 agreement, KL(P_fullkv || P_method) in nats, and the cosine between the
final hidden states (`engine.last_hidden`, before the final norm). The prefill is dense for every method, so the
first compared step is the first decode step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scoutbench.engine import DecodeEngine
from scoutbench.generation import MethodSpec, silent_timer
from scoutbench.methods.base import dense_if_budget_covers
from scoutbench.methods.fullkv import FullKV
from scoutbench.models import LoadedModel


def fidelity_prompts(loaded: LoadedModel, context_len: int, num_prompts: int, seed: int) -> list[list[int]]:
    """Passkey prompts of `context_len` tokens for a model with a tokenizer, else seeded random token ids."""
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        vocab = loaded.model.config.vocab_size
        return [torch.randint(0, vocab, (context_len,), generator=generator).tolist() for _ in range(num_prompts)]
    from scoutbench.workloads.passkey import PasskeyTask

    task = PasskeyTask("passkey-multi", loaded.tokenizer, context_len, num_samples=num_prompts, seed=seed)
    return [task.input_ids(record) for record in task.records]


@torch.no_grad()
def _run(model: torch.nn.Module, method: Any, prompt_ids: list[int], steps: int,
         forced_tokens: list[int] | None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Decode `steps` tokens, greedily or forced; returns the fed tokens, log-probs `[steps, vocab]` and final
    hidden states `[steps, hidden]` after each fed token."""
    device = next(model.parameters()).device
    engine = DecodeEngine(model, method, silent_timer(device))
    engine.start(batch=1, max_len=len(prompt_ids) + steps)
    logits = engine.prefill(torch.tensor([prompt_ids], dtype=torch.long, device=device))
    tokens, log_probs, hidden = [], [], []
    for step in range(steps):
        token = forced_tokens[step] if forced_tokens is not None else int(logits.argmax(-1))
        tokens.append(token)
        logits = engine.decode_step(torch.tensor([token], device=device))
        log_probs.append(F.log_softmax(logits[0].float(), dim=-1))
        hidden.append(engine.last_hidden[0].float())
    return tokens, torch.stack(log_probs), torch.stack(hidden)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure_fidelity(loaded: LoadedModel, spec: MethodSpec, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Per-step and overall agreement of `spec`'s method with FullKV over `prompts`."""
    agreement: list[list[float]] = [[] for _ in range(steps)]
    kl: list[list[float]] = [[] for _ in range(steps)]
    cosine: list[list[float]] = [[] for _ in range(steps)]
    plans = []
    for prompt_ids in prompts:
        reference = FullKV()
        try:
            tokens, ref_log_probs, ref_hidden = _run(loaded.model, reference, prompt_ids, steps, None)
        finally:
            reference.close()
        method, plan = dense_if_budget_covers(spec.build(), len(prompt_ids) + steps)
        plans.append(plan)
        try:
            _, log_probs, hidden = _run(loaded.model, method, prompt_ids, steps, tokens)
        finally:
            method.close()
        step_kl = (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum(-1)
        step_agree = ref_log_probs.argmax(-1) == log_probs.argmax(-1)
        step_cos = F.cosine_similarity(ref_hidden, hidden, dim=-1)
        for step in range(steps):
            agreement[step].append(float(step_agree[step]))
            kl[step].append(float(step_kl[step]))
            cosine[step].append(float(step_cos[step]))
    per_step = [{"step": step, "top1_agreement": _mean(agreement[step]), "kl_mean": _mean(kl[step]),
                 "hidden_cosine": _mean(cosine[step])} for step in range(steps)]
    every_cosine = [c for values in cosine for c in values]
    overall = {"top1_agreement": _mean([a for values in agreement for a in values]),
               "kl_mean": _mean([k for values in kl for k in values]),
               "hidden_cosine": _mean(every_cosine), "hidden_cosine_min": min(every_cosine)}
    return {"overall": overall, "per_step": per_step, "budget": plans[0].budget,
            "effective_budget": max(p.effective_budget or 0 for p in plans) if plans[0].budget is not None else None,
            "sparse": any(p.sparse for p in plans), "num_prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts], "steps": steps}
