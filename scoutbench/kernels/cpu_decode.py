"""A decode step's work around attention on the CPU, through the compiled kernel (`csrc/decode.cpp`): the linears,
HF's RMSNorm, and the attention prologue (q/k/v projections, q/k norms, RoPE) in one call; `F.linear` and the HF
modules elsewhere.

Why: at decode this work is a fixed cost of every method's step, and on a CPU a large one.
- A linear of a few rows (the batch) is a read of its weight. torch's CPU linear (MKL's sgemv) reads weights at
  about half the rate one core streams on AMD CPUs (docs/platform.md). The kernel reads four weight rows against
  each input row at a time, in fp32 or bf16, accumulating in fp32 as torch does (bf16 results rounded to nearest
  even).
- HF's prologue is ~45 torch ops per layer (norms in six ops each, RoPE through `rotate_half` for q and k), each
  microseconds of host time: on bench-attn16 more than its projections' read.

Each function is the one entry point of its operation and picks its backend itself: the kernel where it serves the
call, and otherwise (not a CPU, not fp32/bf16, more than `MAX_ROWS` rows, a non-contiguous weight, autograd, or
`SCOUTBENCH_CPU_ATTENTION=torch` / no kernel build) torch's path, which is `F.linear` and HF's own modules (the
norm's forward, `hf_forward.attention_prologue`): the tested reference. The kernel's results agree with it within
fp32 rounding (bf16: one rounding where HF rounds after each op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scoutbench.kernels import cpu_attention, hf_forward
from scoutbench.kernels.cpu_attention import pointer as ptr

MAX_ROWS = 16  # more rows than this is a matrix product, where MKL's gemm is the faster one


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def supports(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether the kernel takes `x` `[..., K]` with these weights (None entries are absent biases or norms)."""
    present = [w for w in weights if w is not None]
    return (x.device.type == "cpu" and x.dtype in cpu_attention.DTYPE_CODES and 0 < _rows(x) <= MAX_ROWS
            and all(w.device.type == "cpu" and w.dtype == x.dtype and w.is_contiguous() for w in present)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in present)))
            and cpu_attention.library() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x `[..., K]`, weight `[N, K]`, bias `[N]` -> `[..., N]`."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    x2 = cpu_attention.rows_of(x, _rows(x), in_features)
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    code = cpu_attention.library().sb_linear(
        cpu_attention.DTYPE_CODES[x.dtype], x2.shape[0], out_features, in_features, x2.data_ptr(), weight.data_ptr(),
        ptr(bias), out.data_ptr(), torch.get_num_threads())
    cpu_attention.check_call(code, "CPU linear", x=x)
    return out


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for HF's RMSNorm module `norm` (Llama/Mistral/Qwen2/Qwen3's: `weight`, `variance_epsilon`) of x
    `[..., n]`: the kernel where it takes the call, else the module's own forward."""
    if not supports(x, norm.weight):
        return norm(x)
    x2 = cpu_attention.contiguous(x)
    out = torch.empty_like(x2)
    code = cpu_attention.library().sb_rms_norm(cpu_attention.DTYPE_CODES[x.dtype], _rows(x), x.shape[-1],
                                               x2.data_ptr(), norm.weight.data_ptr(), norm.variance_epsilon,
                                               out.data_ptr())
    cpu_attention.check_call(code, "CPU RMSNorm", x=x)
    return out


def attention_prologue(attn: torch.nn.Module, normed: torch.Tensor, num_heads: int, num_kv_heads: int,
                       cos: torch.Tensor, sin: torch.Tensor, with_kv: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """HF's attention prologue of `attn` for the decode rows of `normed` `[B, 1, hidden]`: q `[B, Hq, D]` rotated
    (and q-normed), and `with_kv` also k `[B, Hkv, D]` rotated (and k-normed) and v; cos/sin `[B, 1, D]` from the
    model's rotary embedding. `attn` is a Llama/Mistral/Qwen2/Qwen3 attention with plain linears and, where it has
    them, q/k RMSNorms of one eps (`decode.ops` checks that once per model). Where the kernel does not take the call,
    `hf_forward.decode_prologue`: HF's modules."""
    head_dim = attn.head_dim
    projections = (attn.q_proj, attn.k_proj, attn.v_proj) if with_kv else (attn.q_proj,)
    norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
    tensors = [t for lin in projections for t in (lin.weight, lin.bias)] + ([n.weight for n in norms] if norms else [])
    batch = normed.shape[0]
    if (normed.dim() != 3 or normed.shape[1] != 1 or head_dim % 2 or cos.shape[-1] != head_dim
            or not supports(normed, *tensors, cos, sin)):
        return hf_forward.decode_prologue(attn, normed, cos, sin, with_kv)
    x = cpu_attention.contiguous(normed)
    q = torch.empty((batch, num_heads, head_dim), dtype=x.dtype)
    k = v = None
    if with_kv:
        k = torch.empty((batch, num_kv_heads, head_dim), dtype=x.dtype)
        v = torch.empty_like(k)
    cos2, sin2 = (t if t.is_contiguous() else t.contiguous() for t in (cos, sin))  # [B, 1, D] rows of D
    k_proj, v_proj = (attn.k_proj, attn.v_proj) if with_kv else (None, None)
    code = cpu_attention.library().sb_attention_prologue(
        cpu_attention.DTYPE_CODES[x.dtype], batch, x.shape[-1], x.data_ptr(), attn.q_proj.weight.data_ptr(),
        ptr(attn.q_proj.bias), ptr(k_proj.weight if k_proj else None), ptr(k_proj.bias if k_proj else None),
        ptr(v_proj.weight if v_proj else None), ptr(v_proj.bias if v_proj else None), num_heads, num_kv_heads,
        head_dim, ptr(norms[0].weight if norms else None), ptr(norms[1].weight if norms else None),
        norms[0].variance_epsilon if norms else 0.0, cos2.data_ptr(), sin2.data_ptr(), q.data_ptr(), ptr(k), ptr(v),
        torch.get_num_threads())
    cpu_attention.check_call(code, "CPU attention prologue", x=normed)
    return q, k, v
