"""The compiled decode linear (kernels/cpu_linear) against a float64 reference, and its fallback to `F.linear`."""

import pytest
import torch
import torch.nn.functional as F

from scoutbench.kernels import cpu_linear

SHAPES = [(1, 4096, 256), (1, 256, 4096), (3, 257, 131), (16, 33, 17), (2, 5, 1), (1, 7, 32), (4, 64, 48)]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_float64_reference(rows, out_features, in_features, with_bias, cpu_backend):
    torch.manual_seed(rows * 1000 + out_features + in_features)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    assert cpu_linear.supports(x, weight, bias)
    ours = cpu_linear.linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), bias.double() if with_bias else None)
    assert ours.dtype == torch.float32 and ours.shape == (rows, out_features)
    # fp32 sums of in_features products: error within a few eps of the sum of |products|
    bound = (x.double().abs() @ weight.double().abs().T) * in_features * torch.finfo(torch.float32).eps + 1e-6
    assert ((ours.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_bf16_is_the_fp32_sum_rounded_once(rows, out_features, in_features, cpu_backend):
    """bf16 in and out, fp32 accumulation: within one bf16 ulp of the exact result (as torch's bf16 linear), with a
    bias added before the one rounding."""
    torch.manual_seed(7 + rows + out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    ours = cpu_linear.linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), bias.double())
    assert ours.dtype == torch.bfloat16
    slack = (x.double().abs() @ weight.double().abs().T) * in_features * torch.finfo(torch.float32).eps
    assert ((ours.double() - ref).abs() <= _bf16_ulp(ref) + slack + 1e-30).all()
    assert (ours.double() - F.linear(x, weight, bias).double()).abs().le(_bf16_ulp(ref) + slack).all()


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
def test_leading_dims_and_strided_input(cpu_backend):
    torch.manual_seed(3)
    weight = torch.randn(40, 24)
    x = torch.randn(2, 1, 48)[..., ::2]  # [2, 1, 24], not contiguous
    ours = cpu_linear.linear(x, weight)
    assert ours.shape == (2, 1, 40)
    torch.testing.assert_close(ours, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
def test_what_it_does_not_serve_is_f_linear(cpu_backend):
    """Many rows (a prefill), a transposed weight, mixed dtypes and autograd go to `F.linear`, bit for bit."""
    torch.manual_seed(4)
    weight = torch.randn(32, 16)
    cases = [
        (torch.randn(cpu_linear.MAX_ROWS + 1, 16), weight),
        (torch.randn(1, 16), torch.randn(16, 32).T),
        (torch.randn(1, 16, dtype=torch.bfloat16), weight),
        (torch.randn(1, 16), weight.clone().requires_grad_()),
    ]
    for x, w in cases:
        assert not cpu_linear.supports(x, w, None)
        with torch.no_grad() if not w.requires_grad else torch.enable_grad():
            if x.dtype != w.dtype:
                with pytest.raises(RuntimeError):
                    cpu_linear.linear(x, w)
                continue
            assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("cpu_backend", ["torch"], indirect=True)
def test_torch_backend_is_f_linear(cpu_backend):
    x, weight = torch.randn(1, 64), torch.randn(128, 64)
    assert not cpu_linear.supports(x, weight, None)
    assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))
