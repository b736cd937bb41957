"""Compile every Triton kernel ahead of time for the GPUs scoutbench may meet, on a machine without one.

Why: a GPU is lent rarely and for minutes, and a kernel that does not compile for its target, needs more shared
memory than the target has (it fails to load) or spills registers (it runs from local memory) would only show
there. Triton's compiler needs no GPU (/work/shared/specs/aot_compile.md): each kernel is compiled for sm_80 (A100),
sm_86 (A10, RTX 30x0), sm_89 (L4, RTX 4090) and sm_90 (H100/H200) exactly as a run would launch it.

How: every kernel is reached through its launch site, the wrapper in scoutbench/kernels/triton_*.py, called with
`device="meta"` tensors at the shapes the methods use (Qwen3-8B/14B/32B, the small models, GQA groups 1 to 8,
bf16/fp16/fp32, blocks of 16 and 32 tokens, contexts to 128k) while `KernelInterface.__getitem__` records the
launch (kernel, arguments, constexprs, num_warps, num_stages) instead of running it. Each recorded launch then goes
to the kernel's own `warmup` under a driver that reports the target, so triton specialises it as a launch would
(ints equal to 1, 16-divisibility of ints, strides and pointers) and compiles each distinct specialisation once
per target.

Fails (exit 1) on a compile error, on shared memory over the target's opt-in limit per block, and on a register
spill on sm_90 (the H200's target); prints registers, spills and shared memory per specialisation and target (the
log of ptxas -v as triton runs it, from the wheel's own ptxas), and writes them as JSON with --json.

Usage: python scripts/triton_aot.py [--targets 80,86,89,90] [--json OUT] [--jobs N]   (docs/gpu.md; `nox -s aot`)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

# a fresh cache, removed at exit: a cached kernel is not compiled again, and its ptxas log (registers, spills) would
# not be printed
if "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="scoutbench-aot-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (silences its warning)

import torch  # noqa: E402

KIB = 1024
# the opt-in shared memory per block (CUDA programming guide, "Compute capabilities")
SHARED_LIMIT_BYTES = {80: 163 * KIB, 86: 99 * KIB, 89: 99 * KIB, 90: 227 * KIB}
NO_SPILL_TARGETS = (90,)  # the lent H200's target: a spill there is a failure
# (name, query heads, KV heads, head_dim): Qwen3-8B/14B/32B, the small real models (qwen2.5-0.5b/1.5b,
# smollm2-135m), and two shapes for GQA groups 1 and 2 (Llama-2 style MHA, a 2:1 GQA): groups 1 to 8, head dims 64
# and 128 (the test models' 32 runs on emulated CUDA only)
SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3-14b": (40, 8, 128), "qwen3-32b": (64, 8, 128),
          "qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128), "smollm2-135m": (9, 3, 64),
          "mha": (32, 32, 128), "gqa2": (16, 8, 128)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STEPS = 8  # decode steps past the prompt: a 128k context with them has more than 8192 blocks of 16


@dataclass(frozen=True)
class Case:
    """One shape a method runs at. A kernel's specialisation follows from its dtype, its constexprs (heads, head
    dim, group, block size, the power-of-two paddings of blocks, selections and slots) and which ints and strides
    are 1 or 16-divisible; the cases vary each of these from the paper's shape."""

    shape: str = "qwen3-14b"
    dtype: torch.dtype = torch.bfloat16
    batch: int = 5  # 1 makes batch-sized ints constexprs; with 5, strides of 40 query heads are not 16-divisible
    context: int = 64 * 1024
    block_size: int = 16
    budget: int = 2048  # the sparse methods' token budget (the paper's)
    victims: bool = True  # ScoutAttention's selection with a recall's eviction order (a recall step)

    @property
    def heads(self) -> tuple[int, int, int]:
        return SHAPES[self.shape]


def all_cases() -> list[Case]:
    """The paper's shape (Qwen3-14B, 64k, budget 2048, blocks of 16) in each dtype, and from it one factor at a
    time: every model shape (GQA groups 1 to 8, head dims 64 and 128), blocks of 16 and 32, contexts from 2k to
    128k, budgets 1024 to 4096, batches 1 and 5, a selection without a recall; and the largest selection rows
    (128k in blocks of 16 and of 32) of every Qwen3 model."""
    varied = ([{"shape": name} for name in SHAPES] + [{"block_size": b} for b in (16, 32)]
              + [{"context": c} for c in (2048, 32 * 1024, 128 * 1024)] + [{"budget": b} for b in (1024, 4096)]
              + [{"batch": 1}] + [{"victims": False}]
              + [{"shape": name, "context": 128 * 1024, "block_size": b} for name in SHAPES if "qwen3" in name
                 for b in (16, 32)])
    return list(dict.fromkeys(Case(dtype=dtype, **change) for dtype in DTYPES for change in varied))


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# ---------------------------------------------------------------------------------------------- launch sites
def decode_site(case: Case) -> Iterator[tuple[str, Callable[[], Any]]]:
    """`triton_partial_attention` as the methods call it: a row-major cache `[B, Hkv, capacity, D]` read up to
    its valid keys (FullKV and the dense layers, HGCA's window, InfiniGen's fetch rows, Quest's gathered blocks),
    with per-sequence lengths or a uniform span."""
    from scoutbench.kernels.triton_decode import triton_partial_attention

    hq, hkv, d = case.heads
    capacity = -(-(case.context + STEPS) // 16) * 16  # caches are whole 16-token pages
    q = meta(case.batch, hq, d, dtype=case.dtype)
    k = meta(case.batch, hkv, capacity, d, dtype=case.dtype)[:, :, : case.context + STEPS]
    for valid in (meta(case.batch, dtype=torch.long), None):
        yield "decode", lambda valid=valid: triton_partial_attention(q, k, k, 0.088, valid)


def scout_geometry(case: Case) -> tuple[int, int, int]:
    """(selections k, pool slots, region slots) of ScoutAttention at its defaults: read from the method (its
    `k_sel`, `pool_slots`, sink and local blocks) and the block store's region (pool + sink + local ring)."""
    from scoutbench.methods import build_method

    scout = build_method("scout", {"budget": case.budget, "block_size": case.block_size})
    return scout.k_sel, scout.pool_slots, scout.pool_slots + scout.sink_blocks + scout.local_blocks + 1


def region_site(case: Case) -> Iterator[tuple[str, Callable[[], Any]]]:
    """ScoutAttention's device part (`region_attention` over the slotted region `[B, Hkv, S * b, D]`) and the
    two-part merge of ScoutAttention, HGCA and InfiniGen (`merged_output`)."""
    from scoutbench.kernels.triton_region import merged_output, region_attention

    hq, hkv, d = case.heads
    _, _, slots = scout_geometry(case)
    q = meta(case.batch, hq, d, dtype=case.dtype)
    k = meta(case.batch, hkv, slots * case.block_size, d, dtype=case.dtype)
    tokens = meta(case.batch, hkv, slots, dtype=torch.long)
    yield "region", lambda: region_attention(q, k, k, 0.088, tokens)
    o, lse = meta(case.batch, hq, d), meta(case.batch, hq)
    yield "merge", lambda: merged_output(o, lse, o, lse, case.dtype)


def select_site(case: Case) -> Iterator[tuple[str, Callable[[], Any]]]:
    """ScoutAttention's select-and-split of one layer, as `block_store.select_and_split` calls it: digests in the KV
    dtype `[B, Hkv, max_blocks, 2D]` read up to the scored blocks, the candidates' mask and count shared by the
    KV heads, the layer's block table, its plan and pool use."""
    from scoutbench.kernels.triton_select import select_and_split

    if case.budget >= case.context:
        return  # the method runs dense
    hq, hkv, d = case.heads
    k, pool, _ = scout_geometry(case)
    max_blocks = -(-(case.context + STEPS) // case.block_size)
    b = case.batch
    args = (meta(b, hq, d, dtype=case.dtype), meta(b, hkv, max_blocks, 2 * d, dtype=case.dtype),
            meta(b, 1, max_blocks, dtype=torch.bool), meta(b, 1, dtype=torch.long),
            meta(b, hkv, max_blocks + 1, dtype=torch.long), meta(b, hkv, pool + 1, dtype=torch.bool),
            meta(b, hkv, pool + 1, dtype=torch.long), case.victims, meta(b, hkv, 3 * k + 4, dtype=torch.long),
            meta(b, hkv, pool, dtype=torch.bool))
    yield "select", lambda: select_and_split(*args)


def speculate_site(case: Case) -> Iterator[tuple[str, Callable[[], Any]]]:
    """InfiniGen's dynamic fetch count of one layer: its scores `[B, Hkv, G, max_len]` in the KV dtype, the
    uncached mask, the ranked group max, the fetch rows' lengths and mask `[B, 1, 1, width]`."""
    from scoutbench.kernels.triton_speculate import speculate_count_

    if case.budget >= case.context:
        return
    hq, hkv, _ = case.heads
    b, max_len, capacity = case.batch, case.context + STEPS, case.budget - 1
    width = -(-(capacity + 1) // 16) * 16
    args = (meta(b, hkv, hq // hkv, max_len, dtype=case.dtype), meta(b, 1, 1, max_len), 0.088, 4.0, capacity,
            meta(b, dtype=torch.long), meta(b, hkv, 1, max_len), meta(), meta(b, dtype=torch.long),
            meta(b, dtype=torch.long), meta(b, 1, 1, width, dtype=case.dtype), meta(2, dtype=torch.long))
    yield "speculate", lambda: speculate_count_(*args)


SITES = (decode_site, region_site, select_site, speculate_site)


# ---------------------------------------------------------------------------------------------- recording
class _Pointer:
    """A tensor argument as triton's specialisation sees it: its dtype and its address (the storage offset in
    bytes: a real allocation is at least 256-byte aligned, so a view's alignment is its offset's)."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._address = tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


@dataclass
class Launch:
    site: str
    kernel: Any
    args: tuple
    kwargs: dict


def record_launches(kernels: tuple[str, ...] = (), cases: list[Case] | None = None) -> list[Launch]:
    """Every launch the sites make at `cases` (default: all_cases()), only those of `kernels` (by site name)
    where given, recorded: nothing compiles or runs. The launches do not depend on the target: each kernel's
    configuration is per dtype."""
    from triton.runtime.jit import KernelInterface

    launches: list[Launch] = []
    site = ""

    def record(kernel: Any, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            args = tuple(_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args)
            launches.append(Launch(site, kernel, args, kwargs))
        return launch

    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = record
    try:
        for case in cases or all_cases():
            for sites in SITES:
                for name, call in sites(case):
                    if kernels and name not in kernels:
                        continue
                    site = f"{name} {case.shape} {str(case.dtype).removeprefix('torch.')} B{case.batch} " \
                           f"{case.context // 1024}k b{case.block_size} budget {case.budget}" \
                           f"{'' if case.victims else ' no victims'}"
                    call()
    finally:
        KernelInterface.__getitem__ = original
    return launches


# ---------------------------------------------------------------------------------------------- compiling
class _TargetDriver:
    """The active driver while compiling: it reports the target; device and stream are 0 (nothing launches)."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@dataclass
class Compiled:
    kernel: str
    target: str
    site: str  # the first launch site of this specialisation
    constexprs: str
    num_warps: int
    num_stages: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    shared_limit_bytes: int
    compile_s: float
    error: str | None = None

    @property
    def problems(self) -> list[str]:
        found = [self.error] if self.error else []
        if self.shared_bytes > self.shared_limit_bytes:
            found.append(f"shared memory {self.shared_bytes} B > the target's {self.shared_limit_bytes} B")
        if self.target in (f"sm_{cc}" for cc in NO_SPILL_TARGETS) and self.spill_store_bytes + self.spill_load_bytes:
            found.append(f"spills {self.spill_store_bytes}/{self.spill_load_bytes} B (stores/loads)")
        return found


PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _constexprs(kernel: Any, kwargs: dict) -> str:
    names = {p.name for p in kernel.params if p.is_constexpr}
    return " ".join(f"{k}={v}" for k, v in kwargs.items() if k in names)


def compile_target(capability: int, kernels: tuple[str, ...] = (), cases: list[Case] | None = None
                   ) -> list[Compiled]:
    """Each distinct specialisation of the recorded launches compiled for sm_`capability`, in launch order."""
    from triton import knobs
    from triton.runtime import driver

    launches = record_launches(kernels, cases)
    # the target's driver stays active after (triton's reset would look for a GPU); nothing launches in this process
    driver.set_active(_TargetDriver(capability))
    knobs.nvidia.dump_ptxas_log = True  # triton's own ptxas -v run prints its log: registers and spills
    try:
        return _compile_launches(launches, capability)
    finally:
        knobs.nvidia.dump_ptxas_log = False


def _compile_launches(launches: list[Launch], capability: int) -> list[Compiled]:
    for kernel in {launch.kernel for launch in launches}:
        kernel.device_caches.clear()
    results: list[Compiled] = []
    failed: set[Any] = set()  # kernels with a compile error: reported once, not for each later launch
    for launch in launches:
        if launch.kernel in failed:
            continue
        kernel_cache = launch.kernel.device_caches[0][0]
        before = len(kernel_cache)
        log = io.StringIO()
        start = time.perf_counter()
        error = None
        try:
            with contextlib.redirect_stdout(log):
                compiled = launch.kernel.warmup(*launch.args, grid=(1,), **launch.kwargs)
        except Exception as exc:  # noqa: BLE001 - a compile error is this specialisation's result
            compiled, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if error is None and len(kernel_cache) == before:
            continue  # compiled already for an earlier launch
        text = log.getvalue()
        used = [int(n) for n in PTXAS_USED.findall(text)]
        spills = [tuple(map(int, pair)) for pair in PTXAS_SPILL.findall(text)]
        metadata = compiled.metadata if compiled is not None else None
        results.append(Compiled(
            kernel=launch.kernel.fn.__name__, target=f"sm_{capability}", site=launch.site,
            constexprs=_constexprs(launch.kernel, launch.kwargs),
            num_warps=metadata.num_warps if metadata else launch.kwargs.get("num_warps", 4),
            num_stages=metadata.num_stages if metadata else launch.kwargs.get("num_stages", 3),
            registers=max(used, default=0), spill_store_bytes=max((s for s, _ in spills), default=0),
            spill_load_bytes=max((s for _, s in spills), default=0),
            shared_bytes=metadata.shared if metadata else 0, shared_limit_bytes=SHARED_LIMIT_BYTES[capability],
            compile_s=round(time.perf_counter() - start, 2), error=error))
        if error is not None:
            failed.add(launch.kernel)
    return results


def table(results: list[Compiled]) -> str:
    """One line per kernel configuration and target: the range of registers, the worst spill and shared memory
    over its specialisations."""
    groups: dict[tuple[str, str, str], list[Compiled]] = {}
    for r in results:
        config = re.sub(r"(NUM_KV_HEADS|GROUP|HEAD_DIM|NUM_HEADS)=\S+ ?", "", r.constexprs).strip()
        groups.setdefault((r.kernel, config + f" warps={r.num_warps} stages={r.num_stages}", r.target), []).append(r)
    lines = ["| kernel | configuration | target | specialisations | registers | spill B (st/ld) | shared KiB "
             "(limit) |", "|---|---|---|---|---|---|---|"]
    for (kernel, config, target), rows in sorted(groups.items()):
        regs = sorted({r.registers for r in rows})
        spill = max(rows, key=lambda r: r.spill_store_bytes + r.spill_load_bytes)
        shared = max(r.shared_bytes for r in rows)
        lines.append(f"| {kernel} | {config} | {target} | {len(rows)} | "
                     f"{regs[0]}{'-' + str(regs[-1]) if len(regs) > 1 else ''} | "
                     f"{spill.spill_store_bytes}/{spill.spill_load_bytes} | "
                     f"{shared / KIB:.1f} ({rows[0].shared_limit_bytes // KIB}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="80,86,89,90", help="compute capabilities, e.g. 90 or 80,86,89,90")
    parser.add_argument("--json", help="write every specialisation's result here")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="targets compiled at once")
    parser.add_argument("--kernels", default="", help="only these launch sites, e.g. decode,region (default: all: "
                        "decode, region, merge, select, speculate)")
    args = parser.parse_args(argv)
    import triton

    targets = [int(t) for t in args.targets.split(",")]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(targets)))) as pool:
        kernels = tuple(k for k in args.kernels.split(",") if k)
        results = [r for per_target in pool.map(compile_target, targets, [kernels] * len(targets))
                   for r in per_target]
    print(f"triton {triton.__version__}: {len(results)} compiles ({len(results) // max(1, len(targets))} "
          f"specialisations x {len(targets)} targets) in {time.perf_counter() - start:.0f} s")
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"triton": triton.__version__, "results": [asdict(r) for r in results]}, handle, indent=1)
    failed = [(r, problem) for r in results for problem in r.problems]
    for r, problem in failed:
        print(f"FAILED {r.kernel} {r.target} ({r.site}; {r.constexprs}): {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
