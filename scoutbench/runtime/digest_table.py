"""Quest's digest table: per layer, the block digests of every sequence on the device, filled from a prompt in
chunks and a block at a time in decode, and scored through the kernels of `scoutbench.kernels.digest`. Storage, so
it lives in the runtime beside the block store that reads it."""

from __future__ import annotations

import torch

from scoutbench.kernels import digest_native
from scoutbench.kernels.digest import (
    CandidateBlocks,
    block_digests,
    bound_from_digests,
    center_radius,
    rank_from_digests,
)
from scoutbench.runtime.offload import PREFILL_CHUNK_TOKENS, device_zeros, token_chunks


def digest_score_dtype(kv_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """What `DigestTable` stores center/radius in: the KV dtype on CUDA, fp32 on CPU."""
    return kv_dtype if device_type == "cuda" else torch.float32


class DigestTable:
    """Per-layer digests of complete blocks on the compute device in the form scoring reads, shared by every
    block-sparse method: `center2 = max + min` and `radius2 = max - min` (`[B, Hkv, max_blocks, D]` each, the two
    halves of one `[B, Hkv, max_blocks, 2D]` tensor), written once when a block completes (`write`), so a score is
    one matmul and no per-call conversion.

    On CUDA they are stored in the KV dtype (a 16-bit center/radius pair costs what kmax/kmin did; converting
    bf16 digests to fp32 on every call was ~35 ms per step at paper scale), see `center_radius` for why the bound
    survives the rounding. On CPU they are fp32: every CPU result in results/ selected from fp32 digests, and the
    KV dtype there would change what those runs resume (docs/platform.md, "CPU digests in the KV dtype").
    """

    def __init__(self, layers: range, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device):
        self.kv_dtype = dtype
        self.score_dtype = digest_score_dtype(dtype, torch.device(device).type)
        *rows, head_dim = shape
        self.digests = device_zeros({layer: ((*rows, 2 * head_dim), self.score_dtype) for layer in layers}, device)
        self.center2 = {layer: both[..., :head_dim] for layer, both in self.digests.items()}
        self.radius2 = {layer: both[..., head_dim:] for layer, both in self.digests.items()}

    def __contains__(self, layer: int) -> bool:
        return layer in self.center2

    def write(self, layer: int, index: tuple, kmax: torch.Tensor, kmin: torch.Tensor) -> None:
        """Store the digests (kmax, kmin) of completed blocks at `index` (over the `[B, Hkv, blocks]` dims)."""
        center, radius = center_radius(kmax, kmin, self.score_dtype)
        self.center2[layer][index] = center
        self.radius2[layer][index] = radius

    def write_blocks(self, layer: int, keys: torch.Tensor, block_size: int) -> None:
        """Digests of every complete block of `keys` `[B, Hkv, N, D]` (a prompt), in chunks of
        PREFILL_CHUNK_TOKENS: the fp32 temporaries of a whole prompt would be a quarter of its keys."""
        for blocks in token_chunks(keys.shape[2] // block_size, max(1, PREFILL_CHUNK_TOKENS // block_size)):
            kmax, kmin = block_digests(keys[:, :, blocks.start * block_size: blocks.stop * block_size], block_size)
            self.write(layer, (slice(None), slice(None), blocks), kmax, kmin)

    def scores(self, layer: int, q: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """`upper_bound_scores` of q `[B, Hq, D]` against the first `num_blocks` blocks -> `[B, Hkv, num_blocks]`."""
        return bound_from_digests(q, self.digests[layer][:, :, :num_blocks])

    def select(self, layer: int, q: torch.Tensor, candidates: CandidateBlocks, per_query_head: bool = False,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`candidates.top` of q's scores: (ids `[B, Hkv, candidates.k]`, scores `[B, Hkv, nB]`, the bound in the
        digests' dtype (`rank_from_digests`); `[B, Hq, ..]` per query head); on a CPU one call of the digest kernel
        where it is built (the entries past `candidates.count` are padding either way). With `out` = (values, ids)
        buffers the ids are written there."""
        digests = self.digests[layer]
        if candidates.num_blocks != digests.shape[2]:
            digests = digests[:, :, :candidates.num_blocks]
        if (candidates.k and not per_query_head and digest_native.supports(q, digests)
                and candidates.blocked.device.type == "cpu"):
            ids, scores = digest_native.top_blocks(q, digests, candidates.blocked, candidates.k)
            return (ids if out is None else out[1].copy_(ids)), scores
        scores = rank_from_digests(q, digests, per_query_head)
        return candidates.top(scores, out), scores

    def device_bytes(self) -> int:
        """The digests' bytes on the compute device: two `[B, Hkv, blocks, D]` tensors per layer in the KV dtype
        (on CPU, where they are kept in fp32 for speed, what a CUDA run would hold)."""
        return sum(t.numel() * self.kv_dtype.itemsize for t in (*self.center2.values(), *self.radius2.values()))
