"""The run the emulated-CUDA comparisons share (tests/emulation/test_emulated_cuda.py, test_graphs.py): a small Qwen3
and a ragged batch of two prompts, each method's CUDA path against its CPU path within
`emulated.ATOL`."""

import pytest
from emulated import LENGTHS, small_qwen3
from method_harness import ragged_prompt


@pytest.fixture(scope="module")
def model():
    return small_qwen3()


@pytest.fixture(scope="module")
def prompt(model):
    return ragged_prompt(model.config.vocab_size, LENGTHS, seed=3)
