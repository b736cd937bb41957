"""Optional GPU fast paths, imported lazily: any failure on import means "unavailable", never a crash.

flashinfer's kernels run only on CUDA (sm75+); on a CPU machine the import may even succeed while every kernel
call raises, so it is probed only when a CUDA tensor asks for it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch


@functools.lru_cache(maxsize=2)
def _optional(module_name: str) -> tuple[Any, str | None]:
    try:
        return importlib.import_module(module_name), None
    except Exception as exc:  # noqa: BLE001 - any import failure (even a crash on CPU-only boxes) = unavailable
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _flashinfer() -> tuple[Any, str | None]:
    return _optional("flashinfer")


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and _flashinfer()[0] is not None


def triton_available() -> bool:
    return torch.cuda.is_available() and _optional("triton")[0] is not None


def _status(module_name: str) -> str:
    module, reason = _optional(module_name)
    if module is None:
        return f"unavailable ({reason})"
    if not torch.cuda.is_available():
        return f"installed {getattr(module, '__version__', '?')} but no CUDA device"
    return f"available {getattr(module, '__version__', '?')}"


def flashinfer_status() -> str:
    return _status("flashinfer")


def triton_status() -> str:
    return _status("triton")


def partial_backend(device: torch.device) -> str:
    """The implementation `partial_attention` uses on `device`: flashinfer, else the Triton kernel, else torch."""
    if device.type != "cuda":
        return "torch"
    if flashinfer_available():
        return "flashinfer"
    return "triton" if triton_available() else "torch"


@functools.lru_cache(maxsize=8)
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{device_index}")


def flashinfer_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       valid_len: torch.Tensor | None):
    """Partial attention through flashinfer's paged decode kernel.

    Each (sequence, KV head) row becomes one request with one page of N tokens in HND layout, so ragged
    `valid_len` per KV head maps onto `last_page_len`. The base-2 LSE is converted to natural log here.
    """
    from scoutbench.kernels.attention import PartialState, lse_base2_to_natural, row_lengths  # noqa: PLC0415

    flashinfer = _flashinfer()[0]
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    valid = row_lengths(valid_len, batch, num_kv_heads, num_keys, q.device)
    last_len = valid.clamp(min=1)  # a page holds at least one token; empty rows are masked below
    indptr = torch.arange(rows + 1, dtype=torch.int32, device=q.device)
    indices = torch.arange(rows, dtype=torch.int32, device=q.device)
    pages_k, pages_v = row_pages(k), row_pages(v)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(q.device.index or 0), "HND")
    wrapper.plan(indptr, indices, last_len, group, 1, head_dim, pages_k.shape[2], q_data_type=q.dtype,
                 kv_data_type=k.dtype, sm_scale=scale)
    out, lse2 = wrapper.run(q.reshape(rows, group, head_dim), (pages_k, pages_v), return_lse=True)
    lse = lse_base2_to_natural(lse2.float()).reshape(batch, num_heads)
    out = out.float().reshape(batch, num_heads, head_dim)
    if valid_len is not None:
        empty = (valid <= 0).view(batch, num_kv_heads).repeat_interleave(group, dim=1)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return PartialState(out, lse)


def row_pages(kv: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, N, D]` as one HND page per (sequence, KV head) row: `[B * Hkv, 1, page_size, D]`.

    A prefix `[:, :, :N]` of a preallocated `[B, Hkv, capacity, D]` cache (FullKV's span) is viewed in place with
    page_size = capacity (the tokens past N lie beyond each row's `last_page_len`), so no step copies the cache.
    """
    batch, num_kv_heads, num_keys, head_dim = kv.shape
    capacity = kv.stride(1) // head_dim if head_dim else num_keys
    if kv.stride() == (num_kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1) and capacity >= num_keys:
        return kv.as_strided((batch * num_kv_heads, 1, capacity, head_dim),
                             (capacity * head_dim, capacity * head_dim, head_dim, 1))
    return kv.reshape(batch * num_kv_heads, 1, num_keys, head_dim)
