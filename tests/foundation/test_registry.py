"""The method registry (scoutbench/registry.py): names, aliases, presets, did-you-mean."""

import pytest

from scoutbench.errors import UsageError


def test_registry_did_you_mean_and_aliases():
    from scoutbench.methods import METHODS
    from scoutbench.methods.fullkv import FullKV

    assert METHODS.load("full") is FullKV and METHODS.canonical("full") == "fullkv"
    with pytest.raises(UsageError, match="did you mean 'fullkv'"):
        METHODS.load("fulkv")
    assert METHODS.preset("scout-base") == {"pc": False, "pr": False}
    with pytest.raises(ValueError):
        METHODS.register("fullkv", "x:y")
