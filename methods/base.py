"""The method contract's runtime: a small dataclass that owns its KV storage and returns decode attention.

The engine (scoutbench/decode/engine.py) runs the layer loop and calls, per run and per step:

    bind(ctx)                                   once: allocate storage for ctx.batch x ctx.max_len tokens
    ingest_prefill(layer, q_obs, k, v, lengths) once per layer: the prompt's post-RoPE K/V (and recent queries)
    begin_step(step)                            per decode step: positions of the new tokens (the step's plan)
      before_layer(layer, hidden, normed)       per layer, before its attention (layer-ahead hook)
      decode(layer, q, k, v) -> o               per layer: append k/v, return attention output [B, Hq, D]
    end_step()                                  per decode step
    stats() -> dict, reset_stats()              method statistics for the result JSON (reset after warm-up)
    close()                                     release workers and buffers (always called)

Hyper-parameters are dataclass fields, validated in __post_init__; `repr(method)` is the full constructor call
and goes into every result, as kvpress does. The engine times each `decode` as the `attn_device` stage (a method
times only what differs inside it: `idle`, `merge`). What else is known about a method (labels, argument
conversion, memory plan, work model) is declared beside the runtime: methods/declarations.py. A block-selection
method is one hook on methods/selection.py.

CUDA graphs (scoutbench/decode/graphs.py). `begin_step` and `end_step` always run eagerly: they are the step's plan, where
host arithmetic (positions, block boundaries, what is due) becomes device metadata written in place. The per-layer
hooks (`before_layer`, `decode`) are what a graph captures: their Python runs once, at capture, and only the device
work it issued is replayed, so per step they may read only device tensors (no Python int that changes per step, no
host read) and keep no Python bookkeeping. Host work among them (a hand-off to the CPU worker, a wait for its result,
a recall, a statistic) goes through `ctx.host(fn, *args)`: run at once when eager, and at every replay between the
captured pieces with graphs; `fn` communicates with the device code through buffers, never by return value.
`graph_key()` names the variant of the step's device work this step needs (None: one for every step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# the declarations beside the runtime, and the names the methods have always imported from here
from scoutbench.methods.declarations import DEFAULT_DENSE_LAYERS as DEFAULT_DENSE_LAYERS
from scoutbench.methods.declarations import DENSE_LAYERS_FIELD as DENSE_LAYERS_FIELD
from scoutbench.methods.declarations import DefaultsSearch, MemoryPlan, MethodArgs, MethodLabels, WorkModel
from scoutbench.methods.declarations import Footprint as Footprint
from scoutbench.methods.declarations import ModelShape as ModelShape
from scoutbench.methods.declarations import dense_layers_of as dense_layers_of
from scoutbench.methods.declarations import sparse_layer_range as sparse_layer_range
from scoutbench.timing import StageTimer

# The prompt queries the engine hands every method at prefill (initial selection, InfiniGen's SVD, HGCA's scores).
OBS_WINDOW = 256

@dataclass
class StepInfo:
    """Where the new token of each sequence goes. `positions` lives on the compute device; the host copy
    avoids device syncs in the decode loop."""

    positions: torch.Tensor  # [B] int64: tokens already cached = position of the new token
    positions_host: list[int]
    index: int  # decode step number, 0-based, warm-up included

    @property
    def uniform(self) -> bool:
        return min(self.positions_host) == max(self.positions_host)


@dataclass
class MethodContext:
    """What a method may know about the model and the run."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    batch: int
    max_len: int  # prompt + decode tokens that the storage must hold, per sequence
    device: torch.device
    dtype: torch.dtype
    timer: StageTimer
    # predict_query(target_layer, hidden, normed) -> rotated query [B, Hq, D] of `target_layer` for the current
    # token, computed from another layer's input (the layer-ahead prediction of ScoutAttention and InfiniGen).
    predict_query: Callable[..., torch.Tensor]
    # host(fn, *args): host work inside a layer's hooks (module docstring: CUDA graphs); runs fn(*args) now when eager
    host: Callable[..., None] = lambda fn, *args: fn(*args)
    # the step is replayed from CUDA graphs: per-layer hooks read only device tensors (no host lengths for a backend)
    graphs: bool = False

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass
class AttentionMethod(MethodLabels, MethodArgs, MemoryPlan, WorkModel, DefaultsSearch):
    """The runtime contract (module docstring). What else the rest of scoutbench knows about a method is declared
    beside it, one small class per concern (methods/declarations.py): its labels in reports (`MethodLabels`), its
    fields and their conversion from `--method-arg` (`MethodArgs`), its memory (`MemoryPlan.memory_footprint`) and
    its work model (`WorkModel`: what `project` and `gate --counters` count) and the grid its defaults are chosen
    over (`DefaultsSearch`)."""

    # True when the method needs before_layer (the engine skips the call otherwise).
    layer_ahead: ClassVar[bool] = False
    # True when a captured layer adds to the attended-token counts (`AttendedTokens.accumulate`: device scalars that
    # a replay adds to); otherwise they are counted on the host or accumulated by eager device work.
    attended_on_device: ClassVar[bool] = False
    # The method's host tier as one exact-size arena (runtime/offload.HostArena) once bound, None where it keeps
    # none: the memory plan's host bytes are checked against its size (bench/throughput.py, HOST_PLAN_SLACK).
    host_arena: ClassVar[Any] = None

    def bind(self, ctx: MethodContext) -> None:
        self.ctx = ctx
        self.counters = StepCounters(ctx.device if self.attended_on_device else None)

    def ingest_prefill(self, layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lengths: torch.Tensor) -> None:
        """q_obs `[B, Hq, W, D]`: queries of each prompt's last W tokens; k/v `[B, Hkv, N, D]`, right-padded to N,
        valid up to lengths[b]. The engine may reuse these tensors for the next layer: copy what you keep."""
        raise NotImplementedError

    def begin_step(self, step: StepInfo) -> None:
        self.step = step
        self.counters.steps += 1

    def before_layer(self, layer: int, hidden: torch.Tensor, normed: torch.Tensor) -> None:
        """Layer-ahead hook: `hidden` is layer `layer`'s residual input `[B, hidden]`, `normed` its normalised form."""

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[B, Hq, D]`, k/v `[B, Hkv, D]` (post-RoPE) -> attention output `[B, Hq, D]` in q's dtype."""
        raise NotImplementedError

    def end_step(self) -> None:
        pass

    def graph_key(self) -> Any:
        """Which captured variant of the step's device work this step replays (called after `begin_step`); steps
        with equal keys issue the same device work from the same buffers. None: every step is alike."""
        return None

    def block_cycle(self) -> int | None:
        """Decode steps from one occurrence of the method's per-block work (a completed block's digests and copy to
        the host tier, a window block's migration) to the next, from the config alone; None without such work. A
        timed window of whole cycles holds that work at its real rate (bench/throughput.py)."""
        return None

    def block_events(self, positions: list[int]) -> tuple[str, ...]:
        """The per-block work (named events, e.g. "complete") that a decode step whose new tokens go to
        `positions` does, from the method's state now: right for the next step, and for later ones until an event
        happens. Each event happens once per `block_cycle` steps."""
        return ()

    def stats(self) -> dict[str, Any]:
        return {}

    def reset_stats(self) -> None:
        """Zero the counters behind `stats()`: the throughput runner calls it after warm-up, so statistics cover
        exactly the timed steps. A method with counters of its own zeroes them after calling this."""
        self.counters.reset()

    def close(self) -> None:
        pass


def transfer_stats(h2d_bytes: int, d2h_bytes: int, steps: int) -> dict[str, float]:
    """Bytes copied host-to-device and device-to-host per decode step, every layer: the same two keys in every
    method's stats, counting what the CUDA path really copies (index tensors included)."""
    steps = max(steps, 1)
    return {"h2d_bytes_per_step": h2d_bytes / steps, "d2h_bytes_per_step": d2h_bytes / steps}


class StepCounters:
    """The counters every method's `stats()` reports, declared once (`AttentionMethod.counters`, made at bind and
    zeroed by `reset_stats`): the decode steps (`begin_step` counts them), the bytes copied host-to-device and
    device-to-host (`transfer`: the same two keys in every method's stats) and the tokens attended per (sequence,
    KV head) (`attended`). A method counts its bytes and tokens where it moves and attends them, and keeps only
    counters of its own beside these."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.attended = AttendedTokens(device)  # zeroed as it is made
        self.steps = 0
        self.h2d_bytes = self.d2h_bytes = 0

    def reset(self) -> None:
        self.steps = 0
        self.h2d_bytes = self.d2h_bytes = 0
        self.attended.reset()

    def transfer(self) -> dict[str, float]:
        """`h2d_bytes_per_step` and `d2h_bytes_per_step` over the steps counted (`transfer_stats`)."""
        return transfer_stats(self.h2d_bytes, self.d2h_bytes, self.steps)


class AttendedTokens:
    """Tokens attended per (sequence, KV head) in a method's sparse layers, over every (layer, step): the one
    number `--budget` bounds in every method and ablation, reported as mean and max in every method's stats.

    Counts come as a device tensor `[B, Hkv]` (`add`: accumulated on the device, no host sync until `stats`) or
    as host per-sequence counts shared by every KV head (`add_host`). Made with a `device`, it also accumulates
    in place into two device scalars that `reset` zeroes in place (`accumulate`, which a captured CUDA graph
    replays: it adds no Python state; the rows it stands for are counted by the host, `count_rows`)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._static = None if device is None else (torch.zeros((), device=device), torch.zeros((), device=device))
        self.reset()

    def reset(self) -> None:
        self._host_sum = 0.0
        self._host_max = 0
        self._rows = 0
        self._device_sum: torch.Tensor | None = None
        self._device_max: torch.Tensor | None = None
        if self._static is not None:
            for total in self._static:
                total.zero_()

    def accumulate(self, counts: torch.Tensor) -> None:
        """Device work only: counts `[B, H]` of one layer (or `[L, B, H]` of L layers) into the static sum and max
        (`count_rows` the rows)."""
        static_sum, static_max = self._static
        static_sum.add_(counts.sum())
        torch.maximum(static_max, counts.max(), out=static_max)

    def count_rows(self, rows: int) -> None:
        self._rows += rows

    def add(self, counts: torch.Tensor, layers: int = 1) -> None:
        """Counts `[B, H]` of one layer, or of each of `layers` layers that attended the same in this step."""
        total, most = counts.sum() * layers, counts.max()
        self._device_sum = total if self._device_sum is None else self._device_sum + total
        self._device_max = most if self._device_max is None else torch.maximum(self._device_max, most)
        self._rows += counts.numel() * layers

    def add_host(self, per_sequence: list[int], kv_heads: int, layers: int = 1) -> None:
        if not layers:
            return
        self._host_sum += sum(per_sequence) * kv_heads * layers
        self._host_max = max(self._host_max, max(per_sequence))
        self._rows += len(per_sequence) * kv_heads * layers

    def stats(self, budget: int | None) -> dict[str, Any]:
        """`attended_tokens_per_head` of a method's stats: mean, max, the budget, and whether max <= budget."""
        total, most = self._host_sum, self._host_max
        for device_sum, device_max in ((self._device_sum, self._device_max), self._static or (None, None)):
            if device_sum is not None:
                total += float(device_sum)
                most = max(most, int(round(float(device_max))))
        mean = total / self._rows if self._rows else None
        within = None if budget is None or not self._rows else most <= budget
        return {"mean": mean, "max": most if self._rows else None, "budget": budget, "within_budget": within}


def require(condition: bool, message: str) -> None:
    """Field validation helper for __post_init__."""
    if not condition:
        raise ValueError(message)
