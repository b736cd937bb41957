"""Emulated CUDA (scoutbench/testing/emulated_cuda): every method's CUDA-only branches run on a CPU, against the same
method's CPU path, before any GPU: pinned staging, non_blocking copies, copy streams whose work runs only when it
is waited on, event-gated slot readiness; every host-device sync and every copied byte is recorded.

Each variant (every registered method and ablation at the GPU tests' configuration, plus the branches their
fields switch on) decodes 64 teacher-forced steps of a ragged batch, crossing several block boundaries, with
recalls, HGCA migrations and InfiniGen fetches; its logits must equal the CPU path's at every step."""

from __future__ import annotations

import dataclasses

import gpu_configs
import pytest
import torch
from emulated import ATOL, LENGTHS, run_emulated, teacher_tokens

from scoutbench.methods import build_method

# emulated CUDA runs where no real CUDA device is (it refuses otherwise); tests/emulation/test_gpu.py covers a real one
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present"),
              pytest.mark.usefixtures("one_intra_op_thread")]

STEPS = 64  # decode steps: every sequence crosses four 16-token block boundaries
# every registered method and ablation at the GPU tests' configuration, and the branches their fields switch on
VARIANTS = {name: (name, {}) for name in gpu_configs.ALL_NAMES} | {
    "scout-dense0": ("scout", {"dense_layers": 0}),  # layer 0's CPU part inline, with the true query
    "scout-selected": ("scout", {"device_blocks": "selected"}),
    "scout-beta": ("scout", {"beta_trigger": True, "beta": 0.05}),  # reactive recalls
    "scout-pool2": ("scout", {"pool_factor": 2}),  # a pool of two selections: recall evicts within it
    "hgca-fractions": ("hgca", {"budget": None, "refresh_interval": 4, "migrate_block": 16}),
    "infinigen-dynamic": ("infinigen", {"dynamic_count": True}),  # its one documented sync per sparse layer
    # a count below the cap, varying by layer and step: the device's n and the host's agree
    "infinigen-dynamic-alpha1": ("infinigen", {"dynamic_count": True, "alpha": 1.0}),
}


# for the generation loop (no sync per step), with the attended set fixed by the selection (see that test)
GENERATION_VARIANTS = {"scout-pr-selected": ("scout-pr", {"device_blocks": "selected"}),
                       "scout-base-selected": ("scout-base", {"device_blocks": "selected"})}


def _factory(key: str):
    name, extra = VARIANTS.get(key) or GENERATION_VARIANTS[key]
    args = {**gpu_configs.method_args(name), **extra}
    return name, lambda: build_method(name, args)




@pytest.fixture(scope="module")
def runs(model, prompt):
    """Each variant decoded once on the CPU and once on emulated CUDA (several tests read one run)."""
    cache = {}

    def get(key: str, **options):
        cache_key = (key, tuple(sorted(options.items())))
        if cache_key not in cache:
            _, make = _factory(key)
            cache[cache_key] = run_emulated(model, make, *prompt, STEPS, **options)
        return cache[cache_key]

    return get


# ---------------------------------------------------------------------------------------------- the GPU tests' configurations
@pytest.mark.parametrize("name", gpu_configs.ALL_NAMES)
def test_every_gpu_test_configuration_builds_and_decodes_on_cpu(tiny_qwen3, name):
    """Every method configuration tests/emulation/test_gpu.py uses, built and bound at its shapes (tiny-qwen3 at the ragged
    prompt lengths, bench-attn's footprint at 16k) and decoding a step on the CPU: a configuration a method
    refuses (HGCA at budget 64 did) fails here rather than in the first minutes of a lent GPU."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods.base import ModelShape
    from scoutbench.models import preset_config
    from scoutbench.planning import auto_batch

    method = gpu_configs.build(name)
    engine = DecodeEngine(tiny_qwen3, method)
    try:
        engine.start(len(gpu_configs.PROMPT_LENGTHS), max(gpu_configs.PROMPT_LENGTHS) + gpu_configs.DECODE_STEPS)
        engine.prefill_synthetic(torch.tensor(gpu_configs.PROMPT_LENGTHS))
        logits = engine.decode_step(torch.zeros(len(gpu_configs.PROMPT_LENGTHS), dtype=torch.long))
        assert torch.isfinite(logits).all()
    finally:
        method.close()
    for preset, length in (("tiny-qwen3", 2048 + 6), ("bench-attn", 16384)):
        shape = ModelShape.from_config(preset_config(preset))
        assert method.memory_footprint(shape, length, 2).device_bytes_per_seq > 0
        assert auto_batch(method, shape, length, 2, 2 * 1024**3, 64 * 1024**3, tied_embeddings=True) >= 1


# ---------------------------------------------------------------------------------------------- every variant
@pytest.mark.parametrize("key", list(VARIANTS))
def test_cuda_path_logits_equal_the_cpu_path(runs, key):
    diffs = runs(key).max_diff()
    assert max(diffs) < ATOL, f"{key}: max |logit difference| per step {[f'{d:.1e}' for d in diffs]}"


@pytest.mark.parametrize("key", list(VARIANTS))
def test_decode_loop_has_no_host_device_sync(runs, key):
    """Outside the documented allow-list (tests/emulated.py), nothing in a decode step blocks the host on the
    device: no `.item()`/`.cpu()`/`.tolist()`, no `torch.tensor(host data, device=cuda)`, no blocking or pageable
    copy, no host wait on an event."""
    run = runs(key)
    unexpected = run.unexpected_syncs()
    assert not unexpected, f"{key}: {len(unexpected)} syncs in {STEPS} steps, e.g.\n" + "\n".join(
        map(str, dict.fromkeys(map(str, unexpected))))
    if VARIANTS[key][1].get("dynamic_count"):  # exactly the documented ones: one per sparse layer and step
        assert len(run.syncs) == STEPS * 2
    if key == "scout-dense0":  # layer 0 inline: one wait for its query, at most one for a buffer's reuse
        assert 0 < len(run.syncs) <= 2 * STEPS


@pytest.mark.parametrize("key", list(VARIANTS))
def test_transfer_counters_are_what_the_cuda_path_copies(runs, key):
    """Every method's `h2d_bytes_per_step` / `d2h_bytes_per_step` against the bytes the emulated device saw
    cross the bus (index tensors included)."""
    run = runs(key)
    for direction in ("h2d", "d2h"):
        assert run.cuda_stats[f"{direction}_bytes_per_step"] == pytest.approx(run.transfers[direction]), direction


@pytest.mark.parametrize("key", list(VARIANTS))
def test_attention_backends_are_recorded_per_stage(runs, key):
    """Every call is booked under the stage it ran in: the device part and the dense layers in `attn_device` (or a
    method's own stage inside it), a CPU worker's kernel under `cpu_worker`; the stages add up to the totals. Here
    (no triton interpreted: tests/emulation/test_emulated_triton.py has that path) the dense decode is torch's, as on CUDA
    without triton, and says so."""
    from scoutbench.runtime.offload import CPU_WORKER_STAGE
    from scoutbench.timing import STAGES

    run = runs(key)
    by_stage = run.backends_by_stage
    assert set(by_stage) <= {*STAGES, CPU_WORKER_STAGE}, by_stage
    if run.config.get("dense_layers", 1):  # the dense layers' decode (FullKV: every layer)
        assert by_stage["attn_device"].get("cuda:torch", 0) > 0, by_stage
    totals: dict[str, int] = {}
    for calls in by_stage.values():
        for backend, n in calls.items():
            totals[backend] = totals.get(backend, 0) + n
    assert totals == run.backends
    assert all(key.startswith("cpu:") for key in by_stage.get(CPU_WORKER_STAGE, {})), by_stage


def test_replayed_steps_record_the_backends_per_stage(model, prompt):
    """A CUDA graph's replay books the calls its capture recorded under the stages they were captured in: a
    replayed ScoutAttention run (device region, dense layer, CPU worker) records the eager run's calls per stage."""
    _, make = _factory("scout")
    eager = run_emulated(model, make, *prompt, 8)
    replayed = run_emulated(model, make, *prompt, 8, cuda_graphs=True)
    assert replayed.graphs["replayed_steps"] >= 6
    assert replayed.backends_by_stage == eager.backends_by_stage and len(eager.backends_by_stage) >= 2


@pytest.mark.parametrize("key", ["scout", "scout-pr", "scout-beta"])
def test_recall_bytes_are_what_the_recall_copies(runs, key):
    """2h: ScoutAttention's `recall.bytes` against the K/V bytes its recalls copied to the device (the copy
    stream's only copies of the KV dtype): on CUDA a recall copies the whole used gather buffer and picks the
    recalled blocks on the device, which is more than the recalled blocks (1.46x in a batch-2 check)."""
    run = runs(key)
    copied = sum(n for (direction, stream, dtype), n in run.copied.items()
                 if direction == "h2d" and stream == "side" and dtype == torch.float32)
    recall = run.cuda_stats["recall"]
    assert recall["issued"] > 0 and copied > 0
    assert recall["bytes"] == copied
    block_bytes = 2 * 16 * 32 * 4  # K and V of one block of one KV head, fp32
    assert recall["recalled_bytes"] == recall["blocks"] * block_bytes <= copied
    assert run.cpu_stats["recall"]["bytes"] == run.cpu_stats["recall"]["recalled_bytes"]  # the CPU copies those


@pytest.mark.parametrize("key", ["scout", "scout-pr", "scout-beta", "hgca", "hgca-fractions", "infinigen"])
def test_the_asynchronous_paths_ran(runs, key):
    """The runs really recall, migrate and fetch, on a copy stream whose work ran only when waited on."""
    run, name = runs(key), VARIANTS[key][0].split("-")[0]
    stats = run.cuda_stats
    if name == "scout":
        assert stats["recall"]["issued"] > 0 and stats["recall"]["blocks"] > 0
    elif name == "hgca":
        assert stats["host_tokens_mean"] > run.cpu_stats["host_tokens_mean"] - 1e-9  # identical migrations
        assert run.transfers["d2h"] > 0
    else:
        assert min(stats["tokens_fetched_per_layer"][1:]) > 0
    assert run.side_items > 0


@pytest.mark.parametrize("key", ["scout-pr-selected", "scout-base-selected", "hgca", "infinigen", "quest"])
def test_generation_loop_without_a_sync_per_step(runs, key):
    """As a generation loop runs: no synchronize at the end of each step, only the read of the logits. The copy
    streams' work then runs later still (when the worker or the device waits for it): a recalled slot is still in
    flight at the next step, so a selected block in it is attended on the CPU, and the results hold.

    ScoutAttention compares only where the attended set is the selection, computed with the true query
    (`device_blocks="selected"`, no layer-ahead prediction). By design its results otherwise depend on when a
    recall lands: `device_blocks="resident"` attends every resident block whose copy has landed (a block still in
    flight and not selected is attended by no one), and with layer-ahead prediction a block in flight is attended
    on the CPU with the predicted query. On a GPU without a sync per step that is timing-dependent (the
    throughput runner syncs at each step's end, so its runs are not)."""
    run = runs(key, timed_steps=False)
    diffs = run.max_diff()
    assert max(diffs) < ATOL, f"{key}: {[f'{d:.1e}' for d in diffs]}"
    assert not run.unexpected_syncs()


def test_scout_generation_loop_attends_blocks_in_flight_on_the_cpu(model, prompt):
    """ScoutAttention (layer-ahead) in a generation loop: recalled slots still in flight are never read on the
    device; their blocks go to the CPU (with the predicted query), and no sync or hazard appears."""
    made = []

    def make():
        method = _factory("scout")[1]()
        method.trace = []
        made.append(method)
        return method

    run = run_emulated(model, make, *prompt, 24, timed_steps=False)  # (the trace itself syncs: tests only)
    plans = [r for r in made[-1].trace if r["kind"] == "plan"]
    # selected and resident but not read on the device: its copy was in flight
    in_flight = sum(len((selected & resident) - device)
                    for plan in plans
                    for rows in zip(plan["selected"], plan["device"], plan["resident"], strict=True)
                    for selected, device, resident in zip(*rows, strict=True))
    assert in_flight > 0
    assert max(run.max_diff()) < 1.0  # the predicted query attends those blocks: close, not equal


# ---------------------------------------------------------------------------------------------- missing waits
@pytest.mark.filterwarnings("ignore")  # stale ids make slices and views out of range: that is the point
def test_a_missing_wait_gives_a_wrong_result(model, prompt):
    """The emulated streams defer a copy until it is waited on: ScoutAttention's worker that does not wait for
    the device-to-host copy of its query and block ids reads stale host buffers, and the run fails."""
    from scoutbench.methods import scout
    from scoutbench.runtime.offload import DONE

    name, make = _factory("scout")
    reference = teacher_tokens(model, make(), *prompt, 8)
    original = scout.ScoutAttention._run_cpu

    def without_the_wait(self, plan):
        return original(self, dataclasses.replace(plan, event=DONE))

    scout.ScoutAttention._run_cpu = without_the_wait
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - a wrong result, or a crash on stale indices
            run = run_emulated(model, make, *prompt, 8, reference=reference)
            assert max(run.max_diff()) < ATOL
    finally:
        scout.ScoutAttention._run_cpu = original
    run = run_emulated(model, make, *prompt, 8, reference=reference)  # with the wait: equal
    assert max(run.max_diff()) < ATOL


def test_a_recalled_slot_is_read_only_once_its_copy_event_completed():
    """Event-gated slot readiness (BlockTable): a slot filled by a copy-stream copy is pending until the copy's
    event completed, and the emulated copy does not run before someone waits for it, so reading the slot earlier
    reads the old data; gating on the event is what keeps the device from reading it."""
    from scoutbench.runtime.block_table import BlockTable
    from scoutbench.runtime.offload import CopyStream
    from scoutbench.testing.emulated_cuda import emulated_cuda

    with emulated_cuda():
        pool = torch.zeros(4, 8, device="cuda")
        host_block = torch.arange(8.0).pin_memory()
        table = BlockTable(1, 1, num_slots=4, max_blocks=10, device="cuda")
        copy = CopyStream(torch.device("cuda"))
        event = copy.copy(pool[2], host_block)
        slot, block, row = torch.tensor([2], device="cuda"), torch.tensor([7], device="cuda"), \
            torch.tensor([0], device="cuda")
        table.assign(row, slot, block, event)
        ids, valid = torch.tensor([[[7]]], device="cuda"), torch.tensor([[[True]]], device="cuda")
        table.poll()
        on_device, pending, _ = table.locate(ids, valid)
        assert not bool(on_device.any()) and bool(pending.all())  # gated: the device does not read it yet
        assert bool((pool[2] == 0).all())  # and indeed the copy has not run: reading it would be wrong
        event.synchronize()
        table.poll()
        on_device, pending, _ = table.locate(ids, valid)
        assert bool(on_device.all()) and torch.equal(pool[2].cpu(), torch.arange(8.0))


def test_a_missing_compute_stream_wait_gives_a_wrong_result(model, prompt):
    """HGCA's migration copies the oldest window tokens to host staging on the copy stream, and the compute stream
    waits for that copy (`copied.wait()`) before it shifts the window over them. Without the wait the emulated copy
    runs later, reads the shifted window, and the migrated tokens are wrong."""
    from scoutbench.methods import hgca

    name, make = _factory("hgca")
    reference = teacher_tokens(model, make(), *prompt, STEPS)
    original = hgca.HGCA._migrate

    class NoWait:
        def __init__(self, event):
            self.event = event

        def wait(self, stream=None):  # the removed wait
            pass

        def __getattr__(self, name):
            return getattr(self.event, name)

    def migrate_without_the_wait(self, layer, b):
        copy = self.copy.copy
        self.copy.copy = lambda dst, src, after=None: NoWait(copy(dst, src, after))
        try:
            return original(self, layer, b)
        finally:
            self.copy.copy = copy

    hgca.HGCA._migrate = migrate_without_the_wait
    try:
        run = run_emulated(model, make, *prompt, STEPS, reference=reference)
    finally:
        hgca.HGCA._migrate = original
    method = make()
    prompt_host_tokens = sum(n - method.window_target(n) for n in LENGTHS) / len(LENGTHS)
    assert run.cuda_stats["host_tokens_mean"] > prompt_host_tokens  # it migrated
    assert max(run.max_diff()) > 1e-2


# ---------------------------------------------------------------------------------------------- timing
def test_a_steps_time_includes_its_copy_streams_work(model, prompt):
    """2d: the step's end event must come after every stream's work of the step. Each emulated copy-stream item
    takes 40 ms here, and ScoutAttention recalls at every step and sparse layer; the last layer's recall is
    waited on by nobody before the step ends, so it ran after the end event and the step looked faster than it
    was. The steps' times must cover all the copy-stream work they issued."""
    delay_s = 0.04
    name, _ = _factory("scout-pr")
    make = lambda: build_method(name, {**gpu_configs.method_args(name), "recall_interval": 1})  # noqa: E731
    run = run_emulated(model, make, *prompt, 6, side_item_delay_s=delay_s)
    # a recall is 4 copy-stream items: per K and V the staged blocks' copy and their index_copy into the pool (its
    # indices reach the device on the compute stream, which the copy stream waits for)
    assert run.cuda_stats["recall"]["issued"] >= 6 and run.side_items >= 6 * 4
    assert sum(run.step_ms) >= 0.95 * run.side_items * delay_s * 1e3, (run.step_ms, run.side_items)


# ---------------------------------------------------------------------------------------------- out of memory
def test_batch_auto_retries_cleanly_after_a_failed_host_register():
    """2g: a failed `cudaHostRegister` (the pinned host tier does not fit) leaves CUDA's last error set; unless it is
    cleared, the retry's first kernel launch reports it as a fresh CUDA out-of-memory error, and `--batch auto`
    halves the batch once more than it must. One failed registration: one halving."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.testing.emulated_cuda import emulated_cuda

    args = {**gpu_configs.method_args("scout"), "dense_layers": 1}
    config = ThroughputConfig(method="scout", method_args=args, model="tiny-qwen3", length=256, batch="auto",
                              steps=2, warmup=1, device="cuda", dtype="float32", prefill="synthetic",
                              gpu_mem=2 * 1024**3, host_mem=16 * 1024**2, command=["test"])
    with emulated_cuda() as runtime:
        runtime.fail_host_register = 1
        result = run_throughput(config)
    attempts = result["batch_plan"]["attempts"]
    planned = result["batch_plan"]["planned"]
    assert planned >= 4 and result["device"]["type"] == "cuda"
    assert [(a["batch"], a["status"]) for a in attempts] == [(planned, "oom"), (planned // 2, "ok")], attempts


def test_a_host_register_error_that_is_no_memory_shortage_fails_without_halving():
    """Only cudaErrorMemoryAllocation is out of memory: any other cudaHostRegister error (here memory already
    registered) failed the same way at every batch, yet was reported as "out of memory", so `--batch auto` halved
    the batch for nothing and ran a smaller comparison than planned. It is one error naming the code, and CUDA's
    last error is cleared (the next launch does not fail)."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.errors import ScoutbenchError
    from scoutbench.planning import is_out_of_memory
    from scoutbench.testing.emulated_cuda import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, emulated_cuda

    args = {**gpu_configs.method_args("scout"), "dense_layers": 1}
    config = ThroughputConfig(method="scout", method_args=args, model="tiny-qwen3", length=256, batch="auto",
                              steps=2, warmup=1, device="cuda", dtype="float32", prefill="synthetic",
                              gpu_mem=2 * 1024**3, host_mem=16 * 1024**2, command=["test"])
    with emulated_cuda() as runtime:
        runtime.fail_host_register, runtime.host_register_error = 1, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        with pytest.raises(ScoutbenchError, match="cudaError 712: part or all of the requested memory range is "
                                                  "already mapped.*not a memory shortage") as raised:
            run_throughput(config)
        assert not is_out_of_memory(raised.value) and runtime.fail_host_register == 0
        torch.zeros(1, device="cuda")  # no stale error left for the next launch


def test_a_comparison_takes_fresh_host_memory_once(monkeypatch, capsys, tmp_path):
    """`throughput` with several offloading methods on CUDA (emulated): their host tiers take one kept buffer in
    turn, filled (and registered) once, where each method touched fresh memory of its own (on a VM whose RAM
    grows on demand, 15.8 s per 2 GiB: every offloading method's run was cut while binding)."""
    from cli_runner import run_cli

    from scoutbench.runtime import offload
    from scoutbench.testing.emulated_cuda import emulated_cuda

    fills, arenas = [], []
    fresh, arena_init = offload.fresh_host_buffer, offload.HostArena.__init__
    monkeypatch.setattr(offload, "fresh_host_buffer", lambda n: (fills.append(n), fresh(n))[1])
    monkeypatch.setattr(offload.HostArena, "__init__",
                        lambda self, specs, device: (arena_init(self, specs, device), arenas.append(self.nbytes))[0])
    with emulated_cuda():
        code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "scout", "--method", "hgca",
                                 "--method", "infinigen", "--model", "tiny-qwen3", "--len", "256", "--batch", "2",
                                 "--steps", "1", "--warmup", "0", "--device", "cuda", "--dtype", "fp32", "--budget",
                                 "96", "--block-size", "16", "--dense-layers", "1", "-o", tmp_path, "--json")
    assert code == 0, err
    assert len(arenas) == 3 and len(fills) == 1 and fills[0] >= max(arenas), (arenas, fills)


def test_a_slow_worker_does_not_change_when_a_recall_lands(model, prompt, monkeypatch):
    """The CPU part attends with the predicted query and the device part with the true one, so the step at which a
    recalled block becomes resident changes the output: a recall is issued at a fixed point of the step (after the
    next layer's result, the last layer's at the step's end), never "whenever its staging is done", so a worker
    slowed down after each CPU part (which made the issue point, and the logits, vary from run to run) gives the
    CPU path's logits."""
    import time

    import scoutbench.methods.scout as scout_module

    make = lambda: build_method("scout", {**gpu_configs.method_args("scout"), "recall_interval": 1})  # noqa: E731
    reference = teacher_tokens(model, make(), *prompt, 32)
    attend = scout_module.ScoutAttention._attend_cpu

    def slow_attend(self, plan):
        result = attend(self, plan)
        time.sleep(0.002)
        return result

    monkeypatch.setattr(scout_module.ScoutAttention, "_attend_cpu", slow_attend)
    for _ in range(2):
        run = run_emulated(model, make, *prompt, 32, reference=reference)
        assert run.cuda_stats["recall"]["issued"] > 0
        assert max(run.max_diff()) <= ATOL
