"""HGCA's CPU selection without the score-average read (`score_read="selected"`, methods/hgca.py): the same tokens
as the top-k over every host token's moving average, kept from step to step instead of recomputed.

Why it is the same selection (budget policy, one selection per KV head, group max): between two steps every host
token's average decays by the same factor gamma, and a computed (selected) token gains (1 - gamma) p >= 0 on top. So
a selected token, at least gamma times its score, stays above every token that was not selected, whose score is
exactly gamma times its own (rounding is monotone: this holds in fp32 too), and the group max keeps the order. The
top-k of the next step is therefore the selection minus its lowest entries, plus the tokens that migrated from the
window, which enter at their row's maximum (the top). The scores of the unselected tokens are needed only for that
maximum: their per-head maximum decays by gamma too, so one number per query head stands for all of them.

Per step and layer this reads the selected tokens' averages (budget - window per query head) where the full read
takes every host token's: at 32k, batch 40 on Qwen3-14B, 7.7 of HGCA's 14 GB of CPU reads per step
(docs/methods.md). The first step of each layer scans once, as the full read does every step."""

from __future__ import annotations

import torch


class TrackedSelection:
    """One sparse layer's selection: per (sequence, KV head) the selected host token ids, their moving averages per
    query head, and per query head the maximum average of every other host token. Worker thread only."""

    def __init__(self, ids: torch.Tensor, scores: torch.Tensor, sink_tokens: int) -> None:
        """`ids` int64 `[B, Hkv, capacity]` and `scores` fp32 `[B, Hq, capacity]`: host buffers the method owns (its
        arena), `capacity` the most entries a step holds (the selection and a migrated block)."""
        batch, kv_heads, _ = ids.shape
        self.ids, self.scores, self.sink_tokens = ids, scores, sink_tokens
        self.group = scores.shape[1] // kv_heads
        self.count = [0] * batch  # selected tokens of each sequence (every KV head alike)
        self.others_max = torch.full((batch, scores.shape[1]), float("-inf"))  # per query head, the unselected
        self.started = False

    def start(self, ids: torch.Tensor, ema: torch.Tensor, split: list[int], take: list[int]) -> None:
        """The first step: the full read's selection `ids` `[B, Hkv, max(take)]` (its first take[b] valid) over the
        averages `ema` `[B, Hq, >= max(split)]`; the maximum of every other host token is scanned this once."""
        width = ids.shape[-1]
        per_head = ids.repeat_interleave(self.group, dim=1)
        self.ids[..., :width] = ids
        self.scores[..., :width] = ema.gather(2, per_head)
        self.count = list(take)
        span = max(split)
        others = ema[:, :, :span].clone()
        for b, (host, kept) in enumerate(zip(split, take, strict=True)):
            others[b, :, host:] = float("-inf")
            others[b].scatter_(1, per_head[b, :, :kept], float("-inf"))
        self.others_max = others.amax(dim=-1) if span else self.others_max
        self.started = True

    def select(self, split: list[int], take: list[int]) -> torch.Tensor:
        """This step's selection, ids `[B, Hkv, max(take)]` (row b's first take[b] valid, in descending order when
        the rows keep different counts): the entries' top by the group max of their averages, the sinks first. The
        entries that fall out join the others' maximum."""
        batch, kv_heads, capacity = self.ids.shape
        if any(want > have for want, have in zip(take, self.count, strict=True)):
            raise RuntimeError(f"HGCA's tracked selection holds {self.count} tokens and this step takes {take}: the "
                               "budget policy never takes more than the selection and its admissions")
        width = max(take)
        slot = torch.arange(capacity)
        count = torch.tensor(self.count)[:, None, None]
        key = self.scores.view(batch, kv_heads, self.group, capacity).amax(dim=2)
        sinks = torch.tensor([min(host, self.sink_tokens) for host in split])[:, None, None]
        key = key.masked_fill(self.ids < sinks, float("inf")).masked_fill(slot >= count, float("-inf"))
        keep = key.topk(width, dim=-1, sorted=min(take) != width).indices  # [B, Hkv, width]
        kept = torch.zeros((batch, kv_heads, capacity), dtype=torch.bool)
        valid = (torch.arange(width)[None, None, :] < torch.tensor(take)[:, None, None]).expand(keep.shape)
        kept.scatter_(2, keep, valid)
        dropped = (slot < count) & ~kept
        if bool(dropped.any()):
            out = self.scores.masked_fill(~dropped.repeat_interleave(self.group, dim=1), float("-inf"))
            torch.maximum(self.others_max, out.amax(dim=-1), out=self.others_max)
        ids = self.ids.gather(2, keep)
        scores = self.scores.gather(2, keep.repeat_interleave(self.group, dim=1))
        self.ids[..., :width], self.scores[..., :width] = ids, scores
        self.count = list(take)
        return ids

    def update(self, probs: torch.Tensor, gain: torch.Tensor, decay: float) -> None:
        """The moving-average step over the selection: every average decays, the selected tokens (this step's ids,
        `probs` `[B, Hq, width]`) gain `gain` `[B, Hq]` times their probability, as the full read's scatter adds it."""
        self.scores.mul_(decay)
        self.scores[..., : probs.shape[-1]].add_(probs * gain[..., None])
        self.others_max.mul_(decay)

    def admit(self, b: int, start: int, tokens: int) -> None:
        """Tokens [start, start + tokens) of sequence b migrated to the host: they join the selection at their row's
        maximum (1.0 on an empty host), as the full read admits them."""
        row = self.count[b]
        entries = self.scores[b, :, :row]
        top = torch.maximum(entries.amax(dim=-1), self.others_max[b]) if row else self.others_max[b]
        self.ids[b, :, row: row + tokens] = torch.arange(start, start + tokens)
        self.scores[b, :, row: row + tokens] = top[:, None] if start else 1.0
        self.count[b] = row + tokens
