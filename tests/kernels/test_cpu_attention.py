"""The CPU attention kernel (scoutbench/kernels/csrc/attention*.cpp) and its torch fallback against an fp64
reference: dense and index-driven (selected blocks read in place), bf16 and fp32, GQA groups, head dims, ragged and
empty rows, LSE, probabilities; exact mergeability with `merge_states`; the build-failure and forced fallbacks."""

import os
import platform
import re
import select
import shutil
import signal
import subprocess
import threading
import warnings

import pytest
import torch
from kernel_inputs import native_paths

from scoutbench.errors import UsageError
from scoutbench.kernels import backends, cpu_attention
from scoutbench.kernels.attention import (
    block_sparse_attention,
    block_sparse_attention_probs,
    decode_attention,
    partial_attention,
    partial_attention_probs,
)
from scoutbench.kernels.partial_state import merge_states

# the parity tests: the compiled kernel on every vector path this CPU runs, and torch's kernels
EVERY_PATH = pytest.mark.parametrize("cpu_backend", [*native_paths(), "torch"], indirect=True)

# fp32 rounding: the kernel accumulates in fp32 in another order than the fp64 reference. torch's own bf16 path
# rounds its output to bf16, hence the fallback's wider bf16 tolerance.
ATOL = {("native", torch.float32): 2e-5, ("native", torch.bfloat16): 2e-5,
        ("torch", torch.float32): 2e-5, ("torch", torch.bfloat16): 2e-2}


def _reference(q, keys, values, scale, lengths):
    """fp64 attention of q `[B, H*G, D]` over keys/values `[B, H, N, D]`, row (b, h) valid up to lengths[b, h]."""
    batch, rows, num_keys, dim = keys.shape
    group = q.shape[1] // rows
    q4 = q.double().view(batch, rows, group, dim)
    logits = q4 @ keys.double().transpose(-1, -2) * scale
    hidden = torch.arange(num_keys)[None, None, :] >= lengths.view(batch, rows, 1)
    logits = logits.masked_fill(hidden[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = probs @ values.double()
    return out.reshape(batch, rows * group, dim), lse.reshape(batch, rows * group), probs.reshape(batch, rows * group, -1)


def _inputs(batch, kv_heads, group, num_keys, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, dim, generator=g).to(dtype)
    k = (torch.randn(batch, kv_heads, num_keys, dim, generator=g) * 2).to(dtype)
    v = torch.randn(batch, kv_heads, num_keys, dim, generator=g).to(dtype)
    lengths = torch.randint(1, num_keys + 1, (batch, kv_heads), generator=g)
    lengths[0, 0] = 0  # an empty row
    lengths[-1, -1] = num_keys
    return q, k, v, lengths


def _check(state_o, state_lse, ref, backend, dtype):
    ref_o, ref_lse = ref[0], ref[1]
    atol = ATOL[backend, dtype]
    assert not torch.isnan(state_o).any() and not torch.isnan(state_lse).any()
    assert torch.equal(torch.isneginf(state_lse), torch.isneginf(ref_lse))  # empty rows: lse -inf, o 0
    assert (state_o[torch.isneginf(state_lse)] == 0).all()
    torch.testing.assert_close(state_o.double(), ref_o, atol=atol, rtol=0)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(state_lse.double()[finite], ref_lse[finite], atol=atol, rtol=0)


@EVERY_PATH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_dense_partial_attention_matches_fp64(cpu_backend, dtype, group, dim):
    """Ragged valid lengths (one row empty), every GQA group and head dim: output and natural-log LSE."""
    q, k, v, lengths = _inputs(2, 3, group, 333, dim, dtype, seed=group * 7 + dim)
    state = partial_attention(q, k, v, 0.09, lengths)
    _check(state.o, state.lse, _reference(q, k, v, 0.09, lengths), cpu_backend, dtype)
    dense = decode_attention(q, k, v, 0.09)  # every key valid, output in q's dtype
    ref = _reference(q, k, v, 0.09, torch.full((2, 3), 333))[0]
    torch.testing.assert_close(dense.double(), ref, atol=ATOL[cpu_backend, dtype] + (8e-3 if dtype == torch.bfloat16
                                                                                      else 0), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_portable_head_dim(cpu_backend, dtype):
    """A head_dim outside the vectorised kernel's set (80) runs the kernel's portable loop."""
    q, k, v, lengths = _inputs(1, 2, 4, 100, 80, dtype, seed=3)
    state = partial_attention(q, k, v, 0.11, lengths[:, :] .clamp(min=1))
    _check(state.o, state.lse, _reference(q, k, v, 0.11, lengths.clamp(min=1)), cpu_backend, dtype)


@EVERY_PATH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("group", [3, 7])
def test_softmax_steps_and_uneven_pv_query_blocks(cpu_backend, dtype, dim, group):
    """Rows ending just before, on and after the kernel's 32-token softmax step (and 4 steps and 2 tokens, the
    prefetch cursor stopping short of the row's end), at the head dims and GQA groups whose PV passes split the
    queries unevenly (4 queries a pass at D=64; 2 at D=256, over two column passes)."""
    q, k, v, _ = _inputs(1, 4, group, 130, dim, dtype, seed=dim + group)
    lengths = torch.tensor([[31, 32, 33, 130]])
    state = partial_attention(q, k, v, 0.07, lengths)
    _check(state.o, state.lse, _reference(q, k, v, 0.07, lengths), cpu_backend, dtype)


@EVERY_PATH
@pytest.mark.parametrize("threads", [1, 2])
def test_long_rows_split_over_chunks_merge_exactly(cpu_backend, threads):
    """Rows long enough to be split into chunks (flash-decoding split-K) merged by LSE, one or two threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, lengths = _inputs(2, 2, 4, 5000, 128, torch.float32, seed=11)
        state = partial_attention(q, k, v, 0.08, lengths)
    finally:
        torch.set_num_threads(previous)
    _check(state.o, state.lse, _reference(q, k, v, 0.08, lengths), cpu_backend, torch.float32)


def _scout_tier(batch, kv_heads, num_blocks, block, dim, dtype, g):
    """A block-major host tier (ScoutAttention's layout): row j * B * Hkv + b * Hkv + h, viewed as
    `[B, Hkv, num_blocks, block, D]`, and the same data head-major `[B, Hkv, num_blocks * block, D]`."""
    tier = torch.randn(num_blocks * batch * kv_heads, block, dim, generator=g).to(dtype)
    blocks = tier.view(num_blocks, batch, kv_heads, block, dim).permute(1, 2, 0, 3, 4)
    return blocks, blocks.reshape(batch, kv_heads, num_blocks * block, dim)


@EVERY_PATH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 5])
def test_block_sparse_reads_selected_blocks_in_place(cpu_backend, dtype, group):
    """Selected blocks of a block-major tier, ids padded past each row's valid blocks with garbage (never read),
    a partial last block, an empty row: equal to attention over the same tokens gathered."""
    g = torch.Generator().manual_seed(group)
    batch, kv_heads, num_blocks, block, dim, width = 2, 3, 40, 16, 128, 9
    k_blocks, k_flat = _scout_tier(batch, kv_heads, num_blocks, block, dim, dtype, g)
    v_blocks, v_flat = _scout_tier(batch, kv_heads, num_blocks, block, dim, dtype, g)
    q = torch.randn(batch, kv_heads * group, dim, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch * kv_heads)])
    ids = ids.view(batch, kv_heads, width)
    lengths = torch.tensor([[0, 5 * block + 3, width * block], [block, 2 * block - 1, 7 * block]])
    used = (lengths + block - 1) // block
    padded = ids.masked_fill(torch.arange(width) >= used[..., None], num_blocks + 1000)  # out of range: unread
    state = block_sparse_attention(q, k_blocks, v_blocks, padded, 0.1, lengths)
    token_ids = (ids[..., None] * block + torch.arange(block)).reshape(batch, kv_heads, -1)
    gathered = [x.gather(2, token_ids[..., None].expand(-1, -1, -1, dim)) for x in (k_flat, v_flat)]
    _check(state.o, state.lse, _reference(q, *gathered, 0.1, lengths), cpu_backend, dtype)


@EVERY_PATH
@pytest.mark.parametrize("per_query_head", [False, True], ids=["per-kv-head", "per-query-head"])
def test_token_ids_with_probabilities(cpu_backend, per_query_head):
    """HGCA's form: token ids (blocks of one token) into a head-major tier, one selection per KV head (the group
    packed) or per query head; the probabilities are the softmax within the part, 0 past the valid tokens."""
    g = torch.Generator().manual_seed(5)
    batch, kv_heads, group, num_keys, dim, take = 2, 2, 4, 300, 64, 50
    k = torch.randn(batch, kv_heads, num_keys, dim, generator=g)
    v = torch.randn(batch, kv_heads, num_keys, dim, generator=g)
    q = torch.randn(batch, kv_heads * group, dim, generator=g)
    rows = kv_heads * group if per_query_head else kv_heads
    ids = torch.stack([torch.randperm(num_keys, generator=g)[:take] for _ in range(batch * rows)]).view(batch, rows, take)
    valid = torch.tensor([take, 31])
    state, probs = block_sparse_attention_probs(q, k.unsqueeze(3), v.unsqueeze(3), ids, 0.125, valid)
    kv_of_row = torch.arange(rows) // (rows // kv_heads)
    gathered = [x[:, kv_of_row].gather(2, ids[..., None].expand(-1, -1, -1, dim)) for x in (k, v)]
    ref = _reference(q, *gathered, 0.125, valid[:, None].expand(batch, rows))
    _check(state.o, state.lse, ref, cpu_backend, torch.float32)
    torch.testing.assert_close(probs.double(), ref[2], atol=1e-6, rtol=0)


@EVERY_PATH
def test_dense_probabilities(cpu_backend):
    q, k, v, lengths = _inputs(2, 2, 4, 77, 64, torch.float32, seed=8)
    state, probs = partial_attention_probs(q, k, v, 0.2, lengths)
    ref = _reference(q, k, v, 0.2, lengths)
    _check(state.o, state.lse, ref, cpu_backend, torch.float32)
    torch.testing.assert_close(probs.double(), ref[2], atol=1e-6, rtol=0)


@EVERY_PATH
def test_sparse_part_merges_with_the_rest_into_full_attention(cpu_backend):
    """A block-sparse part and a dense part over the remaining tokens merge (merge_states) into full attention."""
    g = torch.Generator().manual_seed(2)
    batch, kv_heads, group, num_blocks, block, dim = 1, 2, 4, 12, 8, 64
    k = torch.randn(batch, kv_heads, num_blocks * block, dim, generator=g)
    v = torch.randn(batch, kv_heads, num_blocks * block, dim, generator=g)
    q = torch.randn(batch, kv_heads * group, dim, generator=g)
    selected = torch.tensor([[[3, 7, 1], [3, 7, 1]]])  # the same blocks for both heads: the rest is one slice
    blocked = (batch, kv_heads, num_blocks, block, dim)
    sparse = block_sparse_attention(q, k.view(blocked), v.view(blocked), selected, 0.15)
    rest_ids = torch.tensor([j for j in range(num_blocks) if j not in (1, 3, 7)])
    rest_tokens = (rest_ids[:, None] * block + torch.arange(block)).reshape(-1)
    rest = partial_attention(q, k[:, :, rest_tokens], v[:, :, rest_tokens], 0.15)
    merged = merge_states(sparse, rest)
    full = partial_attention(q, k, v, 0.15)
    torch.testing.assert_close(merged.o, full.o, atol=2e-6, rtol=0)
    torch.testing.assert_close(merged.lse, full.lse, atol=2e-6, rtol=0)


@EVERY_PATH
def test_concurrent_callers_get_their_own_results(cpu_backend):
    """ScoutAttention's worker calls the kernels while the main thread does. Concurrent callers share the pool
    (each runs its own items, then helps the other's), and more callers than it has job slots run alone: six
    threads of attention and decode linears at once all get their own right results."""
    from scoutbench.kernels import cpu_decode

    q, k, v, lengths = _inputs(2, 4, 4, 3000, 128, torch.bfloat16, seed=21)
    ref = _reference(q, k, v, 0.1, lengths)
    g = torch.Generator().manual_seed(22)
    x, weight = torch.randn(2, 1, 256, generator=g), torch.randn(3000, 256, generator=g)
    linear_ref = (x.double() @ weight.double().T).float()
    errors: list[tuple[str, float]] = []

    def attention_calls() -> None:
        for _ in range(5):
            state = partial_attention(q, k, v, 0.1, lengths)
            errors.append(("attention", float((state.o.double() - ref[0]).abs().max())))

    def linear_calls() -> None:
        for _ in range(20):
            errors.append(("linear", float((cpu_decode.linear(x, weight) - linear_ref).abs().max())))

    threads = [threading.Thread(target=attention_calls if i % 2 else linear_calls) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3 * 5 + 3 * 20
    assert max(e for kind, e in errors if kind == "attention") < ATOL[cpu_backend, torch.bfloat16]
    assert max(e for kind, e in errors if kind == "linear") < 1e-3  # fp32 sums of 256 products, another order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 300])  # on the caller alone, and across the pool (300 rows of 4 KiB or 8 KiB)
def test_copy_rows_equals_index_copy(cpu_backend, dtype, rows):
    """A recall's one-pass row copy (host tier rows into pool slots, K and V with the same ids) writes exactly what
    `index_copy_` of an `index_select` writes, rows in any order, and nothing else; an id out of range raises
    before any copy of either pair."""
    g = torch.Generator().manual_seed(31)
    srcs = [torch.randn(4 * rows, 1024, generator=g).to(dtype) for _ in range(2)]
    dsts = [torch.randn(2 * rows, 1024, generator=g).to(dtype) for _ in range(2)]
    src_rows = torch.randperm(4 * rows, generator=g)[:rows]
    dst_rows = torch.randperm(2 * rows, generator=g)[:rows]
    pairs = ((dsts[0], srcs[0]), (dsts[1], srcs[1]))
    expected = [d.clone().index_copy_(0, dst_rows, s.index_select(0, src_rows)) for d, s in pairs]
    cpu_attention.copy_rows(pairs, dst_rows, src_rows)
    assert torch.equal(dsts[0], expected[0]) and torch.equal(dsts[1], expected[1])
    before = [d.clone() for d in dsts]
    with pytest.raises(IndexError):
        cpu_attention.copy_rows(pairs, dst_rows, torch.cat([src_rows[:-1], torch.tensor([4 * rows])]))
    assert torch.equal(dsts[0], before[0]) and torch.equal(dsts[1], before[1])


@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)
@pytest.mark.parametrize("setting,expected", [(None, 1000), ("0", 0), ("250", 250)])
def test_helper_spin_follows_the_environment(cpu_backend, setting, expected):
    """SCOUTBENCH_KERNEL_SPIN_US sets how long the pool's helpers stay awake after a job (0: they sleep at once,
    which ab_kernel_builds.py --calls uses); the kernel reads it once, results record it, and calls are right either
    way."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SCOUTBENCH_KERNEL_SPIN_US"}
    if setting is not None:
        env["SCOUTBENCH_KERNEL_SPIN_US"] = setting
    code = ("import torch; from scoutbench.kernels import cpu_attention; from scoutbench.kernels.attention import "
            "partial_attention; from scoutbench.results import env_info; "
            "q, k, v = torch.randn(1, 8, 64), torch.randn(1, 2, 5000, 64), torch.randn(1, 2, 5000, 64); "
            "ref = torch.softmax(q.view(1, 2, 4, 64) @ k.transpose(-1, -2) * 0.1, -1) @ v; "
            "err = float((partial_attention(q, k, v, 0.1).o - ref.reshape(1, 8, 64)).abs().max()); "
            "print(cpu_attention.helper_spin_us(), env_info()['kernel_helper_spin_us'], err < 1e-4)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(expected), str(expected), "True"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("cpu_backend", ["native"], indirect=True)  # torch's OpenMP pool is not fork-safe
def test_kernel_works_in_a_forked_child(cpu_backend):
    """A child forked after the pool's threads started (a DataLoader or multiprocessing worker) has none of them:
    the pool forgets them at fork, and the child's calls start their own."""
    q, k, v, lengths = _inputs(1, 4, 4, 3000, 64, torch.float32, seed=23)
    before = partial_attention(q, k, v, 0.1, lengths)  # the parent's pool threads exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether its result equals the parent's, then leave without cleanup
        try:
            after = partial_attention(q, k, v, 0.1, lengths)
            os.write(write, b"1" if torch.equal(after.o, before.o) and torch.equal(after.lse, before.lse) else b"0")
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    if not ready:  # a hung child: do not hang the suite with it
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read() if ready else b"timeout"
    os.waitpid(pid, 0)
    assert answer == b"1"


def test_backend_is_recorded(cpu_backend):
    backends.USAGE.reset()
    q, k, v, _ = _inputs(1, 2, 2, 10, 64, torch.float32, seed=1)
    partial_attention(q, k, v, 0.1)
    assert backends.USAGE.snapshot() == {f"cpu:{cpu_backend}": 1}
    name = cpu_attention.backend_name()
    assert name == "torch" if cpu_backend == "torch" else name.startswith("native-")
    assert backends.partial_backend(torch.device("cpu")) == name


def test_failed_build_falls_back_to_torch_with_one_warning(monkeypatch, tmp_path):
    """A compiler that fails (here `false`) leaves torch's kernels in charge with a one-line warning, or, with
    SCOUTBENCH_CPU_ATTENTION=native, a clear error."""
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))  # no cached build to find
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    cpu_attention.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU attention kernel unavailable") as caught:
            assert cpu_attention.backend_name() == "torch"
        assert len(caught) == 1 and "\n" not in str(caught[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once: later calls are silent
            q, k, v, lengths = _inputs(1, 2, 4, 20, 64, torch.float32, seed=4)
            state = partial_attention(q, k, v, 0.1, lengths)
        _check(state.o, state.lse, _reference(q, k, v, 0.1, lengths), "torch", torch.float32)
        monkeypatch.setenv(cpu_attention.ENV_BACKEND, "native")
        cpu_attention.library.cache_clear()
        with pytest.raises(cpu_attention.NativeUnavailable, match="native"):
            cpu_attention.library()
    finally:
        cpu_attention.library.cache_clear()


def test_bad_backend_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "ipex")
    cpu_attention.library.cache_clear()
    try:
        with pytest.raises(UsageError, match="SCOUTBENCH_CPU_ATTENTION='ipex'"):
            cpu_attention.library()
    finally:
        cpu_attention.library.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    """The first use compiles into the cache; the next load finds the same file (no second compile)."""
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))
    compiler = cpu_attention._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    first = cpu_attention._build(compiler)
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._build(compiler) == first and first.stat().st_mtime_ns == stamp
    assert first.parent.parent == tmp_path / "kernels" and not list(first.parent.parent.glob("*staging*"))


# The kernel's paths and a CPU that takes each (GCC's -march names). A machine builds only its own path, and CI's
# has no AVX-512, so each path is compiled here for its CPU (syntax and templates, nothing runs, every file of the
# library): a path that no test machine builds would otherwise break unseen, and a CPU that falls back to the
# portable loop runs about 10x slower while every parity test still passes.
ISA_MARCH = {"portable": "x86-64", "avx2": "haswell", "avx512": "skylake-avx512", "avx512-bf16": "sapphirerapids"}


def _gxx(*args: str, sources: list | None = None) -> subprocess.CompletedProcess:
    files = sources if sources is not None else cpu_attention.sources()
    return subprocess.run(["g++", "-std=c++17", "-fopenmp-simd", *args, *map(str, files)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="needs g++ on x86-64")
@pytest.mark.parametrize("isa", list(ISA_MARCH))
def test_every_vector_path_compiles_and_is_the_one_its_cpu_takes(isa):
    march = f"-march={ISA_MARCH[isa]}"
    built = _gxx("-fsyntax-only", "-w", march)
    assert built.returncode == 0, built.stderr[-2000:]
    library = [cpu_attention.SOURCE_DIR / "library.cpp"]  # sb_isa(): the path it names is the one common.h takes
    macros = set(re.findall(r"#define (SB_AVX2|SB_AVX512|__AVX512BF16__) ",
                            _gxx("-E", "-dM", march, sources=library).stdout))
    expected = {"portable": set(), "avx2": {"SB_AVX2"}, "avx512": {"SB_AVX512"},
                "avx512-bf16": {"SB_AVX512", "__AVX512BF16__"}}[isa]
    assert macros == expected


@pytest.mark.parametrize("cpu_backend", native_paths(), indirect=True)
def test_a_forced_vector_path_is_the_one_built(cpu_backend):
    """SCOUTBENCH_CPU_ISA builds the path it names, the widest this CPU runs by default, and the backend's name (what
    results record) says which; each path is its own cached build."""
    forced = os.environ.get(cpu_attention.ENV_ISA)
    expected = forced or cpu_attention.runnable_isa_paths()[0]
    assert cpu_attention.backend_name() == f"native-{expected}"


def test_the_registry_declares_every_vector_path():
    """SCOUTBENCH_CPU_ISA's values in scoutbench.environment (checked at every command's start) are `best` and the
    kernel's paths, widest first."""
    from scoutbench.environment import CPU_ISA_CHOICES, VARIABLES

    assert CPU_ISA_CHOICES == ("best", *cpu_attention.ISA_PATHS)
    assert VARIABLES[cpu_attention.ENV_ISA].decides_run


@pytest.mark.parametrize("text, message", [
    ("avx1024", "SCOUTBENCH_CPU_ISA='avx1024': use one of best, avx512-bf16, avx512, avx2, portable"),
    ("avx512", "SCOUTBENCH_CPU_ISA='avx512': this CPU does not run that path; it runs best, avx2, portable"),
])
def test_a_vector_path_this_cpu_cannot_run_is_a_clear_error(text, message, monkeypatch):
    """A misspelt path, or one the CPU lacks (an AVX2-only CPU's flags here), is the user's error, named with the
    paths that do run here, never a build failure that falls back to torch's kernels."""
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    monkeypatch.setenv(cpu_attention.ENV_ISA, text)
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma")
    monkeypatch.setattr(cpu_attention.platform, "machine", lambda: "x86_64")
    cpu_attention.library.cache_clear()
    try:
        with pytest.raises(UsageError, match=re.escape(message)):
            cpu_attention.library()
    finally:
        cpu_attention.library.cache_clear()


def test_the_build_takes_the_vector_path_this_cpu_has():
    """AVX-512 (F, BW, DQ) where the CPU has it, else AVX2 with FMA, else the portable loop: a build that fell back to
    the portable loop on a vector CPU would still pass every parity test, at a tenth of the speed."""
    lib = cpu_attention.library()
    flags = set((cpu_attention.cpuinfo_field("flags") or "").split())
    if lib is None or platform.machine() != "x86_64" or not flags:
        pytest.skip("needs the kernel built on x86-64 Linux")
    isa = lib.sb_isa().decode()
    if {"avx512f", "avx512bw", "avx512dq"} <= flags:
        assert isa == ("avx512-bf16" if "avx512_bf16" in flags else "avx512")
    elif {"avx2", "fma"} <= flags:
        assert isa == "avx2"
    else:
        assert isa == "portable"
