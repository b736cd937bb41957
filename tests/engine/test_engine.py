"""The engine's explicit layer loop must reproduce `model(...)` bit for bit with the same attention function (on
torch's CPU kernels), and within fp32 rounding where the compiled kernel serves a CPU decode step's linears."""

import inspect

import pytest
import torch
from transformers import DynamicCache

from scoutbench.decode.engine import DecodeEngine, register_hf_attention
from scoutbench.methods.fullkv import FullKV


@pytest.mark.parametrize("cpu_backend", ["torch"], indirect=True)
@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_engine_logits_bit_identical_to_hf(model_fixture, batch, request, cpu_backend):
    _check_against_hf(request.getfixturevalue(model_fixture), batch, prompt_len=37, exact=True)


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_engine_logits_with_native_linears_match_hf(model_fixture, batch, request, cpu_backend):
    """The compiled decode linears (kernels/cpu_decode) sum in another order: the same logits within fp32 rounding,
    and they did serve the decode steps (the prefill's many rows stay with torch, so it is still bit-identical)."""
    from scoutbench.kernels import cpu_decode

    served = []
    original = cpu_decode.supports
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_decode, "supports", lambda *args: served.append(original(*args)) or served[-1])
        _check_against_hf(request.getfixturevalue(model_fixture), batch, prompt_len=37, exact=False)
    assert any(served)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_backend", ["torch"], indirect=True)
def test_engine_logits_bit_identical_to_hf_on_qwen25(qwen25, cpu_backend):
    """The real Qwen2 checkpoint (bf16, q/k/v biases): the same bit-identity over a 300-token prompt."""
    assert qwen25.model.config.model_type == "qwen2" and qwen25.model.model.layers[0].self_attn.q_proj.bias is not None
    _check_against_hf(qwen25.model, 1, prompt_len=300, exact=True)


def cache_keyword(model) -> str:
    """The forward argument that takes the KV cache: `cache` from transformers 5.24 (which still accepts the old
    name until 5.40, with a warning), `past_key_values` before (5.17, the lent GPU machine's, ignores `cache=`
    silently: the reference then decodes without a cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_against_hf(model, batch: int, prompt_len: int, exact: bool) -> None:
    name = register_hf_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        torch.manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len))
        cache = {cache_keyword(model): DynamicCache(config=model.config)}
        with torch.no_grad():
            ref = model(input_ids=prompt, **cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        engine = DecodeEngine(model, FullKV())
        engine.start(batch=batch, max_len=prompt_len + 6)
        ours = engine.prefill(prompt)
        assert torch.equal(ours, ref)
        for _ in range(5):
            token = ref.argmax(-1)
            with torch.no_grad():
                ref = model(input_ids=token[:, None], **cache, use_cache=True).logits[:, -1]
            ours = engine.decode_step(token)
            if exact:
                assert torch.equal(ours, ref)
            else:
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    finally:
        model.set_attn_implementation(previous)
