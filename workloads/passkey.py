"""Synthetic passkey retrieval (Landmark Attention / Quest style), generated locally from a seed and scored exactly.

A haystack of repeated filler sentences hides a 5-digit pass key at a chosen depth; the prompt is sized with the
model's tokenizer to the largest filler count whose full input (chat template and answer prefix included) fits
in `context_len` tokens. `passkey-multi` hides several labelled keys and asks for one, so retrieving "a number"
is not enough. A prediction scores 1 when its first run of digits is exactly the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from scoutbench.errors import UsageError
from scoutbench.workloads.suite import Suite, TaskSettings

TASKS = ("passkey", "passkey-multi")
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_LABELS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
MAX_NEW_TOKENS = 16  # a 5-digit key and a full stop, with room for the digits to come one token at a time
_FIRST_DIGITS = re.compile(r"\d+")


@dataclass
class PasskeyTask:
    """`num_samples` prompts of about `context_len` tokens. `depth` in [0, 1] puts the (queried) key at that fraction
    of the haystack; None spreads the samples over depths in an order whose every prefix is spread too
    (`spread_depth`), so sample i is the same prompt for any `num_samples`: a larger `--limit` extends a run."""

    variant: str  # "passkey" or "passkey-multi"
    tokenizer: Any
    context_len: int
    num_samples: int = 10
    depth: float | None = None
    seed: int = 0
    num_keys: int = 4  # passkey-multi only
    records: list[dict[str, Any]] = field(init=False, repr=False)
    max_new_tokens: ClassVar[int] = MAX_NEW_TOKENS
    min_new_tokens: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if self.variant not in TASKS:
            raise UsageError(f"unknown passkey task {self.variant!r} (use {' or '.join(TASKS)})")
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise UsageError(f"--depth must be between 0 and 1, got {self.depth}")
        if self.num_samples < 1:
            raise UsageError(f"passkey needs at least one sample, got {self.num_samples}")
        if not 2 <= self.num_keys <= len(KEY_LABELS):
            raise UsageError(f"passkey-multi: num_keys must be in 2..{len(KEY_LABELS)}")
        if self.tokenizer is None:
            raise UsageError("passkey prompts are text: the model needs a tokenizer (use smollm2-135m or a real model)")
        self.records = [self._record(index) for index in range(self.num_samples)]

    @property
    def name(self) -> str:
        depth = "" if self.depth is None else f"_d{self.depth:g}"
        return f"{self.variant}_{self.context_len}{depth}"

    def stop_token_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]:
        return model_eos_ids

    def _depth(self, index: int) -> float:
        return self.depth if self.depth is not None else spread_depth(index)

    def _record(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"{self.variant}-{self.seed}-{index}")
        depth = self._depth(index)
        if self.variant == "passkey":
            key = str(rng.randint(10000, 99999))
            needles = [(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")]
            question, answer_prefix = "What is the pass key?", "The pass key is"
        else:
            labels = rng.sample(KEY_LABELS, self.num_keys)
            keys = [str(rng.randint(10000, 99999)) for _ in labels]
            needles = [(depth if i == 0 else rng.random(),
                        f"The pass key for the {label} door is {key}. Remember it. ")
                       for i, (label, key) in enumerate(zip(labels, keys, strict=True))]
            key = keys[0]
            question = f"What is the pass key for the {labels[0]} door?"
            answer_prefix = f"The pass key for the {labels[0]} door is"
        filler_count = self._fit_filler(needles, question, answer_prefix)
        context = _haystack(filler_count, needles)
        prompt_ids = self._encode(context, question, answer_prefix)
        return {"input": question, "context": context, "answers": [key], "length": len(prompt_ids),
                "all_classes": None, "_id": f"{self.name}-d{depth:.3f}-s{self.seed}-{index}", "depth": depth,
                "answer_prefix": answer_prefix}

    def _encode(self, context: str, question: str, answer_prefix: str) -> list[int]:
        from scoutbench.models import (
            encode_prompt,  # here: `accuracy --dataset list` reads TASKS without torch
        )

        return encode_prompt(self.tokenizer, f"{INSTRUCTION}{context}\n\n{question}", chat=True,
                             assistant_prefix=answer_prefix)

    def _fit_filler(self, needles: list[tuple[float, str]], question: str, answer_prefix: str) -> int:
        """Largest filler count whose prompt fits in context_len tokens (binary search on real tokenization)."""
        def fits(count: int) -> bool:
            return len(self._encode(_haystack(count, needles), question, answer_prefix)) <= self.context_len

        if not fits(1):
            raise UsageError(f"--len {self.context_len} is too short for a passkey prompt; use at least "
                             f"{len(self._encode(_haystack(1, needles), question, answer_prefix))} tokens")
        low, high = 1, 2
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def input_ids(self, record: dict[str, Any]) -> list[int]:
        return self._encode(record["context"], record["input"], record["answer_prefix"])

    def describe(self) -> dict[str, Any]:
        return {"metric": "passkey_exact", "max_new_tokens": self.max_new_tokens, "context_len": self.context_len,
                "depth": self.depth, "seed": self.seed, "num_keys": self.num_keys if self.variant != "passkey" else 1}

    def reference_answer(self, prediction: str) -> str:
        """What another prediction is scored against when this one is the reference (agreement with FullKV): the
        key it answered, its first digit run ("" when it has none)."""
        match = _FIRST_DIGITS.search(prediction)
        return match.group() if match else ""

    def score(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Percentage of predictions whose first digit run is exactly the key, rounded like LongBench."""
        if not rows:
            raise ValueError(f"{self.name}: no predictions to score")
        correct = sum(passkey_correct(row["pred"], row["answers"][0]) for row in rows)
        return {"score": round(100 * correct / len(rows), 2)}


def spread_depth(index: int) -> float:
    """The base-2 van der Corput sequence from 1/2: 0.5, 0.25, 0.75, 0.125, 0.625, ... The first 2^k - 1 depths
    are evenly spaced, and depth i does not depend on how many samples are asked for."""
    depth, scale, n = 0.0, 0.5, index + 1
    while n:
        depth += scale * (n & 1)
        n >>= 1
        scale /= 2
    return depth


def passkey_correct(prediction: str, key: str) -> bool:
    match = _FIRST_DIGITS.search(prediction)
    return match is not None and match.group() == key


def _haystack(filler_count: int, needles: list[tuple[float, str]]) -> str:
    """`filler_count` filler sentences with each needle inserted after round(depth * count) of them."""
    slots: dict[int, list[str]] = {}
    for depth, needle in needles:
        slots.setdefault(round(depth * filler_count), []).append(needle)
    parts = []
    for position in range(filler_count + 1):
        parts.extend(slots.get(position, []))
        if position < filler_count:
            parts.append(FILLER)
    return "".join(parts).rstrip(" ")


class PasskeySuite(Suite):
    """passkey and passkey-multi: prompts generated from a seed at --len tokens (no data to read)."""

    usage = ", ".join(TASKS)

    def datasets(self) -> tuple[str, ...]:
        return TASKS

    def listing(self) -> list[dict[str, str]]:
        return [{"name": name, "suite": "passkey", "metric": "passkey_exact"} for name in TASKS]

    def task(self, dataset: str, tokenizer: Any, records: list[dict[str, Any]] | None, source: dict[str, Any] | None,
             settings: TaskSettings) -> PasskeyTask:
        """`settings.limit` prompts (10 by default) of `settings.length` tokens at `settings.depth`."""
        return PasskeyTask(dataset, tokenizer, settings.length, settings.limit or 10, settings.depth, settings.seed)

    def check_context(self, dataset: str, model: str, window: int | None, settings: TaskSettings) -> None:
        """Prompts are sized to --len; with the answer they must fit the window (past it a passkey scores 0 without
        a word)."""
        from scoutbench.models import check_context
        from scoutbench.units import format_length

        check_context(model, window, settings.length + MAX_NEW_TOKENS,
                      f"{dataset} prompts of --len {format_length(settings.length)} plus a {MAX_NEW_TOKENS}-token "
                      "answer", "lower --len")


SUITE = PasskeySuite()
