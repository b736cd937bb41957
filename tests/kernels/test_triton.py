"""The Triton decode kernel against the torch reference `partial_attention`, run on CPU through the Triton
interpreter. Skipped when triton is not installed (it is not a default dependency); `nox -s triton` (run by CI)
installs it and requires it. The methods that use it on CUDA run on emulated CUDA with the kernel interpreted.

How the checks run in the interpreter (a child pytest): tests/triton_interpreter.py.
The interpreter computes `tl.dot` on bfloat16 inputs wrongly (triton 3.9: a bf16 load is fine, a bf16 dot is
not), so bf16 is checked on CUDA only, in tests/emulation/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import child_run_test, interpreted, kernel_module

from scoutbench.kernels.attention import partial_attention

triton_decode = kernel_module("scoutbench.kernels.triton_decode")
SCALE = 0.19


test_kernel_checks_in_triton_interpreter = child_run_test(__file__)


def _inputs(batch, num_heads, num_kv_heads, num_keys, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype)
    # keys as a slice of a longer cache: the kernel must honour strides, not assume contiguity
    k = torch.randn(batch, num_kv_heads, num_keys + 7, head_dim, generator=generator).to(dtype)[:, :, :num_keys]
    v = torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=generator).to(dtype)
    return q, k, v


def _assert_matches(state, reference, atol):
    assert state.o.dtype == torch.float32 and state.lse.dtype == torch.float32
    torch.testing.assert_close(state.lse, reference.lse, atol=atol, rtol=0)
    torch.testing.assert_close(state.o, reference.o, atol=atol, rtol=0)


VALID_LENS = {
    "all": None,
    "per_sequence": torch.tensor([1, 130]),
    "per_row_with_empty": torch.tensor([[130, 0], [37, 64]]),
}


@interpreted
@pytest.mark.parametrize("valid_name", list(VALID_LENS))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_partial_attention_fp32(valid_name, num_splits):
    q, k, v = _inputs(2, 8, 2, 130, 32, torch.float32)
    valid_len = VALID_LENS[valid_name]
    state = triton_decode.triton_partial_attention(q, k, v, SCALE, valid_len, num_splits=num_splits)
    _assert_matches(state, partial_attention(q, k, v, SCALE, valid_len), atol=2e-6)


@interpreted
def test_kernel_odd_group_and_head_dim_fp16():
    """Qwen3-14B's group of 5 query heads per KV head, a head_dim that is not a power of two, fp16 inputs
    against the fp32 reference on the same (rounded) values."""
    q, k, v = _inputs(2, 10, 2, 70, 40, torch.float16, seed=1)
    valid_len = torch.tensor([[3, 70], [70, 64]])
    state = triton_decode.triton_partial_attention(q, k, v, SCALE, valid_len, num_splits=2)
    _assert_matches(state, partial_attention(q.float(), k.float(), v.float(), SCALE, valid_len), atol=2e-3)


@interpreted
def test_kernel_all_rows_empty_is_the_empty_state():
    q, k, v = _inputs(1, 4, 2, 20, 16, torch.float32)
    state = triton_decode.triton_partial_attention(q, k, v, SCALE, torch.zeros(1, dtype=torch.long))
    assert torch.equal(state.o, torch.zeros_like(state.o))
    assert torch.isneginf(state.lse).all()


@interpreted
@pytest.mark.parametrize("name", ["hgca"])
def test_methods_on_emulated_cuda_run_the_triton_kernel(name):
    """The lent H200 has triton and no flashinfer: on CUDA, HGCA's window goes through this kernel (InfiniGen's
    fetched tokens and current token go through `decode_attention` with the step's lengths, as FullKV's cache). On emulated CUDA (scoutbench/testing/emulated_cuda) with the kernel in the interpreter, in a
    ragged batch (valid lengths per row) across block boundaries and migrations: the logits equal the CPU path's,
    the kernel really ran, and the decode loop has no host sync."""
    import gpu_configs
    from emulated import run_emulated, small_qwen3
    from method_harness import ragged_prompt

    from scoutbench.methods import build_method

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = small_qwen3()
        prompt, lengths = ragged_prompt(model.config.vocab_size, [120, 83], seed=3)
        run = run_emulated(model, lambda: build_method(name, gpu_configs.method_args(name)), prompt, lengths, 40)
    finally:
        torch.set_num_threads(threads)
    assert run.backends.get("cuda:triton", 0) > 0, run.backends
    assert max(run.max_diff()) < 2e-4, run.max_diff()
    assert not run.unexpected_syncs(), run.unexpected_syncs()
