"""The compiled CPU kernel library (`csrc/`: one .cpp per operation, shared headers): built on first use, called
through ctypes; this module serves its decode attention.

The same library holds a decode step's other CPU kernels, which share its thread pool: the linears, RMSNorm and
attention prologue that `cpu_decode` serves, Quest's digest scoring and top-k (`digest_native`), InfiniGen's token
speculation (`top_tokens` below), ScoutAttention's pool/CPU split (`split_plan`), and the two-part
merge that `partial_state.merge_states` takes on a CPU (one call where torch makes seven).

Why a compiled kernel: torch's CPU flash kernel converts bf16 K/V to fp32 per tile and reads bf16 KV at half of
fp32's bytes/s, and a sparse call through it first gathers the selected blocks into a buffer (the gather costs as
much as the attention). This kernel reads bf16 directly (AVX512-BF16 dot products where the CPU has them), walks the
selected blocks of a host tier in place (index-driven: no gather copy), splits long rows into chunks merged by LSE
(flash-decoding split-K) over its own threads, and returns the natural-log LSE `merge_states` takes.

Build: one `g++ -O3 -march=native` of every `csrc/*.cpp` into a shared object cached under
`$SCOUTBENCH_CACHE/kernels` (default `~/.cache/scoutbench/kernels`), keyed by the hash of every source file (`.cpp`
and `.h`), the compiler's version and the CPU's flags: seconds, once per machine. It needs only a C++ compiler
(`$CXX`, else g++/c++): no torch or Python headers, nothing at `pip install` time. The cached library is verified
before it is loaded and rebuilt (with one warning) when it does not verify; concurrent first uses (pytest-xdist, Ray
workers) build once (`scoutbench.cache`). The build is bounded by `BUILD_TIMEOUT_S` and leaves no temp file when it
fails, times out or is interrupted.

`SCOUTBENCH_CPU_ATTENTION` picks the CPU backend: `auto` (default: the kernel, or torch's kernels with a one-line
warning when the build fails), `native` (the kernel or an error), `torch` (force torch's kernels, the tested
reference path). `backend_name()` says which runs; `kernels/backends.USAGE` counts each call's.

`SCOUTBENCH_CPU_ISA` picks the kernel's vector path: `best` (default: the widest this CPU has) or one of `ISA_PATHS`
that the CPU can run (`runnable_isa_paths()`), built with the wider extensions switched off (an AVX-512 machine
builds and runs the AVX2 path, the one of Zen 2 and 3 hosts), so that every path's parity tests and benchmarks run
on one machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from scoutbench.cache import cache_root, provide
from scoutbench.environment import CPU_ATTENTION_BACKENDS, value
from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.kernels import native_abi
from scoutbench.kernels.native_abi import ABI_VERSION

SOURCE_DIR = Path(__file__).with_name("csrc")  # the library's C++: one .cpp per operation, shared headers
ENV_BACKEND = "SCOUTBENCH_CPU_ATTENTION"
BACKEND_CHOICES = CPU_ATTENTION_BACKENDS
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# -march=native: the CPU's own vector ISA (the cache key includes its flags); compilers that refuse it on a
# platform (some ARM toolchains) get the next set. -fopenmp-simd enables `omp simd` loops only: no OpenMP runtime.
FLAG_SETS = (("-march=native",), ("-mcpu=native",), ())
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp-simd", "-fno-math-errno")
# the whole build (the compiler's version, each flag set tried, a wait for a concurrent build of the same library): a
# compiler that hangs costs a run this long once, then torch's kernels serve it (a normal build of the ten
# translation units, one after the other in one compiler process: 10-40 s)
BUILD_TIMEOUT_S = 120
LIBRARY_STEM = "cpu_attention"
LIBRARY_NAME = f"{LIBRARY_STEM}.so"
ENV_ISA = "SCOUTBENCH_CPU_ISA"
# the kernel's vector paths, widest first (`sb_isa()` names the one a build takes): each with the CPU flags it needs
# and the g++ options, added to -march=native, that switch the wider ones off (on x86-64)
ISA_PATHS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512-bf16": (frozenset({"avx512f", "avx512bw", "avx512dq", "avx512_bf16"}), ()),
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512dq"}), ("-mno-avx512bf16",)),
    "avx2": (frozenset({"avx2", "fma"}), ("-mno-avx512f",)),
    "portable": (frozenset(), ("-mno-avx2",)),
}


class NativeUnavailable(ScoutbenchError):
    """The kernel cannot be built or loaded here (the message says why): an error only where it was required."""


def requested_backend() -> str:
    return value(ENV_BACKEND)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def cpuinfo_field(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of `names` (None off Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return cpuinfo_field("flags", "Features") or platform.processor()


def runnable_isa_paths() -> list[str]:
    """The vector paths this CPU runs, widest first (the first is the one `best` builds); `portable` alone off
    x86-64, where the vector paths do not exist."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["portable"]
    flags = set(_cpu_flags().split())
    return [name for name, (needs, _) in ISA_PATHS.items() if needs <= flags]


def requested_isa() -> str:
    """`SCOUTBENCH_CPU_ISA` (a path's name, checked by the registry) checked against this CPU: `best`, or a path of
    `runnable_isa_paths()`."""
    choice = value(ENV_ISA)
    runnable = runnable_isa_paths()
    if choice != "best" and choice not in runnable:
        raise UsageError(f"{ENV_ISA}={choice!r}: this CPU does not run that path; it runs best, {', '.join(runnable)} "
                         "(or unset it)")
    return choice


def _isa_flags(isa: str) -> tuple[str, ...]:
    """The g++ options that switch the paths wider than `isa` off (none for `best`, or off x86-64)."""
    return ISA_PATHS[isa][1] if isa != "best" and runnable_isa_paths() != ["portable"] else ()


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _run_bounded(cmd: list[str], deadline: float) -> subprocess.CompletedProcess:
    """`cmd` with its output captured, killed with its whole process group at `deadline` (time.monotonic()) or
    when this process is interrupted: subprocess.run's timeout kills only the compiler driver, and its wait for
    the pipes then lasts as long as the compiler proper (cc1plus) that holds them."""
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        raise NativeUnavailable(f"the build did not finish within {BUILD_TIMEOUT_S} s")
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=left_s)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise NativeUnavailable(f"{Path(cmd[0]).name} did not finish within {BUILD_TIMEOUT_S} s") from None
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


def sources(folder: Path | None = None) -> list[Path]:
    """The library's translation units (the `.cpp` files of `folder`, default `SOURCE_DIR`), in name order."""
    return sorted((folder or SOURCE_DIR).glob("*.cpp"))


def source_files(folder: Path | None = None) -> list[Path]:
    """Every file the build reads (`.cpp` and `.h`), in name order: the cache key covers each one."""
    return sorted(p for p in (folder or SOURCE_DIR).iterdir() if p.suffix in (".cpp", ".h"))


def source_digest(folder: Path | None = None) -> bytes:
    """The hash of every source file's name and bytes: a change to any `.cpp` or `.h` changes the cache key."""
    digest = hashlib.sha256()
    for path in source_files(folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _compile(compiler: str, deadline: float, isa: str, folder: Path) -> None:
    """The library into `folder` (a staging folder of `cache.provide`), with the first flag set the compiler takes
    (the vector path `isa`: `requested_isa()`)."""
    errors = []
    for arch in FLAG_SETS:
        narrowed = _isa_flags(isa) if arch == ("-march=native",) else ()
        cmd = [compiler, *BASE_FLAGS, *arch, *narrowed, *map(str, sources()), "-o", str(folder / LIBRARY_NAME)]
        result = _run_bounded(cmd, deadline)
        if result.returncode == 0:
            return
        errors.append((result.stderr.strip().splitlines() or ["?"])[-1])
    raise NativeUnavailable(f"{compiler} failed: {errors[0]}")


def _build(compiler: str) -> Path:
    """The cached, verified shared object for these sources, compiler and CPU; compiled now if missing or if the
    cached one does not verify (`scoutbench.cache`: a truncated library would kill the process when mapped)."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    isa = requested_isa()
    source = source_digest()
    version = _run_bounded([compiler, "--version"], deadline).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_flags().encode(),
                                     platform.machine().encode(), isa.encode()])).hexdigest()[:16]
    folder, rebuilt_because = provide(cache_dir() / f"{LIBRARY_STEM}-{key}",
                                      functools.partial(_compile, compiler, deadline, isa),
                                      lock_timeout_s=max(deadline - time.monotonic(), 0.0))
    if rebuilt_because is not None:
        warnings.warn(f"scoutbench: the cached CPU kernel in {folder} did not verify ({rebuilt_because}); rebuilt it",
                      RuntimeWarning, stacklevel=3)
    return folder / LIBRARY_NAME


def _load() -> ctypes.CDLL:
    """The kernel, built and cached (raises NativeUnavailable)."""
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C++ compiler (set CXX, or install g++)")
    return ctypes.CDLL(str(_build(compiler)))


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """`library` with every entry point's signature (`native_abi.SIGNATURES`), once its ABI version matches."""
    built = native_abi.abi_version(library)
    if built != ABI_VERSION:
        raise NativeUnavailable(f"stale kernel build (ABI {built}, expected {ABI_VERSION})")
    return native_abi.bind(library)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None when torch's kernels serve the CPU (forced, or the build failed: warned once).
    Tests clear this cache after changing `SCOUTBENCH_CPU_ATTENTION` or `SCOUTBENCH_CPU_ISA`."""
    choice = requested_backend()
    if choice == "torch":
        return None
    requested_isa()  # a path this CPU cannot run is the user's error, not a build failure to fall back from
    try:
        return _bind(_load())
    except (ScoutbenchError, OSError, subprocess.SubprocessError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if choice == "native":
            raise NativeUnavailable(f"{ENV_BACKEND}=native but the CPU attention kernel is unavailable: {reason}; "
                                    f"install a C++ compiler (g++) or set {ENV_BACKEND}=auto") from None
        warnings.warn(f"scoutbench: CPU attention kernel unavailable ({reason}); using torch's kernels",
                      RuntimeWarning, stacklevel=2)
        return None


def backend_name() -> str:
    """`native-<isa>` (e.g. native-avx512-bf16) when the kernel serves CPU attention, else `torch`."""
    lib = library()
    return f"native-{lib.sb_isa().decode()}" if lib is not None else "torch"


def helper_spin_us() -> int | None:
    """How long (us) the kernel pool's helper threads stay awake after a job, from `SCOUTBENCH_KERNEL_SPIN_US`
    (default 1000; 0: sleep at once), as the loaded kernel read it; None without the kernel. Results record it."""
    lib = library()
    return lib.sb_helper_spin_us() if lib is not None else None


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a kernel argument, or None (a null pointer) for an absent operand."""
    return t.data_ptr() if t is not None else None


def check_call(code: int, what: str, **operands: torch.Tensor) -> None:
    """The one error of a kernel call the library rejected (nonzero `code`: its last guard, since every wrapper
    checks shapes first), naming the kernel and its operands' shapes."""
    if code != 0:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in operands.items())
        raise ValueError(f"{what} kernel rejected the call (code {code}): {shapes}")


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes this call: CPU tensors, bf16 or fp32, one dtype, contiguous head_dim."""
    return (q.device.type == "cpu" and k.device.type == "cpu" and q.dtype in DTYPE_CODES and k.dtype == q.dtype
            and k.stride(-1) == 1 and library() is not None)


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x.contiguous()` without the call when it is already contiguous: every torch call of a decode step costs
    host time (the step's `host.torch_calls_per_step`), and most tensors handed to the kernels already are."""
    return x if x.is_contiguous() else x.contiguous()


def rows_of(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`x` as a contiguous `[rows, cols]` matrix, with no call when it already is one."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(rows, cols).contiguous()


def attend(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, scale: float,
           block_ids: torch.Tensor | None, valid_len: torch.Tensor | None, with_probs: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of each selection row's G queries over its tokens, through the kernel (`supports()` is true).

    q `[B, H * G, D]`; k/v blocks `[B, Hkv, num_blocks, block_size, D]` of any strides (unit stride on D);
    block_ids `[B, H, W]` int64 (H = Hkv, or a multiple of it: row h reads KV head h // (H // Hkv)), or None:
    the blocks in order (then H = Hkv); valid_len `[B]` or `[B, H]`: the row's first tokens of its blocks in
    the ids' order (None: all of them). Only the ids of blocks holding valid tokens are read.
    Returns o `[B, H * G, D]` fp32, lse `[B, H * G]` fp32 (natural log; empty rows o = 0, lse = -inf) and, with
    `with_probs`, each query's softmax over the row's tokens `[B, H * G, max tokens]` (0 past valid_len).
    """
    lib = library()
    batch, num_q, head_dim = q.shape
    kv_heads, num_blocks, block_size = k_blocks.shape[1], k_blocks.shape[2], k_blocks.shape[3]
    rows = block_ids.shape[1] if block_ids is not None else kv_heads
    max_tokens = (block_ids.shape[2] if block_ids is not None else num_blocks) * block_size
    group = num_q // rows
    q = contiguous(q)
    lens = None
    if valid_len is not None and valid_len.dtype == torch.int64 and valid_len.shape == (batch, rows) \
            and valid_len.is_contiguous():
        lens = valid_len
    elif valid_len is not None:
        lens = (valid_len[:, None] if valid_len.dim() == 1 else valid_len).expand(batch, rows)
        lens = lens.to(torch.int64).contiguous()
    ids_b = ids_h = 0
    if block_ids is not None:
        if block_ids.dtype != torch.int64 or block_ids.stride(-1) != 1:
            block_ids = block_ids.to(torch.int64).contiguous()
        ids_b, ids_h = block_ids.stride(0), block_ids.stride(1)
    out = torch.empty((batch, num_q, head_dim), dtype=torch.float32)
    lse = torch.empty((batch, num_q), dtype=torch.float32)
    probs = torch.empty((batch, num_q, max_tokens), dtype=torch.float32) if with_probs else None
    ks, vs = k_blocks.stride(), v_blocks.stride()
    code = lib.sb_attention(
        DTYPE_CODES[q.dtype], batch, rows, rows // kv_heads, group, head_dim, q.data_ptr(), k_blocks.data_ptr(),
        v_blocks.data_ptr(), ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3], block_size,
        pointer(block_ids), ids_b, ids_h, pointer(lens), max_tokens, scale, out.data_ptr(), lse.data_ptr(),
        pointer(probs), max_tokens, torch.get_num_threads())
    check_call(code, "CPU attention", q=q, k=k_blocks)
    return out, lse, probs


def copy_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor
              ) -> None:
    """`dst[dst_rows] = src[src_rows]` for each `(dst, src)` of `pairs` (K and V of one recall share their ids), 2-D
    row-major tensors of one dtype and row width per pair, int64 row ids (`dst_rows` unique, as `index_copy_` needs
    them). The ids are checked once for every pair: one out of range raises IndexError before any copy.

    On a CPU through the kernel, one pass over the bytes, where `index_select` into a buffer then `index_copy_` out
    of it read and write every byte twice. Elsewhere, or where the kernel does not take the pair, torch's
    `index_copy_` of an `index_select`."""
    n = dst_rows.numel()
    if src_rows.numel() != n:
        raise ValueError(f"copy_rows: {n} destination rows but {src_rows.numel()} source rows")
    dst_rows, src_rows = dst_rows.to(torch.int64).contiguous(), src_rows.to(torch.int64).contiguous()
    if n:
        bounds = {"destination": (int(dst_rows.min()), int(dst_rows.max())),
                  "source": (int(src_rows.min()), int(src_rows.max()))}
        for dst, src in pairs:
            for what, limit in (("destination", dst.shape[0]), ("source", src.shape[0])):
                low, high = bounds[what]
                if low < 0 or high >= limit:
                    raise IndexError(f"copy_rows: a {what} row id is outside [0, {limit})")
    lib = library()
    for dst, src in pairs:
        if not (lib is not None and dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
                and dst.dim() == src.dim() == 2 and src.shape[1] == dst.shape[1] and dst.is_contiguous()
                and src.is_contiguous()):
            dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))
            continue
        code = lib.sb_copy_rows(n, dst.shape[1] * dst.element_size(), dst.data_ptr(), dst_rows.data_ptr(),
                                src.data_ptr(), src_rows.data_ptr(), torch.get_num_threads())
        check_call(code, "CPU row copy", dst=dst, src=src)


def takes_merge2(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> bool:
    """Whether `merge2` takes the two partial states: fp32 on the CPU, o `[..., D]` and lse `[...]` of one shape,
    no autograd, the kernel built (`partial_state` picks the backend)."""
    return (o_a.device.type == o_b.device.type == "cpu" and lse_a.device.type == lse_b.device.type == "cpu"
            and o_a.dtype == o_b.dtype == lse_a.dtype == lse_b.dtype == torch.float32
            and o_a.shape == o_b.shape and lse_a.shape == lse_b.shape == o_a.shape[:-1]
            and not (torch.is_grad_enabled() and (o_a.requires_grad or o_b.requires_grad))
            and library() is not None)


def merge2(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of two partial states through the kernel (`takes_merge2` is true): (o, lse) like the
    inputs."""
    parts = [contiguous(t) for t in (o_a, lse_a, o_b, lse_b)]
    out, lse = torch.empty_like(parts[0]), torch.empty_like(parts[1])
    code = library().sb_merge2(lse.numel(), o_a.shape[-1], *(t.data_ptr() for t in parts), out.data_ptr(),
                               lse.data_ptr())
    check_call(code, "CPU merge", o=o_a)
    return out, lse


def takes_top_tokens(partial_q: torch.Tensor, partial_keys: torch.Tensor) -> bool:
    """Whether `top_tokens` takes the call: both fp32 on the CPU, unit stride on P, rows of a sequence evenly spaced,
    the kernel built."""
    return (partial_q.device.type == partial_keys.device.type == "cpu"
            and partial_q.dtype == partial_keys.dtype == torch.float32 and partial_keys.stride(-1) == 1
            and partial_keys.stride(0) == partial_keys.shape[1] * partial_keys.stride(1) and library() is not None)


def top_tokens(partial_q: torch.Tensor, partial_keys: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """InfiniGen's speculated tokens through the kernel (`takes_top_tokens` is true; `speculation.top_tokens` picks
    the backend): for each (sequence, KV head) row, the `n` tokens among the first `lengths[b]` whose partial keys
    score highest against any of the row's partial queries (ties by lower index), in ascending token order, then 0
    up to `n`. partial_q `[B, Hkv, G, P]`, partial_keys `[B, Hkv, N, P]`; lengths `[B]`. Returns ids `[B, Hkv, n]`
    int64."""
    batch, kv_heads, group, channels = partial_q.shape
    q = contiguous(partial_q)
    lens = lengths if lengths.dtype == torch.int64 and lengths.is_contiguous() else \
        lengths.to(torch.int64).contiguous()
    ids = torch.empty((batch, kv_heads, n), dtype=torch.int64)
    code = library().sb_top_tokens(batch * kv_heads, kv_heads, group, channels, partial_keys.data_ptr(),
                                   partial_keys.stride(1), partial_keys.stride(2), q.data_ptr(), lens.data_ptr(), n,
                                   ids.data_ptr(), torch.get_num_threads())
    check_call(code, "token top-n", keys=partial_keys)
    return ids
