"""How closely a method tracks FullKV, step by step, with the token stream held fixed.

FullKV generates greedily from each prompt; the method is then teacher-forced on FullKV's tokens, so step t
compares the two next-token distributions given the same history, and an early disagreement does not derail
every later step. Per decode step: top-1 agreement, KL(P_fullkv || P_method) in nats, and the cosine between the
final hidden states (`engine.last_hidden`, before the final norm). The prefill is dense for every method, so the
first compared step is the first decode step, and both runs start from one shared prefill (`SharedPrefill`).
`scoutbench fidelity` measures it on passkey prompts; `scoutbench accuracy --fidelity-steps N` on the task's own
prompts (LongBench records), next to the predictions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scoutbench.analysis import bootstrap
from scoutbench.eval.generation import Generation, MethodSpec, SharedPrefill
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.sparse import dense_if_budget_covers
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


def reference_spec() -> MethodSpec:
    return MethodSpec(FullKV.name)


def fullkv_reference(shared: SharedPrefill, steps: int, stop_ids: frozenset[int] = frozenset(),
                     min_new_tokens: int = 0) -> Generation:
    """FullKV's greedy tokens and its predictions after each of the first `steps` of them (fewer when it stops
    earlier: a stop token is fed to nobody)."""
    return shared.generate(reference_spec(), steps + 1, stop_ids, min_new_tokens, keep_steps=steps)


def compare_steps(reference: Generation, spec: MethodSpec, shared: SharedPrefill) -> dict[str, list[float]]:
    """`spec`'s method teacher-forced on the reference's tokens, step by step against the reference: top-1
    agreement (0/1), KL(P_fullkv || P_method) in nats and the final hidden states' cosine."""
    if reference.log_probs is None:
        return {"top1": [], "kl": [], "cosine": []}
    return step_agreement(reference, shared.forced(spec, reference.token_ids[:reference.log_probs.shape[0]]))


def step_agreement(reference: Generation, ours: Generation) -> dict[str, list[float]]:
    """Per step, a teacher-forced run `ours` against the `reference` it was forced on: top-1 agreement (0/1),
    KL(P_fullkv || P_method) in nats and the final hidden states' cosine."""
    ref = reference.log_probs
    kl = (ref.exp() * (ref - ours.log_probs)).sum(-1)
    agree = ref.argmax(-1) == ours.log_probs.argmax(-1)
    cosine = F.cosine_similarity(reference.hidden, ours.hidden, dim=-1)
    return {"top1": [float(a) for a in agree], "kl": [float(k) for k in kl], "cosine": [float(c) for c in cosine]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure_fidelity(loaded: LoadedModel, spec: MethodSpec, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Per-step and overall agreement of `spec`'s method with FullKV over `prompts` (one dense prefill each)."""
    agreement: list[list[float]] = [[] for _ in range(steps)]
    kl: list[list[float]] = [[] for _ in range(steps)]
    cosine: list[list[float]] = [[] for _ in range(steps)]
    plans = []
    for prompt_ids in prompts:
        plans.append(dense_if_budget_covers(spec.build(), len(prompt_ids) + steps)[1])
        shared = SharedPrefill(loaded.model, prompt_ids)
        compared = compare_steps(fullkv_reference(shared, steps), spec, shared)
        for step in range(steps):
            agreement[step].append(compared["top1"][step])
            kl[step].append(compared["kl"][step])
            cosine[step].append(compared["cosine"][step])
    per_step = [{"step": step, "top1_agreement": _mean(agreement[step]), "kl_mean": _mean(kl[step]),
                 "hidden_cosine": _mean(cosine[step])} for step in range(steps)]
    every_cosine = [c for values in cosine for c in values]
    overall = {"top1_agreement": _mean([a for values in agreement for a in values]),
               "kl_mean": _mean([k for values in kl for k in values]),
               "hidden_cosine": _mean(every_cosine), "hidden_cosine_min": min(every_cosine)}
    for name, by_step in (("top1_agreement", agreement), ("kl_mean", kl)):  # 95% interval over the prompts
        per_prompt = [sum(values[p] for values in by_step) for p in range(len(prompts))]
        interval = bootstrap.bootstrap([len(prompts)], bootstrap.pooled([per_prompt], [[steps] * len(prompts)]))
        if interval is not None:
            overall |= interval.fields(name, 4)
    return {"overall": overall, "per_step": per_step, "budget": plans[0].budget,
            "effective_budget": max(p.effective_budget or 0 for p in plans) if plans[0].budget is not None else None,
            "sparse": any(p.sparse for p in plans), "num_prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts], "steps": steps}
