"""The dense-layer setting every sparse method shares: one field, one default, and every method
exact at its edges: a single sparse layer (the next sparse layer is the same layer, where deferred or layer-ahead
work meets its own next read) and no sparse layer at all."""

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
@pytest.mark.parametrize("sparse_layers", [1, 0])
def test_one_or_no_sparse_layer_equals_fullkv(tiny_llama, reference_run, name, sparse_layers):
    prompt, lengths, reference, tokens = reference_run
    dense = tiny_llama.config.num_hidden_layers - sparse_layers
    method = build_method(name, {**COVERING[name], DENSE_LAYERS_FIELD: dense})
    ours = run_engine(tiny_llama, method, prompt, lengths, tokens)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
