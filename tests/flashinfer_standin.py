"""A stand-in for `flashinfer` (the part scoutbench calls) that implements the contract of
`BatchDecodeWithPagedKVCacheWrapper` as the current release documents and codes it, on emulated CUDA
(scoutbench/testing/emulated_cuda), and refuses what the real one refuses. Read from flashinfer-python 0.7.4
(python/flashinfer/decode.py, include/flashinfer/utils.cuh) and checked against 0.6.17 / 0.6.18 / 0.7.1:

- `__init__(float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, ...)`: the
  workspace "must be initialized to 0 for its first use" and be 16-byte aligned, on the device; `kv_layout` is
  NHD or HND. The wrapper allocates an 8 MiB int workspace on the device and an 8 MiB pinned host buffer.
- `plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, q_data_type=,
  kv_data_type=, sm_scale=, non_blocking=True, ...)`: copies the page table to the device
  (`.to(device, non_blocking=non_blocking)`) and reads `indptr.to("cpu")` / `last_page_len.to("cpu")` (a sync
  when they live on the device); int32 tables; `1 <= last_page_len <= page_size`. The CUDA-core decode kernel
  (`use_tensor_cores=False`) is compiled only for the group sizes of `DISPATCH_GQA_GROUP_SIZE` (1, 2, 3, 4, 8
  before 0.6.18; 6 from 0.6.18; 16 from 0.7.1): any other aborts with "Unsupported group_size". head_dim in
  `DISPATCH_HEAD_DIM` (64, 128, 256, 512); fp16/bf16 (or fp8) data, no fp32 kernels. The plan is written into the
  pinned host buffer and copied to the device int workspace asynchronously (so replanning before that copy ran
  races: the emulator reports it).
- `run(q, paged_kv_cache, *, return_lse=False, out=None, lse=None)`: q `[batch, num_qo_heads, head_dim]` in the
  planned q dtype, K/V pages `[num_pages, num_kv_heads, page_size, head_dim]` (HND) in the planned kv dtype and
  page size; returns the output in q's dtype and, with `return_lse`, the fp32 **base-2** log-sum-exp
  `[batch, num_qo_heads]`. It reads the page table from the device copies plan() made.
"""

from __future__ import annotations

import math

import torch

from scoutbench.testing.emulated_cuda import EmulatedTensor

__version__ = "0.7.4"
HEAD_DIMS = (64, 128, 256, 512)
DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
INT_WORKSPACE_BYTES = 8 * 1024 * 1024


def decode_group_sizes(version: str) -> tuple[int, ...]:
    """`DISPATCH_GQA_GROUP_SIZE` of a flashinfer release."""
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    sizes = (1, 2, 3, 4, 8)
    if parts >= (0, 6, 18):
        sizes = (1, 2, 3, 4, 6, 8)
    if parts >= (0, 7, 1):
        sizes = (*sizes, 16)
    return sizes


def _data(tensor: torch.Tensor) -> torch.Tensor:
    """The stand-in's own checks read device data without a sync (the real ones happen inside kernels)."""
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


class BatchDecodeWithPagedKVCacheWrapper:
    plans = 0  # plan() calls, all wrappers (tests count them)
    runs = 0

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None) -> None:
        if float_workspace_buffer.device.type != "cuda":
            raise ValueError("float_workspace_buffer must be on the CUDA device")
        if _data(float_workspace_buffer).data_ptr() % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        if kv_layout not in ("NHD", "HND"):
            raise KeyError(f"Invalid kv_layout {kv_layout}")
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.empty((INT_WORKSPACE_BYTES,), dtype=torch.uint8, device=self.device)
        self._pin_memory_int_workspace_buffer = torch.empty((INT_WORKSPACE_BYTES,), dtype=torch.uint8,
                                                            pin_memory=True, device="cpu")
        self._use_tensor_cores = use_tensor_cores
        self._planned = False

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking: bool = True, **kwargs) -> None:
        if torch.count_nonzero(_data(self._float_workspace_buffer)) and not getattr(self, "_used", False):
            raise RuntimeError("flashinfer stand-in: the float workspace buffer was not zeroed before its first use "
                               "(flashinfer: 'Must be initialized to 0 for its first use'); its split-k partial "
                               "results would be read from garbage")
        self._used = True
        for name, table in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            if table.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {table.dtype}")
        q_dtype = _dtype(data_type if data_type is not None else q_data_type)
        kv_dtype = _dtype(kv_data_type) if kv_data_type is not None else q_dtype
        if q_dtype not in DTYPES or kv_dtype not in DTYPES:
            raise RuntimeError(f"flashinfer: no decode kernel for dtype {q_dtype} (fp16, bf16 or fp8 only)")
        if head_dim not in HEAD_DIMS:
            raise RuntimeError(f"Unsupported head_dim: {head_dim}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        group = num_qo_heads // num_kv_heads
        if not self._use_tensor_cores and group not in decode_group_sizes(__version__):
            raise RuntimeError(f"Unsupported group_size: {group}")
        # the device page table (asynchronous from pinned memory; from pageable memory the emulator reports it)
        self._indptr_dev = indptr.to(self.device, non_blocking=non_blocking)
        self._indices_dev = indices.to(self.device, non_blocking=non_blocking)
        self._last_dev = last_page_len.to(self.device, non_blocking=non_blocking)
        indptr_host, last_host = indptr.to("cpu"), last_page_len.to("cpu")
        batch = len(last_host)
        if len(indptr_host) != batch + 1 or int(indptr_host[0]) != 0 or bool((indptr_host.diff() < 1).any()):
            raise ValueError("indptr must be [batch_size + 1], start at 0 and give every request a page")
        if len(indices) < int(indptr_host[-1]):
            raise ValueError("indices shorter than indptr[-1]")
        if bool((last_host < 1).any()) or bool((last_host > page_size).any()):
            raise ValueError(f"last_page_len must lie in [1, page_size={page_size}]")
        kv_len = (indptr_host.diff() - 1) * page_size + last_host
        # plan info: written into the pinned buffer, copied to the int workspace on the stream (as flashinfer's
        # C++ planner does); run() reads the device copy
        info = self._pin_memory_int_workspace_buffer[: 4 * batch].view(torch.int32)
        info.copy_(kv_len.to(torch.int32))
        self._int_workspace_buffer[: 4 * batch].copy_(self._pin_memory_int_workspace_buffer[: 4 * batch],
                                                      non_blocking=True)
        self._batch, self._num_qo_heads, self._num_kv_heads, self._head_dim = batch, num_qo_heads, num_kv_heads, \
            head_dim
        self._page_size, self._max_kv_len = page_size, int(kv_len.max())
        self._q_dtype, self._kv_dtype = q_dtype, kv_dtype
        self._sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._planned = True
        BatchDecodeWithPagedKVCacheWrapper.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, **kwargs):
        if not self._planned:
            raise RuntimeError("plan() must be called before run()")
        k_cache, v_cache = paged_kv_cache if isinstance(paged_kv_cache, (tuple, list)) else \
            paged_kv_cache.unbind(1)
        if self._kv_layout == "NHD":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        for tensor in (q, k_cache, v_cache):
            if tensor.device.type != "cuda":
                raise ValueError("q and the paged KV cache must be on the CUDA device")
        if q.dtype != self._q_dtype or k_cache.dtype != self._kv_dtype or v_cache.dtype != self._kv_dtype:
            raise ValueError(f"The dtype of q {q.dtype} / kv {k_cache.dtype} does not match the q_data_type "
                             f"{self._q_dtype} / kv_data_type {self._kv_dtype} specified in plan function.")
        expected_pages = (k_cache.shape[0], self._num_kv_heads, self._page_size, self._head_dim)
        if tuple(k_cache.shape) != expected_pages or tuple(v_cache.shape) != expected_pages:
            raise ValueError(f"paged kv cache of shape {tuple(k_cache.shape)} does not match the plan "
                             f"(pages, {self._num_kv_heads}, {self._page_size}, {self._head_dim})")
        if tuple(q.shape) != (self._batch, self._num_qo_heads, self._head_dim):
            raise ValueError(f"q of shape {tuple(q.shape)} does not match the plan "
                             f"({self._batch}, {self._num_qo_heads}, {self._head_dim})")
        BatchDecodeWithPagedKVCacheWrapper.runs += 1
        # the kernel: each request's tokens through its pages, attention in fp32 (device ops only: no sync)
        page_size, batch = self._page_size, self._batch
        kv_len = self._int_workspace_buffer[: 4 * batch].view(torch.int32).long()
        token = torch.arange(self._max_kv_len, device=q.device)
        last_page = self._indptr_dev[1:].long() - 1
        page_slot = torch.minimum(self._indptr_dev[:-1, None].long() + token[None, :] // page_size,
                                  last_page[:, None])
        pages = self._indices_dev.long()[page_slot]  # [batch, max_len]
        within = (token % page_size)[None, :].expand(batch, -1)
        keys = k_cache[pages, :, within]  # [batch, max_len, Hkv, D]
        values = v_cache[pages, :, within]
        group = self._num_qo_heads // self._num_kv_heads
        q4 = q.float().view(batch, self._num_kv_heads, group, self._head_dim)
        logits = torch.einsum("bhgd,bnhd->bhgn", q4, keys.float()) * self._sm_scale
        logits = logits.masked_fill((token[None, :] >= kv_len[:, None])[:, None, None, :], float("-inf"))
        lse_natural = torch.logsumexp(logits, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        result = torch.einsum("bhgn,bnhd->bhgd", probs, values.float()).reshape(batch, self._num_qo_heads, -1)
        result = result.to(q.dtype)
        lse2 = (lse_natural / math.log(2.0)).reshape(batch, self._num_qo_heads)
        if out is not None:
            out.copy_(result)
            result = out
        if return_lse:
            if lse is not None:
                lse.copy_(lse2)
                lse2 = lse
            return result, lse2
        return result


def _dtype(value) -> torch.dtype:
    return getattr(torch, value) if isinstance(value, str) else value
