"""The projection: hardware profiles carry a source for every number; work counters derived from a run agree
with the method's own statistics; the timeline equals hand-computed references where the model is simple enough
to compute by hand (FullKV, no-overlap, same-layer and layer-ahead waits, bus saturation); `project`'s CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

from scoutbench.analysis.hardware import hardware_names, load_hardware, parse_hardware
from scoutbench.analysis.projection import Target, project_results, project_step
from scoutbench.analysis.work import MeasuredWork, Shape, measured_work, result_shape, step_work
from scoutbench.bench.throughput import ThroughputConfig, run_throughput
from scoutbench.errors import UsageError
from scoutbench.methods.base import ModelShape
from scoutbench.models import preset_config

PAPER_PROFILES = {"a100-80gb-pcie", "h100-sxm", "h100-pcie", "h200", "l40s", "gh200", "paper"}
SHAPE = Shape(ModelShape(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, hidden_size=64,
                         intermediate_size=128, vocab_size=1000), context_len=4096, batch=2, elem_bytes=2)


def profile(memory_bw=1e9, peak=1e15, bus_bw=1e9, overhead=0.0, host_attention=1e9, host_bw=1e9,
            shares_device=False, efficiency=None, **extra):
    """A round-number profile: 1 GB/s everywhere makes every time = bytes x 1e-9 s (every kernel at full
    bandwidth and no hand-off cost unless `efficiency` says otherwise)."""
    def n(value):
        return {"value": value, "source": "test"}

    kernels = {"dense_attention": 1.0, "digest_topk": 1.0, "block_sparse_16": 1.0, "block_sparse_32": 1.0,
               "layer_handoff_s": 1e-30, **(efficiency or {})}
    data = {"name": "test",
            "device": {"memory_bytes": n(80e9), "memory_bw_bytes_s": n(memory_bw), "peak_flops": n(peak)},
            "bus": {"bw_bytes_s": n(bus_bw), "transfer_overhead_s": n(overhead) if overhead else n(1e-30)},
            "host": {"cores": n(8), "memory_bytes": n(512e9), "memory_bw_bytes_s": n(host_bw),
                     "attention_bytes_s": n(host_attention), "shares_device": shares_device},
            "efficiency": {k: {**n(v), "basis": "assumed"} for k, v in kernels.items()}}
    data["device"].update({k: n(v) for k, v in extra.items()})
    return parse_hardware(data)


def test_builtin_profiles_load_with_a_source_for_every_number():
    """Every number has a source, device memory is what the device reports (whole MiB: nvidia-smi's
    memory.total), and every kernel efficiency is there with its basis."""
    from scoutbench.analysis.hardware import EFFICIENCIES

    assert PAPER_PROFILES <= set(hardware_names())
    for name in PAPER_PROFILES:
        hw = load_hardware(name)
        assert set(hw.values) == set(hw.sources) and all(s.strip() for s in hw.sources.values())
        assert hw.values["device.memory_bw_bytes_s"] > 1e11 and hw.labels["bus"]
        assert hw.values["device.memory_bytes"] % 2**20 == 0, name
        assert {f"efficiency.{k}" for k in EFFICIENCIES} == set(hw.bases) and set(hw.bases.values()) <= {
            "measured", "assumed"}
        assert all(0 < hw.efficiency(k) <= 1 for k in EFFICIENCIES if not k.endswith("_s"))
    assert load_hardware("paper").values["device.memory_bytes"] == 81920 * 2**20  # an 80 GB A100 as it reports


def test_profile_efficiencies_are_required_with_a_basis():
    with open(load_hardware("paper").path, encoding="utf-8") as handle:
        data = json.load(handle)
    for broken, message in ((lambda d: d.pop("efficiency"), "missing section 'efficiency'"),
                            (lambda d: d["efficiency"].pop("block_sparse_16"), "efficiency.block_sparse_16 needs"),
                            (lambda d: d["efficiency"]["digest_topk"].pop("basis"), "digest_topk needs a basis"),
                            (lambda d: d["efficiency"]["dense_attention"].update(source=""), "has no source")):
        copied = copy.deepcopy(data)
        broken(copied)
        with pytest.raises(UsageError, match=message):
            parse_hardware(copied)


def test_kernel_efficiencies_time_each_kernel_class_by_hand():
    """Dense layers and contiguous KV at the dense kernel's efficiency, selected pages at their page size's, digests
    at the selection kernel's, and one hand-off per layer with a host part (none for FullKV or Quest)."""
    halves = {"dense_attention": 0.5, "digest_topk": 0.25, "block_sparse_16": 0.2, "block_sparse_32": 0.4,
              "layer_handoff_s": 1e-3}
    hw, full = profile(efficiency=halves), profile()
    for block, efficiency in ((16, 0.2), (32, 0.4)):
        config = {"budget": 512, "block_size": block, "dense_layers": 1}
        work = step_work(MeasuredWork("quest", "quest", config), SHAPE)
        sparse, dense = work.sparse, work.dense
        slow, fast = project_step(work, hw, SHAPE.batch), project_step(work, full, SHAPE.batch)
        extra_s = (work.num_sparse * (sparse.device_kv_bytes * (1 / efficiency - 1) + sparse.select_bytes * 3)
                   + work.num_dense * dense.device_kv_bytes) * 1e-9
        assert slow.step_ms - fast.step_ms == pytest.approx(extra_s * 1e3)
    scout = step_work(MeasuredWork("scout", "scout", {"budget": 512, "block_size": 16, "dense_layers": 1}), SHAPE)
    slow, fast = project_step(scout, hw, SHAPE.batch), project_step(scout, full, SHAPE.batch)
    assert slow.stages_ms["other"] - fast.stages_ms["other"] == pytest.approx(scout.num_sparse * 1e-3 * 1e3)
    assert slow.stages_ms["predict"] - fast.stages_ms["predict"] == pytest.approx(
        scout.num_sparse * scout.sparse.select_bytes * 3 * 1e-9 * 1e3)


def test_profile_without_a_source_is_refused(tmp_path):
    with open(load_hardware("h200").path, encoding="utf-8") as handle:
        data = json.load(handle)
    data["bus"]["bw_bytes_s"]["source"] = " "
    with pytest.raises(UsageError, match="bus.bw_bytes_s has no source"):
        parse_hardware(data)
    data["bus"]["bw_bytes_s"]["source"] = "PCIe spec"
    del data["host"]["attention_bytes_s"]
    with pytest.raises(UsageError, match="host.attention_bytes_s"):
        parse_hardware(data)
    with pytest.raises(UsageError, match="unknown hardware"):
        load_hardware("tpu-v9")


def test_fullkv_step_equals_the_roofline_by_hand():
    work = step_work(MeasuredWork("fullkv", "fullkv", {}), SHAPE)
    m, B, N = SHAPE.model, SHAPE.batch, SHAPE.context_len
    weights = (m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * 64 * 128) * 2
    kv = B * N * 2 * m.num_kv_heads * m.head_dim * 2
    head = m.vocab_size * m.hidden_size * 2
    step = project_step(work, profile(), B)
    assert step.step_ms == pytest.approx((m.num_layers * (weights + kv) + head) * 1e-9 * 1e3)
    assert step.stages_ms["idle"] == 0 and step.bound_by == "device"
    compute_bound = project_step(work, profile(peak=1e6), B)  # FLOPs now dominate the linear layers
    assert compute_bound.stages_ms["mlp"] > step.stages_ms["mlp"] * 100


def test_scout_without_a_cpu_part_reads_what_quest_reads():
    config = {"budget": 512, "block_size": 16, "dense_layers": 1, "pc": True, "pr": False}
    quest = step_work(MeasuredWork("quest", "quest", {"budget": 512, "block_size": 16, "dense_layers": 1}), SHAPE)
    scout = step_work(MeasuredWork("scout", "scout", config), SHAPE)
    assert scout.totals()["device_kv_bytes_per_step"] == quest.totals()["device_kv_bytes_per_step"]
    assert scout.totals()["select_bytes_per_step"] == quest.totals()["select_bytes_per_step"]
    split = step_work(MeasuredWork("scout", "scout", config, cpu_budget_frac=0.25), SHAPE).totals()
    # the CPU share moves tokens between tiers, it does not add any
    assert split["device_kv_bytes_per_step"] + split["host_kv_bytes_per_step"] == \
        quest.totals()["device_kv_bytes_per_step"]


def test_quest_per_query_head_reads_one_selection_per_query_head():
    config = {"budget": 512, "block_size": 16, "dense_layers": 1}
    per_kv = step_work(MeasuredWork("quest", "quest", config), SHAPE).totals()
    per_q = step_work(MeasuredWork("quest", "quest", {**config, "per_query_head": True}), SHAPE).totals()
    group = SHAPE.model.num_heads // SHAPE.model.num_kv_heads
    assert per_q["device_kv_bytes_per_step"] - per_kv["device_kv_bytes_per_step"] == pytest.approx(
        (group - 1) * (SHAPE.model.num_layers - 1) * SHAPE.batch * 512 * 2 * SHAPE.model.num_kv_heads
        * SHAPE.model.head_dim * SHAPE.elem_bytes)
    assert per_q["select_bytes_per_step"] == per_kv["select_bytes_per_step"]


def test_overlap_patterns_idle_by_hand():
    config = {"budget": 1024, "block_size": 16, "dense_layers": 0, "pr": False}
    hw = profile(host_attention=1e8)  # the CPU is 10x slower than the device
    same = step_work(MeasuredWork("scout-base", "scout", {**config, "pc": False}, cpu_budget_frac=0.5), SHAPE)
    ahead = step_work(MeasuredWork("scout-pc", "scout", {**config, "pc": True}, cpu_budget_frac=0.5), SHAPE)
    s = same.sparse
    cpu_s = s.host_kv_bytes / 1e8
    chain = cpu_s + (s.d2h.bytes + s.h2d.bytes) * 1e-9
    idle_same = project_step(same, hw, SHAPE.batch).stages_ms["idle"]
    assert idle_same == pytest.approx(same.num_sparse * (chain - s.device_kv_bytes * 1e-9) * 1e3)
    a = ahead.sparse
    window = (a.weight_bytes + a.device_kv_bytes + a.merge_bytes) * 1e-9  # the layer after the prediction
    idle_ahead = project_step(ahead, hw, SHAPE.batch).stages_ms["idle"]
    assert idle_ahead == pytest.approx(ahead.num_sparse * max(0.0, chain - window) * 1e3)
    assert idle_ahead < idle_same  # pre-computation hides CPU time behind a whole layer


def test_prefetch_and_bus_saturation():
    config = {"budget": 4097, "dynamic_count": True, "partial_ratio": 0.25, "dense_layers": 0}  # fetch <= 4096
    work = MeasuredWork("infinigen", "infinigen", config, fetch_context_frac=0.5)
    gathered = step_work(work, SHAPE)
    token = step_work(work, SHAPE, fetch_granularity="token")
    assert gathered.sparse.h2d.copies == 2 and token.sparse.h2d.copies == SHAPE.batch * SHAPE.context_len * 0.5
    slow_copies = profile(overhead=1e-5)
    assert project_step(token, slow_copies, 2).step_ms > 10 * project_step(gathered, slow_copies, 2).step_ms
    # a bus 1000x slower than memory: the step is the serial bus time, the rest is idle
    step = project_step(gathered, profile(bus_bw=1e6), 2)
    assert step.bound_by == "bus" and step.step_ms >= step.bus_h2d_ms and step.idle_frac > 0.9


@pytest.fixture(scope="module")
def tiny_runs():
    """Real runs of every method family on the tiny preset (seconds on 2 cores)."""
    import torch

    from scoutbench.models import load_model

    loaded = load_model("tiny-qwen3", "cpu", torch.float32)
    runs = {}
    for method, args in (("fullkv", {}), ("quest", {"budget": "128", "block_size": "16"}),
                         ("scout", {"budget": "128", "block_size": "16", "recall_interval": "2"}),
                         ("infinigen", {"budget": "129"}),
                         ("hgca", {"budget": "128", "window_share": "0.25", "migrate_block": "4"})):
        cfg = ThroughputConfig(method=method, method_args=args, model="tiny-qwen3", length=512, batch=2, steps=4,
                               warmup=1, prefill="synthetic", device="cpu", command=["test"])
        runs[method] = run_throughput(cfg, loaded)
    return runs


def test_work_counters_agree_with_method_stats(tiny_runs):
    scout = tiny_runs["scout"]
    stats = scout["method_stats"]
    totals = step_work(measured_work(scout), result_shape(scout)).totals()
    assert stats["recall"]["blocks"] > 0
    assert totals["recall_bytes_per_step"] == pytest.approx(stats["recall"]["bytes"] / stats["steps"])
    infinigen = tiny_runs["infinigen"]
    totals = step_work(measured_work(infinigen), result_shape(infinigen)).totals()
    assert totals["h2d_bytes_per_step"] == pytest.approx(infinigen["method_stats"]["h2d_bytes_per_step"])
    quest = tiny_runs["quest"]
    shape = result_shape(quest)
    attended = quest["method_stats"]["attended_tokens_per_layer"]
    dense = quest["method_config"]["dense_layers"]
    expected = shape.batch * shape.model.num_kv_heads * (dense * shape.context_len + sum(attended[dense:]))
    assert step_work(measured_work(quest), shape).totals()["device_attended_tokens_per_step"] == pytest.approx(expected)
    hgca = tiny_runs["hgca"]
    shape = result_shape(hgca)
    pairs = sum(hgca["method_stats"]["cpu_tokens_per_layer"])
    group = shape.model.num_heads // shape.model.num_kv_heads
    cpu_tokens = step_work(measured_work(hgca), shape).totals()["cpu_attended_tokens_per_step"]
    assert cpu_tokens * group == pytest.approx(pairs, rel=0.05)  # mean context vs the run's own host split


def test_work_counters_report_the_attended_tokens_per_head(tiny_runs):
    """What --budget bounds is a work counter too: tokens per (sequence, KV head) in a sparse layer,
    mean and max, from the method's measured stats at the run's own shape."""
    for name, result in tiny_runs.items():
        shape = result_shape(result)
        totals = step_work(measured_work(result), shape).totals()
        measured = result["method_stats"]["attended_tokens_per_head"]
        if name == "fullkv":  # every token, at the shape's (mean) context
            assert totals["attended_tokens_per_head_max"] == totals["attended_tokens_per_head_mean"] == shape.context_len
            continue
        assert totals["attended_tokens_per_head_max"] == pytest.approx(measured["max"]), name
        assert totals["attended_tokens_per_head_mean"] == pytest.approx(measured["mean"], rel=0.02), name


def test_projection_scales_to_the_target_and_auto_batch_follows_planning(tiny_runs):
    from scoutbench.methods import build_method
    from scoutbench.planning import plan_method

    results = list(tiny_runs.values())
    hw = load_hardware("paper")
    target = Target(model="qwen3-14b", length=65536, batch="auto", budget=2048, block_size=32, dtype="bf16")
    projections = {p.method: p for p in project_results(results, hw, target)}
    assert set(projections) == set(tiny_runs)
    shape = ModelShape.from_config(preset_config("qwen3-14b"))
    plan = plan_method(build_method("fullkv", {}), shape, 65536, 2, int(hw.values["device.memory_bytes"]),
                       int(hw.values["host.memory_bytes"]))
    assert projections["fullkv"].batch == plan.max_batch and projections["fullkv"].batch_limited_by == "device"
    scout = projections["scout"]
    assert scout.batch > projections["fullkv"].batch
    # the measured CPU share of the budget carries over: CPU tokens = share x 2048 per (sequence, KV head, layer)
    share = measured_work(tiny_runs["scout"]).cpu_budget_frac
    sparse_layers = shape.num_layers - scout.method_config["dense_layers"]
    assert scout.work["cpu_attended_tokens_per_step"] == pytest.approx(
        share * 2048 * scout.batch * shape.num_kv_heads * sparse_layers)
    # the pool is device memory: a larger one fits fewer sequences; a result from before the pool was a setting
    # (no pool_factor in its config) ran a pool of one selection and is planned with it
    scout_result = tiny_runs["scout"]
    pooled = {**scout_result, "method_config": {**scout_result["method_config"], "pool_factor": 3.0}}
    older = {**scout_result, "method_config": {k: v for k, v in scout_result["method_config"].items()
                                               if k != "pool_factor"}}
    one = {**scout_result, "method_config": {**scout_result["method_config"], "pool_factor": 1.0}}
    batches = [project_results([r], hw, target)[0].batch for r in (one, older, pooled)]
    assert batches[0] == batches[1] > batches[2]
    fixed = {p.method: p for p in project_results(results, hw, Target(model="qwen3-14b", length=32768, batch=16))}
    assert all(p.batch == 16 for p in fixed.values())
    assert fixed["fullkv"].step.step_ms > fixed["quest"].step.step_ms  # dense reads far more KV at 32k


def test_repeats_merge_and_measured_step_is_shown_only_on_matching_hardware(tiny_runs):
    run = tiny_runs["scout"]
    twin = copy.deepcopy(run)
    twin["method_stats"]["cpu_compute_ratio"]["mean"] = 3 * (run["method_stats"]["cpu_compute_ratio"]["mean"] or 0.1)
    third = copy.deepcopy(twin)
    for repeat in (twin, third):  # fewer tokens than the budget in the busiest row, as a real run can attend
        repeat["method_stats"]["attended_tokens_per_head"]["max"] = 100
    merged = project_results([run, twin, third], load_hardware("h200"), Target())
    assert len(merged) == 1 and merged[0].measured.cpu_budget_frac == twin["method_stats"]["cpu_compute_ratio"]["mean"]
    assert merged[0].work["attended_tokens_per_head_max"] == pytest.approx(100)  # the median repeat's, not the budget
    assert merged[0].measured_step_ms is None  # a CPU run is not compared with a GPU profile
    mine = project_results([run], profile(shares_device=True, cores=2), Target())[0]
    assert mine.measured_step_ms == pytest.approx(run["decode_step_ms"]["median"])


def test_project_cli(tiny_runs, tmp_path, monkeypatch, capsys):
    from scoutbench.results import write_json_atomic

    for name, result in tiny_runs.items():
        write_json_atomic(tmp_path / "runs" / f"{name}.json", result)
    out = tmp_path / "projection.json"
    code, stdout, _ = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h100-sxm", "--model",
                              "qwen3-8b", "--len", "32k", "--batch", "8", "--budget", "2k", "-o", out)
    assert code == 0 and "scout" in stdout
    document = json.loads(out.read_text())
    assert document["kind"] == "projection" and document["hardware"]["name"] == "h100-sxm"
    assert document["skipped"] == []
    for p in document["projections"]:
        assert p["decode_step_ms"] == pytest.approx(sum(p["latency_breakdown_ms"].values()))
        assert math.isclose(p["decode_throughput_tok_s"], 8 / (p["decode_step_ms"] / 1e3))
    from scoutbench.analysis.report import build_report

    summary = build_report([out], tmp_path / "report").summary.read_text()
    assert "## Projections" in summary and "| scout | pool 3 (paper: pool 1) | qwen3-8b | 32k | 8 |" in summary
    for args, message in ((("--hardware", "nope"), "unknown hardware"), (("--hardware", "h200", "--batch", "x"),
                          "bad --batch"), (("--hardware", "h200", "--model", "gpt-9"), "not a built-in name")):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # gpt-9: not a built-in, not a folder, not in the cache
        code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", *args)
        assert code == 2 and message in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "empty-does-not-exist", "--hardware", "h200")
    assert code == 2
    write_json_atomic(tmp_path / "runs" / "projection.json", document)  # a projection beside the runs is skipped
    code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h200")
    assert code == 0 and "kind 'projection' is not a throughput result" in err
    third_party = {**tiny_runs["fullkv"], "method": "my-method"}
    write_json_atomic(tmp_path / "runs" / "third.json", third_party)
    write_json_atomic(tmp_path / "runs" / "failed.json", {**tiny_runs["fullkv"], "status": "failed", "error": "oom"})
    code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "h200")
    assert code == 0 and "skipped" in err and "my-method" in err and "oom" in err
    only_bad = tmp_path / "bad"
    write_json_atomic(only_bad / "third.json", third_party)
    code, _, err = run_cli(monkeypatch, capsys, "project", only_bad, "--hardware", "h200")
    assert code == 2 and "no ok throughput results" in err


def test_project_decode_instance_and_dense_layers(tiny_runs, tmp_path, monkeypatch, capsys):
    """`--decode-instance` plans every method without the prefill transient (never fewer sequences, ScoutAttention
    more at 32k); `--dense-layers 0` runs every layer sparse (ScoutAttention then reads less device KV per step, and
    fits more sequences), as `plan --dense-layers` does; a method without dense layers refuses the flag."""
    from scoutbench.methods import build_method
    from scoutbench.planning import plan_method
    from scoutbench.results import write_json_atomic

    hw = load_hardware("paper")
    target = dict(model="qwen3-14b", length=32768, batch="auto", budget=2048, block_size=32, dtype="bf16")
    colocated = {p.method: p for p in project_results(list(tiny_runs.values()), hw, Target(**target))}
    decode = {p.method: p for p in project_results(list(tiny_runs.values()), hw, Target(**target, decode_instance=True))}
    assert all(decode[m].max_batch >= colocated[m].max_batch for m in tiny_runs)
    assert decode["scout"].max_batch > colocated["scout"].max_batch
    config = {**tiny_runs["scout"]["method_config"], "budget": 2048, "block_size": 32, "dense_layers": 0}
    shape = ModelShape.from_config(preset_config("qwen3-14b"))
    plan = plan_method(build_method("scout", config), shape, 32768, 2, int(hw.values["device.memory_bytes"]),
                       int(hw.values["host.memory_bytes"]), decode_instance=True)
    all_sparse = {p.method: p for p in project_results(list(tiny_runs.values()), hw,
                                                       Target(**target, decode_instance=True, dense_layers=0))}
    assert all_sparse["scout"].method_config["dense_layers"] == 0 and all_sparse["scout"].batch == plan.max_batch
    fixed = dict(target, batch=16)
    two, none = (project_results([tiny_runs["scout"]], hw, Target(**fixed, dense_layers=n))[0] for n in (2, 0))
    assert none.work["device_kv_bytes_per_step"] < two.work["device_kv_bytes_per_step"]
    for name, result in tiny_runs.items():
        write_json_atomic(tmp_path / "runs" / f"{name}.json", result)
    code, out, err = run_cli(monkeypatch, capsys, "project", tmp_path / "runs", "--hardware", "paper", "--model",
                             "qwen3-14b", "--len", "32k", "--budget", "2k", "--block-size", "32", "--batch", "auto",
                             "--dtype", "bf16", "--decode-instance", "--dense-layers", "0", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["target"]["decode_instance"] is True and document["target"]["dense_layers"] == 0
    scout = next(p for p in document["projections"] if p["method"] == "scout")
    assert scout["batch"] == plan.max_batch and scout["method_config"]["dense_layers"] == 0
    write_json_atomic(tmp_path / "dense" / "fullkv.json", tiny_runs["fullkv"])
    code, _, err = run_cli(monkeypatch, capsys, "project", tmp_path / "dense", "--hardware", "paper",
                           "--dense-layers", "0")
    assert code == 2 and "--dense-layers: no projected result's method has dense layers" in err, err


def test_project_refuses_a_silent_budget_change_and_shows_both_budgets(tiny_runs, tmp_path, monkeypatch, capsys):
    """Issue 46: a 512-token run at budget 128 carried to 64k without --budget kept budget 128 silently (0.2% of the
    context instead of a quarter). It is refused (exit 2, one line naming the run's budget); with --budget the
    table and JSON show the run's budget and the projection's."""
    from scoutbench.results import write_json_atomic

    for name in ("fullkv", "quest"):
        write_json_atomic(tmp_path / "runs" / f"{name}.json", tiny_runs[name])
    base = ("project", tmp_path / "runs", "--hardware", "h200", "--model", "qwen3-8b", "--batch", "4")
    code, _, err = run_cli(monkeypatch, capsys, *base, "--len", "64k")
    assert code == 2 and "budget 128 at len 512" in err and "pass --budget 128" in err and err.count("\n") == 1, err
    code, out, err = run_cli(monkeypatch, capsys, *base, "--len", "512")  # the run's own length: nothing carried
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, *base, "--len", "64k", "--budget", "2k", "--json")
    assert code == 0, err
    quest = next(p for p in json.loads(out)["projections"] if p["method"] == "quest")
    fullkv = next(p for p in json.loads(out)["projections"] if p["method"] == "fullkv")
    assert (quest["run_budget"], quest["budget"]) == (128, 2048) and (fullkv["run_budget"], fullkv["budget"]) == (None, None)
    code, out, err = run_cli(monkeypatch, capsys, *base, "--len", "64k", "--budget", "2k")
    assert code == 0 and "budget" in out and "128 -> 2k" in out, out
    code, out, err = run_cli(monkeypatch, capsys, *base, "--len", "64k", "--budget", "128")
    assert code == 0 and "128 -> 128" not in out and " 128 " in out, out


def test_calibrate_profile_is_valid_for_project(monkeypatch):
    import scoutbench.bench.calibration as calibration

    # the engine run is the slow part; its own test is the throughput suite
    monkeypatch.setattr(calibration, "engine_overhead_per_layer_s", lambda device, bw: 1e-4)
    import torch

    data = calibration.calibrate(torch.device("cpu"), repeats=1)
    hw = parse_hardware(data)
    assert hw.shares_device and hw.values["device.layer_overhead_s"] == 1e-4
    assert all("measured by scoutbench calibrate" in s for s in hw.sources.values())
    assert set(hw.bases.values()) == {"measured"}
    # every kernel class ran on this CPU (emulation of a device: the plumbing); rates are finite and positive
    assert 1e8 < hw.attention_bytes_s(0) < 1e12 and 1e8 < hw.attention_bytes_s(16) < 1e12
    assert 1e7 < hw.select_bytes_s < 1e12 and 0 < hw.layer_handoff_s < 0.1


def test_calibrate_measures_the_kernel_efficiencies_on_emulated_cuda():
    """The CUDA branch of the efficiency measurements (events, pinned copies, the kernels on the device) runs on
    emulated CUDA: the plumbing, every entry present, positive and marked measured; the numbers of a GPU come only
    from a run on one."""
    import torch

    from scoutbench.analysis.hardware import EFFICIENCIES
    from scoutbench.bench.calibration import kernel_efficiencies
    from scoutbench.testing.emulated_cuda import emulated_cuda

    with emulated_cuda():
        section = kernel_efficiencies(torch.device("cuda:0"), torch.float32, 1, 1e10,
                                      lambda value, what: {"value": value, "source": what})
    assert set(section) == set(EFFICIENCIES)
    assert all(entry["basis"] == "measured" and entry["value"] > 0 and entry["source"] for entry in section.values())
    assert "event wait" in section["layer_handoff_s"]["source"]


def test_committed_projection_inputs_stay_projectable():
    """The paper-ratio table's inputs (results/projection, docs/projection.md) are results an older version wrote:
    every file must still project, budget-matched (every sparse method at budget 2048 / 512 with 2 dense layers),
    and the real-drift set must merge its three records into one point per method."""

    from scoutbench.analysis.projection import unprojectable
    from scoutbench.results import load_results

    root = REPO_ROOT / "results" / "projection"
    target = Target(model="qwen3-14b", length=65536, batch=40, budget=2048, block_size=32, dtype="bf16")
    for folder, budget, files in (("bench-attn16-32k-b2048", 2048, 7), ("qwen2.5-0.5b-longbench-8k-b512", 512, 21)):
        results = [r for r in load_results([str(root / folder)]) if r.get("kind") == "throughput"]
        assert len(results) == files and not [unprojectable(r) for r in results if unprojectable(r)]
        for r in results:
            if r["method"] != "fullkv":
                assert (r["method_config"]["budget"], r["method_config"]["dense_layers"]) == (budget, 2), r["_path"]
        projections = project_results(results, load_hardware("paper"), target)
        assert sorted(p.method for p in projections) == sorted({r["method"] for r in results})
        assert all(p.step.step_ms > 0 for p in projections)


def test_host_issue_is_launches_times_their_cost_and_a_slow_host_sets_the_step():
    """A step's host issue: torch calls x host.launch_s + replays x host.graph_replay_s, per layer of the model
    the counts were taken on, times the target's layers; when it exceeds the device's time it sets the step, which
    is then launch-bound."""
    work = step_work(MeasuredWork("fullkv", "fullkv", {}), SHAPE)
    hw = profile()
    device = project_step(work, hw, SHAPE.batch)
    assert device.host_issue_ms is None and device.launch_bound is None  # no launch costs in the profile
    costs = {"launch_s": 1e-6, "graph_replay_s": 4e-6}
    with_costs = parse_hardware({**copy.deepcopy(_profile_data(hw)),
                                 "host": {**_profile_data(hw)["host"], **{k: {"value": v, "source": "test"}
                                                                          for k, v in costs.items()}}})
    counts = {"torch_calls_per_step": 80.0, "graph_replays_per_step": 40.0, "layers": 8}
    fast = project_step(work, with_costs, SHAPE.batch, "fullkv", counts)
    issue_ms = (80 * 1e-6 + 40 * 4e-6) / 8 * SHAPE.model.num_layers * 1e3
    assert fast.host_issue_ms == pytest.approx(issue_ms)
    assert fast.step_ms == pytest.approx(device.step_ms) and fast.launch_bound is False
    slow = project_step(work, with_costs, SHAPE.batch, "fullkv", {**counts, "torch_calls_per_step": 8e7})
    assert slow.step_ms == pytest.approx(slow.host_issue_ms) and slow.launch_bound is True
    assert slow.bound_by == "launches" and slow.stages_ms["idle"] == pytest.approx(slow.step_ms - device.step_ms)


def test_committed_launch_counts_cover_every_method_both_ways():
    """scoutbench/data/launch_counts.json (benchmarks/launch_counts.py) has every registered method with graphs on
    and off, every one captured, and a graph replay issues fewer launches than the eager step."""
    from scoutbench.analysis.projection import launch_counts
    from scoutbench.methods import METHODS

    for name in METHODS.names():
        off, on = launch_counts(name, False), launch_counts(name, True)
        assert off is not None and on is not None, name
        assert on["captured"] and on["torch_calls_per_step"] + on["graph_replays_per_step"] < \
            off["torch_calls_per_step"]


def _profile_data(hw):
    """A parsed profile back as the JSON it came from."""
    data = {"name": hw.name, "device": {}, "bus": {}, "host": {"shares_device": hw.shares_device}, "efficiency": {}}
    for key, value in hw.values.items():
        section, field = key.split(".")
        data[section][field] = {"value": value, "source": hw.sources[key],
                                **({"basis": hw.bases[key]} if key in hw.bases else {})}
    return data


def _validation():
    import sys

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import projection_validation

    return projection_validation


def test_paper_validation_with_the_papers_counters(monkeypatch, capsys):
    """Issue 45: `projection_validation.py paper --counters paper --json` prints one object per claim; where the paper
    states the batch each row has its error and whether its batches fit the plan (decode instance, no dense layers,
    one selection in the pool, the card's reported memory), and is within 25% (idle: 10 points) or says why; the
    timeline reproduces ScoutAttention's batch scaling and the baselines' 16 -> 32 from the paper's own counters,
    and the 8k claim holds; a claim the paper leaves open gives what was solved for instead of a verdict."""
    validation = _validation()
    monkeypatch.setattr("sys.argv", ["projection_validation.py", "paper", "--counters", "paper", "--json"])
    validation.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all({"claim", "paper", "projected", "counters"} <= set(row) for row in rows)
    stated = [row for row in rows if row.get("stated_batch") and not row.get("open")]
    assert len(stated) >= 7 and all("batch" in row and "fits" in row for row in stated)
    for row in stated:
        assert len({"error_pct", "error_pp", "holds"} & set(row)) == 1, row
        assert row["fits"], row  # every batch the paper states fits its decode instance
        assert row.get("within_tolerance") or row.get("holds") or row.get("reason"), row
    by_claim = {row["claim"]: row for row in rows}
    for claim in ("ScoutAttention batch 16 -> 32, 32k", "ScoutAttention batch 32 -> 64, 32k",
                  "HGCA (score average of every host token read) batch 16 -> 32, 32k",
                  "InfiniGen (fixed fetch: budget - 1) batch 16 -> 32, 32k"):
        assert by_claim[claim]["within_tolerance"], by_claim[claim]
    assert by_claim["ScoutAttention batch 32 -> 64, 32k"]["max_batch"] >= 64
    qualitative = [row for row in stated if row["kind"] == "qualitative"]
    assert qualitative and all(row["holds"] for row in qualitative)
    open_rows = [row for row in rows if not row.get("stated_batch")]
    assert {"ScoutAttention / FullKV, 64k", "ScoutAttention idle, 32k"} <= {row["claim"] for row in open_rows}
    assert all("solved" in row and "error_pct" not in row and "error_pp" not in row for row in open_rows)
    fullkv_64k = by_claim["ScoutAttention / FullKV, 64k"]
    assert 1 <= fullkv_64k["solved"]["scout_batch"] <= fullkv_64k["solved"]["scout_batch_max"]


def test_measured_counters_are_explained_row_by_row():
    """(b) names, per row, the counters that differ from the paper's, and says so where a configuration sets a
    baseline's work whatever was measured (InfiniGen's fixed fetch ignores its measured count)."""
    validation = _validation()
    paper = validation.paper_counters()
    measured = validation.Counters("measured", dict(paper.works), {})
    measured.works["scout"] = paper.works["scout"].replace(cpu_budget_frac=0.383, recall_budget_frac=0.053)
    measured.works["infinigen"] = paper.works["infinigen"].replace(fetch_context_frac=0.015)
    for variant in ("scout-pc", "scout-base", "infinigen-dynamic", "infinigen-speedup", "hgca-selected-read"):
        measured.missing[variant] = "not in this test"
        measured.works.pop(variant, None)
    rows_a = validation.claims(validation.Projector(paper))
    rows_b = validation.explained(rows_a, validation.claims(validation.Projector(measured)), paper, measured)
    scaling = next(row for row in rows_b if row["claim"] == "ScoutAttention batch 16 -> 32, 32k")
    assert "cpu_budget_frac 0.383 (paper 0.082)" in scaling["differs_from_paper_counters"]
    assert scaling["change_from_paper_counters"] < 0  # a CPU share 4.7x the paper's: the step turns CPU-bound
    fixed = next(row for row in rows_b if row["claim"].startswith("InfiniGen (fixed fetch: budget - 1) idle"))
    assert fixed["differs_from_paper_counters"] == "infinigen: the same work (its configuration sets it)"
    assert fixed["projected"] == next(row for row in rows_a if row["claim"] == fixed["claim"])["projected"]
