"""Where this CPU puts a line that a software prefetch fetched from DRAM, for each locality hint.

The CPU attention kernel (`scoutbench/kernels/csrc/attention_*.cpp`) prefetches K and V rows ahead of its loops, and
its tuning notes (docs/platform.md) compare prefetch hints. What a hint does is the CPU's choice: Intel's cores put
`_MM_HINT_T1`/`T2` lines in L2, AMD's before Zen 4 put every hint's line in L1, as `T0` does. Then "a prefetch into
L2" is no different from the near one, and each prefetch holds one of the core's few L1 miss buffers until DRAM
answers. This prints, for each hint, the TSC ticks of a dependent load of a line prefetched from DRAM a few
microseconds earlier, beside the same load of a line in L1 and of one in L2, so a reader can tell which level the
hint filled here.

    python benchmarks/prefetch_hints.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <x86intrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

// Each case puts 16 random lines of a 1 GiB buffer somewhere, then times the same dependent chain of loads
// through them: the reference cases (lines just loaded: L1; loaded, then 128 KiB of other lines read: L2) against
// a DRAM line prefetched with each hint a few microseconds earlier.
int main() {
  const size_t bytes = size_t(1) << 30;  // far beyond any L3
  char* buf = static_cast<char*>(aligned_alloc(4096, bytes));
  for (size_t i = 0; i < bytes; i += 4096) buf[i] = 1;
  const size_t evict_bytes = size_t(128) << 10;  // 4x Zen 3's L1, a quarter of its L2
  char* evict = static_cast<char*>(aligned_alloc(4096, evict_bytes));
  for (size_t i = 0; i < evict_bytes; ++i) evict[i] = 1;
  std::mt19937_64 rng(1);
  const int lines = 16;
  const char* names[] = {"loaded (L1)", "loaded, evicted from L1 (L2)", "in DRAM, no prefetch",
                         "prefetched _MM_HINT_T0", "prefetched _MM_HINT_T1", "prefetched _MM_HINT_T2",
                         "prefetched _MM_HINT_NTA"};
  volatile uint64_t sink = 0;
  for (int c = 0; c < 7; ++c) {
    std::vector<double> ticks;
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<size_t> offsets(lines);
      for (auto& o : offsets) o = (rng() % (bytes / 64)) * 64;
      for (auto o : offsets) *reinterpret_cast<uint64_t*>(buf + o) = 0;  // chain values: 0, the next offset added
      for (auto o : offsets) _mm_clflush(buf + o);
      _mm_mfence();
      for (auto o : offsets) {
        if (c <= 1) sink = sink + *reinterpret_cast<volatile uint64_t*>(buf + o);
        if (c == 3) _mm_prefetch(buf + o, _MM_HINT_T0);
        if (c == 4) _mm_prefetch(buf + o, _MM_HINT_T1);
        if (c == 5) _mm_prefetch(buf + o, _MM_HINT_T2);
        if (c == 6) _mm_prefetch(buf + o, _MM_HINT_NTA);
      }
      if (c == 1) {
        uint64_t s = 0;
        for (size_t i = 0; i < evict_bytes; i += 64) s += *reinterpret_cast<volatile char*>(evict + i);
        sink = sink + s;
      }
      const uint64_t wait = __rdtsc();
      while (__rdtsc() - wait < 20000) {}  // several microseconds: every prefetch has landed
      uint64_t dep = 0;
      unsigned aux;
      const uint64_t t0 = __rdtscp(&aux);
      for (auto o : offsets) dep += *reinterpret_cast<volatile uint64_t*>(buf + o + dep);  // dep stays 0
      const uint64_t t1 = __rdtscp(&aux);
      ticks.push_back(double(t1 - t0) / lines + double(dep));
    }
    std::sort(ticks.begin(), ticks.end());
    std::printf("a line %-30s %6.1f TSC ticks per dependent load (median of %zu)\n", names[c], ticks[ticks.size() / 2],
                ticks.size());
  }
  free(buf);
  free(evict);
}
"""


def main() -> None:
    from scoutbench.kernels.cpu_attention import _compiler

    compiler = _compiler()  # the kernel's own choice: $CXX, then g++, then c++
    if compiler is None:
        raise SystemExit("prefetch_hints: no C++ compiler: set CXX, or install g++ (e.g. apt install g++)")
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "hints.cpp", Path(folder) / "hints"
        source.write_text(SOURCE)
        build = subprocess.run([compiler, "-O2", "-march=native", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"prefetch_hints: {compiler} failed (an x86-64 CPU is needed): "
                             f"{(build.stderr.strip().splitlines() or ['?'])[-1]}")
        sys.stdout.write(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
