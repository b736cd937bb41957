"""The method configurations of the CUDA tests (tests/emulation/test_gpu.py), in one place: tests/emulation/test_emulated_cuda.py builds
and runs every one of them on a CPU, so a configuration a method refuses fails here, not on a lent GPU."""

from __future__ import annotations

from typing import Any

from scoutbench.methods import METHODS

PROMPT_LENGTHS = [256, 200]  # ragged: exercises per-sequence valid lengths
DECODE_STEPS = 4
# tiny but really sparse: 96-token budgets in 16-token blocks, one dense layer. 96, not 64: HGCA's budget must hold
# its window at its largest (48 + a 32-token migration block) and its 4 sink tokens. ScoutAttention with a pool of
# one selection (3 blocks): its default of two would hold nearly every block of these short prompts, and nothing
# would reach the CPU or be recalled (the `scout-pool2` variants run the default)
BUDGET, BLOCK_SIZE, COMMON_ARGS = 96, 16, {"dense_layers": 1, "pool_factor": 1}
ALL_NAMES = METHODS.names()


def method_args(name: str) -> dict[str, Any]:
    from scoutbench.method_args import MethodSettings, resolve_method_args

    settings = MethodSettings.of(COMMON_ARGS, budget=BUDGET, block_size=BLOCK_SIZE)
    return resolve_method_args(ALL_NAMES, settings)[name]  # as `throughput --method all` would give it


def build(name: str):
    from scoutbench.methods import build_method

    return build_method(name, method_args(name))


def attention_inputs(dtype: Any, group: int, head_dim: int, num_keys: int = 300, seed: int = 0):
    """q `[3, 2 * group, head_dim]`, k/v `[3, 2, num_keys, head_dim]` and ragged valid lengths `[3, 2]` (a full row,
    an empty one, one key, ...) in `dtype`: the decode-attention inputs of the GPU tests and their emulation."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2 * group, head_dim, generator=generator).to(dtype)
    k = torch.randn(3, 2, num_keys, head_dim, generator=generator).to(dtype)
    v = torch.randn(3, 2, num_keys, head_dim, generator=generator).to(dtype)
    valid_len = torch.tensor([[num_keys, 0], [1, 77], [150, num_keys - 3]])
    return q, k, v, valid_len
