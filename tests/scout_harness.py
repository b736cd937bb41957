"""ScoutAttention's test references and helpers (tests/methods/test_scout*.py): the device-only selection reference, runs
with the trace on, and the shared 300-token prompt."""

from __future__ import annotations

import dataclasses

import torch
from method_harness import fullkv_reference, ragged_prompt, run_engine

from scoutbench.kernels.attention import partial_attention
from scoutbench.kernels.digest import block_digests, select_top_blocks, upper_bound_scores
from scoutbench.methods.fullkv import FullKV

REFERENCE_CFG = dict(budget=64, block_size=4, dense_layers=2, sink_blocks=1, local_blocks=1)


@dataclasses.dataclass
class SelectionReference(FullKV):
    """Device-only Quest-style attention with ScoutAttention's selection rules and always-on blocks, computed the
    plain way: the true query's top-k_sel selectable blocks plus sink, local and tail tokens, gathered and attended
    in one partial attention per (sequence, KV head). Also records the selected sets."""

    name = "selection-reference"
    budget: int = 64
    block_size: int = 4
    dense_layers: int = 2
    sink_blocks: int = 1
    local_blocks: int = 1

    def bind(self, ctx):
        super().bind(ctx)
        self.k_sel = self.budget // self.block_size - self.sink_blocks - self.local_blocks - 1
        self.selections: list[dict] = []

    def decode(self, layer, q, k, v):
        dense_out = super().decode(layer, q, k, v)  # writes the new token
        if layer < self.dense_layers:
            return dense_out
        b, ctx = self.block_size, self.ctx
        positions = self.step.positions_host
        num_scored = max(1, max(positions) // b)
        keys, values = self.keys[layer], self.values[layer]
        kmax, kmin = block_digests(keys[:, :, : num_scored * b], b)
        scores = upper_bound_scores(q, kmax, kmin)
        limit = (torch.tensor(positions) // b - self.local_blocks).clamp(min=0)
        excluded = (torch.arange(num_scored) < self.sink_blocks)[None, None, :] if self.sink_blocks else None
        ids, count = select_top_blocks(scores, limit, self.k_sel, excluded)
        count = count.expand(ctx.batch, ctx.num_kv_heads)
        out = torch.zeros(q.shape, dtype=torch.float32)
        group = ctx.num_heads // ctx.num_kv_heads
        record = []
        for s, p in enumerate(positions):
            tail = p // b
            row = []
            for h in range(ctx.num_kv_heads):
                chosen = sorted(int(j) for j in ids[s, h, : int(count[s, h])])
                row.append(set(chosen))
                always = [j for j in range(min(self.sink_blocks, tail))]
                always += [j for j in range(max(self.sink_blocks, tail - self.local_blocks), tail)]
                blocks = sorted(set(chosen) | set(always))
                assert len(blocks) == len(chosen) + len(always)  # disjoint
                tokens = [j * b + t for j in blocks for t in range(b)] + list(range(tail * b, p + 1))
                idx = torch.tensor(tokens)
                heads = slice(h * group, (h + 1) * group)
                state = partial_attention(q[s:s + 1, heads], keys[s:s + 1, h:h + 1, idx], values[s:s + 1, h:h + 1, idx],
                                          ctx.scale)
                out[s, heads] = state.o[0]
            record.append(row)
        self.selections.append({"layer": layer, "step": self.step.index, "selected": record})
        return out.to(q.dtype)


def tokens_for(model, prompt, lengths, steps):
    _, tokens = fullkv_reference(model, prompt, lengths, steps)
    return tokens


def scout_run(model, method, prompt, lengths, tokens, trace=False):
    if trace:
        method.trace = []
    logits = run_engine(model, method, prompt, lengths, tokens)
    return logits


def plans(method, layer=None):
    return [r for r in method.trace if r["kind"] == "plan" and (layer is None or r["layer"] == layer)]


def prompt_300(model):
    """A 300-token prompt and the 8 tokens FullKV decodes after it."""
    prompt, lengths = ragged_prompt(model.config.vocab_size, [300], seed=3)
    return prompt, lengths, tokens_for(model, prompt, lengths, 8)


def reference_300(model, prompt_300):
    """The device-only selection reference on prompt_300: its logits and selected sets."""
    prompt, lengths, tokens = prompt_300
    method = SelectionReference(**REFERENCE_CFG)
    logits = run_engine(model, method, prompt, lengths, tokens)
    return logits, {(r["layer"], r["step"]): r["selected"] for r in method.selections}
