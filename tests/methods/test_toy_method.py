"""The method contract is closed: a method that no module outside `methods/` has heard of, registered
in a test-only registry scope, runs through throughput, sweep, report, `gate --counters` and `project` with nothing
else patched, because every one of them asks the registry and the method class what it needs to know."""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from cli_runner import run_cli

from scoutbench.kernels.attention import decode_attention
from scoutbench.methods import METHODS, display_rank, is_reference, method_family
from scoutbench.methods.base import Footprint, MethodContext, ModelShape
from scoutbench.methods.fullkv import FullKV
from scoutbench.methods.selection import BlockSelection
from scoutbench.methods.sparse import SparseLayerMethod
from scoutbench.methods.work_model import LayerTerms, LayerWork, RunRecord
from scoutbench.results import load_results, write_json_atomic

TOY = "toy-window"
TOY_SINKS = "toy-sinks"


@dataclass
class SinksWindow(BlockSelection):
    """Toy StreamingLLM-style selection: the first `sink_blocks` blocks and the newest complete ones (and the tail)."""

    name = TOY_SINKS
    display_name = "Sinks + window (toy)"
    keeps_digests = False  # it scores no block
    budget: int = 48
    block_size: int = 8
    dense_layers: int = 1
    sink_blocks: int = 1

    def select_blocks(self, layer, q):
        slot = torch.arange(self.page_budget - 1, device=q.device)  # selection i: block i (a sink), or i blocks
        newest = (self.tail_block - (self.page_budget - 1)).clamp(min=0)[:, None, None]  # after the oldest recent
        self.selection.copy_(slot + (slot >= self.sink_blocks) * newest)


@dataclass
class RecentWindow(SparseLayerMethod):
    """Toy sliding window: a sparse layer attends the newest `budget` tokens of each sequence, on the device."""

    name = TOY
    display_name = "Recent window (toy)"
    work_fractions = {"window_budget_frac": 1.0}  # tokens attended per (sequence, KV head, sparse layer) / budget
    budget: int = 48
    dense_layers: int = 1

    def __post_init__(self) -> None:
        self.check_dense_layers()

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.cache = FullKV()
        self.cache.bind(ctx)  # every layer's KV (the dense layers' copy stays unused: a toy)

    def ingest_sparse_prefill(self, layer, q_obs, k, v, lengths):
        self.cache.ingest_prefill(layer, q_obs, k, v, lengths)

    def decode_sparse(self, layer, q, k, v):
        position = self.step.positions_host[0]  # the test runs batch 1
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[:, :, position].copy_(k)
        values[:, :, position].copy_(v)
        start = max(0, position + 1 - self.budget)
        self.counters.attended.add_host([position + 1 - start] * self.ctx.batch, self.ctx.num_kv_heads)
        return decode_attention(q, keys[:, :, start: position + 1], values[:, :, start: position + 1], self.ctx.scale)

    def memory_footprint(self, shape: ModelShape, context_len: int, elem_bytes: int) -> Footprint:
        return Footprint(2 * shape.num_layers * context_len * shape.kv_bytes_per_token_layer(elem_bytes), 0)

    def stats(self) -> dict[str, Any]:
        return {"attended_tokens_per_head": self.counters.attended.stats(self.budget), **self.counters.transfer()}

    def measure_work(self, run: RunRecord) -> dict[str, float]:
        mean = run.attended_budget_frac("mean")
        return {"window_budget_frac": 1.0 if mean is None else mean}

    def sparse_layer_work(self, fractions: dict[str, float], terms: LayerTerms) -> LayerWork:
        shape = terms.shape
        tokens = min(fractions["window_budget_frac"] * self.budget, shape.context_len)
        return terms.layer("none", device_kv_bytes=shape.batch * tokens * shape.kv_bytes_per_token,
                           device_tokens=shape.batch * shape.model.num_kv_heads * tokens)


@pytest.fixture
def toy_registry():
    """The toy method registered for one test; the registry is restored afterwards, whatever happens."""
    with METHODS.scoped() as registry:
        registry.register(TOY, RecentWindow)
        registry.register(TOY_SINKS, SinksWindow)
        yield registry
    assert TOY not in METHODS and TOY_SINKS not in METHODS


RUN = ("--model", "tiny-qwen3", "--len", "96", "--steps", "3", "--warmup", "1", "--device", "cpu")


@pytest.mark.parametrize("toy", [TOY, TOY_SINKS])
def test_toy_method_through_every_command(toy_registry, tmp_path, monkeypatch, capsys, toy):
    """The window toy (a whole method on `SparseLayerMethod`) and the sinks + window toy (a selection hook on
    `BlockSelection`) go through the same commands."""
    TOY = toy  # noqa: N806 - the name the steps below check
    assert method_family(TOY) == TOY and not is_reference(TOY) and display_rank(TOY) == METHODS.names().index(TOY)

    # throughput (the reference beside it: its table compares with FullKV)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", TOY, "--method", "fullkv", *RUN,
                             "-o", tmp_path / "runs")
    assert code == 0, err
    toy = next(r for r in load_results([tmp_path / "runs"]) if r["method"] == TOY)
    attended = toy["method_stats"]["attended_tokens_per_head"]
    assert attended["max"] == (48 if TOY == "toy-window" else 44) and attended["within_budget"] is True

    # sweep
    code, out, err = run_cli(monkeypatch, capsys, "sweep", "--method", TOY, "--method", "fullkv", *RUN,
                             "-o", tmp_path / "sweep", "--json")
    assert code == 0, err
    manifest = json.loads(out)
    assert sorted((p["method"], p["status"]) for p in manifest["points"]) == [("fullkv", "ok"), (TOY, "ok")]

    # gate --counters: the sweep's toy point against itself passes, against a copy that reads more it fails
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", tmp_path / "sweep",
                             "--current", tmp_path / "sweep")
    assert code == 0 and "counter gate passed" in out, err
    assert TOY in out
    point = next(r for r in load_results([tmp_path / "sweep"]) if r["method"] == TOY)
    worse = copy.deepcopy(point)
    worse["method_config"]["budget"] = 64  # a wider window: more KV read per step
    worse["method_stats"]["attended_tokens_per_head"]["mean"] *= 64 / 48
    if "attended_tokens_per_layer" in worse["method_stats"]:
        worse["method_stats"]["attended_tokens_per_layer"] = [
            n * 64 / 48 for n in worse["method_stats"]["attended_tokens_per_layer"]]
    write_json_atomic(tmp_path / "worse" / "toy.json", {k: v for k, v in worse.items() if not k.startswith("_")})
    code, out, err = run_cli(monkeypatch, capsys, "gate", "--counters", "--baseline", tmp_path / "sweep",
                             "--current", tmp_path / "worse", "--allow-missing")
    assert code != 0, out

    # project: the toy's own work model, at its own shape and at a bigger one
    code, out, err = run_cli(monkeypatch, capsys, "project", tmp_path / "sweep", "--hardware", "h200", "--len", "4k",
                             "--budget", "48", "-o", tmp_path / "projection.json")  # the run's own budget, kept
    assert code == 0, err
    document = json.loads((tmp_path / "projection.json").read_text())
    assert not document["skipped"]
    projected = next(p for p in document["projections"] if p["method"] == TOY)
    full = next(p for p in document["projections"] if p["method"] == "fullkv")
    assert projected["work_per_step"]["device_kv_bytes_per_step"] < full["work_per_step"]["device_kv_bytes_per_step"]
    (fraction,) = METHODS.load(TOY).work_fractions
    assert projected["measured_work"][fraction] == (pytest.approx(1.0) if TOY == "toy-window" else
                                                    pytest.approx((5 * 8 + 2.5) / 48, abs=0.05))

    # report: figures and summary over the sweep and the projection
    code, out, err = run_cli(monkeypatch, capsys, "report", tmp_path / "sweep", tmp_path / "projection.json",
                             "-o", tmp_path / "report")
    assert code == 0, err
    summary = (tmp_path / "report" / "summary.md").read_text()
    toy_rows = [line for line in summary.splitlines() if line.startswith(f"| {TOY}")]
    assert len(toy_rows) == 2, summary  # its throughput row and its projection row
    # the projection row is compared with FullKV (the throughput table compares only points of equal run settings,
    # and FullKV has no dense layers: its `vs fullkv` is "-" for every sparse method, the built-in ones included)
    assert re.search(r"\| \d+\.\d\dx \|$", toy_rows[1]), summary


def test_a_method_without_a_work_model_is_skipped_with_its_reason(toy_registry, tmp_path, monkeypatch, capsys):
    """A registered method that declares no work model is not refused by name: project skips its results and says
    why (the method declares none)."""

    @dataclass
    class NoModel(RecentWindow):
        name = "toy-nomodel"
        sparse_layer_work = SparseLayerMethod.sparse_layer_work  # the base's: none

    toy_registry.register("toy-nomodel", NoModel)
    code, _, err = run_cli(monkeypatch, capsys, "throughput", "--method", "toy-nomodel", "--method", "fullkv", *RUN,
                           "-o", tmp_path / "runs")
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h200", "--json")
    document = json.loads(out) if code == 0 else None
    assert code == 0, err
    assert [s["reason"] for s in document["skipped"]] == [
        "method 'toy-nomodel' declares no work model (AttentionMethod.sparse_layer_work): `project` and "
        "`gate --counters` cannot count its work"]


def test_scoped_registry_restores_on_error():
    with pytest.raises(RuntimeError), METHODS.scoped() as registry:
        registry.register("toy-temporary", RecentWindow)
        assert "toy-temporary" in METHODS and METHODS.load("toy-temporary") is RecentWindow
        raise RuntimeError
    assert "toy-temporary" not in METHODS


def test_attention_without_explicit_stages_is_booked_as_attention(tiny_qwen3):
    """A method that never calls `ctx.timer.stage(...)` still has its decode booked as `attn_device`, not `other`:
    the engine times every method's decode there (a method's own stages inside it, idle or merge, stay theirs)."""
    from scoutbench.decode.engine import DecodeEngine

    class Unstaged(FullKV):
        def decode(self, layer, q, k, v):
            time.sleep(0.02)  # the attention's cost, with no stage of its own
            keys, values = self.keys[layer], self.values[layer]
            keys[self._batch_index, :, self.step.positions] = k
            values[self._batch_index, :, self.step.positions] = v
            return decode_attention(q, keys, values, self.ctx.scale, lengths=self._step_lengths)

    engine = DecodeEngine(tiny_qwen3, Unstaged())
    engine.start(batch=1, max_len=40)
    logits = engine.prefill(torch.randint(0, 100, (1, 32)), torch.tensor([32]))
    engine.timer.begin_step()
    engine.decode_step(logits.argmax(-1))
    record = engine.timer.end_step()
    layers = tiny_qwen3.config.num_hidden_layers
    assert record["attn_device"] >= 20.0 * layers and record["other"] < 20.0 * layers, record


def test_sinks_window_selects_the_sinks_and_the_newest_blocks():
    """The hook's selection through the base's plan, in a ragged batch: one sink block and the newest complete
    blocks, then the tail; a sequence with no more complete blocks than selections attends all of them."""
    from method_harness import hand_context, step_info

    method = SinksWindow(budget=48, block_size=8, dense_layers=1)  # 6 pages: 5 selected blocks and the tail
    method.bind(hand_context(batch=2, max_len=80))
    method.begin_step(step_info([63, 40]))  # tail blocks 7 and 5
    block_ids, valid = method.select(1, torch.zeros(2, 4, 16))
    assert block_ids[:, 0].tolist() == [[0, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5]]
    assert valid[:, 0].tolist() == [5 * 8 + 8, 5 * 8 + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present")
def test_sinks_window_replays_its_eager_logits_from_cuda_graphs():
    """The hook runs inside the captured region: on emulated CUDA (tests/emulation/test_graphs.py) the toy's replayed steps
    over a ragged batch, crossing block boundaries, give its eager logits."""
    from emulated import run_emulated, small_qwen3
    from method_harness import ragged_prompt

    model = small_qwen3()
    run = run_emulated(model, lambda: SinksWindow(budget=48, block_size=8, dense_layers=1),
                       *ragged_prompt(model.config.vocab_size, [120, 83], seed=3), 24, cuda_graphs=True)
    assert run.graphs["captured"] and run.graphs["replayed_steps"] >= 24 - 2 * run.graphs["variants"], run.graphs
    assert max(run.max_diff()) <= 2e-4 and run.unexpected_syncs() == []
