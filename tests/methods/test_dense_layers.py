"""The dense-layer setting every sparse method shares: one field, one default, every method exact at its edge (a
single sparse layer: the next sparse layer is the same layer, where deferred or layer-ahead work meets its own next
read), and no sparse layer at all refused wherever a method meets a model's layers."""

import pytest
import torch
from method_harness import fullkv_reference, ragged_prompt, run_engine

from scoutbench.methods import ALL_METHODS, build_method
from scoutbench.methods.base import DEFAULT_DENSE_LAYERS, DENSE_LAYERS_FIELD, dense_layers_of

SPARSE = [name for name in ALL_METHODS if name != "fullkv"]
# budgets that cover the 60 + 16 tokens: every method then attends every token, on whichever tier
COVERING = {"quest": {"budget": 256, "block_size": 4}, "infinigen": {"budget": 256},
            "hgca": {"budget": None, "cpu_topk_frac": 1.0, "migrate_block": 4},
            "scout": {"budget": 256, "block_size": 4, "recall_interval": 2}}


def test_every_sparse_method_has_the_shared_field_and_default():
    assert set(COVERING) == set(SPARSE)
    for name in SPARSE:
        assert dense_layers_of(build_method(name, {})) == DEFAULT_DENSE_LAYERS
        assert build_method(name, {DENSE_LAYERS_FIELD: "0"}).dense_layers == 0
    assert dense_layers_of(build_method("fullkv", {})) is None


@pytest.fixture(scope="module")
def reference_run(tiny_llama):
    prompt, lengths = ragged_prompt(tiny_llama.config.vocab_size, [60, 37])
    return prompt, lengths, *fullkv_reference(tiny_llama, prompt, lengths, steps=16)


@pytest.mark.parametrize("name", SPARSE)
def test_one_sparse_layer_equals_fullkv(tiny_llama, reference_run, name):
    prompt, lengths, reference, tokens = reference_run
    dense = tiny_llama.config.num_hidden_layers - 1
    method = build_method(name, {**COVERING[name], DENSE_LAYERS_FIELD: dense})
    ours = run_engine(tiny_llama, method, prompt, lengths, tokens)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("name", SPARSE)
def test_no_sparse_layer_is_refused_where_a_method_meets_the_model(tiny_llama, reference_run, name):
    """`--dense-layers` at or above the layer count ran FullKV's work recorded as `sparse: true` with the method's
    budget (a clamp). Refused when the method binds to a model, when it is planned, and in its work model."""
    from scoutbench.errors import UsageError
    from scoutbench.methods.base import ModelShape

    prompt, lengths, _, tokens = reference_run
    layers = tiny_llama.config.num_hidden_layers
    message = rf"^{name}: dense_layers {layers} keeps all {layers} layers of the model dense, so nothing would run sparse"
    method = build_method(name, {**COVERING[name], DENSE_LAYERS_FIELD: layers})
    with pytest.raises(UsageError, match=message):
        run_engine(tiny_llama, method, prompt, lengths, tokens)
    with pytest.raises(UsageError, match=message):
        method.memory_footprint(ModelShape.from_config(tiny_llama.config), 1024, 4)
    with pytest.raises(UsageError, match=message):
        method.work_dense_layers(layers)
    assert build_method(name, {**COVERING[name], DENSE_LAYERS_FIELD: layers - 1}).work_dense_layers(layers) == layers - 1


def test_the_cli_refuses_no_sparse_layer_before_running(monkeypatch, capsys, tmp_path):
    from cli_runner import run_cli

    for command in (["throughput", "--len", "1k", "--steps", "2", "-o", tmp_path / "t"],
                    ["sweep", "--len", "1k", "--steps", "2", "-o", tmp_path / "s"],
                    ["plan", "--len", "1k", "--gpu-mem", "1GiB"]):
        code, out, err = run_cli(monkeypatch, capsys, *command, "--model", "tiny-qwen3", "--method", "scout",
                                 "--budget", "256", "--dense-layers", "4")
        assert code == 2 and err.startswith("error: scout: dense_layers 4 keeps all 4 layers"), (command, err)
    assert not (tmp_path / "s").exists() and not list((tmp_path / "t").glob("*.json"))


def test_a_sparse_method_without_a_budget_is_labelled_sparse():
    """HGCA's fraction policy (budget none) runs sparse, but its results said `sparse: false`."""
    from scoutbench.methods.sparse import plan_budget

    assert plan_budget(build_method("hgca", {"budget": "none"}), 4096).sparse is True
    assert plan_budget(build_method("fullkv", {}), 4096).sparse is False
    assert plan_budget(build_method("quest", {"budget": "8192"}), 4096).sparse is False
