"""Model loading and its checks (scoutbench/models.py): the context window every command checks before it
loads a model, and unsupported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli


def _never(*args, **kwargs):
    raise AssertionError("this must fail before it loads the model or runs")


@pytest.mark.parametrize("command", [
    ["accuracy", "--dataset", "passkey", "--model", "smollm2-135m", "--len", "10k"],
    ["accuracy", "--dataset", "passkey-multi", "--model", "qwen2.5-0.5b", "--len", "40k"],
    ["accuracy", "--dataset", "passkey", "--model", "qwen2.5-0.5b", "--len", "1m"],
    ["fidelity", "--model", "smollm2-135m", "--len", "10k"],
    ["throughput", "--model", "smollm2-135m", "--len", "10k", "--method", "fullkv"],
    ["cosine", "--model", "smollm2-135m", "--len", "10k"],
])
def test_prompts_longer_than_the_models_context_are_refused_before_loading(command, monkeypatch, capsys, tmp_path):
    """A length past the model's context window (smollm2 at 10k, qwen2.5-0.5b at 40k and 1m) is a usage error before
    any model loads, in every command that takes one."""
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    monkeypatch.setattr("scoutbench.gguf_models.load_gguf_model", _never)
    out_flag = [] if command[0] == "cosine" else ["-o", str(tmp_path / ("o.json" if command[0] == "fidelity" else "o"))]
    code, out, err = run_cli(monkeypatch, capsys, *command, *out_flag)
    assert code == 2 and "context window is" in err and len(err.strip().splitlines()) == 1, err


def test_longbench_max_length_beyond_the_context_is_refused(monkeypatch, capsys, tmp_path):
    records = Path("/work/shared/longbench/records")
    data_dir = records if (records / "qasper.jsonl").exists() else None
    if data_dir is None:
        pytest.skip("needs the LongBench records")
    monkeypatch.setattr("scoutbench.gguf_models.load_gguf_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "qasper", "--model", "qwen2.5-0.5b",
                             "--max-length", "40k", "--data-dir", data_dir, "--limit", "1", "-o", tmp_path)
    assert code == 2 and "--max-length 40960" in err and "32768 tokens" in err, err


def test_a_real_prefill_past_the_window_of_a_loaded_model_is_refused(smollm2):
    from scoutbench.bench.resolve import ThroughputConfig, check_context_fits
    from scoutbench.errors import UsageError
    from scoutbench.models import LoadedModel

    loaded = LoadedModel(smollm2.model, "my-folder", "local", False)  # a folder's window comes from its config
    with pytest.raises(UsageError, match="context window is 8192"):
        check_context_fits(ThroughputConfig(model="my-folder", length=9000, prefill="real"), loaded)
    check_context_fits(ThroughputConfig(model="my-folder", length=9000, prefill="synthetic"), loaded)  # timing only


def test_plan_refuses_an_unsupported_architecture_in_one_line(tmp_path, monkeypatch, capsys):
    """`plan --model DIR` with an architecture the engine does not walk (gpt2) is one error line, no traceback."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                               "n_head": 2, "vocab_size": 100, "bos_token_id": 0,
                                                               "eos_token_id": 0}))
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", tmp_path / "gpt2", "--len", "1k", "--gpu-mem",
                             "1GiB")
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "architecture 'gpt2'" in error_lines[0] and "Traceback" not in err, err
