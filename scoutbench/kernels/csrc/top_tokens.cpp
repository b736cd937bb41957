// InfiniGen's token speculation (kernels/cpu_attention.py's top_tokens).
#include "common.h"
#include "pool.h"

namespace sb {
namespace {

// ------------------------------------------------------------------------------------------ token top-n
// InfiniGen's speculation on a CPU: for each row r (a (sequence, KV head) pair), token t < len of its partial keys
// k [t, P] scores max_g q_g . k_t over the row's G partial queries; the n best tokens (ties by lower index) are
// written in ascending token order, so that the attention reading them in place walks the tier in address order.
// torch's path is a [G, P] x [P, N] matmul with P = 26 channels, which MKL reads at a third of the memory rate, a
// mask, a group max and topk over the row's tokens; here one pass scores and a histogram select picks.
#ifdef SB_AVX512
// 16 tokens at a time, C chunks of 16 channels (the last masked): per query, each token's partial dot product is a
// vector, and reduce16 sums the tile's 16 of them at once (as the attention kernel's QK does).
template <int C>
int64_t token_scores_avx512(const float* k, int64_t tok_stride, const float* q, int64_t G, int64_t P, int64_t len,
                            float* scores) {
  const __mmask16 tail = static_cast<__mmask16>(P % 16 ? (1u << (P % 16)) - 1u : 0xffffu);
  // the rows kTokenPrefetch tokens ahead: the hardware prefetcher alone left this stream at half the read rate
  constexpr int64_t kTokenPrefetch = 4 * kTile;
  const bool contiguous = tok_stride == P;
  int64_t t = 0;
  for (; t + kTile <= len; t += kTile) {
    if (contiguous && t + kTokenPrefetch + kTile <= len)
      prefetch_row(k + (t + kTokenPrefetch) * tok_stride, static_cast<int>(kTile * P * sizeof(float)));
    __m512 best = _mm512_set1_ps(kNegInf);
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) qv[c] = _mm512_maskz_loadu_ps(c + 1 == C ? tail : 0xffff, q + g * P + 16 * c);
      __m512 acc[kTile];
#pragma GCC unroll 16
      for (int i = 0; i < kTile; ++i) {
        const float* row = k + (t + i) * tok_stride;
        __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(C == 1 ? tail : 0xffff, row), qv[0]);
#pragma GCC unroll 4
        for (int c = 1; c < C; ++c)
          a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(c + 1 == C ? tail : 0xffff, row + 16 * c), qv[c], a);
        acc[slot_of(i)] = a;
      }
      best = _mm512_max_ps(best, reduce16(acc));
    }
    _mm512_storeu_ps(scores + t, best);
  }
  return t;
}
#endif

#ifdef SB_AVX2
// token_scores_avx512 on 8 tokens at a time and C chunks of 8 channels (the last masked), reduced by reduce8
template <int C>
int64_t token_scores_avx2(const float* k, int64_t tok_stride, const float* q, int64_t G, int64_t P, int64_t len,
                          float* scores) {
  const __m256i tail = _mm256_castps_si256(lanes_below(P % 8 ? static_cast<int>(P % 8) : 8));
  constexpr int64_t kTokenPrefetch = 8 * kTile8;
  const bool contiguous = tok_stride == P;
  auto load = [&](const float* p, int c) {
    return c + 1 == C ? _mm256_maskload_ps(p, tail) : _mm256_loadu_ps(p);
  };
  int64_t t = 0;
  for (; t + kTile8 <= len; t += kTile8) {
    if (contiguous && t + kTokenPrefetch + kTile8 <= len)
      prefetch_row(k + (t + kTokenPrefetch) * tok_stride, static_cast<int>(kTile8 * P * sizeof(float)));
    __m256 best = _mm256_set1_ps(kNegInf);
    for (int64_t g = 0; g < G; ++g) {
      __m256 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load(q + g * P + 8 * c, c);
      __m256 acc[kTile8];
#pragma GCC unroll 8
      for (int i = 0; i < kTile8; ++i) {
        const float* row = k + (t + i) * tok_stride;
        __m256 a = _mm256_mul_ps(load(row, 0), qv[0]);
        for (int c = 1; c < C; ++c) a = _mm256_fmadd_ps(load(row + 8 * c, c), qv[c], a);
        acc[i] = a;
      }
      best = _mm256_max_ps(best, reduce8(acc));
    }
    _mm256_storeu_ps(scores + t, best);
  }
  return t;
}
#endif

void token_scores(const float* k, int64_t tok_stride, const float* q, int64_t G, int64_t P, int64_t len,
                  float* scores) {
  int64_t t = 0;
#ifdef SB_AVX512
  switch ((P + 15) / 16) {
    case 1: t = token_scores_avx512<1>(k, tok_stride, q, G, P, len, scores); break;
    case 2: t = token_scores_avx512<2>(k, tok_stride, q, G, P, len, scores); break;
    case 3: t = token_scores_avx512<3>(k, tok_stride, q, G, P, len, scores); break;
    case 4: t = token_scores_avx512<4>(k, tok_stride, q, G, P, len, scores); break;
    default: break;
  }
#elif defined(SB_AVX2)
  switch ((P + 7) / 8) {
    case 1: t = token_scores_avx2<1>(k, tok_stride, q, G, P, len, scores); break;
    case 2: t = token_scores_avx2<2>(k, tok_stride, q, G, P, len, scores); break;
    case 3: t = token_scores_avx2<3>(k, tok_stride, q, G, P, len, scores); break;
    case 4: t = token_scores_avx2<4>(k, tok_stride, q, G, P, len, scores); break;
    default: break;
  }
#endif
  for (; t < len; ++t) {
    const float* row = k + t * tok_stride;
    float best = kNegInf;
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t c = 0; c < P; ++c) dot += q[g * P + c] * row[c];
      best = std::max(best, dot);
    }
    scores[t] = best;
  }
}

// a float's bits as an unsigned key in the same order (negative floats reversed below the positive ones)
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The take-th largest key of keys[0, len) (1 <= take <= len), by three histogram passes over 11, 11 and 10 bits:
// no comparison branches (std::nth_element's mispredict on random scores).
uint32_t kth_largest_key(const uint32_t* keys, int64_t len, int64_t take) {
  uint32_t prefix = 0, prefix_mask = 0;
  int64_t remaining = take;
  const int shifts[3] = {21, 10, 0};
  const uint32_t widths[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass];
    const uint32_t bins = 1u << widths[pass];
    int64_t count[2048] = {};
    for (int64_t t = 0; t < len; ++t) {
      const uint32_t key = keys[t];
      if ((key & prefix_mask) == prefix) ++count[(key >> shift) & (bins - 1)];
    }
    uint32_t bin = bins - 1;
    for (;; --bin) {
      if (count[bin] >= remaining) break;
      remaining -= count[bin];
    }
    prefix |= bin << shift;
    prefix_mask |= (bins - 1) << shift;
  }
  return prefix;
}

// the n best of scores[0, len) (ties by lower index) in ascending index order into out, then 0 up to n
void top_tokens_of(const float* scores, int64_t len, int64_t n, int64_t* out) {
  const int64_t take = std::min(n, len);
  int64_t written = 0;
  if (take > 0) {
    thread_local std::vector<uint32_t> keys;
    keys.resize(len);
    for (int64_t t = 0; t < len; ++t) keys[t] = order_key(scores[t]);
    const uint32_t threshold = kth_largest_key(keys.data(), len, take);
    int64_t above = 0;  // every token above the threshold is taken, then the first ones at it
    for (int64_t t = 0; t < len; ++t) above += keys[t] > threshold;
    int64_t ties = take - above;
    for (int64_t t = 0; t < len && written < take; ++t) {
      const uint32_t key = keys[t];
      if (key > threshold || (key == threshold && ties-- > 0)) out[written++] = t;
    }
  }
  std::fill(out + written, out + n, int64_t{0});
}

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

// InfiniGen's speculated tokens: partial keys k of row r at k + r * row_stride, token t at + t * tok_stride (P
// contiguous floats); q [rows, G, P]; lens [B] valid tokens per sequence (rows r / heads); ids [rows, n] (above).
int sb_top_tokens(int64_t rows, int64_t heads, int64_t G, int64_t P, const float* k, int64_t row_stride,
                  int64_t tok_stride, const float* q, const int64_t* lens, int64_t n, int64_t* ids, int threads) {
  if (rows < 0 || heads < 1 || G < 1 || P < 1 || n < 0) return 1;
  pool().run(rows, threads, [&](int64_t r) {
    thread_local std::vector<float> scores;
    const int64_t len = lens[r / heads];
    scores.resize(std::max<int64_t>(len, 1));
    token_scores(k + r * row_stride, tok_stride, q + r * G * P, G, P, len, scores.data());
    top_tokens_of(scores.data(), len, n, ids + r * n);
  });
  return 0;
}

}  // extern "C"
