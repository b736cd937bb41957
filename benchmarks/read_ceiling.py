"""The memory system's ratio for the sparse speed-up: how fast this machine reads the bytes of a sparse call and of
a full call when nothing is computed, beside the attention kernel's own calls in the same rounds.

Issue 49 asks the CPU kernel for sparse/full >= 28x (2048 of 64k tokens in blocks of 32: ideal 32x), that is, a
sparse call's bytes read at >= 0.875 of the rate of full attention's. A sparse call reads each row's selected blocks
(8 KiB of K and 8 KiB of V per block in bf16, 16 KiB each in fp32) at random places of the host tier; full attention
reads one sequential stream per row. This measures what the memory system gives each pattern with no arithmetic at
all: a compiled reader (vector loads summed into four accumulators) walks the same layout the kernel walks
(`bench_sparse_attention.attention_calls`: a block-major tier of 8 KV rows and a head-major full cache, both in 2
MiB-aligned memory with `madvise(MADV_HUGEPAGE)`, as the methods' arenas ask), on the same two threads' split (each
thread half the rows, K and V a 32-token step at a time), over 16 rotating random selections. The stream is read
without software prefetches (the hardware prefetcher follows a stream). The sparse reader tries
each software prefetch of `AHEADS` (into L2 where the CPU has an L2 hint, else L1) and keeps the fastest. Its

    reads ratio = (len / budget) * (sparse read rate) / (stream read rate)

is the speed-up of a kernel that reads both patterns as fast as a bare reader does. The kernel's calls are timed in
the same round (`attention_calls`, min of the calls), and each is given as a fraction of its pattern's bare read
rate: where both fractions are near 1, the speed-up is the memory system's; where the sparse fraction is the lower,
the kernel loses on the random blocks, not the memory system (and a kernel whose full call falls short of the stream
can show more than the reads ratio). Two more columns say whether the kernel's arithmetic keeps up: `in cache ms`,
the sparse call repeated over one selection (8 MiB in bf16, 16 MiB in fp32: resident in a 32 MiB L3), its compute
with cache-speed reads, beside `stream ms`, the sparse call's bytes at the stream's read rate. Where the first is near
the second, the call is as much compute as memory, and only a perfect overlap of the two reaches the memory's rate.
Times are minimums (kernel times: the uncontended time on a shared machine).

    python benchmarks/read_ceiling.py                       # bf16 and fp32, blocks of 32, three rounds
    python benchmarks/read_ceiling.py --dtype bf16 --block-size 16,32,64,128 --rounds 2
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md): before torch

import torch  # noqa: E402
from bench_sparse_attention import DTYPES, attention_calls, time_ms  # noqa: E402

from scoutbench.kernels.attention import block_sparse_attention  # noqa: E402
from scoutbench.units import parse_length  # noqa: E402

# the sparse reader's prefetches (passed to the reader): none; the whole block 1, 2 or 4 blocks ahead at each block's
# start; the rows 32, 64 or 128 tokens ahead before each 32-token step (the kernel's spread form: 64 into L2)
AHEADS = (0, 1, 2, 4, -32, -64, -128)

SOURCE = r"""
#include <immintrin.h>
#include <sys/mman.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <functional>
#include <thread>
#include <vector>

// argv: element bytes, tokens, budget, block tokens, rows, head_dim, calls per variant, then each sparse prefetch
// (`AHEADS`)
static char* huge_alloc(size_t bytes) {
  const size_t align = size_t(2) << 20;
  bytes = (bytes + align - 1) / align * align;
  char* p = static_cast<char*>(aligned_alloc(align, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  std::fill(reinterpret_cast<uint64_t*>(p), reinterpret_cast<uint64_t*>(p + bytes), uint64_t{1});  // sums count words
  return p;
}

#ifdef __AVX512F__
typedef __m512i vec;
static inline vec vzero() { return _mm512_setzero_si512(); }
static inline vec vload(const char* p) { return _mm512_loadu_si512(p); }
static inline vec vadd(vec a, vec b) { return _mm512_add_epi64(a, b); }
static inline uint64_t vsum(vec a) { return _mm512_reduce_add_epi64(a); }
static const int kL2Hint = _MM_HINT_T2;  // AVX-512 CPUs (Zen 4, Intel): an L2-only hint
#else
typedef __m256i vec;
static inline vec vzero() { return _mm256_setzero_si256(); }
static inline vec vload(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline vec vadd(vec a, vec b) { return _mm256_add_epi64(a, b); }
static inline uint64_t vsum(vec a) {
  alignas(32) uint64_t x[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(x), a);
  return x[0] + x[1] + x[2] + x[3];
}
static const int kL2Hint = _MM_HINT_T0;  // Zen 2/3: every hint fills L1
#endif
static const int kVec = sizeof(vec);

// every byte of [p, p + bytes), four independent accumulators
static inline uint64_t read_bytes(const char* p, size_t bytes) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (size_t off = 0; off < bytes; off += 4 * kVec) {
    a0 = vadd(a0, vload(p + off));
    a1 = vadd(a1, vload(p + off + kVec));
    a2 = vadd(a2, vload(p + off + 2 * kVec));
    a3 = vadd(a3, vload(p + off + 3 * kVec));
  }
  return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

static inline void prefetch(const char* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, static_cast<_mm_hint>(kL2Hint));
}

struct Team {  // the caller and one helper per further thread, woken by a generation counter (spinning)
  int threads;
  std::atomic<int> generation{0}, done{0};
  std::atomic<bool> quit{false};
  std::function<void(int)> work;
  std::vector<std::thread> helpers;
  explicit Team(int n) : threads(n) {
    for (int t = 1; t < n; ++t)
      helpers.emplace_back([this, t] {
        int seen = 0;
        while (true) {
          while (generation.load(std::memory_order_acquire) == seen && !quit.load()) _mm_pause();
          if (quit.load()) return;
          seen = generation.load();
          work(t);
          done.fetch_add(1, std::memory_order_release);
        }
      });
  }
  double run_s(std::function<void(int)> fn) {
    work = std::move(fn);
    done.store(0);
    const auto start = std::chrono::steady_clock::now();
    generation.fetch_add(1, std::memory_order_release);
    work(0);
    while (done.load(std::memory_order_acquire) < threads - 1) _mm_pause();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  ~Team() {
    quit.store(true);
    for (auto& h : helpers) h.join();
  }
};

int main(int argc, char** argv) {
  if (argc < 9) return 2;
  const size_t elem = atoi(argv[1]), tokens = atol(argv[2]), budget = atol(argv[3]), bs = atol(argv[4]);
  const int rows = atoi(argv[5]), calls = atoi(argv[7]);
  const size_t row_bytes = elem * atol(argv[6]), block_bytes = bs * row_bytes, step_bytes = 32 * row_bytes;
  const size_t blocks = tokens / bs, selected = budget / bs;
  char* full_k = huge_alloc(rows * tokens * row_bytes);
  char* full_v = huge_alloc(rows * tokens * row_bytes);
  char* tier_k = huge_alloc(blocks * rows * block_bytes);
  char* tier_v = huge_alloc(blocks * rows * block_bytes);
  std::mt19937_64 rng(0);
  std::vector<std::vector<int64_t>> selections(16, std::vector<int64_t>(rows * selected));
  for (auto& s : selections)
    for (int r = 0; r < rows; ++r) {
      std::vector<int64_t> ids(blocks);
      for (size_t b = 0; b < blocks; ++b) ids[b] = b;
      std::shuffle(ids.begin(), ids.end(), rng);
      std::copy(ids.begin(), ids.begin() + selected, s.begin() + r * selected);
    }
  Team team(2);
  std::atomic<uint64_t> sink{0};
  const int per_thread = rows / team.threads;
  auto stream = [&](int t) {  // each row's K and V, a 32-token step of each in turn
    uint64_t s = 0;
    for (int r = t * per_thread; r < (t + 1) * per_thread; ++r)
      for (size_t off = 0; off < tokens * row_bytes; off += step_bytes) {
        s += read_bytes(full_k + r * tokens * row_bytes + off, step_bytes);
        s += read_bytes(full_v + r * tokens * row_bytes + off, step_bytes);
      }
    sink += s;
  };
  // each selection's block addresses, per thread in the order it reads them (its rows, each row's blocks)
  std::vector<std::vector<const char*>> k_blocks(16), v_blocks(16);
  for (int c = 0; c < 16; ++c)
    for (size_t i = 0; i < rows * selected; ++i) {
      k_blocks[c].push_back(tier_k + (selections[c][i] * rows + i / selected) * block_bytes);
      v_blocks[c].push_back(tier_v + (selections[c][i] * rows + i / selected) * block_bytes);
    }
  const int shift = __builtin_ctzll(bs);  // block sizes are powers of two
  int call = 0;
  // a sparse call's reads: each block's K and V a 32-token step at a time; `ahead` > 0: at each block's start the
  // whole block `ahead` blocks further prefetched; `ahead` < 0: before each step the rows -ahead tokens further
  auto sparse = [&](int ahead) {
    const int c = call++ % 16;
    return [&, ahead, c](int t) {
      const char* const* kb = k_blocks[c].data() + t * per_thread * selected;
      const char* const* vb = v_blocks[c].data() + t * per_thread * selected;
      const size_t n_blocks = per_thread * selected, n_tokens = n_blocks * bs;
      uint64_t s = 0;
      size_t far_done = 0;
      auto prefetch_tokens = [&](size_t stop) {
        for (stop = std::min(stop, n_tokens); far_done < stop; ++far_done) {
          const size_t at = (far_done & (bs - 1)) * row_bytes;
          prefetch(kb[far_done >> shift] + at, row_bytes);
          prefetch(vb[far_done >> shift] + at, row_bytes);
        }
      };
      if (ahead > 0)
        for (size_t j = 0; j < std::min<size_t>(ahead, n_blocks); ++j) {
          prefetch(kb[j], block_bytes);
          prefetch(vb[j], block_bytes);
        }
      for (size_t i = 0; i < n_blocks; ++i) {
        if (ahead > 0 && i + ahead < n_blocks) {
          prefetch(kb[i + ahead], block_bytes);
          prefetch(vb[i + ahead], block_bytes);
        }
        for (size_t off = 0; off < block_bytes; off += step_bytes) {
          if (ahead < 0) prefetch_tokens(i * bs + off / row_bytes + 32 - ahead);
          const size_t n = std::min(step_bytes, block_bytes - off);
          s += read_bytes(kb[i] + off, n);
          s += read_bytes(vb[i] + off, n);
        }
      }
      sink += s;
    };
  };
  std::vector<int> aheads;
  for (int a = 8; a < argc; ++a) aheads.push_back(atoi(argv[a]));
  const int variants = static_cast<int>(aheads.size());
  double stream_s = 1e30;
  std::vector<double> sparse_s(variants, 1e30);
  team.run_s(stream);
  for (int rep = 0; rep < 5; ++rep) {
    stream_s = std::min(stream_s, team.run_s(stream));
    for (int v = 0; v < variants; ++v)
      for (int c = 0; c < calls; ++c) sparse_s[v] = std::min(sparse_s[v], team.run_s(sparse(aheads[v])));
  }
  const double full_bytes = 2.0 * rows * tokens * row_bytes, sparse_bytes = 2.0 * rows * selected * block_bytes;
  std::printf("stream %.6f %.1f\n", stream_s, full_bytes / stream_s / 1e9);
  for (int v = 0; v < variants; ++v)
    std::printf("sparse%d %.6f %.1f\n", aheads[v], sparse_s[v], sparse_bytes / sparse_s[v] / 1e9);
  // what one call of each pattern read, in bytes (every word holds 1, so a sum counts the words it read)
  auto bytes_read = [&](std::function<void(int)> fn) {
    const uint64_t before = sink.load();
    team.run_s(std::move(fn));
    return static_cast<unsigned long long>((sink.load() - before) * 8);
  };
  std::printf("bytes stream %llu\n", bytes_read(stream));
  for (int v = 0; v < variants; ++v) std::printf("bytes sparse%d %llu\n", aheads[v], bytes_read(sparse(aheads[v])));
}
"""


def build(folder: Path) -> Path:
    from scoutbench.kernels.cpu_attention import _compiler

    compiler = _compiler()  # the kernel's own choice: $CXX, then g++, then c++
    if compiler is None:
        raise SystemExit("read_ceiling: no C++ compiler: set CXX, or install g++ (e.g. apt install g++)")
    source, binary = folder / "ceiling.cpp", folder / "ceiling"
    source.write_text(SOURCE)
    result = subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o", str(binary)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"read_ceiling: {compiler} failed (an x86-64 CPU with AVX2 is needed): "
                         f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return binary


def run_reader(binary: Path, element: int, length: int, budget: int, block_size: int, rows: int, head_dim: int,
               calls: int) -> list[list[str]]:
    """The reader's output lines, split: `<pattern> <s> <GB/s>` (the min over 5 rounds of `calls` calls each) and
    `bytes <pattern> <n>` (what one call read), for `stream` and each `sparse<ahead>` of `AHEADS`."""
    out = subprocess.run([str(binary), *map(str, (element, length, budget, block_size, rows, head_dim, calls, *AHEADS))],
                         check=True, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines()]


def read_rates(binary: Path, *shape: int) -> dict[str, tuple[float, float]]:
    """(seconds, GB/s) of each pattern's fastest call; `shape`: element bytes, length, budget, block size, rows,
    head_dim."""
    return {fields[0]: (float(fields[1]), float(fields[2])) for fields in run_reader(binary, *shape, 20)
            if fields[0] != "bytes"}


def bytes_read(binary: Path, *shape: int) -> dict[str, int]:
    """The bytes one call of each pattern read, counted by the reader (`shape` as `read_rates`)."""
    return {fields[1]: int(fields[2]) for fields in run_reader(binary, *shape, 1) if fields[0] == "bytes"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--len", default="64k")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--block-size", default="32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    length, rows, head_dim = parse_length(args.len), 8, 128
    ideal = length / args.budget
    print(f"bare reads vs the kernel, 2 threads, {args.len} vs {args.budget} tokens, 8 KV rows x head_dim {head_dim}, "
          f"load {os.getloadavg()[0]:.1f}; GB/s and ratios from minimum times; ideal {ideal:.0f}x")
    print("round dtype block  stream GB/s  sparse GB/s: no prefetch / blocks 1, 2, 4 / rows 32, 64, 128 ahead"
          "  reads x  kernel full / sparse ms  kernel x  kernel of reads full / sparse  in cache ms  stream ms")
    with tempfile.TemporaryDirectory() as folder:
        binary = build(Path(folder))
        for round_ in range(1, args.rounds + 1):
            for name in args.dtype.split(","):
                dtype = DTYPES[name]
                element = torch.tensor([], dtype=dtype).element_size()
                for block_size in map(int, args.block_size.split(",")):
                    read = read_rates(binary, element, length, args.budget, block_size, rows, head_dim)
                    sparse = [read[f"sparse{a}"][1] for a in AHEADS]
                    reads_ratio = ideal * max(sparse) / read["stream"][1]
                    full_bytes = 2 * rows * length * head_dim * element
                    sparse_bytes = full_bytes * args.budget / length
                    calls = attention_calls(dtype, length, args.budget, block_size, 1, 32, rows, head_dim)
                    full_ms = time_ms(calls.full, 7)[1]
                    sparse_ms = time_ms(calls.sparse, 41)[1]
                    cached_ms = time_ms(functools.partial(block_sparse_attention, calls.q, calls.blocks_k, calls.blocks_v,
                                                          calls.selections[0], calls.scale), 41)[1]
                    del calls
                    kernel = full_ms / sparse_ms
                    print(f"{round_:5d} {name:>5} {block_size:5d} {read['stream'][1]:12.1f}  "
                          f"{sparse[0]:5.1f} / {', '.join(f'{s:.1f}' for s in sparse[1:4])} / "
                          f"{', '.join(f'{s:.1f}' for s in sparse[4:]):>16}  {reads_ratio:7.1f}x  {full_ms:9.2f} / "
                          f"{sparse_ms:.3f}  {kernel:7.1f}x  "
                          f"{full_bytes / full_ms / 1e6 / read['stream'][1]:13.2f} / "
                          f"{sparse_bytes / sparse_ms / 1e6 / max(sparse):.2f}  {cached_ms:13.3f}  "
                          f"{sparse_bytes / read['stream'][1] / 1e6:10.3f}")


if __name__ == "__main__":
    main()
