// Row copies between tensors by index (kernels/cpu_attention.py's copy_rows: a recall's K and V blocks).
#include "common.h"
#include "pool.h"

namespace sb {
namespace {

constexpr int64_t kMinParallelCopyBytes = 256 * 1024;  // bytes below which a copy runs on the caller alone

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

// dst row dst_rows[i] = src row src_rows[i] for i < n, rows of row_bytes (the caller checks the ids): one pass,
// where index_select into a buffer and index_copy_ out of it read and write every byte twice. 0 on success.
int sb_copy_rows(int64_t n, int64_t row_bytes, void* dst, const int64_t* dst_rows, const void* src,
                 const int64_t* src_rows, int threads) {
  if (n < 0 || row_bytes < 0) return 1;
  if (n * row_bytes < kMinParallelCopyBytes) threads = 1;
  char* to = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
  pool().run(n, threads, [&](int64_t i) {
    std::memcpy(to + dst_rows[i] * row_bytes, from + src_rows[i] * row_bytes, static_cast<size_t>(row_bytes));
  });
  return 0;
}

}  // extern "C"
