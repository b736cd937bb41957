// The library's identity and its one thread pool.
//
//
// The library also holds a decode step's other CPU kernels, on the same pool (each section says why): the decode
// linear, HF's RMSNorm and attention prologue (kernels/cpu_decode.py), Quest digest scores with their top-k
// (kernels/digest_native.py), InfiniGen's token top-n, and the two-part LSE merge (kernels/cpu_attention.py).
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

int sb_abi_version() { return 6; }

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
