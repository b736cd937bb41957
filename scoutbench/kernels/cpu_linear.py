"""Decode linears on the CPU through the compiled kernel's `sb_linear` (`cpu_attention.cpp`), torch elsewhere.

Why: at decode a linear multiplies a few rows (the batch) by a weight, so it is a read of the weight, and the model's
linears are a fixed cost of every method's step. torch's CPU linear (MKL's sgemv) read them at ~12 GB/s on our AMD
machines, where one core streams 25-28 GB/s: on bench-attn16 the linears were 25 of FullKV's and ScoutAttention's
ms per step, more than ScoutAttention's own sparse attention. The kernel reads four weight rows against each input
row at a time, in fp32 or bf16, accumulating in fp32 as torch does (bf16 results rounded to nearest even).

It serves what it can (CPU, fp32 or bf16, at most `MAX_ROWS` rows, a contiguous weight, no autograd) where the
attention kernel is built; everything else, and every run with `SCOUTBENCH_CPU_ATTENTION=torch`, is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scoutbench.kernels import cpu_attention

MAX_ROWS = 16  # more rows than this is a matrix product, where MKL's gemm is the faster one
BYTES_PER_THREAD = 2 << 20  # below this much weight per thread, waking a helper costs what it saves


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in cpu_attention.DTYPE_CODES
            and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and weight.is_contiguous()
            and 0 < rows <= MAX_ROWS and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and cpu_attention.library() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x `[..., K]`, weight `[N, K]`, bias `[N]` -> `[..., N]`."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    x2 = x.reshape(rows, in_features).contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    threads = max(1, min(torch.get_num_threads(), weight.numel() * weight.element_size() // BYTES_PER_THREAD))
    code = cpu_attention.library().sb_linear(
        cpu_attention.DTYPE_CODES[x.dtype], rows, out_features, in_features, x2.data_ptr(), weight.data_ptr(),
        bias.contiguous().data_ptr() if bias is not None else None, out.data_ptr(), threads)
    if code != 0:
        raise ValueError(f"CPU linear kernel rejected the call (code {code}): x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    return out
