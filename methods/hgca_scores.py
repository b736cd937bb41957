"""HGCA's moving-average scores where they start: the mean causal attention of the last observed prompt queries
over the prompt (methods/hgca.py, "moving average"), computed once per layer at prefill within a constant
transient."""

from __future__ import annotations

import torch

from scoutbench.runtime.offload import token_chunks

OBSERVED_LOGIT_BYTES = 64 * 1024**2  # fp32 logits per piece of the prefill's observed attention weights


def observed_weights(q_obs: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean causal attention `[B, Hq, N]` (fp32) of the observed last W prompt queries over the prompt, into
    `out` (host, fp32) where given: its first `out.shape[-1]` tokens (the host part; the rest is overwritten
    when a token migrates).

    One (sequence, KV group) and at most `OBSERVED_LOGIT_BYTES` of fp32 logits at a time: the whole batch at
    once held `B x G x W x N` fp32 logits and as many probabilities (15 x 5 x 256 x 64k: 4.7 GiB each at paper
    scale), a transient that grew with the batch; this one is constant.
    """
    batch, num_heads, window, _ = q_obs.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty((batch, num_heads, num_keys))
    kept = min(out.shape[-1], num_keys)
    query_pos = lengths[:, None] - window + torch.arange(window, device=k.device)  # as the engine observes
    keys = torch.arange(num_keys, device=k.device)
    queries = max(1, OBSERVED_LOGIT_BYTES // max(1, group * num_keys * 4))
    for b in range(batch):
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            total = torch.zeros((group, num_keys), device=k.device)
            for rows in token_chunks(window, queries):
                logits = torch.matmul(q_obs[b, heads, rows].float(), k[b, h].float().transpose(-1, -2))
                hidden = keys[None, :] > query_pos[b, rows, None]  # [w, N]: causal
                total += logits.mul_(scale).masked_fill_(hidden, float("-inf")).softmax(dim=-1).sum(1)
            out[b, heads, :kept] = (total[:, :kept] / window).cpu()
    return out
