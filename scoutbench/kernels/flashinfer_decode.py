"""flashinfer's paged batch decode as a partial-attention backend: page tables built on the host, one planned wrapper
per call site, the base-2 LSE converted to natural log at this boundary. `backends.select_backend` decides when it
serves a call; `attention.decode_attention` and `attention.partial_attention` call `flashinfer_partial`.

What flashinfer's batch decode supports (flashinfer-python 0.7.4, python/flashinfer/decode.py and
include/flashinfer/utils.cuh; checked against 0.6.17, 0.6.18, 0.7.1; tests/flashinfer_standin.py implements it):
- the CUDA-core decode kernel is instantiated only for the GQA group sizes in `DISPATCH_GQA_GROUP_SIZE`: 1, 2, 3,
  4, 8 up to 0.6.17, plus 6 from 0.6.18 and 16 from 0.7.1 (`decode_group_sizes`); any other group (Qwen3-14B:
  40 / 8 = 5) aborts inside `plan()` with "Unsupported group_size". `BatchDecodeWithPagedKVCacheWrapper(...,
  use_tensor_cores=True)` runs decode through the prefill (tensor-core) kernels, which take any group size
  ("faster for large group size in grouped query attention", docs.flashinfer.ai/api/decode.html).
- head_dim in {64, 128, 256} (`DISPATCH_HEAD_DIM`; 512 too, not used here) and fp16/bf16 inputs (no fp32 kernels).
- the float workspace "must be initialized to 0 for its first use" (the constructor's docstring): it is
  allocated with `torch.zeros`.
- `plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type=,
  kv_data_type=, sm_scale=)` copies the page table to the device with `non_blocking=True` and reads
  `indptr.to("cpu")`: the table is built here on the host, in pinned memory (from pageable memory the copy is
  synchronous, or unsafe), from lengths the caller knows on the host (`positions_host`); a call whose lengths live
  only on the device uses the next backend. plan() also writes its schedule into a pinned buffer of the wrapper and
  queues that buffer's copy, so a wrapper is replanned only after its previous plan's copy ran. Each call site
  (layer shape) gets its own wrapper, planned once per step and reused by every layer of the step (the docs'
  example): one shared wrapper replanned between call sites would wait on the device at every switch.
- pages tile each row of a cache exactly, so a row's capacity is a multiple of the page size; caches that
  flashinfer reads are allocated in whole `PAGE_TOKENS` pages (`page_aligned`): pages of gcd(capacity, 16)
  tokens degenerate to 1 token for a capacity such as 65555 (64k + warm-up + steps) or 2047.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels.backends import flashinfer_module
from scoutbench.kernels.partial_state import PartialState, lse_base2_to_natural, row_lengths

PAGE_TOKENS = 16  # tokens per flashinfer page when the row's capacity allows it (split-KV works in whole pages)
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's float workspace (split-KV partial results), one per device


def row_lengths_host(lengths: Sequence[int] | None, batch: int, num_kv_heads: int, num_keys: int) -> list[int]:
    """Valid keys of each (sequence, KV head) row from host lengths given per sequence (`[B]`) or per row
    (`[B * Hkv]`), clamped to `num_keys`; None = every row holds `num_keys`."""
    rows = batch * num_kv_heads
    if lengths is None:
        return [num_keys] * rows
    if len(lengths) == batch:
        return [min(max(int(n), 0), num_keys) for n in lengths for _ in range(num_kv_heads)]
    if len(lengths) != rows:
        raise ValueError(f"host lengths: {len(lengths)} values for {batch} sequences x {num_kv_heads} KV heads")
    return [min(max(int(n), 0), num_keys) for n in lengths]


def page_aligned(tokens: int) -> int:
    """`tokens` rounded up to whole PAGE_TOKENS pages: the row capacity of a cache flashinfer reads."""
    return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS


def page_size_for(capacity: int) -> int:
    """The largest page of at most PAGE_TOKENS tokens that tiles a row of `capacity` tokens exactly (PAGE_TOKENS
    for the `page_aligned` caches; a smaller one only for a row that is not, such as one current token)."""
    return math.gcd(capacity, PAGE_TOKENS) if capacity else 1


def row_capacity(kv: torch.Tensor) -> int | None:
    """Tokens between consecutive (sequence, KV head) rows of `[B, Hkv, N, D]` when each row is contiguous and
    rows are evenly spaced (a prefix of a preallocated `[B, Hkv, capacity, D]` cache), else None."""
    batch, num_kv_heads, num_keys, head_dim = kv.shape
    capacity = kv.stride(1) // head_dim if head_dim else 0
    if kv.stride() == (num_kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1) and capacity >= num_keys:
        return capacity
    return None


def row_pages(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[B, Hkv, N, D]` as HND pages `[B * Hkv * capacity / page_size, 1, page_size, D]`, row r's pages first-to-last
    at r * (capacity / page_size): a view of the preallocated cache (no step copies it) when `row_capacity` is
    known; otherwise the caller passes a contiguous tensor (capacity N)."""
    batch, num_kv_heads, _, head_dim = kv.shape
    capacity = row_capacity(kv)
    assert capacity is not None and capacity % page_size == 0, "row_pages needs evenly spaced rows of whole pages"
    num_pages = batch * num_kv_heads * capacity // page_size
    return kv.as_strided((num_pages, 1, page_size, head_dim), (page_size * head_dim, page_size * head_dim, head_dim, 1))


def page_table(lengths: Sequence[int], capacity: int, page_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's CSR page table on the host for rows of `lengths` valid tokens in rows of `capacity` tokens.

    Returns int32 (indptr `[R + 1]`, indices `[sum pages]`, last_page_len `[R]`). An empty row gets one page with
    one token (flashinfer needs a page; the caller masks the row), so every last_page_len is in [1, page_size].
    """
    valid = torch.tensor(list(lengths), dtype=torch.int64)
    pages = ((valid + page_size - 1) // page_size).clamp(min=1)
    indptr = torch.zeros(len(valid) + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=indptr[1:])
    first_page = torch.arange(len(valid), dtype=torch.int64) * (capacity // page_size)
    page_in_row = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1], pages)
    indices = torch.repeat_interleave(first_page, pages) + page_in_row
    last = (valid - (pages - 1) * page_size).clamp(min=1)
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


@functools.lru_cache(maxsize=8)
def _workspace(device_index: int) -> torch.Tensor:
    """flashinfer's float workspace, shared by the wrappers of a device (their kernels run in stream order):
    zeroed, as flashinfer requires before its first use."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


@dataclass
class _Planned:
    """One flashinfer decode wrapper per call site (device, path and layer shape) and the plan it holds."""

    wrapper: Any
    lengths: tuple | None = None
    planned: Any = None  # CUDA event after the last plan(): its page table copy has been queued before it


@functools.lru_cache(maxsize=32)
def _wrapper(device_index: int, use_tensor_cores: bool, site: tuple = ()) -> _Planned:
    flashinfer = flashinfer_module()
    return _Planned(flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(device_index), "HND",
                                                                  use_tensor_cores=use_tensor_cores))


def _planned_wrapper(device: torch.device, use_tensor_cores: bool, site: tuple, lengths: list[int], capacity: int,
                     page_size: int, group: int, head_dim: int, dtype: torch.dtype, scale: float) -> Any:
    """The wrapper of call site `site`, planned for `lengths`: planned again only when they changed (a new step),
    so the layers of a step share one plan and call sites never replan each other's wrapper.

    plan() writes its schedule into a pinned buffer of the wrapper and queues that buffer's copy; replanning before
    the copy ran would change the schedule under the previous plan's kernels, so a replan first waits for the
    previous plan's event (complete by then: the previous step ended, and with it, in the throughput runner, a
    synchronize).
    """
    planned = _wrapper(device.index or 0, use_tensor_cores, site)
    key = tuple(lengths)
    if planned.lengths == key:
        return planned.wrapper
    if planned.planned is not None and not planned.planned.query():
        planned.planned.synchronize()
    table = page_table(lengths, capacity, page_size)
    if device.type == "cuda":  # plan() copies it with non_blocking=True: from pinned memory, asynchronous
        table = tuple(t.pin_memory() for t in table)
    indptr, indices, last_page_len = table
    planned.wrapper.plan(indptr, indices, last_page_len, group, 1, head_dim, page_size, q_data_type=dtype,
                         kv_data_type=dtype, sm_scale=scale)
    planned.lengths = key
    planned.planned = _record_event(device)
    return planned.wrapper


def _record_event(device: torch.device) -> Any:
    return torch.cuda.current_stream(device).record_event()


def flashinfer_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       valid_len: torch.Tensor | None, lengths_host: Sequence[int] | None, use_tensor_cores: bool):
    """Partial attention through flashinfer's paged decode; `lengths_host` is the host copy of `valid_len`.

    Each (sequence, KV head) row is one request (one KV head, G query heads) whose pages tile its row of the
    cache (`row_pages`), so ragged lengths per row map onto the page table. The base-2 LSE becomes natural log.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    lengths = row_lengths_host(lengths_host if valid_len is not None else None, batch, num_kv_heads, num_keys)
    if row_capacity(k) is None or row_capacity(v) != row_capacity(k):
        k, v = k.contiguous(), v.contiguous()
    capacity = row_capacity(k)
    page_size = page_size_for(capacity)
    site = (batch, num_kv_heads, group, head_dim, capacity, page_size, q.dtype, scale)
    wrapper = _planned_wrapper(q.device, use_tensor_cores, site, lengths, capacity, page_size, group, head_dim,
                               q.dtype, scale)
    rows = batch * num_kv_heads
    out, lse2 = wrapper.run(q.reshape(rows, group, head_dim), (row_pages(k, page_size), row_pages(v, page_size)),
                            return_lse=True)
    lse = lse_base2_to_natural(lse2.float()).reshape(batch, num_heads)
    out = out.float().reshape(batch, num_heads, head_dim)
    if min(lengths) <= 0:  # flashinfer gave an empty row one page: mask it, from the device lengths (no copy)
        empty = (row_lengths(valid_len, batch, num_kv_heads, num_keys, q.device) <= 0).view(batch, num_kv_heads)
        empty = empty.repeat_interleave(group, dim=1)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return PartialState(out, lse)
