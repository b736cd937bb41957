"""The compiled decode linear (kernels/cpu_decode) against a float64 reference, and its fallback to `F.linear`."""

import copy

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import native_paths

from scoutbench.kernels import cpu_decode

# fp32 rows of 1 KiB, 16 KiB and 3 KiB (each of the linear's prefetch forms: burst, hardware's, sweep), then ragged
SHAPES = [(1, 4096, 256), (1, 256, 4096), (1, 64, 768), (3, 257, 131), (16, 33, 17), (2, 5, 1), (1, 7, 32),
          (4, 64, 48)]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_float64_reference(rows, out_features, in_features, with_bias, cpu_backend):
    torch.manual_seed(rows * 1000 + out_features + in_features)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    assert cpu_decode.supports(x, weight, bias)
    ours = cpu_decode.linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), bias.double() if with_bias else None)
    assert ours.dtype == torch.float32 and ours.shape == (rows, out_features)
    # fp32 sums of in_features products: error within a few eps of the sum of |products|
    bound = (x.double().abs() @ weight.double().abs().T) * in_features * torch.finfo(torch.float32).eps + 1e-6
    assert ((ours.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_bf16_is_the_fp32_sum_rounded_once(rows, out_features, in_features, cpu_backend):
    """bf16 in and out, fp32 accumulation: within one bf16 ulp of the exact result (as torch's bf16 linear), with a
    bias added before the one rounding."""
    torch.manual_seed(7 + rows + out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    ours = cpu_decode.linear(x, weight, bias)
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
    ours = cpu_decode.linear(x, weight)
    assert ours.shape == (2, 1, 40)
    torch.testing.assert_close(ours, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
def test_what_it_does_not_serve_is_f_linear(cpu_backend):
    """Many rows (a prefill), a transposed weight, mixed dtypes and autograd go to `F.linear`, bit for bit."""
    torch.manual_seed(4)
    weight = torch.randn(32, 16)
    cases = [
        (torch.randn(cpu_decode.MAX_ROWS + 1, 16), weight),
        (torch.randn(1, 16), torch.randn(16, 32).T),
        (torch.randn(1, 16, dtype=torch.bfloat16), weight),
        (torch.randn(1, 16), weight.clone().requires_grad_()),
    ]
    for x, w in cases:
        assert not cpu_decode.supports(x, w, None)
        with torch.no_grad() if not w.requires_grad else torch.enable_grad():
            if x.dtype != w.dtype:
                with pytest.raises(RuntimeError):
                    cpu_decode.linear(x, w)
                continue
            assert torch.equal(cpu_decode.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("cpu_backend", ["torch"], indirect=True)
def test_torch_backend_is_f_linear(cpu_backend):
    x, weight = torch.randn(1, 64), torch.randn(128, 64)
    assert not cpu_decode.supports(x, weight, None)
    assert torch.equal(cpu_decode.linear(x, weight), F.linear(x, weight))


# ---------------------------------------------------------------------------------------------- RMSNorm, prologue
@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_module(tiny_qwen3, dtype, cpu_backend):
    norm = copy.deepcopy(tiny_qwen3.model.layers[0].input_layernorm).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = (torch.randn(3, 1, norm.weight.shape[0]) * 4).to(dtype)
    with torch.no_grad():
        ref = norm(x)
        ours = cpu_decode.rms_norm(norm, x)
    assert ours is not None and ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    else:  # HF rounds the normalised row, then the product: the same two roundings here
        assert ((ours.double() - ref.double()).abs() <= _bf16_ulp(ref.double())).all()


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prologue_matches_hf_modules(model_fixture, dtype, request, cpu_backend):
    """The kernel's prologue (one call) against HF's modules, for Qwen3 (q/k norms), Llama and Qwen2 (q/k/v biases),
    two sequences at different positions; q alone (ScoutAttention's prediction) too."""
    from scoutbench.decode.ops import DecodeOps

    model = copy.deepcopy(request.getfixturevalue(model_fixture)).to(dtype)
    kernel, hf = DecodeOps(model, "cpu-kernel", 512), DecodeOps(model, "hf", 512)
    torch.manual_seed(5)
    normed = torch.randn(2, model.config.hidden_size).to(dtype)
    cos, sin = hf.rotary(torch.tensor([17, 301]))
    with torch.no_grad():
        ref = hf.prologue(1, normed, cos, sin)
        fused = kernel.prologue(1, normed, cos, sin)
        q_only = kernel.query(1, normed, cos, sin)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for ours, want in zip(fused, ref, strict=True):
        assert ours.dtype == dtype and ours.shape == want.shape
        torch.testing.assert_close(ours.float(), want.float(), **tol)
    assert torch.equal(q_only, fused[0])


@pytest.mark.parametrize(("cpu_backend", "batch"), [("torch", 2), (native_paths()[0], cpu_decode.MAX_ROWS + 1)],
                         indirect=["cpu_backend"])
@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_qwen2"])
def test_prologue_and_norm_equal_hf_bit_for_bit_where_the_kernel_does_not_serve(model_fixture, batch, request,
                                                                                 cpu_backend):
    """Where the kernel does not take the call (torch's backend, more rows than MAX_ROWS), the one entry point runs
    HF's modules: the results equal HF's attention forward's q/k/v bit for bit (q/k norms, RoPE, Qwen2's biases),
    computed here from the modules by hand."""
    import sys

    from scoutbench.decode.ops import DecodeOps

    model = request.getfixturevalue(model_fixture)
    norm = model.model.layers[0].input_layernorm
    torch.manual_seed(3)
    x = torch.randn(batch, 1, norm.weight.shape[0])
    hf = DecodeOps(model, "hf", 512)
    attn = model.model.layers[1].self_attn
    cos, sin = hf.rotary(torch.arange(batch) * 7 + 3)
    with torch.no_grad():
        assert torch.equal(cpu_decode.rms_norm(norm, x), norm(x))
        ours = cpu_decode.attention_prologue(attn, x, hf.num_heads, hf.num_kv_heads, cos, sin)
        q_only = cpu_decode.attention_prologue(attn, x, hf.num_heads, hf.num_kv_heads, cos, sin, with_kv=False)
        # HF's attention forward up to its cache update, for one new token per sequence
        shape = (batch, 1, -1, attn.head_dim)
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        want = (q[:, :, 0], k[:, :, 0], attn.v_proj(x).view(shape)[:, 0])
    for got, ref in zip(ours, want, strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(q_only[0], want[0]) and q_only[1:] == (None, None)
