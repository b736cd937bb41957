"""Memory planning: how many sequences of a context length fit on the device, per method, without running anything.

The paper compares methods at their own maximum batch (Figure 8), so `--batch auto` and `scoutbench plan` size
each method from the same model:

    device memory at batch B = weights + reserve + B x (method device bytes + workspace)
    host memory at batch B   = B x method host bytes

- weights: every parameter of the decoder (embeddings, per-layer attention, MLP and norms, final norm, and the
  LM head unless tied), from the config alone.
- method device/host bytes: the method's own `memory_footprint` (KV, digests, resident blocks, buffers).
- workspace per sequence: the larger of the decode activations and the synthetic-prefill transient, which never
  coexist (see `workspace_bytes_per_seq`); on a decode instance (`decode_instance`: prefill-decode disaggregation,
  the prompt's KV arrives from a prefill instance) the decode activations alone.
- reserve: a fixed CUDA_CONTEXT_BYTES for the CUDA context and kernels' workspaces plus
  DEVICE_RESERVE_FRACTION of the memory for allocator fragmentation: the caching allocator rounds and splits
  blocks, and a plan that fills the card to the byte fails at the first odd-sized tensor.
- host: offloading methods pin their host tier, and pinned pages cannot be swapped, so at most
  (1 - HOST_RESERVE_FRACTION) of the host memory is planned for.

`context_len` is what each sequence's storage holds: for a run, prompt + warm-up + timed decode tokens.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.methods.base import OBS_WINDOW, AttentionMethod, ModelShape

GIB = 1024**3
CUDA_CONTEXT_BYTES = 1 * GIB
DEVICE_RESERVE_FRACTION = 0.10
HOST_RESERVE_FRACTION = 0.20
FP32_BYTES = 4


@dataclass(frozen=True)
class Plan:
    """One method's memory at one context length, and the largest batch that fits."""

    method: str
    context_len: int
    elem_bytes: int
    device_bytes_per_seq: int  # the method's device tier (KV, digests, resident blocks, buffers)
    host_bytes_per_seq: int  # the method's host tier
    workspace_bytes_per_seq: int  # activations / prefill transient, on the device
    weights_bytes: int
    reserved_bytes: int
    gpu_mem_bytes: int
    host_mem_bytes: int | None  # None: the host tier is not limited
    max_batch: int
    limited_by: str  # "device", "host", or "weights" (the model alone does not fit: max_batch 0)
    decode_instance: bool = False  # planned without the prefill transient (the prefill ran elsewhere)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_linear_params(shape: ModelShape) -> tuple[int, int]:
    """(attention, MLP) weights of one decoder layer: the q/k/v/o projections and the gated MLP (gate, up, down)."""
    attention = shape.hidden_size * shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    return attention, 3 * shape.hidden_size * shape.intermediate_size


def weights_bytes(shape: ModelShape, elem_bytes: int, tied_embeddings: bool = False) -> int:
    """Parameters of a Llama/Qwen3 decoder. Q/K norms (Qwen3) are counted for every model: 2 x head_dim per
    layer, a few KB too many for a Llama."""
    hidden, head_dim = shape.hidden_size, shape.head_dim
    attention, mlp = layer_linear_params(shape)
    norms = 2 * hidden + 2 * head_dim  # input + post-attention norms, q/k norms
    embeddings = shape.vocab_size * hidden * (1 if tied_embeddings else 2)
    params = shape.num_layers * (attention + mlp + norms) + embeddings + hidden  # + final norm
    return params * elem_bytes


def decode_workspace_bytes_per_seq(shape: ModelShape, context_len: int, elem_bytes: int) -> int:
    """Device activations of one sequence during a decode step (one layer's worth: they are freed per layer).

    Logits in fp32, the hidden-size vectors (residual, normed, attention output, MLP output), q/k/v and the
    attention output heads, the MLP intermediates (gate, up, their product), fp32 attention logits and
    probabilities over all N keys for every query head (the dense layers every method keeps, and the torch
    fallback, materialise them), and the two fp32 partial states (device and host parts) merged per layer.
    """
    q_dim = shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    activations = elem_bytes * (4 * shape.hidden_size + 2 * q_dim + 2 * kv_dim + 3 * shape.intermediate_size)
    attention_scratch = 2 * shape.num_heads * context_len * FP32_BYTES
    partial_states = 2 * (q_dim + shape.num_heads) * FP32_BYTES
    return shape.vocab_size * FP32_BYTES + activations + attention_scratch + partial_states


def prefill_workspace_bytes_per_seq(shape: ModelShape, context_len: int, elem_bytes: int,
                                    method_prefill_bytes: int = 0) -> int:
    """Device transient of one sequence during the synthetic prefill (DecodeEngine.prefill_synthetic), per layer.

    Random K and V: two `[Hkv, N, D]` tensors; plus the observation-window queries handed to the method; plus what
    the method's `ingest_prefill` holds on top of them (`Footprint.prefill_bytes_per_seq`: its prompt-sized copies
    and fp32 temporaries are chunked, so this is a chunk's worth). Transients that do not grow with the batch
    (HGCA's observed weights, one sequence at a time, at most a few hundred MiB) are covered by the fixed reserve.
    """
    one_kv_tensor = shape.num_kv_heads * context_len * shape.head_dim * elem_bytes
    window = min(OBS_WINDOW, context_len)
    return 2 * one_kv_tensor + shape.num_heads * window * shape.head_dim * elem_bytes + method_prefill_bytes


def workspace_bytes_per_seq(shape: ModelShape, context_len: int, elem_bytes: int, method_prefill_bytes: int = 0) -> int:
    """Prefill and decode never overlap, so the workspace is the larger of the two transients.

    A real (not synthetic) prefill at long context needs far more (MLP intermediates for every prompt token);
    `run_with_oom_backoff` is the safety net for it.
    """
    return max(decode_workspace_bytes_per_seq(shape, context_len, elem_bytes),
               prefill_workspace_bytes_per_seq(shape, context_len, elem_bytes, method_prefill_bytes))


def reserved_bytes(gpu_mem_bytes: int) -> int:
    return CUDA_CONTEXT_BYTES + int(DEVICE_RESERVE_FRACTION * gpu_mem_bytes)


def plan_method(method: AttentionMethod, shape: ModelShape, context_len: int, elem_bytes: int, gpu_mem_bytes: int,
                host_mem_bytes: int | None = None, tied_embeddings: bool = False, decode_instance: bool = False) -> Plan:
    """The largest batch of `method` whose device tier fits `gpu_mem_bytes` and host tier fits `host_mem_bytes`.
    `decode_instance`: the sequences arrive prefilled (prefill-decode disaggregation, the ScoutAttention paper's
    setting), so no prefill transient is planned for, only the decode activations."""
    footprint = method.memory_footprint(shape, context_len, elem_bytes)
    workspace = (decode_workspace_bytes_per_seq(shape, context_len, elem_bytes) if decode_instance else
                 workspace_bytes_per_seq(shape, context_len, elem_bytes, footprint.prefill_bytes_per_seq))
    weights = weights_bytes(shape, elem_bytes, tied_embeddings)
    reserve = reserved_bytes(gpu_mem_bytes)
    free_for_sequences = gpu_mem_bytes - weights - reserve
    device_batch = max(0, free_for_sequences // (footprint.device_bytes_per_seq + workspace))
    max_batch, limited_by = device_batch, "device" if free_for_sequences > 0 else "weights"
    if host_mem_bytes is not None and footprint.host_bytes_per_seq > 0 and free_for_sequences > 0:
        host_batch = int(host_mem_bytes * (1 - HOST_RESERVE_FRACTION)) // footprint.host_bytes_per_seq
        if host_batch < device_batch:
            max_batch, limited_by = host_batch, "host"
    return Plan(method.name, context_len, elem_bytes, footprint.device_bytes_per_seq, footprint.host_bytes_per_seq,
                workspace, weights, reserve, gpu_mem_bytes, host_mem_bytes, max_batch, limited_by, decode_instance)


def available_host_bytes() -> int | None:
    """MemAvailable of this machine (None where /proc/meminfo is unreadable). On machines whose RAM grows on
    demand (some VMs) it understates what can be had: pass the host memory explicitly there."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_host_bytes() -> int | None:
    """The host memory a run may plan to allocate now: MemAvailable less the planner's reserve (None where unknown)."""
    free = available_host_bytes()
    return None if free is None else int(free * (1 - HOST_RESERVE_FRACTION))


def device_free_bytes(device: torch.device) -> int:
    """Memory of a CUDA device that this process can plan for: the driver's free memory plus what torch's caching
    allocator holds here. The weights are planned for, so with the model already loaded (its bytes counted in the
    second term) the answer is the same as before loading."""
    if device.type != "cuda":
        raise UsageError("--gpu-mem is required when the device is not CUDA (e.g. --gpu-mem 80GiB)")
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


def auto_batch(method: AttentionMethod, shape: ModelShape, context_len: int, elem_bytes: int, gpu_mem_bytes: int,
               host_mem_bytes: int | None = None, tied_embeddings: bool = False) -> int:
    """`--batch auto`: the plan's max_batch, at least 1, or a one-line error saying what does not fit.

    `host_mem_bytes=None` plans the host tier against this machine's available memory (the run happens here).
    """
    if host_mem_bytes is None:
        host_mem_bytes = available_host_bytes()
    plan = plan_method(method, shape, context_len, elem_bytes, gpu_mem_bytes, host_mem_bytes, tied_embeddings)
    if plan.max_batch >= 1:
        return plan.max_batch
    if plan.limited_by == "weights":
        raise ScoutbenchError(f"the model's weights ({plan.weights_bytes / GIB:.1f} GiB) plus the reserve "
                              f"({plan.reserved_bytes / GIB:.1f} GiB) do not fit in {gpu_mem_bytes / GIB:.1f} GiB; "
                              "use a smaller model, a smaller --dtype or more --gpu-mem")
    where = "host memory" if plan.limited_by == "host" else "device memory"
    raise ScoutbenchError(f"{method.name}: not even one sequence of {context_len} tokens fits in {where}; lower --len")


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocation failure, or a host (pinned or pageable) allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError is the same class
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def run_with_oom_backoff(fn: Callable[[int], Any], batch: int) -> tuple[Any, list[dict[str, Any]]]:
    """Call `fn(batch)`; on an out-of-memory error free the cache, halve the batch and retry, down to 1.

    Returns `(result, attempts)`, one attempt per call: `{"batch", "status": "oom"|"ok", "error"}`, for the
    result file. Other exceptions propagate; an OOM at batch 1 becomes a ScoutbenchError.
    """
    attempts: list[dict[str, Any]] = []
    while True:
        error = None
        try:
            result = fn(batch)
        except Exception as exc:  # noqa: BLE001 - only OOMs are handled; the rest is re-raised
            if not is_out_of_memory(exc):
                raise
            error = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if error is None:
            attempts.append({"batch": batch, "status": "ok", "error": None})
            return result, attempts
        attempts.append({"batch": batch, "status": "oom", "error": error})
        release_cached_memory()
        if batch == 1:
            raise ScoutbenchError(f"out of memory even at batch 1 ({error}); lower --len or use a smaller model")
        batch = max(1, batch // 2)


def release_cached_memory() -> None:
    """Give back what a failed attempt left: the traceback (gone with `exc` by now) held its tensors, so collect
    them (a method's host arena is unpinned by its `close()`, and at the latest when collected), then empty
    torch's device cache and its pinned host cache (small staging buffers), before the retry allocates again."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # torch.accelerator.empty_host_cache is public from torch 2.9 on, torch._C._host_emptyCache is private: a
        # torch with neither has no pinned cache to empty (the retry must not fail on its absence)
        accelerator = getattr(torch, "accelerator", None)
        empty_host_cache = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def format_bytes(num_bytes: int | float) -> str:
    """1.5 GiB, 300 MiB, ... for tables."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"

