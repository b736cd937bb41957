"""The synthetic workload's K/V: what `--prefill synthetic` hands the method instead of running the prompt through
the model (decode-only benchmarks; the paper measures decode instances only).

The engine ingests these layers as it ingests a recorded prefill (`DecodeEngine.prefill_synthetic`); this module
only draws them. It sits beside the engine in the import layers (tests/project/test_layers.py): it reads the planner's host
memory figure, and the engine calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from scoutbench import planning
from scoutbench.workloads.synthetic import DEFAULT_KV_SKEW

# per layer: the observation queries, keys and values, as `AttentionMethod.ingest_prefill` takes them
PrefillLayer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SyntheticPrefill:
    """One synthetic prefill: the shape of the K/V and how they are drawn. Two equal ones draw the same tensors,
    so it is also the key under which `SyntheticKVCache` keeps them.

    Keys and values are standard normal; with `key_skew > 0` each run of `skew_block` keys gets a log-normal
    magnitude (scale `exp(key_skew * N(0, 1))`): real KV caches have heavy-hitter regions that stay important
    across decode steps, which is the temporal locality block-sparse offloading relies on; i.i.d. keys
    (`key_skew=0`) make every step's selection independent, the worst case for ScoutAttention's resident set.
    No RoPE is applied: a standard normal vector rotated by any fixed rotation is again standard normal, so
    rotating keys and observation queries at their positions would change no statistic, at a read and write
    of every key per layer. The tensors are filled in fixed pieces, each from its own generator
    (`_fill_standard_normal_`), in parallel on a CPU.
    """

    lengths: tuple[int, ...]  # prompt tokens per sequence
    obs_queries: int  # observation-window queries per sequence (the last ones of the shortest prompt)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    key_skew: float = DEFAULT_KV_SKEW
    skew_block: int = 32

    def layers(self, shared_kv: SyntheticKVCache | None = None) -> tuple[Iterable[PrefillLayer], bool]:
        """The per-layer `(q_obs, k, v)` to ingest, and whether they came from `shared_kv` rather than being drawn.

        With `shared_kv`, a prefill it holds (equal to this one) is returned from there, and one it admits is kept
        there for the next method. Drawn layers come one at a time, each drawn when the previous one has been
        ingested; unless kept, one K and one V buffer serve every layer (methods copy what they keep, as the
        contract says): a fresh tensor per layer would fault its pages in again, 2 x 256 MB per layer of
        bench-attn16 at 32k."""
        kept = None if shared_kv is None else shared_kv.lookup(self)
        if kept is not None:
            return kept, True
        return self._draw(shared_kv), False

    def _draw(self, shared_kv: SyntheticKVCache | None) -> Iterator[PrefillLayer]:
        batch, seq_len = len(self.lengths), max(self.lengths)
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        kv_shape = (batch, self.num_kv_heads, seq_len, self.head_dim)
        q_shape = (batch, self.num_heads, self.obs_queries, self.head_dim)
        if shared_kv is not None:
            shared_kv.clear()
        layer_bytes = (2 * math.prod(kv_shape) + math.prod(q_shape)) * self.dtype.itemsize
        keep = shared_kv is not None and shared_kv.admits(self.num_layers * layer_bytes, self.device)
        layers, k, v = [], None, None
        for _ in range(self.num_layers):
            if keep or k is None:
                k = torch.empty(kv_shape, device=self.device, dtype=self.dtype)
                v = torch.empty_like(k)
            _fill_standard_normal_(k, generator)
            if self.key_skew > 0:
                num_runs = -(-seq_len // self.skew_block)
                scale = torch.exp(self.key_skew * torch.randn((batch, self.num_kv_heads, num_runs, 1),
                                                              generator=generator, device=self.device)).to(self.dtype)
                k.mul_(scale.repeat_interleave(self.skew_block, dim=2)[:, :, :seq_len])
            _fill_standard_normal_(v, generator)
            q = torch.randn(q_shape, generator=generator, device=self.device, dtype=self.dtype)
            if keep:
                layers.append((q, k, v))
            yield q, k, v
        if keep:
            shared_kv.store(self, layers)


class SyntheticKVCache:
    """One synthetic prefill's per-layer `(q_obs, k, v)`, kept between the methods of one run on a CPU so that every
    method after the first ingests the very same tensors instead of drawing them again: random K/V come at about
    1.2 GB/s on 2 cores, 4 s of each method's prefill at bench-attn16 32k (4.3 GB).

    It holds one prefill at a time, and only while host memory allows: `admits` keeps a prefill only where it fits
    in the usable host memory left once the running method has allocated its caches, and `make_room` drops it
    before a run whose planned memory would not fit beside it. On CUDA nothing is kept: drawing there takes
    milliseconds, and device memory is the scarce tier.
    """

    def __init__(self) -> None:
        self.key: SyntheticPrefill | None = None
        self.layers: list[PrefillLayer] = []

    def lookup(self, key: SyntheticPrefill) -> list[PrefillLayer] | None:
        """The kept layers of the prefill that `key` describes, or None."""
        return self.layers if self.layers and key == self.key else None

    def admits(self, nbytes: int, device: torch.device) -> bool:
        """Whether a prefill of `nbytes` on `device` may be kept (asked after `clear`, the run's caches allocated)."""
        usable = planning.usable_host_bytes()
        return device.type == "cpu" and usable is not None and nbytes <= usable

    def store(self, key: SyntheticPrefill, layers: list[PrefillLayer]) -> None:
        self.key, self.layers = key, layers

    def make_room(self, need_bytes: int) -> None:
        """Drop the kept prefill if a run that will allocate `need_bytes` would not fit beside it."""
        usable = planning.usable_host_bytes()
        if self.layers and usable is not None and need_bytes > usable:
            self.clear()

    def clear(self) -> None:
        self.key, self.layers = None, []


# elements per piece of a synthetic K/V tensor, each piece from its own generator: the pieces, hence the values, do not
# depend on the thread count, and a 32k bench-attn16 tensor (134 MB in fp32) makes 16 of them
SYNTHETIC_PIECE_ELEMENTS = 1 << 21


def _fill_standard_normal_(x: torch.Tensor, generator: torch.Generator) -> None:
    """Fill contiguous `x` with N(0, 1), one seed per piece drawn from `generator`, the pieces in parallel on a CPU.

    torch's CPU `normal_` runs on one thread (a generator is sequential); at about 0.6 GB/s the random K/V were
    most of the default benchmark's wall time. Measured on 2 cores: 0.11-0.14 s instead of 0.23-0.26 s for one 134
    MB tensor.
    """
    flat = x.view(-1)
    pieces = flat.split(SYNTHETIC_PIECE_ELEMENTS)
    seeds = torch.randint(2**62, (len(pieces),), generator=generator, device=generator.device).tolist()

    def fill(piece: torch.Tensor, piece_seed: int) -> None:
        piece.normal_(generator=torch.Generator(device=x.device).manual_seed(piece_seed))

    workers = min(torch.get_num_threads(), len(pieces)) if x.device.type == "cpu" else 1
    if workers <= 1:
        for piece, piece_seed in zip(pieces, seeds, strict=True):
            fill(piece, piece_seed)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, pieces, seeds))
