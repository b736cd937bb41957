"""Synthetic decode workloads: prompts of a given length as random token ids, deterministic with a seed.

`prefill="real"` runs the model over the prompt; `prefill="synthetic"` skips it and fills every layer with
random K/V (with `kv_skew`-controlled heavy-hitter structure; the paper measures decode instances only, with prefill
handled elsewhere), so a 64k decode benchmark does not pay for a 64k prefill.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from scoutbench.errors import UsageError

if TYPE_CHECKING:  # torch is imported where prompts are made: the CLI reads this module's defaults for `--help`
    import torch

PREFILL_MODES = ("real", "synthetic")
# Derived from real attention, not tuned to a paper number: SmolLM2-135M over 3k tokens of real
# license prose, ScoutAttention budget 384 (1/8 of the context), 32 greedy steps, no recall: CPU compute ratio
# 0.312; synthetic prefill of the same shape: 0.362 at kv_skew 0.05, 0.273 at 0.075, 0.225 at 0.1, 0.093 at the
# old default 0.3. The closest grid value is the default. Reproduce:
#   python benchmarks/derive_kv_skew.py --len 3k --budget 384 --steps 32 --skews 0.05,0.075,0.1
DEFAULT_KV_SKEW = 0.075


@dataclass(frozen=True)
class SyntheticWorkload:
    length: int  # prompt tokens per sequence
    batch: int
    steps: int  # timed decode steps
    warmup: int  # untimed decode steps before them
    seed: int = 0
    prefill: str = "real"
    # synthetic prefill only: log-normal spread of key magnitude per 32-token run (heavy hitters that persist
    # across steps, i.e. temporal locality); default from real attention (DEFAULT_KV_SKEW); 0 = i.i.d. keys, every
    # step's selection independent (worst case). See synthetic_kv.SyntheticPrefill.
    kv_skew: float = DEFAULT_KV_SKEW

    def __post_init__(self) -> None:
        if self.length < 1:
            raise UsageError(f"--len must be at least 1 token (got {self.length})")
        if self.batch < 1:
            raise UsageError(f"--batch must be at least 1 (got {self.batch})")
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1 (got {self.steps})")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be 0 or more (got {self.warmup})")
        if not math.isfinite(self.kv_skew) or self.kv_skew < 0:  # nan passes `< 0` and was stored as "nan"
            raise UsageError(f"--kv-skew must be a finite number, 0 or more (got {self.kv_skew})")
        if self.prefill not in PREFILL_MODES:
            raise UsageError(f"--prefill must be one of {', '.join(PREFILL_MODES)} (got {self.prefill!r})")

    @property
    def total_tokens(self) -> int:
        """Tokens each sequence's cache must hold: prompt + warm-up + timed steps."""
        return self.length + self.warmup + self.steps

    def prompt_ids(self, vocab_size: int) -> torch.Tensor:
        import torch

        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, vocab_size, (self.batch, self.length), generator=generator)

    def first_tokens(self, vocab_size: int) -> torch.Tensor:
        """The first decode input when prefill is synthetic (there are no prompt logits to sample from)."""
        import torch

        generator = torch.Generator().manual_seed(self.seed + 1)
        return torch.randint(0, vocab_size, (self.batch,), generator=generator)

    def kv_source(self, model_name: str) -> str:
        """Where the decoded-over K/V came from: random keys shaped by `kv_skew`, or the model's own prefill."""
        if self.prefill == "synthetic":
            return f"synthetic(kv_skew={self.kv_skew})"
        return f"model({model_name}, random token ids)"

    def describe(self) -> dict:
        return {"name": "synthetic", "len": self.length, **{k: v for k, v in asdict(self).items() if k != "length"}}
