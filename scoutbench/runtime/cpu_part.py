"""The CPU part of a GPU-CPU co-attention layer on both tiers (HGCA, ScoutAttention): the query goes down to the
host, where a worker attends the host tokens, and the partial state comes back to where the merge reads it.

`cpu_part(...)` chooses the variant for the compute device, once, at bind; the methods call one interface:
- `PinnedCpuPart` (CUDA): per slot (a layer, or a parity of consecutive layers) a pinned host copy of the query
  (one non-blocking device-to-host copy, then an event the worker waits for), the worker's result written into a
  pinned buffer with output and LSE side by side `[B, H, D + 1]` (one asynchronous copy back: a copy from the
  worker's fresh pageable tensors would be synchronous, or unsafe), and the static device buffer of the same shape
  that the merge reads (so a captured graph reads it). The worker refills a slot's result buffer only once the copy
  that read it has run (the events of `read_event`).
- `InPlaceCpuPart` (CPU): the host is the compute device: nothing moves, the merge reads the worker's state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from scoutbench.kernels.partial_state import PartialState
from scoutbench.runtime.offload import DONE, host_empty


def cpu_part(slots: Iterable[Hashable], batch: int, heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device | str, with_lse: bool = False) -> CpuPart:
    """The CPU part's buffers for the compute device: pinned copies on CUDA, none on a CPU. `with_lse`: the device
    part's LSE goes to the host too (HGCA's moving average reads it)."""
    if torch.device(device).type == "cuda":
        return PinnedCpuPart(slots, batch, heads, head_dim, dtype, device, with_lse)
    return InPlaceCpuPart()


class CpuPart:
    """Query down, partial state back, per slot. Device work (captured with CUDA graphs): `send`, `send_lse`,
    `copy_in`, `result`; host work: `query`, `lse`, `result_in`, `read_event`; worker: `hand_over`."""

    def send(self, slot: Hashable, q: torch.Tensor) -> None:
        """Device: start the copy of the query `[B, H, D]` to the host."""

    def query(self, slot: Hashable, q: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Host, after `send`: the query the worker reads and the event that says it is there."""
        return q, DONE

    def send_lse(self, slot: Hashable, lse: torch.Tensor) -> None:
        """Device: start the copy of the device part's LSE `[B, H]` to the host."""

    def lse(self, slot: Hashable, lse: torch.Tensor) -> torch.Tensor:
        """The device part's LSE where the host reads it (after `send_lse` and a `read_event`)."""
        return lse

    def hand_over(self, slot: Hashable, state: PartialState) -> PartialState:
        """Worker: the CPU part's state into the slot's result buffer; returns what the merge reads."""
        raise NotImplementedError

    def copy_in(self, slot: Hashable) -> None:
        """Device: the slot's handed-over result to where the merge reads it (`result`)."""

    def result_in(self, slot: Hashable, state: PartialState | None) -> int:
        """Host: as `copy_in`, for a result `state` that may be None (nothing attended on the CPU: the empty
        state); returns the bytes copied to the device."""
        raise NotImplementedError

    def result(self, slot: Hashable) -> PartialState | None:
        """Device: the CPU part's state that the merge reads (None: nothing attended)."""
        raise NotImplementedError

    def read_event(self) -> Any:
        """Host: an event after the copies queued so far (those that read the host buffers of a slot)."""
        return DONE


class InPlaceCpuPart(CpuPart):
    """On a CPU: the worker's tensors are where the merge reads them."""

    def __init__(self) -> None:
        self._states: dict[Hashable, PartialState | None] = {}

    def hand_over(self, slot: Hashable, state: PartialState) -> PartialState:
        self._states[slot] = state
        return state

    def result_in(self, slot: Hashable, state: PartialState | None) -> int:
        self._states[slot] = state
        return 0 if state is None else state.o.numel() * 4 + state.lse.numel() * 4

    def result(self, slot: Hashable) -> PartialState | None:
        return self._states.pop(slot)


class PinnedCpuPart(CpuPart):
    """On CUDA: pinned host buffers per slot and the static device buffers the merge reads (module docstring)."""

    def __init__(self, slots: Iterable[Hashable], batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, with_lse: bool):
        self.device = torch.device(device)
        slots = list(slots)
        D = head_dim
        self.q_host = {s: host_empty((batch, heads, D), dtype, device) for s in slots}
        self.lse_host = {s: host_empty((batch, heads), torch.float32, device) for s in slots} if with_lse else {}
        self.out_host = {s: host_empty((batch, heads, D + 1), torch.float32, device) for s in slots}
        self.out_device = {s: torch.zeros((batch, heads, D + 1), device=device) for s in slots}
        self._handed = {s: _unpacked(out) for s, out in self.out_host.items()}
        self._merged = {s: _unpacked(out) for s, out in self.out_device.items()}
        for state in self._merged.values():  # the empty state until a result lands
            state.lse.fill_(float("-inf"))

    def send(self, slot: Hashable, q: torch.Tensor) -> None:
        self.q_host[slot].copy_(q, non_blocking=True)

    def query(self, slot: Hashable, q: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.q_host[slot], self.read_event()

    def send_lse(self, slot: Hashable, lse: torch.Tensor) -> None:
        self.lse_host[slot].copy_(lse, non_blocking=True)

    def lse(self, slot: Hashable, lse: torch.Tensor) -> torch.Tensor:
        return self.lse_host[slot]

    def hand_over(self, slot: Hashable, state: PartialState) -> PartialState:
        handed = self._handed[slot]
        handed.o.copy_(state.o)
        handed.lse.copy_(state.lse)
        return handed

    def copy_in(self, slot: Hashable) -> None:
        self.out_device[slot].copy_(self.out_host[slot], non_blocking=True)

    def result_in(self, slot: Hashable, state: PartialState | None) -> int:
        if state is None:
            o, lse = self._merged[slot]
            o.zero_()
            lse.fill_(float("-inf"))
            return 0
        self.copy_in(slot)  # `hand_over` wrote it
        return state.o.numel() * 4 + state.lse.numel() * 4

    def result(self, slot: Hashable) -> PartialState:
        return self._merged[slot]

    def read_event(self) -> Any:
        return torch.cuda.current_stream(self.device).record_event()


def _unpacked(packed: torch.Tensor) -> PartialState:
    """The partial state `(o [B, H, D], lse [B, H])` packed as `[B, H, D + 1]` (views)."""
    return PartialState(packed[..., :-1], packed[..., -1])
