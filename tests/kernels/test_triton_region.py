"""The Triton kernels of `fused_ops.region_attention` and `fused_ops.merged_output` (scoutbench/kernels/
triton_region.py) against their torch references, run on CPU through the Triton interpreter. Skipped when triton is
not installed (it is not a default dependency); `nox -s triton` (run by CI) installs it and requires it.

How the checks run in the interpreter (a child pytest): tests/triton_interpreter.py.

bfloat16: the interpreter computes `tl.dot` on bf16 inputs wrongly (triton 3.9: outputs off by 1e8 and more), so
the region kernel, which multiplies with `tl.dot`, is checked in fp32 and fp16 only. The merge has no dot and is
checked in bf16 too, to one bf16 unit in the last place: the interpreter's fp32 -> bf16 cast truncates where a GPU
(and torch) rounds to nearest even; on values that bf16 holds exactly the cast is exact, and so is the check.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import child_run_test, interpreted, kernel_module

from scoutbench.kernels.fused_ops import region_reference
from scoutbench.kernels.partial_state import _interpolated

triton_region = kernel_module("scoutbench.kernels.triton_region")
SCALE = 0.17
NEG_INF = float("-inf")


test_kernel_checks_in_triton_interpreter = child_run_test(__file__)


# ---------------------------------------------------------------------------------------------- region attention
def _slot_tokens(batch, num_kv_heads, num_slots, slot_size, generator):
    """Full slots, partly open ones and closed ones (0) interleaved at random, each row with an open token; every
    other column of a wider tensor, so the kernel must honour the strides of slot_tokens too."""
    kind = torch.randint(0, 3, (batch, num_kv_heads, 2 * num_slots), generator=generator)
    partial = torch.randint(1, slot_size, kind.shape, generator=generator)
    tokens = torch.where(kind == 0, 0, torch.where(kind == 1, slot_size, partial))[..., ::2]
    empty = tokens.sum(-1) == 0
    tokens[..., -1] = torch.where(empty, partial[..., -1], tokens[..., -1])
    assert (tokens.sum(-1) > 0).all() and tokens.stride(-1) == 2
    return tokens


def _region_inputs(batch, num_kv_heads, group, head_dim, num_slots, slot_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_keys = num_slots * slot_size
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=generator).to(dtype)
    # k: the leading columns of wider rows; v: a transposed store (stride 1 on tokens): neither is contiguous
    k = torch.randn(batch, num_kv_heads, num_keys, head_dim + 8, generator=generator).to(dtype)[..., :head_dim]
    v = torch.randn(batch, num_kv_heads, head_dim, num_keys, generator=generator).to(dtype).transpose(-1, -2)
    assert not k.is_contiguous() and not v.is_contiguous()
    return q, k, v, _slot_tokens(batch, num_kv_heads, num_slots, slot_size, generator)


def _assert_region_matches(got, reference, atol):
    (o, lse), (ref_o, ref_lse) = got, reference
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=0)
    torch.testing.assert_close(o, ref_o, atol=atol, rtol=0)


# (batch, num_kv_heads, group, head_dim, num_slots, slot_size): groups of 1, 2 and 5 (Qwen3-14B), head_dim 64,
# 128 and 80 (not a power of two: masked columns), one slot to 70, slots of 16 and 32 tokens
REGION_SHAPES = [
    (1, 2, 1, 64, 1, 16),
    (3, 2, 2, 128, 9, 32),
    (3, 2, 5, 128, 70, 16),
    (1, 1, 5, 80, 37, 32),
    (3, 1, 5, 64, 70, 32),
]


def _shape_id(shape):
    return "B{}-Hkv{}-G{}-D{}-S{}-b{}".format(*shape)


@interpreted
@pytest.mark.parametrize("shape", REGION_SHAPES, ids=_shape_id)
def test_region_kernel_matches_reference_fp32(shape):
    q, k, v, slot_tokens = _region_inputs(*shape, torch.float32, seed=sum(shape))
    got = triton_region.region_attention(q, k, v, SCALE, slot_tokens)
    _assert_region_matches(got, region_reference(q, k, v, SCALE, slot_tokens), atol=1e-5)


@interpreted
@pytest.mark.parametrize("shape", REGION_SHAPES, ids=_shape_id)
def test_region_kernel_fp16(shape):
    """fp16 inputs against the fp32 reference on the same (rounded) values (the kernel accumulates in fp32), and
    against the fp16 reference, which rounds its logits and probabilities to fp16, more loosely."""
    q, k, v, slot_tokens = _region_inputs(*shape, torch.float16, seed=1)
    got = triton_region.region_attention(q, k, v, SCALE, slot_tokens)
    _assert_region_matches(got, region_reference(q.float(), k.float(), v.float(), SCALE, slot_tokens), atol=2e-3)
    _assert_region_matches(got, region_reference(q, k, v, SCALE, slot_tokens), atol=1e-2)


@interpreted
def test_region_kernel_closed_leading_tiles_and_single_tokens():
    """Whole key tiles of closed slots before the first open token (the online softmax starts at -inf there and must
    not produce NaN), and rows whose only open token is one token of one slot."""
    q, k, v, _ = _region_inputs(2, 2, 5, 64, 12, 16, torch.float32, seed=5)
    slot_tokens = torch.zeros(2, 2, 12, dtype=torch.long)
    slot_tokens[0, 0, 9:] = torch.tensor([16, 3, 0])  # tokens 144-159 and 160-162: the first two tiles are closed
    slot_tokens[0, 1, 11] = 1  # only the very last token
    slot_tokens[1, 0, 0] = 1  # only the very first token
    slot_tokens[1, 1, 4] = 16  # one full slot inside the first tile
    got = triton_region.region_attention(q, k, v, SCALE, slot_tokens)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    _assert_region_matches(got, region_reference(q, k, v, SCALE, slot_tokens), atol=1e-5)


# ---------------------------------------------------------------------------------------------- merged output
def _merge_inputs(batch, num_heads, head_dim, seed=0, representable_in=torch.float32):
    """Two fp32 partial states as non-contiguous views: o_a a slice of a wider tensor, o_b a transposed store,
    the LSEs every other column of wider tensors."""
    generator = torch.Generator().manual_seed(seed)

    def values(*shape):
        return torch.randn(*shape, generator=generator).to(representable_in).float()

    o_a = values(batch, num_heads, 2 * head_dim)[..., head_dim:]
    o_b = values(batch, head_dim, num_heads).transpose(1, 2)
    lse_a = (values(batch, 2 * num_heads) * 4)[:, ::2]
    lse_b = (values(batch, 2 * num_heads) * 4)[:, 1::2]
    assert not any(t.is_contiguous() for t in (o_a, o_b, lse_a, lse_b))
    return o_a, lse_a, o_b, lse_b


def _merge_reference(o_a, lse_a, o_b, lse_b, dtype):
    return _interpolated(o_a, lse_a, o_b, lse_b).to(dtype)


@interpreted
@pytest.mark.parametrize("head_dim", [128, 80])
def test_merge_kernel_matches_reference_fp32(head_dim):
    o_a, lse_a, o_b, lse_b = _merge_inputs(3, 10, head_dim, seed=head_dim)
    lse_b[1, :3] = lse_a[1, :3]  # equal masses: share 1/2, the second branch of lerp's two-sided form
    got = triton_region.merged_output(o_a, lse_a, o_b, lse_b, torch.float32)
    assert got.dtype == torch.float32 and got.shape == o_a.shape
    torch.testing.assert_close(got, _merge_reference(o_a, lse_a, o_b, lse_b, torch.float32), atol=1e-6, rtol=0)


@interpreted
def test_merge_kernel_bf16_within_one_unit():
    o_a, lse_a, o_b, lse_b = _merge_inputs(3, 10, 128, seed=2)
    got = triton_region.merged_output(o_a, lse_a, o_b, lse_b, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    expected = _merge_reference(o_a, lse_a, o_b, lse_b, torch.bfloat16)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-6, rtol=2.0**-7)  # one bf16 ulp: 2^-8..2^-7


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_empty_parts_are_exact(dtype):
    """A part with lse -inf (empty) gives the other part's output exactly; two empty parts give o_a, not NaN.
    The values are ones bf16 holds (scaled by powers of two), so the cast to bf16 is exact in the interpreter too."""
    o_a, lse_a, o_b, lse_b = _merge_inputs(2, 6, 64, seed=3, representable_in=torch.bfloat16)
    lse_a[0, 0] = NEG_INF  # a empty: o_b
    lse_b[0, 1] = NEG_INF  # b empty: o_a
    lse_a[1, 2] = lse_b[1, 2] = NEG_INF  # both empty: o_a
    lse_a[1, 3], lse_b[1, 3] = NEG_INF, 80.0  # a empty, b far above zero
    lse_a[1, 4], lse_b[1, 4] = 80.0, NEG_INF
    # where a is empty, an o_a far larger than o_b: o_a + 1 * (o_b - o_a) would lose o_b's low bits
    o_a[0, 0] *= 1024
    o_a[1, 3] *= 1024
    o_b[0, 0] /= 16
    got = triton_region.merged_output(o_a, lse_a, o_b, lse_b, dtype)
    assert not got.isnan().any()
    for (row, head), part in {(0, 0): o_b, (0, 1): o_a, (1, 2): o_a, (1, 3): o_b, (1, 4): o_a}.items():
        assert torch.equal(got[row, head], part[row, head].to(dtype)), (row, head)
    rest = torch.ones(2, 6, dtype=torch.bool)
    rest[0, :2] = rest[1, 2:5] = False
    expected = _merge_reference(o_a, lse_a, o_b, lse_b, dtype)
    torch.testing.assert_close(got[rest].float(), expected[rest].float(), atol=1e-6, rtol=2.0**-7)


# ---------------------------------------------------------------------------------------------- one launch each
class _CountingKernel:
    """Stands in for a `@triton.jit` function: counts the launches (`kernel[grid](...)`) and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@interpreted
def test_each_op_is_one_launch(monkeypatch):
    region = _CountingKernel(triton_region._region_kernel)
    merge = _CountingKernel(triton_region._merge_kernel)
    monkeypatch.setattr(triton_region, "_region_kernel", region)
    monkeypatch.setattr(triton_region, "_merge_kernel", merge)
    q, k, v, slot_tokens = _region_inputs(2, 2, 2, 64, 5, 16, torch.float32)
    o, lse = triton_region.region_attention(q, k, v, SCALE, slot_tokens)
    triton_region.merged_output(o, lse, o, lse, torch.float32)
    assert (region.launches, merge.launches) == (1, 1)
