"""Decode attention, partial attention with log-sum-exp, and the exact LSE merge.

Conventions (every method relies on them):
- decode query `q` is `[B, Hq, D]`; keys/values are `[B, Hkv, N, D]` (post-RoPE); `G = Hq // Hkv`.
- the query heads of a KV group are packed as G query rows against their KV head (`[B, Hkv, G, D]`):
  on CPU this form of SDPA is 2-10x faster than `enable_gqa=True` (docs/platform.md).
- CPU: the compiled kernel of `cpu_attention` (bf16 and fp32 read at the memory limit, selected blocks attended in
  place by `block_sparse_attention`), or torch's kernels where it is unavailable or `SCOUTBENCH_CPU_ATTENTION=torch`;
  `backends.USAGE` records `cpu:native` or `cpu:torch` per call.
- a partial result is `(o: fp32 [B, Hq, D], lse: fp32 [B, Hq])` with a *natural-log* LSE; an empty part has
  `lse = -inf` and `o = 0`. FlashInfer's base-2 LSE is converted at its boundary only.
- `valid_len` (`[B, Hkv]` or `[B]`) counts the leading valid tokens of each row: gathers put valid tokens first.
  `lengths_host` is its host copy, where the caller knows it (from `StepInfo.positions_host`): flashinfer plans
  on the host, so without it a call with `valid_len` uses the next backend (`backends.select_backend`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from scoutbench.kernels import backends, cpu_attention, flashinfer_decode, fused_ops
from scoutbench.kernels.partial_state import PartialState, empty_state, expand_valid_len, merged_output


def _packed(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    return q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)


def length_bias(valid_len: torch.Tensor, num_keys: int, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[B, Hkv, 1, N]`: 0 for the first `valid_len` keys of a row, -inf after."""
    valid_len = expand_valid_len(valid_len, valid_len.shape[0], num_kv_heads)
    positions = torch.arange(num_keys, device=valid_len.device)
    keep = positions[None, None, :] < valid_len[:, :, None]
    bias = torch.zeros(keep.shape, dtype=dtype, device=valid_len.device)
    return bias.masked_fill_(~keep, float("-inf")).unsqueeze(2)


class StepLengths:
    """How many leading tokens of each sequence's rows a step's dense attention reads, for every layer of the step:
    written once per step, in place (flashinfer's `plan`), so that each layer's call is one kernel and a captured
    CUDA graph reads this step's lengths. `valid_len` `[B]` on the device; `bias`, the torch path's additive mask
    `[B, 1, 1, capacity]` (0 for a valid slot, -inf after), where the compiled CPU kernel (which reads `valid_len`)
    does not serve the device; `host`, the lengths on the host where a backend plans there (flashinfer), None with
    CUDA graphs."""

    def __init__(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, with_host: bool):
        self.valid_len = torch.zeros(batch, dtype=torch.long, device=device)
        self.bias: torch.Tensor | None = None
        if not (device.type == "cpu" and cpu_attention.library() is not None):
            self._slots = torch.arange(capacity, device=device)[None, :]
            self._keep, self._drop = (torch.tensor(value, dtype=dtype, device=device) for value in (0.0, float("-inf")))
            self.bias = torch.zeros((batch, 1, 1, capacity), dtype=dtype, device=device)
            self._bias_rows = self.bias.view(batch, capacity)
        self.with_host = with_host
        self.host: list[int] | None = None
        self.span: int | None = None

    def update(self, valid_len: torch.Tensor, valid_host: Sequence[int] | None) -> None:
        """This step's lengths `[B]` (device), and on the host where known (kept only `with_host`). The mask is
        rewritten only where a call will read it: not for a uniform batch with its span known."""
        self.valid_len.copy_(valid_len)
        self.set_host(valid_host)
        if self.bias is not None and self.span is None:
            torch.where(self._slots < self.valid_len[:, None], self._keep, self._drop, out=self._bias_rows)

    def set_host(self, valid_host: Sequence[int] | None) -> None:
        self.host = list(valid_host) if self.with_host and valid_host is not None else None
        self.span = self.host[0] if self.host and min(self.host) == max(self.host) else None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     valid_len: torch.Tensor | None = None, lengths_host: Sequence[int] | None = None,
                     lengths: StepLengths | None = None) -> torch.Tensor:
    """Exact single-token attention over all (valid) keys; returns `[B, Hq, D]` in q's dtype (FullKV's kernel, every
    dense layer's, InfiniGen's fetched rows): on CUDA the best backend `select_backend` allows, in the documented
    order (flashinfer's paged decode, the Triton split-KV kernel, torch SDPA in the packed-GQA form); on a CPU the
    compiled kernel, else SDPA. A step's `lengths` (StepLengths) stand for `valid_len` and `lengths_host`, with the
    torch path's mask made."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    bias = None
    if lengths is not None and lengths.span is not None:  # a uniform batch: exactly its keys, nothing to mask
        k, v = k[:, :, : lengths.span], v[:, :, : lengths.span]
    elif lengths is not None:
        valid_len, lengths_host, bias = lengths.valid_len, lengths.host, lengths.bias
    backend = backends.backend_for(q, num_kv_heads, valid_len is None or lengths_host is not None)
    if backend.startswith("flashinfer"):
        backends.USAGE.add(q.device.type, backend)
        return flashinfer_decode.flashinfer_partial(q, k, v, scale, valid_len, lengths_host,
                                           use_tensor_cores=backend == "flashinfer-tc").o.to(q.dtype)
    if backend == "triton":
        backends.USAGE.add(q.device.type, backend)
        return _triton_partial(q, k, v, scale, valid_len).o.to(q.dtype)
    if cpu_attention.supports(q, k):
        backends.USAGE.add("cpu", "native")
        return _native(q, k, v, scale, valid_len).o.to(q.dtype)
    backends.USAGE.add(q.device.type, "torch")
    if bias is None and valid_len is not None:
        bias = length_bias(valid_len, k.shape[2], num_kv_heads, q.dtype)
    out = F.scaled_dot_product_attention(_packed(q, num_kv_heads), k, v, attn_mask=bias, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      valid_len: torch.Tensor | None = None, lengths_host: Sequence[int] | None = None,
                      lengths: StepLengths | None = None) -> PartialState:
    """Attention of `q` over the leading `valid_len` keys of each (sequence, KV head) row, with its LSE.

    Rows with no valid key come back as the empty state (o = 0, lse = -inf), so merging them is a no-op. A step's
    `lengths` (StepLengths over k's rows) stand for `valid_len` and `lengths_host`, as in `decode_attention`.
    """
    batch, num_heads, head_dim = q.shape
    bias = None
    if lengths is not None and lengths.span is not None:  # a uniform batch: exactly its keys, nothing to mask
        k, v = k[:, :, : lengths.span], v[:, :, : lengths.span]
    elif lengths is not None:
        valid_len, lengths_host, bias = lengths.valid_len, lengths.host, lengths.bias
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    if num_keys == 0:
        return empty_state(batch, num_heads, head_dim, q.device)
    if num_keys == 1 and valid_len is None:  # one key (a current token): softmax of one is 1, no kernel needed
        return single_key_state(q, k, v, scale)
    if cpu_attention.supports(q, k):
        backends.USAGE.add("cpu", "native")
        return _native(q, k, v, scale, valid_len)
    backend = backends.backend_for(q, num_kv_heads, valid_len is None or lengths_host is not None)
    backends.USAGE.add(q.device.type, backend)
    if backend.startswith("flashinfer"):
        return flashinfer_decode.flashinfer_partial(q, k, v, scale, valid_len, lengths_host,
                                           use_tensor_cores=backend == "flashinfer-tc")
    if backend == "triton":
        return _triton_partial(q, k, v, scale, valid_len)
    q4 = _packed(q, num_kv_heads)
    if bias is None and valid_len is not None:
        bias = length_bias(valid_len, num_keys, num_kv_heads, q.dtype)
    if q.device.type != "cpu":
        logits = torch.einsum("bhgd,bhnd->bhgn", q4, k).float()  # q4 @ k^T in one call
        logits = logits.mul_(scale) if bias is None else torch.add(bias, logits, alpha=scale)
        lse = torch.logsumexp(logits, dim=-1)  # -inf for a row with no valid key
        # _safe_softmax: such a row's probabilities are 0 (softmax's would be NaN), so its output is the empty 0
        out = torch.matmul(torch.ops.aten._safe_softmax(logits, -1).to(v.dtype), v).float()
        return PartialState(out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k, v, 0.0, False, attn_mask=bias, scale=scale)[:2]
    out = out.float()
    if valid_len is not None:  # the flash kernel's rows without a valid key
        empty = (expand_valid_len(valid_len, batch, num_kv_heads) <= 0)[:, :, None].expand_as(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return PartialState(out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads))


def _triton_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    valid_len: torch.Tensor | None) -> PartialState:
    """The Triton split-KV flash-decoding kernel (`triton_decode`, imported at its first call: triton is optional)."""
    from scoutbench.kernels.triton_decode import triton_partial_attention  # noqa: PLC0415

    return triton_partial_attention(q, k, v, scale, valid_len)


def partial_attention_probs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            valid_len: torch.Tensor | None = None) -> tuple[PartialState, torch.Tensor]:
    """`partial_attention` in explicit form that also returns each query head's probabilities over the part,
    `[B, Hq, N]` fp32, normalised within the part (0 for invalid keys): for methods that track attention weights
    (HGCA's moving average) without a second pass over the keys. Empty rows give the empty state and zeros."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    if cpu_attention.supports(q, k) and num_keys:
        backends.USAGE.add("cpu", "native")
        o, lse, probs = cpu_attention.attend(q, k.unsqueeze(2), v.unsqueeze(2), scale, None, valid_len, with_probs=True)
        return PartialState(o, lse), probs
    backends.USAGE.add(q.device.type, "torch")
    logits = torch.matmul(_packed(q, num_kv_heads), k.transpose(-1, -2)).float() * scale
    if valid_len is not None:
        logits = logits + length_bias(valid_len, num_keys, num_kv_heads, torch.float32)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    out = torch.matmul(probs.to(v.dtype), v).float()
    state = PartialState(out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads))
    return state, probs.reshape(batch, num_heads, num_keys)


def single_key_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> PartialState:
    """Attention over exactly one key per row, `k`/`v` `[B, Hkv, 1, D]`: the output is that value, the LSE its
    logit (exact; a flashinfer call would plan 1-token pages for it)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q4 = _packed(q, num_kv_heads).float()
    lse = torch.matmul(q4, k.float().transpose(-1, -2))[..., 0] * scale  # [B, Hkv, G]
    out = v.float().expand(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return PartialState(out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads))


def block_sparse_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_ids: torch.Tensor,
                           scale: float, valid_len: torch.Tensor | None = None) -> PartialState:
    """Partial attention over selected blocks of a blocked cache, read in place (no gather copy on CPU).

    k/v blocks `[B, Hkv, num_blocks, block_size, D]`: any strided view with a contiguous head_dim (a head-major
    cache `[B, Hkv, N, D]` viewed as `[B, Hkv, N // bs, bs, D]`, a block-major host tier permuted to it, or token
    rows with block_size 1). block_ids `[B, H, W]` int64: per selection row the blocks attended, in order; H is
    Hkv, or a multiple of it for per-query-head selections (row h reads KV head h // (H // Hkv), q then holds one
    query per row). valid_len `[B]` or `[B, H]` counts the row's leading valid tokens of the selected blocks in that
    order (None: all `W * block_size`); only the ids of blocks holding valid tokens are read (padding may be
    anything). CPU tensors use the compiled kernel; otherwise (CUDA, or torch forced) the blocks are gathered and
    `partial_attention` runs over them.
    """
    if cpu_attention.supports(q, k_blocks):
        backends.USAGE.add("cpu", "native")
        o, lse, _ = cpu_attention.attend(q, k_blocks, v_blocks, scale, block_ids, valid_len)
        return PartialState(o, lse)
    keys, values = _gather_selected(k_blocks, v_blocks, block_ids, valid_len)
    return partial_attention(q, keys, values, scale, valid_len)


def block_sparse_attention_probs(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                                 block_ids: torch.Tensor, scale: float, valid_len: torch.Tensor | None = None
                                 ) -> tuple[PartialState, torch.Tensor]:
    """`block_sparse_attention` that also returns each query head's probabilities over the selected tokens,
    `[B, Hq, W * block_size]` fp32 (as `partial_attention_probs`: normalised within the part, 0 past valid_len)."""
    if cpu_attention.supports(q, k_blocks):
        backends.USAGE.add("cpu", "native")
        o, lse, probs = cpu_attention.attend(q, k_blocks, v_blocks, scale, block_ids, valid_len, with_probs=True)
        return PartialState(o, lse), probs
    keys, values = _gather_selected(k_blocks, v_blocks, block_ids, valid_len)
    return partial_attention_probs(q, keys, values, scale, valid_len)


def merge_output(a: PartialState, b: PartialState, dtype: torch.dtype) -> torch.Tensor:
    """A co-attention layer's output: the exact LSE merge of its two parts (`merged_output`) in `dtype`. One launch
    where the fused ops serve the device (`fused_ops.merged_output`), one call of the compiled kernel and the cast on
    a CPU, else torch's 5 calls and the cast."""
    if backends.fused_ops_available(a.o.device):
        return fused_ops.merged_output(a.o, a.lse, b.o, b.lse, dtype)
    return merged_output(a, b).to(dtype)


def region_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     slot_tokens: torch.Tensor) -> PartialState:
    """Partial attention of `q` `[B, Hq, D]` over a region `k`/`v` `[B, Hkv, S * b, D]` of S block slots, of which
    each (sequence, KV head) row attends the first `slot_tokens[b, h, s]` tokens of slot s (`[B, Hkv, S]` int64),
    query heads packed per KV group.

    At most one slot per row may be partly open (ScoutAttention's tail block), and every row must have an open
    token (the region always holds the current token). The CPU kernel then reads only the open slots, in place by
    id (full ones first, the partial one last, the row's open tokens as its valid length): at budget 2048 on
    bench-attn16 that was 0.8 ms per layer where torch's flash kernel with a mask over the whole region took 1.7.
    Elsewhere (CUDA, torch's CPU kernels) the same mask is applied to the whole region; masked tokens must hold
    finite values there (their weight is exp(-inf)). Returns fp32 output and natural-log LSE.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_slots = slot_tokens.shape[1:]
    block_size = k.shape[2] // num_slots
    if cpu_attention.supports(q, k):
        backends.USAGE.add("cpu", "native")
        # full slots, then the partly open one, then the closed ones (in slot order within each)
        ids = torch.argsort(slot_tokens, dim=-1, descending=True, stable=True)
        blocked = (batch, num_kv_heads, num_slots, block_size, head_dim)
        o, lse, _ = cpu_attention.attend(q, k.view(blocked), v.view(blocked), scale, ids, slot_tokens.sum(-1))
        return PartialState(o, lse)
    if backends.fused_ops_available(q.device):  # one launch (fused_ops: its Triton kernel on a GPU)
        backends.USAGE.add(q.device.type, "fused-region")
        return PartialState(*fused_ops.region_attention(q, k, v, scale, slot_tokens))
    backends.USAGE.add(q.device.type, "torch-region")
    if q.device.type != "cpu":  # CUDA without triton: the fused op's torch reference
        return PartialState(*fused_ops.region_reference(q, k, v, scale, slot_tokens))
    q4 = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keep = torch.arange(block_size, device=q.device) < slot_tokens.unsqueeze(-1)  # [B, Hkv, S, b]
    bias = torch.where(keep, 0.0, float("-inf")).view(batch, num_kv_heads, 1, num_slots * block_size)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k, v, 0.0, False, attn_mask=bias.to(q.dtype), scale=scale)[:2]
    return PartialState(out.float().reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads))


def _gather_selected(k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_ids: torch.Tensor,
                     valid_len: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected blocks as `[B, H, W * block_size, D]` copies (the path without the CPU kernel). Padding ids
    past a row's valid blocks are set to 0: their tokens are masked by valid_len."""
    batch, rows, width = block_ids.shape
    kv_heads, _, block_size, head_dim = k_blocks.shape[1:]
    device = block_ids.device
    if valid_len is not None:
        used = (expand_valid_len(valid_len, batch, rows) + block_size - 1) // block_size  # [B, H] blocks
        block_ids = block_ids.masked_fill(torch.arange(width, device=device) >= used[..., None].to(device), 0)
    b = torch.arange(batch, device=device)[:, None, None]
    kv = (torch.arange(rows, device=device) // (rows // kv_heads))[None, :, None]
    shape = (batch, rows, width * block_size, head_dim)
    return _take_blocks(k_blocks, b, kv, block_ids).view(shape), _take_blocks(v_blocks, b, kv, block_ids).view(shape)


def _take_blocks(blocks: torch.Tensor, b: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """blocks[b, kv, ids]: one flat `index_select` when every block is a contiguous run of its storage at a multiple
    of the block's size (all our tiers), the fastest gather on CPU (docs/platform.md); else advanced indexing."""
    row = blocks.shape[3] * blocks.shape[4]
    strides = blocks.stride()
    if strides[3:] != (blocks.shape[4], 1) or any(s % row for s in strides[:3]):
        return blocks[b, kv, ids]
    flat = (b * strides[0] + kv * strides[1] + ids * strides[2]) // row
    rows = 1 + sum((n - 1) * s for n, s in zip(blocks.shape[:3], strides[:3], strict=True)) // row
    table = blocks.as_strided((rows, row), (row, 1), blocks.storage_offset())
    return torch.index_select(table, 0, flat.reshape(-1))


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            valid_len: torch.Tensor | None) -> PartialState:
    """Dense partial attention `[B, Hkv, N, D]` through the CPU kernel (the cache as one block per row)."""
    o, lse, _ = cpu_attention.attend(q, k.unsqueeze(2), v.unsqueeze(2), scale, None, valid_len)
    return PartialState(o, lse)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention for a prompt: q `[B, Hq, L, D]`, k/v `[B, Hkv, L, D]` -> `[B, Hq, L, D]`.

    Right-padded prompts are safe: with a causal mask no real token sees a pad to its right.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
