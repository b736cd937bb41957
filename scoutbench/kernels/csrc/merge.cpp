// The exact merge of two partial attention states (kernels/partial_state.py's merge_states on a CPU): one call for
// torch's seven.
#include "common.h"

using namespace sb;

extern "C" {

// The exact merge of two partial states (PartialState: o [rows, D] fp32, natural-log lse [rows]); an empty part
// (lse = -inf) weighs 0, two empty parts give o = 0, lse = -inf. 0 on success.
int sb_merge2(int64_t rows, int64_t D, const float* o_a, const float* lse_a, const float* o_b, const float* lse_b,
              float* o, float* lse) {
  if (rows < 0 || D < 0) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    const float la = lse_a[r], lb = lse_b[r], m = std::max(la, lb);
    float* dst = o + r * D;
    if (m == kNegInf) {
      std::fill(dst, dst + D, 0.f);
      lse[r] = kNegInf;
      continue;
    }
    const float wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
    const float ca = wa / sum, cb = wb / sum;
    const float* a = o_a + r * D;
    const float* b = o_b + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = ca * a[d] + cb * b[d];
    lse[r] = m + std::log(sum);
  }
  return 0;
}

}  // extern "C"
