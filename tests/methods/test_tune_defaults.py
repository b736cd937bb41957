"""The one rule for every method's defaults (docs/methods.md; benchmarks/tune_defaults.py): its choice on made-up
points, the grids the methods declare, and that every registered default is its method's winner on the committed
real-text sweep."""

from __future__ import annotations

import sys

import pytest
from repo_paths import REPO_ROOT

from scoutbench.methods import METHODS

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import tune_defaults as tune  # noqa: E402

SWEEP = REPO_ROOT / "results" / "real-text-sweep"


def _point(label: str, agreement: float, speed: float) -> tune.Point:
    point = tune.Point(label, {}, [], agreement)
    point.tok_s = {length: speed for length in tune.LENGTHS}
    return point


def test_the_rule_takes_the_fastest_admissible_setting():
    grid = [_point("slow, exact", 0.95, 100.0), _point("fast, below", 0.84, 900.0), _point("fast", 0.86, 500.0)]
    assert tune.winner(grid, 0.85)[0].label == "fast"  # the fastest is below the bound
    assert tune.winner(grid, 0.80)[0].label == "fast, below"
    assert tune.winner(grid, 0.90)[0].label == "slow, exact"


def test_within_one_percent_the_more_accurate_setting_wins():
    grid = [_point("a", 0.86, 500.0), _point("b", 0.90, 496.0), _point("c", 0.99, 480.0)]
    assert tune.winner(grid, 0.85)[0].label == "b"


def test_without_an_admissible_setting_the_most_accurate_wins():
    grid = [_point("a", 0.70, 500.0), _point("b", 0.80, 100.0)]
    best, admissible = tune.winner(grid, 0.85)
    assert (best.label, admissible) == ("b", False)


def test_every_grid_is_declared_in_its_method_file_and_holds_its_defaults_and_the_paper_setting():
    """Each searched method's grid sets fields the method has, the paper-literal setting is one of its points, and
    the registered defaults are one of them (the rule can only choose among them)."""
    searched = {cls.name for cls in tune.searched_methods()}
    assert searched == {"quest", "infinigen", "hgca", "scout"}
    for cls in tune.searched_methods():
        fields = set(cls.defaults())
        assert all(set(point) <= fields for point in cls.settings_grid.values()), cls.name
        assert cls.paper_setting[0] in cls.settings_grid, cls.name
        assert tune.default_point(cls) is not None, cls.name
        for point in cls.settings_grid.values():  # every point builds
            cls(**point)
    assert not METHODS.load("fullkv").settings_grid


@pytest.fixture(scope="module")
def committed_search() -> dict:
    if not SWEEP.is_dir():
        pytest.skip("no committed real-text sweep")
    return tune.search(str(SWEEP))


def test_the_registered_defaults_follow_the_rule_on_the_committed_sweep(committed_search):
    """benchmarks/tune_defaults.py on results/real-text-sweep with today's projection: every grid point ran on every
    record, and every method's registered default is the rule's winner (rerun the search when this fails)."""
    assert committed_search["missing"] == []
    assert tune.stale_defaults(committed_search) == []


def test_docs_show_the_search_as_the_command_prints_it(committed_search):
    """docs/methods.md holds the search's tables (every grid point, the winner, the default, the paper-literal
    setting) exactly as `python benchmarks/tune_defaults.py --runs results/real-text-sweep` prints them today."""
    docs = (SWEEP.parents[1] / "docs" / "methods.md").read_text(encoding="utf-8")
    assert "\n".join(tune.markdown(committed_search)) in docs


def test_a_row_is_named_by_its_grid_setting():
    """What tables name a row's setting by: the grid point its registered name and fields are (None off the grid)."""
    from scoutbench.methods import setting_label

    assert setting_label("infinigen-speedup", {}) == "alpha 4, cap 400"
    assert setting_label("infinigen-dynamic", {}) == "alpha 5, cap 20%"
    assert setting_label("quest-official", {}) == "pages 16, per query head"
    assert setting_label("hgca", {"window_share": 0.75, "score_read": "selected"}) == "window 0.75, selected read"
    assert setting_label("scout", {"pool_factor": 4}) == "pool 4"
    assert setting_label("scout", {"pool_factor": 1.5}) is None and setting_label("fullkv", {}) is None


def test_a_row_names_the_paper_literal_setting_beside_its_own():
    """What every table prints for a result's setting: the grid label, then the paper's point or that it is the
    paper's; a field the result lacks is at the value its run had (a result from before the pool field: pool 1)."""
    from scoutbench.methods import resolved_method_config, setting_text

    def recorded(name: str) -> dict:  # the method_config a run of `name` records: every field
        return resolved_method_config(name, {})

    assert setting_text("scout", recorded("scout")) == "pool 3 (paper: pool 1)"
    assert setting_text("scout", {}) == "pool 1 (the paper's)"
    assert setting_text("quest-official", recorded("quest-official")) == "pages 16, per query head (the paper's)"
    assert setting_text("infinigen-dynamic", recorded("infinigen-dynamic")) == "alpha 5, cap 20% (paper: fixed fetch)"
    assert setting_text("scout", {"pool_factor": 1.5}) == "off the grid (paper: pool 1)"
    assert setting_text("fullkv", {}) is None and setting_text("no-such-method", {}) is None
