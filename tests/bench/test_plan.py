"""Memory planning (`scoutbench plan`, `--batch auto`, OOM back-off) against hand-computed values.

Qwen3-14B: 40 layers, 8 KV heads, head_dim 128, 40 query heads, hidden 5120, intermediate 17408, vocab 151936,
untied embeddings. In bf16 one token of one layer holds K and V: 2 x 8 x 128 x 2 = 4096 bytes. At 64k tokens
N = 65536 and a 32-token block size gives 2048 blocks, each digest (min and max keys) 4096 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli

from scoutbench.errors import ScoutbenchError
from scoutbench.methods import METHODS
from scoutbench.methods.base import ModelShape
from scoutbench.models import preset_config
from scoutbench.planning import (
    auto_batch,
    plan_method,
    run_with_oom_backoff,
    weights_bytes,
    workspace_bytes_per_seq,
)

GIB = 1024**3
N = 65536
KV = 4096  # bytes per token per layer
QWEN3_14B_WEIGHTS = 2 * (40 * (5120 * 128 * (2 * 40 + 2 * 8) + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128)
                         + 2 * 151936 * 5120 + 5120)  # 14.77e9 parameters x 2 bytes
# 80 GiB - weights - reserve (1 GiB + 10% of 80 GiB) = what the sequences share
FREE_80GIB = 80 * GIB - QWEN3_14B_WEIGHTS - (GIB + 8 * GIB)
# synthetic prefill transient per sequence: K and V [Hkv, N, D] bf16 (RoPE in place) + 256 observation queries
WORKSPACE_64K = 2 * 8 * N * 128 * 2 + 40 * 256 * 128 * 2

ONE_KV = KV // 2  # K (or V) of one token in one layer
# method -> (device bytes, host bytes, prefill transient) per sequence at 64k, defaults of each method
EXPECTED_64K = {
    "fullkv": (40 * N * KV, 0, 0),
    # + digests of the 38 sparse layers
    "quest": (40 * N * KV + 38 * 2048 * KV, 0, 0),
    # 2 dense layers on the device; 38 sparse layers: digests + the region (the default pool of three selections of
    # k_sel = 2048 / 32 - 3 = 61 blocks, + 1 sink and 2 local/tail slots: 186 blocks of 32 tokens) + the block table
    # (int64 per block, int64 + bool per pool slot, per KV head); once: the recall staging (61 blocks of K and V) and
    # the region's open tokens (int64 per slot and KV head). Host: their full KV + two recall staging buffers of 61
    # blocks. Prefill: a 4096-token chunk + 61 blocks of K
    "scout": (2 * N * KV + 38 * (2048 * KV + 186 * 32 * KV + 8 * (2049 * 8 + 184 * 9)) + 61 * 32 * KV + 8 * 186 * 8,
              38 * N * KV + 2 * 61 * 32 * KV, (4096 + 61 * 32) * ONE_KV),
    # partial keys: ceil(0.2 x 128) = 26 dims; + 2 x (2047 fetched tokens + the current one) (budget 2048) in rows of
    # whole 16-token pages (2048), and the 2047 speculated ids of both slots (int64) and their scores (fp32) per KV
    # head; host: + pinned staging of both slots (K, V and an int64 row id per KV head); prefill: fp32 key chunk x 2
    # and 256 observed queries x 3
    "infinigen": (2 * N * KV + 38 * N * 8 * 26 * 2 + 2 * 2048 * KV + 2047 * 8 * (2 * 8 + 4),
                  38 * N * KV + 2 * 2047 * (KV + 8 * 8),
                  4 * 128 * (2 * 4096 * 8 + 3 * 256 * 40)),
    # 2 dense layers on the device; 38 sparse layers: a window of 1024 tokens (budget 2048 x window_share 0.5) + one
    # 32-token migration block on the device; on the host the rest + fp32 moving averages per query head and
    # migration staging (32 tokens), and the kept selection (budget - window + a migration block = 1056 entries: token
    # ids per KV head, averages per query head); the CPU part reads the host tier in place (no gather buffers)
    "hgca": (2 * N * KV + 38 * (1024 + 32) * KV,
             38 * (N - 1024) * KV + 38 * 40 * (N - 1024) * 4 + 38 * 32 * KV + 38 * 1056 * (8 * 8 + 40 * 4), 0),
}


@pytest.fixture(scope="module")
def qwen3_14b():
    return ModelShape.from_config(preset_config("qwen3-14b"))




def test_weights_match_the_built_model(tiny_qwen3, qwen3_14b):
    """Every parameter is counted: exact against a built Qwen3 (tied embeddings), and Qwen3-14B is 14.77e9."""
    shape = ModelShape.from_config(tiny_qwen3.config)
    assert weights_bytes(shape, 4, tied_embeddings=True) == 4 * sum(p.numel() for p in tiny_qwen3.parameters())
    assert weights_bytes(qwen3_14b, 2) == QWEN3_14B_WEIGHTS == 2 * 14_768_307_200


@pytest.mark.parametrize("method", list(EXPECTED_64K))
def test_plan_json_matches_hand_computed_values(monkeypatch, capsys, method):
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem",
                             "80GiB", "--method", method, "--json")
    assert code == 0, err
    [row] = json.loads(out)
    device, host, prefill = EXPECTED_64K[method]
    assert row["method"] == method
    assert row["device_bytes_per_seq"] == device
    assert row["host_bytes_per_seq"] == host
    assert row["workspace_bytes_per_seq"] == WORKSPACE_64K + prefill
    assert row["max_batch"] == FREE_80GIB // (device + WORKSPACE_64K + prefill)


def test_plan_paper_scale_batches(monkeypatch, capsys):
    """The numbers behind Figure 8's comparison: FullKV fits 4 sequences of 64k in 80 GiB, ScoutAttention 22 with
    its default pool of three selections, 31 with a pool of one (the paper says 32; counting its block tables, recall
    staging and prefill chunk costs the 32nd)."""
    args = ("plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem", "80GiB", "--json")
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--method", "fullkv", "--method", "scout")
    assert code == 0
    assert {row["method"]: row["max_batch"] for row in json.loads(out)} == {"fullkv": 4, "scout": 22}
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--method", "scout", "--method-arg", "pool_factor=1")
    assert code == 0
    assert {row["method"]: row["max_batch"] for row in json.loads(out)} == {"scout": 31}
    code, out, _ = run_cli(monkeypatch, capsys, *args[:-1], "--method", "scout", "--method-arg", "pool_factor=1")
    assert code == 0 and "settings: scout pool 1 (the paper's)" in " ".join(out.split())  # what each row plans


def test_plan_budget_and_block_size_change_scout(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--gpu-mem", "80GiB",
                           "--method", "scout", "--budget", "4k", "--block-size", "64", "--json")
    assert code == 0
    # 1024 blocks of 64 tokens; k_sel = 61 blocks of 64, a pool of three selections: 186 region slots of 64 tokens
    assert json.loads(out)[0]["device_bytes_per_seq"] == (
        2 * N * KV + 38 * (1024 * KV + 186 * 64 * KV + 8 * (1025 * 8 + 184 * 9)) + 61 * 64 * KV + 8 * 186 * 8)


def _fullkv_plan(shape, context_len, gpu_mem, host_mem=None):
    return plan_method(METHODS.load("fullkv")(), shape, context_len, 2, gpu_mem, host_mem)


def test_max_batch_grows_with_memory_and_shrinks_with_length(qwen3_14b):
    by_memory = [_fullkv_plan(qwen3_14b, N, gib * GIB).max_batch for gib in (40, 80, 141, 320, 640)]
    assert by_memory == sorted(by_memory) and by_memory[0] < by_memory[-1]
    by_length = [_fullkv_plan(qwen3_14b, length, 80 * GIB).max_batch for length in (4096, 8192, 32768, 65536, 131072)]
    assert by_length == sorted(by_length, reverse=True) and by_length[0] > by_length[-1]


def test_host_memory_caps_offloading_methods(qwen3_14b):
    scout = METHODS.load("scout")()
    unlimited = plan_method(scout, qwen3_14b, N, 2, 80 * GIB)
    capped = plan_method(scout, qwen3_14b, N, 2, 80 * GIB, host_mem_bytes=128 * GIB)
    # 80% of 128 GiB over the host arena of one sequence
    assert capped.max_batch == int(128 * GIB * 0.8) // EXPECTED_64K["scout"][1] < unlimited.max_batch
    assert capped.limited_by == "host" and unlimited.limited_by == "device"
    # FullKV keeps nothing on the host: the host cap never binds
    assert _fullkv_plan(qwen3_14b, N, 80 * GIB, host_mem=1 * GIB).max_batch == 4


def test_weights_that_do_not_fit(qwen3_14b):
    plan = _fullkv_plan(qwen3_14b, N, 24 * GIB)
    assert plan.max_batch == 0 and plan.limited_by == "weights"
    with pytest.raises(ScoutbenchError, match="weights"):
        auto_batch(METHODS.load("fullkv")(), qwen3_14b, N, 2, 24 * GIB, host_mem_bytes=None)


def test_auto_batch_is_the_plan(qwen3_14b):
    fullkv = METHODS.load("fullkv")()
    assert auto_batch(fullkv, qwen3_14b, 8192, 2, 141 * GIB) == _fullkv_plan(qwen3_14b, 8192, 141 * GIB).max_batch
    assert workspace_bytes_per_seq(qwen3_14b, 8192, 2) > 0


@pytest.mark.parametrize("args,message", [
    (("--gpu-mem", "80XB"), "bad memory size"),
    (("--gpu-mem", "0GiB"), "more than 0"),
    (("--gpu-mem", "80GiB", "--method", "nosuch"), "unknown method"),
    (("--gpu-mem", "80GiB", "--len", "64q"), "bad --len"),
])
def test_plan_bad_input_is_one_line_exit_2(monkeypatch, capsys, args, message):
    argv = ["plan", "--model", "qwen3-14b", *(() if "--len" in args else ("--len", "64k")), *args]  # one --len
    code, out, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ""


def test_plan_requires_gpu_mem_without_cuda(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: --gpu-mem defaults to its free memory")
    code, _, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "64k", "--method", "fullkv")
    assert code == 2 and "--gpu-mem is required" in err and len(err.strip().splitlines()) == 1


def test_plan_unknown_model_is_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not a built-in, not a folder, not in the cache
    code, _, err = run_cli(monkeypatch, capsys, "plan", "--model", "no-such-model", "--len", "8k", "--gpu-mem", "80GiB",
                           "--method", "fullkv")
    assert code == 2 and "not a built-in name" in err


def test_oom_backoff_halves_until_it_fits():
    calls = []

    def run(batch):
        calls.append(batch)
        if batch > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ran {batch}"

    result, attempts = run_with_oom_backoff(run, 16)
    assert result == "ran 2" and calls == [16, 8, 4, 2]
    assert [(a["batch"], a["status"]) for a in attempts] == [(16, "oom"), (8, "oom"), (4, "oom"), (2, "ok")]
    assert attempts[0]["error"].startswith("CUDA out of memory")


def test_oom_backoff_gives_up_at_batch_1_and_passes_other_errors():
    def always_oom(batch):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(ScoutbenchError, match="even at batch 1"):
        run_with_oom_backoff(always_oom, 4)

    def broken(batch):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError):
        run_with_oom_backoff(broken, 4)


def test_batch_auto_runs_the_planned_batch(tiny_qwen3):
    """`throughput --batch auto` on CPU: the run's batch is the plan's and the result records the plan."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.models import LoadedModel

    gpu_mem = int(1.2 * GIB)  # 1 GiB + 10% is the reserve: a few dozen tiny sequences remain
    planned = plan_method(METHODS.load("fullkv")(), ModelShape.from_config(tiny_qwen3.config), 256 + 3, 4, gpu_mem,
                          tied_embeddings=True).max_batch
    config = ThroughputConfig(method="fullkv", model="tiny-qwen3", length=256, batch="auto", gpu_mem=gpu_mem,
                              steps=2, warmup=1, device="cpu", dtype="float32", prefill="synthetic")
    result = run_throughput(config, LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
    assert 1 < planned == result["workload"]["batch"]
    assert result["batch_plan"]["planned"] == planned
    assert result["batch_plan"]["attempts"] == [{"batch": planned, "status": "ok", "error": None}]


def test_arena_layout_is_exact_and_aligned():
    from scoutbench.runtime.offload import ARENA_ALIGN_BYTES, HostArena, arena_layout

    specs = {"a": ((3, 5), torch.bfloat16), "b": ((7,), torch.float32), "c": ((2, 0, 4), torch.bfloat16),
             "d": ((9,), torch.int64)}
    offsets, total = arena_layout(specs)
    assert offsets == {"a": 0, "b": ARENA_ALIGN_BYTES, "c": 2 * ARENA_ALIGN_BYTES, "d": 2 * ARENA_ALIGN_BYTES}
    assert total == 2 * ARENA_ALIGN_BYTES + 9 * 8
    arena = HostArena(specs, torch.device("cpu"))
    assert arena.nbytes == total and not arena.pinned
    assert all(arena[key].shape == shape and arena[key].dtype == dtype for key, (shape, dtype) in specs.items())
    arena["b"].fill_(1.0)
    arena["d"].fill_(-1)
    assert torch.equal(arena["a"], torch.zeros(3, 5, dtype=torch.bfloat16))  # zeroed, and no overlap
    assert all(arena[key].untyped_storage().data_ptr() == arena.buffer.data_ptr() for key in specs)


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(encoding="utf-8")
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text(encoding="utf-8").splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_huge_page_advice_covers_the_aligned_interior_and_backs_the_arena():
    """huge_page_backing advises exactly the 2 MiB-aligned interior (nothing under 2 MiB), and a host arena big
    enough is backed by huge pages where Linux allows them, even on memory the allocator recycles (already faulted
    in as small pages), its tensors still zeroed views of one buffer."""
    from scoutbench.runtime.offload import HUGE_PAGE_BYTES, HostArena, huge_page_backing

    assert huge_page_backing(torch.empty(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)) == 0
    if _thp_mode() in (None, "never"):
        pytest.skip("this kernel has no transparent huge pages")
    touched = torch.ones(5 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)  # faulted in as small pages
    start = -(-touched.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (touched.data_ptr() + touched.numel()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    assert huge_page_backing(touched) == end - start >= 4 * HUGE_PAGE_BYTES
    touched.fill_(7)
    assert _huge_bytes_at(start + HUGE_PAGE_BYTES) > 0 and bool((touched == 7).all())
    arena = HostArena({"k": ((8, HUGE_PAGE_BYTES // 4), torch.float32), "v": ((3,), torch.bfloat16)},
                      torch.device("cpu"))
    assert arena.huge_page_bytes >= 6 * HUGE_PAGE_BYTES and not arena.pinned
    assert torch.count_nonzero(arena["k"]) == 0 and torch.count_nonzero(arena["v"]) == 0
    assert _huge_bytes_at(arena.buffer.data_ptr() + arena.nbytes // 2) > 0


# (method, --method-arg) at a small shape; ScoutAttention's budget (3 selectable blocks) and InfiniGen's fetch are
# small because their CUDA-only pinned staging is in the plan but not in a CPU arena
ARENA_METHODS = [("scout", {"budget": 96, "block_size": 16, "dense_layers": 1}),
                 ("hgca", {}), ("hgca", {"budget": None, "refresh_interval": 4, "dense_layers": 1}),
                 ("infinigen", {"budget": 17, "dense_layers": 1})]


@pytest.mark.parametrize("name,args", ARENA_METHODS)
def test_planned_host_bytes_are_what_bind_allocates(tiny_qwen3, name, args):
    """The host tier is one arena per method; the planner's host bytes per sequence equal it within 2%."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods import build_method

    method = build_method(name, args)
    engine = DecodeEngine(tiny_qwen3, method)
    batch, max_len = 3, 2000
    engine.start(batch, max_len)
    try:
        planned = method.memory_footprint(ModelShape.from_config(tiny_qwen3.config), max_len, 4).host_bytes_per_seq
        allocated = method.host_arena.nbytes / batch
        assert planned == pytest.approx(allocated, rel=0.02)
    finally:
        method.close()


def test_oom_retry_releases_the_failed_runs_host_arena_first(tiny_qwen3, monkeypatch):
    """`--batch auto`: an out-of-memory attempt unpins its host arena (method.close) before the next one binds."""
    from scoutbench.bench.throughput import ThroughputConfig, run_throughput
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.models import LoadedModel
    from scoutbench.runtime.offload import HostArena

    events = []
    original_init, original_release, original_step = HostArena.__init__, HostArena.release, DecodeEngine.decode_step

    def init(self, specs, device):
        original_init(self, specs, device)
        events.append(("arena", id(self)))

    def release(self):
        events.append(("release", id(self)))
        original_release(self)

    def decode_step(self, tokens):
        if tokens.shape[0] > 30:
            events.append(("oom", tokens.shape[0]))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return original_step(self, tokens)

    monkeypatch.setattr(HostArena, "__init__", init)
    monkeypatch.setattr(HostArena, "release", release)
    monkeypatch.setattr(DecodeEngine, "decode_step", decode_step)
    config = ThroughputConfig(method="scout", method_args={"budget": 64, "block_size": 16, "dense_layers": 1},
                              model="tiny-qwen3", length=256, batch="auto", gpu_mem=int(1.2 * GIB), host_mem=GIB,
                              steps=2, warmup=1, device="cpu", dtype="float32", prefill="synthetic")
    result = run_throughput(config, LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
    attempts = result["batch_plan"]["attempts"]
    assert [(a["batch"], a["status"]) for a in attempts] == [(83, "oom"), (41, "oom"), (20, "ok")]  # 83: the plan
    kinds = [kind for kind, _ in events]
    attempt_start = 0
    for index, kind in enumerate(kinds):
        if kind == "oom":  # one of the failed run's arenas (its host tier) is released before the next is allocated
            allocated = {arena for event, arena in events[attempt_start:index] if event == "arena"}
            assert kinds[index + 1] == "release" and events[index + 1][1] in allocated
            attempt_start = index + 1


def test_prefill_transients_are_chunked(tiny_qwen3, monkeypatch):
    """The methods' prompt-sized temporaries come in chunks of PREFILL_CHUNK_TOKENS: with the chunk shrunk to 64
    tokens, ingesting a 1000-token prompt gives the same state as one piece (InfiniGen's channels and host tier,
    scout's host tier and digests)."""
    import scoutbench.runtime.block_store as block_store
    import scoutbench.runtime.digest_table as digest_table
    import scoutbench.runtime.offload as offload
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.methods import build_method

    def ingest(chunk):  # where the chunk is read: the runtime's token_chunks, scout's host tier and its digests
        for module in (offload, block_store, digest_table):
            monkeypatch.setattr(module, "PREFILL_CHUNK_TOKENS", chunk)
        state = []
        for name, args in (("infinigen", {"dense_layers": 1}),
                           ("scout", {"budget": 128, "block_size": 16, "dense_layers": 1})):
            method = build_method(name, args)
            engine = DecodeEngine(tiny_qwen3, method)
            engine.start(2, 1100)
            engine.prefill_synthetic(torch.tensor([1000, 937]))
            if name == "infinigen":
                state += [method.partial_proj[i] for i in method.sparse_layers]
                state += [method.host_k[i].clone() for i in method.sparse_layers]
            else:
                state += [method.store.host_k[i].clone() for i in method.store.host_k]
                state += [method.store.digests.center2[i].clone() for i in method.store.host_k]
            method.close()
        return state

    chunked, whole = ingest(64), ingest(100_000)
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_decode_instance_plans_the_decode_activations_alone(qwen3_14b, monkeypatch, capsys):
    """A decode instance of prefill-decode disaggregation never holds a prefill transient: its workspace per sequence
    is the decode activations (their hand count below), so more sequences fit; `plan --decode-instance` says so."""
    from scoutbench.planning import decode_workspace_bytes_per_seq

    scout = METHODS.load("scout")(budget=2048, block_size=32, dense_layers=0, pool_factor=1.0)
    colocated = plan_method(scout, qwen3_14b, 32768, 2, 81920 * 2**20)
    decode = plan_method(scout, qwen3_14b, 32768, 2, 81920 * 2**20, decode_instance=True)
    # fp32 logits, bf16 activations (4 hidden vectors, q/k/v and attention output heads, 3 MLP intermediates),
    # fp32 scores and probabilities over every key of each query head, two fp32 partial states + their LSEs
    by_hand = (151936 * 4 + 2 * (4 * 5120 + 2 * 40 * 128 + 2 * 8 * 128 + 3 * 17408) + 2 * 40 * 32768 * 4
               + 2 * (40 * 128 + 40) * 4)
    assert decode.workspace_bytes_per_seq == decode_workspace_bytes_per_seq(qwen3_14b, 32768, 2) == by_hand
    assert colocated.workspace_bytes_per_seq > decode.workspace_bytes_per_seq and decode.decode_instance
    assert decode.max_batch > colocated.max_batch
    args = ("plan", "--model", "qwen3-14b", "--len", "32k", "--gpu-mem", "81920MiB", "--method", "scout", "--budget",
            "2k", "--block-size", "32", "--dense-layers", "0", "--method-arg", "pool_factor=1", "--json")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--decode-instance")
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["decode_instance"] is True and row["max_batch"] == decode.max_batch
    code, out, _ = run_cli(monkeypatch, capsys, *args[:-1], "--decode-instance")
    assert code == 0 and "decode instance" in out


def test_the_papers_batch_64_at_32k_fits_its_decode_instance(monkeypatch, capsys):
    """The paper's largest stated point (ScoutAttention at batch 64, 32k, Qwen3-14B, budget 2048, block 32) on its
    80 GB card as the card reports it, with one selection in the pool, no dense layers, as a decode instance."""
    from scoutbench.analysis.hardware import load_hardware

    memory = int(load_hardware("paper").values["device.memory_bytes"])
    code, out, err = run_cli(monkeypatch, capsys, "plan", "--model", "qwen3-14b", "--len", "32k", "--gpu-mem",
                             f"{memory}B", "--method", "scout", "--budget", "2k", "--block-size", "32",
                             "--dense-layers", "0", "--method-arg", "pool_factor=1", "--decode-instance", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["max_batch"] >= 64
