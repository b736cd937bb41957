"""Every timed window holds each method's per-block work at its real rate (bench/throughput.py, `block_window`): by
default whole block cycles, where every event comes steps / cycle times; with `amortise_blocks` a window opened on
the next block event, whose event and ordinary steps are weighted as one cycle holds them."""

import statistics

import pytest

from scoutbench.api import run_throughput_configs, throughput_configs, whole_cycle_steps
from scoutbench.bench.throughput import block_window
from scoutbench.methods import SPEED_METHODS, build_method

SMALL = dict(model="tiny-qwen3", length=1000, budget=256, device="cpu", count_steps=0)  # a prompt of no whole block


def test_default_steps_are_whole_cycles_of_every_compared_method():
    assert whole_cycle_steps(8, [32, None, 16]) == 32
    assert whole_cycle_steps(16, [64, 32]) == 64
    assert whole_cycle_steps(40, [32]) == 64
    assert whole_cycle_steps(8, [None, None]) == 8
    assert [c.steps for c in throughput_configs(SPEED_METHODS, device="cpu")] == [32] * len(SPEED_METHODS)
    assert [c.steps for c in throughput_configs(["scout"], device="cpu", block_size=64)] == [64]


def test_a_whole_cycle_window_holds_each_block_event_steps_over_cycle_times():
    """The default run's window, at a prompt length that is no multiple of any block: every method with per-block
    work records each of its events steps / cycle times (ScoutAttention's completion and hand-over, Quest's digest
    writes at pages of 32 and 16, HGCA's migration), and the methods without any say so."""
    names = [*SPEED_METHODS, "quest-official"]
    results = run_throughput_configs(throughput_configs(names, **SMALL))
    expected = {"scout": {"complete", "hand-over"}, "quest": {"complete"}, "quest-official": {"complete"},
                "hgca": {"migrate"}, "fullkv": set(), "infinigen": set(), "infinigen-dynamic": set()}
    for result in results:
        window, steps = result["block_window"], result["workload"]["steps"]
        cycle = build_method(result["method"], {}).block_cycle()
        assert window["steps"] == steps == 32 and window["cycle_steps"] == cycle, result["method"]
        assert window["form"] == ("none" if cycle is None else "whole"), result["method"]
        assert set(window["events"]) == expected[result["method"]], result["method"]
        assert all(count == steps // cycle for count in window["events"].values()), (result["method"], window)
        assert result["decode_throughput_tok_s"] == pytest.approx(steps / result["decode_time_s"])


def test_an_amortised_window_opens_on_the_next_block_event():
    """Six timed steps of a 32-step cycle: untimed alignment steps bring the window to its method's next event, the
    window holds each event once, and throughput is tokens over the window at the cycle's mix of steps."""
    configs = throughput_configs(["scout", "hgca", "quest", "fullkv"], steps=6, amortise_blocks=True, **SMALL)
    for result in run_throughput_configs(configs):
        window, step_ms = result["block_window"], result["step_ms"]
        if result["method"] == "fullkv":
            assert (window["form"], window["alignment_steps"]) == ("none", 0)
            continue
        assert window["form"] == "amortised" and 0 < window["alignment_steps"] <= 32, result["method"]
        assert all(count == 1 for count in window["events"].values()) and window["events"], result["method"]
        kinds = len(window["event_step_ms"])
        ordinary = statistics.fmean(step_ms[kinds:])  # the window opens on its event steps
        expected = (sum(step_ms[:kinds]) + (32 - kinds) * ordinary) / 32
        assert window["amortised_step_ms"] == pytest.approx(expected)
        assert result["decode_time_s"] == pytest.approx(6 * expected / 1e3)
        assert result["measured_decode_time_s"] == pytest.approx(sum(step_ms) / 1e3)
        assert result["decode_throughput_tok_s"] == pytest.approx(6 / result["decode_time_s"])


def test_block_window_forms():
    """The forms from the recorded steps alone: whole cycles, amortised (each event step kind at its share of a
    cycle, the ordinary steps filling the rest), partial (an event kind the window missed, or no amortising)."""
    events = [("complete",), ("hand-over",), (), (), ()]
    per_cycle = {("complete",): 1, ("hand-over",): 1}
    ms = [10.0, 6.0, 2.0, 3.0, 4.0]
    amortised = block_window(ms, events, 8, per_cycle, True, 5)
    assert amortised["form"] == "amortised" and amortised["events"] == {"complete": 1, "hand-over": 1}
    assert amortised["amortised_step_ms"] == pytest.approx((10 + 6 + 6 * 3.0) / 8)
    assert block_window(ms, events, 8, per_cycle, False, 0)["form"] == "partial"
    assert block_window(ms[1:], events[1:], 8, per_cycle, True, 5)["form"] == "partial"
    assert block_window(ms[:4] * 2, (events[:4]) * 2, 8, per_cycle, False, 0)["form"] == "whole"
    assert block_window(ms, [()] * 5, None, {}, True, 0)["form"] == "none"
