"""The decode step's model work (scoutbench/decode/ops.py): the fused form against HF's modules, and how many torch
calls it issues per layer."""

import copy

import pytest
import torch

from scoutbench.decode.engine import DecodeEngine
from scoutbench.decode.ops import DecodeOps, rotate_half_matrix
from scoutbench.methods.fullkv import FullKV
from scoutbench.timing import TorchCallCounter


def _decode(model, form: str, monkeypatch, steps: int = 4) -> list[torch.Tensor]:
    monkeypatch.setenv("SCOUTBENCH_DECODE_OPS", form)
    engine = DecodeEngine(model, FullKV())
    engine.start(2, 96)
    prompt = torch.randint(0, model.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([80, 71])
    logits = [engine.prefill(prompt, lengths)]
    assert engine.ops.form == form
    for _ in range(steps):
        logits.append(engine.decode_step(logits[-1].argmax(-1)))
    return logits


def test_rotate_half_matrix_is_hf_rotate_half():
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    x = torch.randn(3, 5, 64, dtype=torch.float64)
    assert torch.equal(x @ rotate_half_matrix(64, torch.float64, torch.device("cpu")), rotate_half(x))


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen2"])
def test_fused_form_is_bit_identical_to_hf_in_fp32(model_fixture, request, monkeypatch):
    """fp32 on a CPU: one F.rms_norm, RoPE through R and the table of cos/sin round exactly as HF's modules."""
    model = request.getfixturevalue(model_fixture)
    fused, hf = _decode(model, "fused", monkeypatch), _decode(model, "hf", monkeypatch)
    for ours, ref in zip(fused, hf, strict=True):
        assert torch.equal(ours, ref)


def test_fused_form_in_bf16_is_within_the_norms_rounding(tiny_qwen3, monkeypatch):
    """bf16: F.rms_norm rounds once where HF rounds twice (one bf16 ulp on the norm's output); over a decode step of
    the tiny model that stays within the tolerance documented in docs/architecture.md."""
    model = copy.deepcopy(tiny_qwen3).to(torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(4, norm.weight.shape[0]).to(torch.bfloat16)
    ours = DecodeOps(model, "fused", 16).norm(norm, x).double()
    ref = norm(x).double()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((ours - ref).abs() <= ulp).all()
    fused, hf = _decode(model, "fused", monkeypatch), _decode(model, "hf", monkeypatch)
    for ours, ref in zip(fused[1:], hf[1:], strict=True):
        torch.testing.assert_close(ours.float(), ref.float(), rtol=0.05, atol=0.05)


def test_fused_form_issues_few_calls_per_layer(tiny_qwen3, monkeypatch):
    """The model work of a decode step in the fused form, per layer (Qwen3: q/k norms): the input norm, three
    linears and their views, two q/k norms, RoPE of q and k (4 calls each), o_proj with its residual (3), the
    post-attention norm and the gated MLP with its residual (7)."""
    monkeypatch.setenv("SCOUTBENCH_DECODE_OPS", "fused")
    engine = DecodeEngine(tiny_qwen3, FullKV())
    engine.start(1, 8)
    ops = engine.ops
    layer = engine.layers[0]
    x = torch.randn(1, tiny_qwen3.config.hidden_size)
    cos, sin = ops.rotary(torch.tensor([3]))
    counter = TorchCallCounter()
    with torch.no_grad(), counter:
        normed = ops.norm(layer.input_layernorm, x)
        q, k, v = ops.prologue(0, normed, cos, sin)
        x = ops.residual_linear(x, layer.self_attn.o_proj, q)
        x = ops.mlp_residual(layer, x)
    assert counter.calls == 1 + 6 + 2 + 8 + 3 + 7  # 27
