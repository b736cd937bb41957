"""The engine's explicit layer loop must reproduce `model(...)` bit for bit with the same attention function."""

import pytest
import torch
from transformers import DynamicCache

from scoutbench.engine import DecodeEngine, register_hf_attention
from scoutbench.methods.fullkv import FullKV


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_llama"])
@pytest.mark.parametrize("batch", [1, 2])
def test_engine_logits_bit_identical_to_hf(model_fixture, batch, request):
    model = request.getfixturevalue(model_fixture)
    name = register_hf_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        torch.manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (batch, 37))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ref = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        engine = DecodeEngine(model, FullKV())
        engine.start(batch=batch, max_len=37 + 6)
        ours = engine.prefill(prompt)
        assert torch.equal(ours, ref)
        for _ in range(5):
            token = ref.argmax(-1)
            with torch.no_grad():
                ref = model(input_ids=token[:, None], cache=cache, use_cache=True).logits[:, -1]
            ours = engine.decode_step(token)
            assert torch.equal(ours, ref)
    finally:
        model.set_attn_implementation(previous)
