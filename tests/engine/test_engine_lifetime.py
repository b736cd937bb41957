"""Every production site that runs a DecodeEngine closes its method on every path: a decode step that raises still
stops the method's CPU workers (the engine's `with` closes the method; where an engine is set up and handed on,
`DecodeEngine.closed_on_failure` closes it when the setup raises)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

BUDGET = {"budget": 128, "block_size": 16}  # under the prompts below: ScoutAttention runs sparse, with its workers
PROMPT = list(range(1, 301))


@pytest.fixture
def scout_pools(monkeypatch) -> list:
    """The worker pool of every ScoutAttention bound during the test."""
    from scoutbench.methods.scout import ScoutAttention

    pools = []
    bind = ScoutAttention.bind

    def recording_bind(self, ctx):
        bind(self, ctx)
        pools.append(self.transport.pool)

    monkeypatch.setattr(ScoutAttention, "bind", recording_bind)
    return pools


def _loaded(model: torch.nn.Module):
    from scoutbench.models import LoadedModel

    return LoadedModel(model=model, name="tiny-qwen3", source="preset", random_weights=True)


def _api_decode_engine(model: torch.nn.Module) -> None:
    from scoutbench import api

    with api.decode_engine(_loaded(model), api.build_method("scout", **BUDGET), batch=1, max_len=320) as engine:
        logits = engine.prefill(torch.tensor([PROMPT]))
        engine.decode_step(logits.argmax(-1))


def _greedy_generate(model: torch.nn.Module) -> None:
    from scoutbench import api
    from scoutbench.eval.generation import greedy_generate

    greedy_generate(model, api.build_method("scout", **BUDGET), PROMPT, 4)


def _shared_prefill_generate(model: torch.nn.Module) -> None:
    from scoutbench.eval.generation import SharedPrefill, method_spec

    SharedPrefill(model, PROMPT).generate(method_spec("scout", **BUDGET), 4)


def _shared_prefill_forced(model: torch.nn.Module) -> None:
    from scoutbench.eval.generation import SharedPrefill, method_spec

    SharedPrefill(model, PROMPT).forced(method_spec("scout", **BUDGET), [5, 6, 7])


def _run_throughput(model: torch.nn.Module) -> None:
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput

    run_throughput(ThroughputConfig(method="scout", method_args=dict(BUDGET), model="tiny-qwen3", length=256,
                                    steps=2, warmup=1, device="cpu", dtype="float32", count_steps=0),
                   _loaded(model))


SITES: dict[str, Callable[[torch.nn.Module], None]] = {
    "api.decode_engine": _api_decode_engine, "greedy_generate": _greedy_generate,
    "SharedPrefill.generate": _shared_prefill_generate, "SharedPrefill.forced": _shared_prefill_forced,
    "run_throughput": _run_throughput,
}


@pytest.mark.parametrize("site", SITES)
def test_a_raising_decode_step_still_closes_the_methods_workers(site, scout_pools, monkeypatch, tiny_qwen3):
    from scoutbench.methods.scout import ScoutAttention

    def failing_decode(self, *args):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(ScoutAttention, "decode", failing_decode)
    with pytest.raises(RuntimeError, match="decode failed"):
        SITES[site](tiny_qwen3)
    assert len(scout_pools) == 1 and scout_pools[0]._closed


@pytest.mark.parametrize("site", SITES)
def test_a_start_that_raises_after_the_bind_still_closes_the_methods_workers(site, scout_pools, monkeypatch,
                                                                             tiny_qwen3):
    """The engine's start fails after the method is bound (here the kernel library's lookup): the method is
    closed before the error reaches the caller, also where the engine would be handed on started
    (api.decode_engine, SharedPrefill.engine: `closed_on_failure`)."""
    from scoutbench.kernels import cpu_attention

    library = cpu_attention.library

    def library_missing_once_scout_is_bound():
        if scout_pools:  # the shared prefill's own engine starts first, with no method of its own
            raise OSError("no kernel library")
        return library()

    monkeypatch.setattr(cpu_attention, "library", library_missing_once_scout_is_bound)
    with pytest.raises(OSError, match="no kernel library"):
        SITES[site](tiny_qwen3)
    assert len(scout_pools) == 1 and scout_pools[0]._closed
