"""HF's attention prologue through HF's own modules: the reference that every other form of it reproduces, and the
path that runs where none of them serves (the prefill on any device, the `hf` decode form, and the CPU kernel's
entry point where the kernel does not take the call: `cpu_decode.attention_prologue`). One definition, so that
"bit-identical to HF" means the same thing everywhere.
"""

from __future__ import annotations

import sys

import torch


def attention_prologue(attn: torch.nn.Module, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       with_kv: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """HF's prologue of a Llama/Mistral/Qwen2/Qwen3 attention `attn` for `normed` `[B, L, hidden]`: q `[B, Hq, L, D]`
    and, `with_kv`, k and v `[B, Hkv, L, D]`: the projections, the q/k RMSNorms where the attention has them, and
    RoPE by the model's own `apply_rotary_pos_emb` with cos/sin `[B, L, D]`. Without `with_kv` (ScoutAttention's
    layer-ahead query) only q is projected and rotated."""
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    shape = (*normed.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(normed).view(shape)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    if not with_kv:
        q, _ = apply_rope(q.transpose(1, 2), q.transpose(1, 2)[:, :1], cos, sin)
        return q, None, None
    k = attn.k_proj(normed).view(shape)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    v = attn.v_proj(normed).view(shape).transpose(1, 2)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def decode_prologue(attn: torch.nn.Module, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    with_kv: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`attention_prologue` for one new token per sequence: `normed` `[B, 1, hidden]` -> q `[B, Hq, D]` and,
    `with_kv`, k and v `[B, Hkv, D]` (the decode step's rows)."""
    q, k, v = attention_prologue(attn, normed, cos, sin, with_kv)
    return q[:, :, 0], None if k is None else k[:, :, 0], None if v is None else v[:, :, 0]
