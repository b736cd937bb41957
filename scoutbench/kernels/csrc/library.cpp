// The library's identity (its ABI version, the vector ISA this build takes, the pool's helper spin) and its one
// thread pool, which every kernel shares: decode attention (attention*.cpp), the decode linear, HF's RMSNorm and
// attention prologue (decode.cpp), Quest digest scores with their top-k (digest.cpp), InfiniGen's token top-n
// (top_tokens.cpp), ScoutAttention's split (split_plan.cpp), row copies (copy_rows.cpp) and the two-part LSE
// merge (merge.cpp). Each file says why its kernel exists; scoutbench/kernels/native_abi.py declares every
// extern "C" function for ctypes.
#include "pool.h"

namespace sb {

Pool& pool() {
  static Pool* instance = [] {
    Pool* p = new Pool();  // never destroyed: detached helpers may outlive static destruction
    pthread_atfork(nullptr, nullptr, [] { pool().reset_after_fork(); });
    return p;
  }();
  return *instance;
}

}  // namespace sb

using namespace sb;

extern "C" {

// native_abi.ABI_VERSION: raised with any change of an entry point's parameters, so that a stale cached build is
// refused rather than called with the wrong arguments
int sb_abi_version() { return 7; }

int sb_helper_spin_us() { return Pool::spin_us(); }

const char* sb_isa() {
#if defined(SB_AVX512) && defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(SB_AVX512)
  return "avx512";
#elif defined(SB_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // extern "C"
