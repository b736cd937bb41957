"""Emulated CUDA on a CPU: scoutbench's CUDA-only code paths run, unchanged, on CPU tensors that say `cuda:0`.

Why: a GPU is lent rarely and briefly, so the CUDA branches (pinned staging, `non_blocking` copies, copy streams
and their events, event-gated slot readiness, the flashinfer adapter) must be proven on a CPU first. Enable it
with `with emulated_cuda() as cuda:` (tests) or `SCOUTBENCH_EMULATE_CUDA=1` (the CLI, `scripts/gpu_check.sh`'s dry
run). It is adversarial where real hardware is lucky:

- Device memory is an `EmulatedTensor`: `.device` is `cuda:0`, the data a CPU tensor. Every torch call on it runs
  on the CPU data (`__torch_function__`), so HF modules, methods and kernels run as they are; mixing it with a
  CPU tensor of one or more dimensions raises as CUDA does.
- Host memory is plain CPU memory; it is pinned when made by `pin_memory` / `torch.empty(..., pin_memory=True)` or
  registered with `cudart().cudaHostRegister` (a registry of address ranges answers `is_pinned()`).
- The default stream runs device work at once (the device is never behind the host); every other stream queues its
  work, which runs only when someone waits for it (an event or stream wait, a synchronize), in stream order and
  after whatever it waited on (`lazy=True`). So a missing wait reads stale data, never a lucky finished copy.
- A device-to-host copy into pinned memory lands only when it is waited on; a host-to-device copy from pinned memory
  reads its source at once, and that source must not change before the copy is known complete (else
  `EmulatedCudaHazard`: the host overwrote a buffer a queued copy still reads). A copy from or to a non-contiguous
  host view is staged through pageable memory, as torch does, pinned or not (`staged_copies`).
- Host-device synchronisations (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, a blocking or pageable copy,
  `torch.tensor(data, device=cuda)`, indexing with host or boolean indices, `nonzero`, a host wait on an event or
  stream) on a thread inside `detect_syncs()` are recorded with the source line that caused them.
- `cudart()` (the functions torch binds) keeps CUDA's per-thread last error: a failed call (see
  `fail_host_register` and `host_register_error`) leaves it set and the next device operation raises it, as
  torch's kernel-launch check does (which also clears it).
- CUDA graphs (`torch.cuda.CUDAGraph`, `torch.cuda.graph`, `graph_pool_handle`, `is_current_stream_capturing`):
  capture records and does not run, as on a GPU. Each device operation issued on a capturing stream is recorded
  with its device tensors by identity and its Python scalars (and host scalar tensors) by value; its outputs are
  allocated from meta shapes and poisoned, views are made at once, in-place and `out=` operations, factories and
  pinned copies either way are recorded. A replay re-runs the recorded operations in order on the same tensors,
  writing each one's outputs into the tensors capture returned, without the Python that issued them, so a baked
  Python value, a fresh allocation filled from one, or an input not copied into its static buffer makes replayed
  results differ from eager ones. A replay is device work on the current stream (at once on the default stream,
  queued on another) and one launch: torch function modes do not see its operations. What CUDA refuses in a
  capture raises its error: host reads and syncs (by capture mode, as CUDA: see `check_capture_sync`), a wait on
  work outside the capture, device work on a stream outside it, a fork not joined back by the capture's end, a
  capture on the default stream, a random op with an explicit generator; waits, queries and timing of an event
  recorded in a capture fail afterwards (a replay does not record it). A kernel reading device memory by address
  is refused in a capture: it would run at capture only.
- Triton kernels (`interpreter`): where triton was imported with TRITON_INTERPRET=1, its interpreter runs them on the
  device's CPU tensors, each launch device work of its stream (captured as a launch is), so the dispatch takes the
  H200's path; elsewhere their torch references stand for them. Never a compiled launch (it would need libcuda).

The modules: `state` (the device, CUDA's error codes, the active emulation), `streams` (streams and
events), `runtime` (one emulation: how streams run, pinned memory, copies, syncs, cudart), `tensors` (device
tensors and their dispatch), `factories` (calls without a device tensor), `capture` and `graphs` (CUDA graphs),
`interpreter` (Triton kernels), and here the activation. What it cannot see is listed in docs/gpu.md ("What
emulation cannot catch").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

from scoutbench.kernels import backends
from scoutbench.testing.emulated_cuda.factories import EmulatedGenerator, EmulationMode
from scoutbench.testing.emulated_cuda.graphs import (
    EmulatedCUDAGraph,
    EmulatedGraphContext,
    empty_cache,
    end_allocate_to_pool,
    graph_pool_handle,
    is_current_stream_capturing,
    make_graphed_callables,
    release_pool,
)
from scoutbench.testing.emulated_cuda.interpreter import interpreter_patches, triton_path
from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime
from scoutbench.testing.emulated_cuda.state import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    EMULATED_DEVICE,
    EmulatedCudaHazard,
    SyncSite,
    active_runtime,
    set_active,
)
from scoutbench.testing.emulated_cuda.streams import EmulatedEvent, EmulatedStream, StreamContext
from scoutbench.testing.emulated_cuda.tensors import EmulatedTensor


def _patches(runtime: EmulatedRuntime) -> dict[tuple[Any, str], Any]:
    cuda = torch.cuda
    mib = 1024**2
    triton = triton_path()

    def current_stream(device: Any = None) -> EmulatedStream:
        return runtime.current_stream()

    return {
        (backends, "EMULATED_TRITON"): triton,  # the Triton kernels interpreted, or their torch references
        **(interpreter_patches() if triton == backends.INTERPRETED else {}),
        (cuda, "is_available"): lambda: True,
        (cuda, "device_count"): lambda: 1,
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): lambda device: None,
        (cuda, "init"): lambda: None,
        (cuda, "is_initialized"): lambda: True,
        (cuda, "Stream"): EmulatedStream,
        (cuda, "Event"): EmulatedEvent,
        (cuda, "current_stream"): current_stream,
        (cuda, "default_stream"): lambda device=None: runtime.default_stream,
        (cuda, "stream"): StreamContext,
        (cuda, "synchronize"): lambda device=None: runtime.synchronize(),
        (cuda, "cudart"): lambda: runtime.cudart,
        (cuda, "set_sync_debug_mode"): lambda mode: None,
        (cuda, "get_device_properties"): lambda device=None: runtime.properties,
        (cuda, "get_device_name"): lambda device=None: runtime.properties.name,
        (cuda, "get_device_capability"): lambda device=None: (runtime.properties.major, runtime.properties.minor),
        (cuda, "mem_get_info"): lambda device=None: (runtime.properties.total_memory - 256 * mib,
                                                     runtime.properties.total_memory),
        (cuda, "memory_allocated"): lambda device=None: 0,
        (cuda, "memory_reserved"): lambda device=None: 0,
        (cuda, "max_memory_allocated"): lambda device=None: 0,
        (cuda, "reset_peak_memory_stats"): lambda device=None: None,
        (cuda, "empty_cache"): empty_cache,
        (cuda.memory, "_cuda_endAllocateToPool"): end_allocate_to_pool,
        (cuda.memory, "_cuda_releasePool"): release_pool,
        (torch, "Generator"): EmulatedGenerator,
        **{(owner, name): value for owner in (cuda, cuda.graphs) for name, value in (
            ("CUDAGraph", EmulatedCUDAGraph), ("graph", EmulatedGraphContext), ("graph_pool_handle", graph_pool_handle),
            ("is_current_stream_capturing", is_current_stream_capturing),
            ("make_graphed_callables", make_graphed_callables))},
        **({(torch.accelerator, "empty_host_cache"): lambda: None}
           if hasattr(getattr(torch, "accelerator", None), "empty_host_cache") else {}),
        **({(torch._C, "_host_emptyCache"): lambda: None} if hasattr(torch._C, "_host_emptyCache") else {}),
    }


@contextlib.contextmanager
def emulated_cuda(lazy: bool = True, memory_bytes: int = 8 * 1024**3,
                  side_item_delay_s: float = 0.0) -> Iterator[EmulatedRuntime]:
    """Run the block with emulated CUDA (see the module docstring); one emulation at a time."""
    runtime = activate(lazy, memory_bytes, side_item_delay_s)
    try:
        yield runtime
    finally:
        deactivate()


_SAVED: dict[tuple[Any, str], Any] = {}
_MODE: EmulationMode | None = None


def activate(lazy: bool = True, memory_bytes: int = 8 * 1024**3, side_item_delay_s: float = 0.0) -> EmulatedRuntime:
    """Patch `torch.cuda` and push the emulation's torch function mode on this thread (`deactivate` undoes it)."""
    global _MODE
    if active_runtime() is not None:
        raise RuntimeError("emulated CUDA is already active")
    if torch.cuda.is_available():
        raise RuntimeError("emulated CUDA refuses to run where a real CUDA device is available")
    runtime = EmulatedRuntime(lazy, memory_bytes, side_item_delay_s)
    _clear_device_caches()
    for (owner, name), value in _patches(runtime).items():
        _SAVED[owner, name] = getattr(owner, name)
        setattr(owner, name, value)
    set_active(runtime)
    _MODE = EmulationMode(runtime)
    _MODE.__enter__()
    return runtime


def _clear_device_caches() -> None:
    """Per-device caches of scoutbench's backends (flashinfer wrappers and workspace) belong to one emulation."""
    from scoutbench.kernels import backends, flashinfer_decode

    for module in (backends, flashinfer_decode):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def deactivate() -> None:
    global _MODE
    _clear_device_caches()
    gc.collect()  # host arenas that are garbage unregister now, while `cudaHostUnregister` is still emulated
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
    for (owner, name), value in _SAVED.items():
        setattr(owner, name, value)
    _SAVED.clear()
    set_active(None)
    _MODE = None


def to_emulated_device(module: torch.nn.Module) -> torch.nn.Module:
    """Move a (CPU) module's parameters and buffers to the emulated device, in place; returns it."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(EmulatedTensor(param.detach().clone()), requires_grad=False)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = EmulatedTensor(buffer.detach().clone())
    return module


def activate_from_environment() -> EmulatedRuntime | None:
    """`SCOUTBENCH_EMULATE_CUDA=1` (the CLI calls this first): the whole process runs on emulated CUDA, with
    `SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES` of device memory (8 GiB)."""
    from scoutbench.environment import value

    if not value("SCOUTBENCH_EMULATE_CUDA"):
        return None
    memory = value("SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES")
    torch.set_num_threads(1)  # thousands of tiny emulated device ops: a second intra-op thread only adds waits
    return activate(lazy=True, memory_bytes=memory)


__all__ = ["CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "EMULATED_DEVICE", "EmulatedCudaHazard", "EmulatedEvent",
           "EmulatedRuntime", "EmulatedStream", "EmulatedTensor", "SyncSite", "activate", "activate_from_environment",
           "active_runtime", "deactivate", "emulated_cuda", "to_emulated_device"]
