"""Two-tier block storage of a GPU-CPU co-attention method (ScoutAttention's sparse layers), and its per-step plan.

`TieredBlockStore` holds, per sparse layer:

- the host tier: every complete block, as block-major rows `[max_blocks * B * Hkv, block_size, D]` (row
  `j * B * Hkv + b * Hkv + h` is block `j` of sequence `b`, KV head `h`), so the CPU kernel reads any set of blocks
  in place and a block completed by every sequence at once is one contiguous (asynchronous on CUDA) copy. It and,
  on CUDA, the recall's two staging buffers are one exact-size `HostArena`, pinned there;
- the device region: one contiguous row of block slots per (sequence, KV head): `pool_slots` pool slots (which
  block sits where: `BlockTable`), `sink_blocks` sink slots and a ring of `local_blocks + 1` slots that holds the
  local blocks and the tail (the partial block with the current token);
- `slot_tokens`, what the region's attention reads: the open tokens (a prefix) of each slot, whose always-on part
  `step_slots` sets once per step and whose pool part the method opens for the slots it reads (`open_pool`).

`SplitPlan` is one layer's split for one step packed into one int64 tensor (one device-to-host copy), read through
named views instead of offsets; `split_selection` makes it from a selection and the block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scoutbench.kernels import cpu_attention, fused_ops
from scoutbench.kernels.digest import CandidateBlocks
from scoutbench.kernels.split_plan import split_plan
from scoutbench.runtime.block_table import BlockTable
from scoutbench.runtime.digest_table import DigestTable
from scoutbench.runtime.offload import PREFILL_CHUNK_TOKENS, HostArena, device_zeros, host_empty, token_chunks

NUM_COUNTS = 4  # n_cpu, n_selected, n_available, n_resident
RECALL_INDEX_ROWS = 4  # a staged recall's index rows (TieredBlockStore._staged_index)


@dataclass
class SplitPlan:
    """`data` `[..., 3k + 4]` int64 for `k` pool slots per row: the selected block ids with the CPU ones first (by
    score), whether each is in flight to the pool (`pending`), the recall's eviction order (`victims`), and four
    counts per row. Every view works for any leading shape (`[B, Hkv]`, or flattened rows: `rows()`)."""

    data: torch.Tensor
    k: int

    @staticmethod
    def width(k: int) -> int:
        """int64 entries per row for `k` pool slots."""
        return 3 * k + NUM_COUNTS

    def rows(self) -> SplitPlan:
        """The same plan over flattened (sequence, KV head) rows `[B * Hkv, 3k + 4]`."""
        return SplitPlan(self.data.view(-1, self.data.shape[-1]), self.k)

    @property
    def ids(self) -> torch.Tensor:
        """Selected block ids, the CPU part's first (then the pool's, then padding)."""
        return self.data[..., : self.k]

    @property
    def pending(self) -> torch.Tensor:
        """Whether each of `ids` is being copied into the pool (a recall in flight): a recall skips it."""
        return self.data[..., self.k: 2 * self.k].bool()

    @property
    def victims(self) -> torch.Tensor:
        """Pool slots a recall may overwrite, in eviction order (free first, then the least important)."""
        return self.data[..., 2 * self.k: 3 * self.k]

    @property
    def counts(self) -> torch.Tensor:
        """n_cpu, n_selected, n_available, n_resident per row."""
        return self.data[..., 3 * self.k:]

    @property
    def n_cpu(self) -> torch.Tensor:
        """Blocks the CPU part attends (the first n_cpu of `ids`)."""
        return self.data[..., 3 * self.k]

    @property
    def n_available(self) -> torch.Tensor:
        """Pool slots a recall may fill (the first n_available of `victims`)."""
        return self.data[..., 3 * self.k + 2]


def split_selection(table: BlockTable, ids: torch.Tensor, valid: torch.Tensor, victims: torch.Tensor,
                    available: torch.Tensor, every_resident: bool = False) -> tuple[SplitPlan, torch.Tensor]:
    """Split a selection `ids` (`valid` entries) between the device pool and the CPU: B_cpu = B_pred minus B_gpu,
    the selected blocks the pool does not hold ready. Returns the `SplitPlan` (with the recall's `victims` and
    `available`) and the pool slots the device part reads `[B, Hkv, pool_slots]`: the selected resident ones, or
    with `every_resident` every resident block whose copy has landed (`kernels.split_plan`, which picks the
    backend)."""
    data, pool_use = split_plan(ids, valid, victims, available, table.block_slot, table.slot_ready, table.slot_block,
                                every_resident)
    return SplitPlan(data, ids.shape[-1]), pool_use


def select_and_split(store: TieredBlockStore, layer: int, q: torch.Tensor, candidates: CandidateBlocks,
                     with_victims: bool, split: SplitPlan, pool_use: torch.Tensor) -> None:
    """`DigestTable.select`, `BlockTable.victims` (`with_victims`) and `split_selection` of one layer in one fused
    device launch (`fused_ops.select_and_split`, where `backends.fused_ops_available`), into the layer's `split` and
    `pool_use` (static buffers: a captured graph writes them in place)."""
    digests = store.digests.digests[layer]
    if candidates.num_blocks != digests.shape[2]:
        digests = digests[:, :, : candidates.num_blocks]
    table = store.tables[layer]
    fused_ops.select_and_split(q, digests, candidates.blocked, candidates.count, table.block_slot, table.slot_ready,
                               table.slot_block, with_victims, split.data, pool_use)


class TieredBlockStore:
    """Host tier, device region and block tables of the sparse `layers` (see the module docstring)."""

    def __init__(self, layers: range, batch: int, kv_heads: int, head_dim: int, block_size: int, max_len: int,
                 pool_slots: int, sink_blocks: int, local_blocks: int, dtype: torch.dtype, device: torch.device,
                 recall_blocks: int):
        """`recall_blocks`: the most blocks one recall copies per (sequence, KV head) (one selection, which may
        be smaller than the pool), which sizes its staging."""
        b, B, Hkv, D = block_size, batch, kv_heads, head_dim
        self.layers, self.block_size, self.pool_slots, self.sink_blocks = layers, b, pool_slots, sink_blocks
        self.batch, self.kv_heads, self.head_dim = B, Hkv, D
        self.max_blocks = -(-max_len // b)
        self.n_ring = local_blocks + 1
        self.n_slots = pool_slots + sink_blocks + self.n_ring  # device block slots per (sequence, KV head)
        self.region = self.n_slots * b
        self.ring_base = (pool_slots + sink_blocks) * b  # the region row of the ring's first slot
        self.cuda = torch.device(device).type == "cuda"
        # Zeroed: gathers may read never-written rows, masked out, but they must be finite. The recall's staging
        # buffers (CUDA) come in two sets: consecutive layers alternate, at most two plans are in flight. On a CPU
        # a recall copies host rows into pool slots in one pass and stages nothing.
        rows, staged = self.max_blocks * B * Hkv, B * Hkv * recall_blocks
        parities = range(2) if layers else range(0)
        staging = {(kind, i): ((staged, b, D), dtype) for kind in ("rk", "rv") for i in parities} if self.cuda else {}
        self.arena = HostArena({**{(kind, layer): ((rows, b, D), dtype) for kind in "kv" for layer in layers},
                                **staging}, device)
        self.host_k = {layer: self.arena["k", layer] for layer in layers}
        self.host_v = {layer: self.arena["v", layer] for layer in layers}
        blocked = (self.max_blocks, B, Hkv, b, D)
        self._blocked_host = {layer: (self.host_k[layer].view(blocked).permute(1, 2, 0, 3, 4),
                                      self.host_v[layer].view(blocked).permute(1, 2, 0, 3, 4)) for layer in layers}
        if self.cuda:
            self.recall_k = [self.arena["rk", i] for i in parities]
            self.recall_v = [self.arena["rv", i] for i in parities]
            # a recall's indices, staged beside its blocks (`RECALL_INDEX_ROWS` rows of n): one copy to the device
            self.recall_index = [host_empty((RECALL_INDEX_ROWS * staged,), torch.long, device) for _ in parities]
        self.digests = DigestTable(layers, (B, Hkv, self.max_blocks, D), dtype, device)
        region = device_zeros({(kind, layer): ((B, Hkv, self.region, D), dtype) for kind in "kv" for layer in layers},
                              device)
        self.dev_k = {layer: region["k", layer] for layer in layers}
        self.dev_v = {layer: region["v", layer] for layer in layers}
        self.tables = {layer: BlockTable(B, Hkv, pool_slots, self.max_blocks, device) for layer in layers}
        if self.cuda:  # the recall's device staging (host staging -> here -> pool slots)
            self.stage_k = torch.empty((staged, b, D), dtype=dtype, device=device)
            self.stage_v = torch.empty((staged, b, D), dtype=dtype, device=device)
        self.slot_tokens = torch.zeros((B, Hkv, self.n_slots), dtype=torch.long, device=device)
        self._pool_tokens = self.slot_tokens[..., :pool_slots]  # the view `open_pool` writes (made once)
        self._batch_index = torch.arange(B, device=device)
        self._bh_rows = torch.arange(B * Hkv, device=device)  # row b * Hkv + h of every (sequence, KV head)

    def ring_slot(self, block: int) -> int:
        return self.pool_slots + self.sink_blocks + block % self.n_ring

    def blocked_host(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The host tier as `[B, Hkv, blocks, block_size, D]` views (block j of row (b, h) is host row
        j * B * Hkv + b * Hkv + h): what the CPU kernel reads by block id. Made once: the worker asks every layer,
        and each torch call there hands the GIL back and forth with the main thread."""
        return self._blocked_host[layer]

    # ------------------------------------------------------------------ prefill
    def selectable(self, positions: torch.Tensor, max_position: int, k: int) -> tuple[CandidateBlocks, torch.Tensor]:
        """The blocks a selection of `k` may pick when the new token sits at `positions` (complete blocks `j` with
        `sink_blocks <= j < tail - local_blocks`), and which of the k selections are valid `[B, Hkv, k]` (the
        prefill's initial selection; a decode step's are the method's, updated in place)."""
        b, device = self.block_size, positions.device
        num_scored = max(1, max_position // b)
        limit = (positions // b - (self.n_ring - 1)).clamp(min=0)
        excluded = None
        if self.sink_blocks:
            excluded = (torch.arange(num_scored, device=device) < self.sink_blocks)[None, None, :]
        candidates = CandidateBlocks.build(num_scored, limit, k, excluded, device)
        count = candidates.count.expand(positions.shape[0], self.kv_heads)  # [B, 1]: nothing excluded per head
        return candidates, torch.arange(k, device=device)[None, None, :] < count[:, :, None]

    def ingest_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> None:
        """Complete prompt blocks to the host tier with their digests; sink and local/tail blocks to the region."""
        b, B, Hkv, D = self.block_size, self.batch, self.kv_heads, self.head_dim
        complete = k.shape[2] // b
        for host, src in ((self.host_k[layer], k), (self.host_v[layer], v)):  # complete blocks, block-major
            blocks = src[:, :, : complete * b].reshape(B, Hkv, complete, b, D).permute(2, 0, 1, 3, 4)
            # a permuted device tensor is made contiguous before its D2H copy: in chunks, that transient is small
            for chunk in token_chunks(complete, max(1, PREFILL_CHUNK_TOKENS // b)):
                host.view(self.max_blocks, B, Hkv, b, D)[chunk].copy_(blocks[chunk])
        self.digests.write_blocks(layer, k, b)
        dev_k, dev_v = self.dev_k[layer], self.dev_v[layer]
        dev_k.zero_()
        dev_v.zero_()
        self.tables[layer].reset()
        # always-on blocks: sink slots and the local/tail ring (the tail's prompt tokens), from the prompt's K/V
        for seq, n in enumerate(lengths):
            tail = n // b  # block of the first decode token
            blocks = [(j, self.pool_slots + j) for j in range(min(self.sink_blocks, tail + 1))]
            blocks += [(j, self.ring_slot(j)) for j in range(max(0, tail - self.n_ring + 1), tail + 1)]
            for j, slot in blocks:
                count = min(n, (j + 1) * b) - j * b
                if count > 0:
                    dev_k[seq, :, slot * b: slot * b + count].copy_(k[seq, :, j * b: j * b + count])
                    dev_v[seq, :, slot * b: slot * b + count].copy_(v[seq, :, j * b: j * b + count])

    def load_resident(self, layer: int, ids: torch.Tensor, chosen: torch.Tensor) -> None:
        """Copy the `chosen` blocks of `ids` `[B, Hkv, pool_slots]` from the host tier into pool slots (slot i of
        a row holds its i-th block) and record them in the table."""
        b, D, rows = self.block_size, self.head_dim, self.batch * self.kv_heads
        ids_host, chosen_host = ids.cpu(), chosen.cpu()
        bh, kk = chosen_host.view(rows, -1).nonzero(as_tuple=True)
        if not bh.numel():
            return
        blocks = ids_host.view(rows, -1)[bh, kk]
        src = self.host_rows(bh, blocks)
        dst = bh * self.n_slots + kk
        for host, dev in ((self.host_k[layer], self.dev_k[layer]), (self.host_v[layer], self.dev_v[layer])):
            dev.view(-1, b, D).index_copy_(0, dst.to(dev.device), host.index_select(0, src).to(dev.device))
        device = self.dev_k[layer].device
        self.tables[layer].assign(bh.to(device), kk.to(device), blocks.to(device))

    # ------------------------------------------------------------------ decode
    def keep_leaving_blocks(self, positions_host: list[int], positions: torch.Tensor, prompt_len: list[int],
                            prompt_len_device: torch.Tensor) -> None:
        """Keep the block that leaves the local window this step on the device: move it from its ring slot (which
        the new tail block is about to overwrite) into a free pool slot, a device-to-device copy.

        The block is on the device all along; without this hand-off it would become host-only the moment it
        turns selectable, so its attention would move to the CPU and use the *predicted* query, and with a budget
        covering the whole context scout would drift from FullKV at every block boundary until a recall brought
        the block back. Rows whose pool is full leave the block to the host tier, as the paper's GPU keeps
        a fixed set of blocks; the periodic recall brings it back when it matters. No host-device copy or sync:
        which rows move is computed on the device from the positions (a list built on the host cost a blocking
        `torch.tensor(..., device=cuda)` copy per block boundary), every (sequence, KV head) row takes part, and
        rows that do not move, or have no free slot, write to the table's trash column (BlockTable keeps one for
        masked scatters) and copy their ring slot onto itself.
        """
        b, n_ring, k = self.block_size, self.n_ring, self.pool_slots
        # the ring held blocks tail - n_ring .. tail - 1 in the previous step only if that step was a decode step
        # (prefill fills the ring for the first decode token's tail block); the host check only skips idle steps
        if not any(p % b == 0 and p > prompt and p // b - n_ring >= self.sink_blocks
                   for p, prompt in zip(positions_host, prompt_len, strict=True)):
            return
        Hkv, D = self.kv_heads, self.head_dim
        block = positions // b - n_ring  # the block leaving the ring, per sequence
        moving = ((positions % b == 0) & (positions > prompt_len_device)
                  & (block >= self.sink_blocks)).repeat_interleave(Hkv)
        block = block.repeat_interleave(Hkv)
        ring = k + self.sink_blocks + block % n_ring
        src = self._bh_rows * self.n_slots + ring
        for layer in self.layers:
            table = self.tables[layer]
            free = table.slot_block.view(-1, k + 1)[:, :k] < 0
            take = moving & free.any(-1)
            slot = free.to(torch.uint8).argmax(-1)
            dst = self._bh_rows * self.n_slots + torch.where(take, slot, ring)
            for region in (self.dev_k[layer], self.dev_v[layer]):
                rows = region.view(-1, b, D)
                rows.index_copy_(0, dst, rows.index_select(0, src))
            table.assign(self._bh_rows, torch.where(take, slot, k), torch.where(take, block, self.max_blocks))

    def step_slots(self, positions: torch.Tensor) -> None:
        """The always-on part of this step's `slot_tokens` (the same for every layer): complete sink blocks, the
        local blocks and the tail up to the current token."""
        b, dev = self.block_size, positions.device
        tail, off = positions // b, positions % b
        sink = torch.where(torch.arange(self.sink_blocks, device=dev)[None, :] < tail[:, None], b, 0)
        r = torch.arange(self.n_ring, device=dev)
        j = tail[:, None] - ((tail[:, None] - r[None, :]) % self.n_ring)  # block held by ring slot r
        ring_ok = (j >= 0) & ((j >= self.sink_blocks) | (j == tail[:, None]))
        ring = torch.where(ring_ok, torch.where(j < tail[:, None], b, off[:, None] + 1), 0)
        self.slot_tokens[:, :, self.pool_slots:] = torch.cat([sink, ring], dim=1)[:, None, :]

    def open_pool(self, pool_use: torch.Tensor) -> None:
        """Open the pool slots a layer reads this time (bool `[B, Hkv, pool_slots]`) in `slot_tokens`."""
        torch.mul(pool_use, self.block_size, out=self._pool_tokens)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ring_rows: torch.Tensor,
               short_positions: list[int] | None = None) -> None:
        """Write the new token `[B, Hkv, D]` into the device ring at each sequence's `ring_rows` `[B]` (the region
        row of its position: device arithmetic, no host value), and while the context is shorter than the sink
        region (`short_positions`: the host positions then) into its sink slot too. The block it completes goes to
        the host tier in `complete_blocks`, once the step has attended it as its tail."""
        b = self.block_size
        dev_k, dev_v = self.dev_k[layer], self.dev_v[layer]
        dev_k[self._batch_index, :, ring_rows] = k
        dev_v[self._batch_index, :, ring_rows] = v
        for seq, p in enumerate(short_positions or ()):
            j = p // b
            if j < self.sink_blocks:  # context shorter than the sink region: the sink slot fills as we go
                row = (self.pool_slots + j) * b + p % b
                dev_k[seq, :, row].copy_(k[seq])
                dev_v[seq, :, row].copy_(v[seq])

    def complete_blocks(self, layer: int, positions_host: list[int], uniform: bool) -> int:
        """The blocks the tokens at `positions_host` completed: their digests, and their copy to the host tier (one
        contiguous copy when every sequence completed its block, asynchronous on CUDA). The host tier only ever
        needs complete blocks: the tail is attended on the device. Returns the bytes copied to the host tier."""
        b, B, Hkv, D = self.block_size, self.batch, self.kv_heads, self.head_dim
        done = [seq for seq, p in enumerate(positions_host) if (p + 1) % b == 0]
        if not done:
            return 0
        dev_k, dev_v = self.dev_k[layer], self.dev_v[layer]
        host_k = self.host_k[layer].view(self.max_blocks, B, Hkv, b, D)
        host_v = self.host_v[layer].view(self.max_blocks, B, Hkv, b, D)
        copied = len(done) * Hkv * b * D * dev_k.element_size() * 2
        if len(done) == B and uniform:
            j = positions_host[0] // b
            slot = self.ring_slot(j)
            block_k = dev_k[:, :, slot * b:(slot + 1) * b]
            self.digests.write(layer, (slice(None), slice(None), j), block_k.amax(dim=2), block_k.amin(dim=2))
            host_k[j].copy_(block_k.contiguous(), non_blocking=True)
            host_v[j].copy_(dev_v[:, :, slot * b:(slot + 1) * b].contiguous(), non_blocking=True)
            return copied
        for seq in done:
            j = positions_host[seq] // b
            slot = self.ring_slot(j)
            block_k = dev_k[seq, :, slot * b:(slot + 1) * b]
            self.digests.write(layer, (seq, slice(None), j), block_k.amax(dim=1), block_k.amin(dim=1))
            host_k[j, seq].copy_(block_k.contiguous(), non_blocking=True)
            host_v[j, seq].copy_(dev_v[seq, :, slot * b:(slot + 1) * b].contiguous(), non_blocking=True)
        return copied

    # ------------------------------------------------------------------ recall
    def host_rows(self, bh: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The host tier's rows of blocks `blocks` of (sequence, KV head) rows `bh` (block-major: the module
        docstring)."""
        return blocks * (self.batch * self.kv_heads) + bh

    def stage(self, layer: int, parity: int, bh: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """The worker's half of a recall of blocks `blocks` of rows `bh` into pool `slots`: on CUDA, gather them
        from the host tier into this parity's pinned staging buffers (rows [0, n)), with the indices the device
        side reads (`_staged_index`); nothing on a CPU, where `load_staged` copies them from the host tier into the
        pool directly."""
        if not self.cuda:
            return
        host_rows, n = self.host_rows(bh, blocks), bh.numel()
        torch.index_select(self.host_k[layer], 0, host_rows, out=self.recall_k[parity][:n])
        torch.index_select(self.host_v[layer], 0, host_rows, out=self.recall_v[parity][:n])
        index = self._staged_index(parity, n)
        torch.stack([bh, slots, blocks, bh * self.n_slots + slots], out=index)

    def _staged_index(self, parity: int, n: int) -> torch.Tensor:
        """This parity's staged recall indices `[RECALL_INDEX_ROWS, n]` (contiguous, pinned): rows, pool slots,
        blocks and the region rows of the slots."""
        return self.recall_index[parity][: RECALL_INDEX_ROWS * n].view(RECALL_INDEX_ROWS, n)

    def load_staged(self, layer: int, parity: int, bh: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                    copy_stream: Any) -> Any:
        """Copy the `n = bh.numel()` staged blocks into pool `slots` of rows `bh` and record them in the table
        (readable once the returned copy event, None on CPU, has completed)."""
        b, D, n = self.block_size, self.head_dim, bh.numel()
        dk, dv = self.dev_k[layer].view(-1, b * D), self.dev_v[layer].view(-1, b * D)
        if self.cuda:
            # the indices the worker staged, in one copy (on the compute stream, which the copy stream waits for)
            bh, slots, blocks, dst = self._staged_index(parity, n).to(dk.device, non_blocking=True).unbind(0)
            # blocks as flat rows of b * D: torch's CPU index_copy_ copies [n, b, D] blocks at half the rate of the
            # same bytes as [n, b * D] rows (140 vs 72 us for 128 fp32 blocks of 32 x 128)
            staged_k, staged_v = self.recall_k[parity][:n].view(n, b * D), self.recall_v[parity][:n].view(n, b * D)

            def job() -> None:
                for stage, staged, pool in ((self.stage_k, staged_k, dk), (self.stage_v, staged_v, dv)):
                    rows = stage[:n].view(n, b * D)
                    rows.copy_(staged, non_blocking=True)
                    pool.index_copy_(0, dst, rows)

            _, event = copy_stream.run(job)
        else:
            host_k, host_v = self.host_k[layer].view(-1, b * D), self.host_v[layer].view(-1, b * D)
            cpu_attention.copy_rows(((dk, host_k), (dv, host_v)), bh * self.n_slots + slots,
                                    self.host_rows(bh, blocks))
            event = None
        self.tables[layer].assign(bh, slots, blocks, event)
        return event

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def bytes_per_sequence(layers: int, context_len: int, kv_heads: int, head_dim: int, elem_bytes: int,
                           block_size: int, pool_slots: int, sink_blocks: int, local_blocks: int, recall_blocks: int
                           ) -> tuple[int, int, int]:
        """What `layers` sparse layers of such stores hold per sequence for a context of `context_len` tokens:
        (device bytes, host bytes, the prefill's device transient)."""
        if not layers:
            return 0, 0, 0
        kv = 2 * kv_heads * head_dim * elem_bytes  # K and V of one token
        n_blocks = -(-context_len // block_size)
        # device tokens per (sequence, KV head): the pool's slots, the sink slots and the local/tail ring
        region = (pool_slots + sink_blocks + local_blocks + 1) * block_size
        # per sparse layer: digests, the slotted region and its BlockTable (int64 block -> slot, int64 + bool per
        # slot); once: the recall's device staging (K and V) and the region's open tokens per slot
        block_table = kv_heads * ((n_blocks + 1) * 8 + (pool_slots + 1) * 9)
        device = layers * (n_blocks * 2 * kv_heads * head_dim * elem_bytes + region * kv + block_table)
        device += recall_blocks * block_size * kv + kv_heads * (region // block_size) * 8
        # the host arena: every block, and on CUDA two pinned recall staging buffers (a CPU recall copies host rows
        # into the pool directly)
        host = layers * n_blocks * block_size * kv + 2 * recall_blocks * block_size * kv
        # prefill: one chunk of blocks made contiguous for its D2H copy, and the initial resident K (then V) blocks
        prefill = (min(PREFILL_CHUNK_TOKENS, context_len) + recall_blocks * block_size) * kv // 2
        return device, host, prefill

    def device_bytes(self) -> int:
        tensors = [*self.dev_k.values(), *self.dev_v.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + self.digests.device_bytes()

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.host_k.values(), *self.host_v.values()))

    def release(self) -> None:
        self.arena.release()
