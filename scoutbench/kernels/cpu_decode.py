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
`SCOUTBENCH_CPU_ATTENTION=torch` / no kernel build) torch's path, which is `F.linear` and HF's forward op for op: the
tested reference. The kernel's results agree with it within fp32 rounding (bf16: one rounding where HF rounds after
each op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scoutbench.kernels import cpu_attention
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of x `[..., n]` (weight `[n]`)."""
    if not supports(x, weight):
        return hf_rms_norm(x, weight, eps)
    x2 = cpu_attention.contiguous(x)
    out = torch.empty_like(x2)
    code = cpu_attention.library().sb_rms_norm(cpu_attention.DTYPE_CODES[x.dtype], _rows(x), x.shape[-1],
                                               x2.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    cpu_attention.check_call(code, "CPU RMSNorm", x=x)
    return out


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward of HF's Llama/Mistral/Qwen2/Qwen3 RMSNorm, op for op (fp32 statistics, the input's dtype before
    the weight)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def attention_prologue(normed: torch.Tensor, q_proj: torch.nn.Linear, kv_proj: tuple[torch.nn.Linear, torch.nn.Linear]
                       | None, num_heads: int, num_kv_heads: int, head_dim: int,
                       qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """HF's attention prologue for the decode rows of `normed` `[B, 1, hidden]`: q `[B, Hq, D]` rotated (and
    q-normed), and with `kv_proj` = (k_proj, v_proj) also k `[B, Hkv, D]` rotated (and k-normed) and v; qk_norm =
    (q_norm weight, k_norm weight, eps) for Qwen3; cos/sin `[B, 1, D]` from the model's rotary embedding. The
    modules are a Llama/Mistral/Qwen2/Qwen3 attention's (plain linears, RMSNorms, `apply_rotary_pos_emb`)."""
    linears = [q_proj] + (list(kv_proj) if kv_proj else [])
    tensors = [t for lin in linears for t in (lin.weight, lin.bias)] + (list(qk_norm[:2]) if qk_norm else [])
    batch = normed.shape[0]
    if (normed.dim() != 3 or normed.shape[1] != 1 or head_dim % 2 or cos.shape[-1] != head_dim
            or not supports(normed, *tensors, cos, sin)):
        return _hf_prologue(normed, q_proj, kv_proj, num_heads, num_kv_heads, head_dim, qk_norm, cos, sin)
    x = cpu_attention.contiguous(normed)
    q = torch.empty((batch, num_heads, head_dim), dtype=x.dtype)
    k = v = None
    if kv_proj:
        k = torch.empty((batch, num_kv_heads, head_dim), dtype=x.dtype)
        v = torch.empty_like(k)
    cos2, sin2 = (t if t.is_contiguous() else t.contiguous() for t in (cos, sin))  # [B, 1, D] rows of D
    k_proj, v_proj = kv_proj if kv_proj else (None, None)
    code = cpu_attention.library().sb_attention_prologue(
        cpu_attention.DTYPE_CODES[x.dtype], batch, x.shape[-1], x.data_ptr(), q_proj.weight.data_ptr(),
        ptr(q_proj.bias), ptr(k_proj.weight if k_proj else None), ptr(k_proj.bias if k_proj else None),
        ptr(v_proj.weight if v_proj else None), ptr(v_proj.bias if v_proj else None), num_heads, num_kv_heads,
        head_dim, ptr(qk_norm[0] if qk_norm else None), ptr(qk_norm[1] if qk_norm else None),
        qk_norm[2] if qk_norm else 0.0, cos2.data_ptr(), sin2.data_ptr(), q.data_ptr(), ptr(k), ptr(v),
        torch.get_num_threads())
    cpu_attention.check_call(code, "CPU attention prologue", x=normed)
    return q, k, v


def _hf_prologue(normed: torch.Tensor, q_proj: torch.nn.Linear, kv_proj: tuple[torch.nn.Linear, torch.nn.Linear]
                 | None, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`attention_prologue` as HF's forward computes it, op for op: the linears, the q/k RMSNorms, and RoPE as
    `apply_rotary_pos_emb` (`x * cos + rotate_half(x) * sin`)."""
    batch = normed.shape[0]

    def rows(linear: torch.nn.Linear, heads: int, norm: torch.Tensor | None) -> torch.Tensor:
        x = F.linear(normed, linear.weight, linear.bias).view(batch, 1, heads, head_dim)
        if norm is not None:
            x = hf_rms_norm(x, norm, qk_norm[2])
        return x.view(batch, heads, head_dim)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    q = rotated(rows(q_proj, num_heads, qk_norm[0] if qk_norm else None))
    if not kv_proj:
        return q, None, None
    k = rotated(rows(kv_proj[0], num_kv_heads, qk_norm[1] if qk_norm else None))
    return q, k, rows(kv_proj[1], num_kv_heads, None)
