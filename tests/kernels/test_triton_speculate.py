"""The Triton kernel of `fused_ops.speculate_count_` (InfiniGen's dynamic count) against its torch reference, run on
CPU through the Triton interpreter: every output bit-identical. Skipped when triton is not installed (it is not a
default dependency); `nox -s triton` (run by CI) installs it and requires it.

How the checks run in the interpreter (a child pytest): tests/triton_interpreter.py.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import child_run_test, interpreted, kernel_module

from scoutbench.kernels.fused_ops import speculate_count_reference

triton_speculate = kernel_module("scoutbench.kernels.triton_speculate")
SCALE = 0.19


test_kernel_checks_in_triton_interpreter = child_run_test(__file__)


def _inputs(positions: list[int], num_kv_heads: int, group: int, num_slots: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw scores `[B, Hkv, G, N]` as a slice of a wider buffer: the kernel must honour strides; the uncached bias
    `[B, 1, 1, N]`; positions `[B]`), as InfiniGen's CUDA path makes them."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(positions)
    scores = (4 * torch.randn(batch, num_kv_heads, group, num_slots + 5, generator=generator)).to(dtype)
    positions_t = torch.tensor(positions)
    uncached = torch.zeros(batch, 1, 1, num_slots)
    uncached.view(batch, num_slots).masked_fill_(torch.arange(num_slots) >= positions_t[:, None], float("-inf"))
    return scores[..., :num_slots], uncached, positions_t


def _outputs(batch: int, num_kv_heads: int, num_slots: int, width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output buffers filled with garbage: every value the op defines must be written."""
    return [torch.full((batch, num_kv_heads, 1, num_slots), 7.0), torch.full((), 3.0),
            torch.full((batch,), -9, dtype=torch.long), torch.full((batch,), -9, dtype=torch.long),
            torch.full((batch, 1, 1, width), 5.0, dtype=dtype)]


def _assert_kernel_matches(positions: list[int], num_kv_heads: int, group: int, num_slots: int, capacity: int,
                           alpha: float, dtype: torch.dtype = torch.float32, width: int = 48, calls: int = 1) -> None:
    scores, uncached, positions_t = _inputs(positions, num_kv_heads, group, num_slots, dtype)
    batch = len(positions)
    expected = _outputs(batch, num_kv_heads, num_slots, width, dtype)
    speculate_count_reference(scores, uncached, SCALE, alpha, capacity, positions_t, *expected)
    scratch = torch.zeros(2, dtype=torch.long)
    for _ in range(calls):  # the counters are reset by each launch: a repeat gives the same outputs
        got = _outputs(batch, num_kv_heads, num_slots, width, dtype)
        triton_speculate.speculate_count_(scores, uncached, SCALE, alpha, capacity, positions_t, *got, scratch)
        for name, value, reference in zip(("ranked", "mean_count", "current", "valid_len", "bias"), got, expected,
                                          strict=True):
            assert torch.equal(value, reference), (name, value, reference)
        assert scratch.tolist() == [0, 0]


@interpreted
@pytest.mark.parametrize("alpha", [0.5, 5.0, float("inf")])
def test_ragged_batch_over_several_slot_blocks(alpha):
    """A ragged batch (one sequence shorter than the fetch) over more slots than one block of the kernel, GQA
    group of 4: the count under and at the capacity, the short sequence's current token at its own length."""
    _assert_kernel_matches([517, 40, 3], num_kv_heads=2, group=4, num_slots=600, capacity=60, alpha=alpha, calls=2)


@interpreted
def test_one_row_and_odd_group_bf16():
    """One sequence with one KV head (integer arguments of 1 reach the kernel as constants), Qwen3-14B's group of 5
    query heads, bf16 scores and a bf16 mask; the mean is not an integer."""
    _assert_kernel_matches([300], num_kv_heads=1, group=5, num_slots=300, capacity=500, alpha=2.0,
                           dtype=torch.bfloat16, width=1040)


@interpreted
def test_batch_wider_than_one_block_of_sequences():
    """More sequences than the last program writes per block, each with its own length."""
    _assert_kernel_matches(list(range(20, 40)), num_kv_heads=2, group=2, num_slots=64, capacity=30, alpha=1.0)
