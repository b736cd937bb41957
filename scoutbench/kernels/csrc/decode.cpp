// A decode step's CPU work around attention (kernels/cpu_decode.py): the decode linear, HF's RMSNorm and the
// attention prologue (q/k/v projections, q/k norms, RoPE) in one call.
#include "common.h"
#include "pool.h"

namespace sb {
namespace {

// ------------------------------------------------------------------------------------------ decode linear
// y [M, N] = x [M, K] W^T (+ bias [N]) with W [N, K] row-major (nn.Linear's weight), fp32 or bf16, accumulated in
// fp32; a bf16 result is rounded to nearest even, as torch rounds. At decode M is the batch, so a linear is a read
// of W: four rows of W against each row of x at a time stream it at about twice the rate of MKL's sgemv on AMD
// CPUs, whose AVX-512 paths are Intel's (docs/platform.md). Tasks are runs of kLinearRows rows of W.
constexpr int64_t kLinearRows = 64;
// Rows of a page or more, read four at a time, are four page-long streams, which the hardware prefetcher follows.
// Shorter rows, four at a time, interleave four streams within a page, which it does not follow (docs/platform.md).
constexpr int64_t kPageBytes = 4096;

#ifdef SB_AVX512
template <typename T>
inline __m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
}
#endif

#ifdef SB_AVX512
// The sums of four rows of W (w0, rows K apart) against one row x, Lanes elements a step: dot(acc, w, x, mask)
// adds one step's products (the last step masked to K). With `sweep`, each step also prefetches as many bytes from
// there on as it reads of W, so that the sweep covers the next four rows as these four are read.
template <int Lanes, typename TW, typename TX, typename Dot>
inline void four_row_sums(const TW* w0, const TX* x, int64_t K, Dot dot, float* sums, const char* sweep) {
  using Mask = std::conditional_t<Lanes == 32, __mmask32, __mmask16>;
  const int64_t body = K - K % Lanes;
  const Mask full = static_cast<Mask>(~Mask{0});
  const Mask tail = static_cast<Mask>((uint64_t{1} << (K % Lanes)) - 1u);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < body; k += Lanes) {
    if (sweep != nullptr) {
      constexpr int kStepBytes = 4 * Lanes * static_cast<int>(sizeof(TW));
      for (int line = 0; line < kStepBytes; line += 64) _mm_prefetch(sweep + line, _MM_HINT_T0);
      sweep += kStepBytes;
    }
    for (int j = 0; j < 4; ++j) acc[j] = dot(acc[j], w0 + j * K + k, x + k, full);
  }
  if (tail)
    for (int j = 0; j < 4; ++j) acc[j] = dot(acc[j], w0 + j * K + body, x + body, tail);
  for (int j = 0; j < 4; ++j) sums[j] = _mm512_reduce_add_ps(acc[j]);
}
#endif

#ifdef SB_AVX2
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
}

// The sums of four rows of W (w0, rows K apart) against one row x in fp32, 8 elements a step, the tail in scalars.
template <typename T>
inline void four_row_sums8(const T* w0, const float* x, int64_t K, float* sums) {
  const int64_t body = K - K % 8;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(load8(w0 + j * K + k), xv, acc[j]);
  }
  for (int j = 0; j < 4; ++j) {
    sums[j] = hsum8(acc[j]);
    for (int64_t k = body; k < K; ++k) sums[j] += to_float(w0[j * K + k]) * x[k];
  }
}
#endif

// rows [n0, n1) of W against every row of x (xf: x in fp32, [M, K]; xbf: x itself)
template <typename T>
void linear_rows(const float* xf, const T* xbf, const T* W, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef SB_AVX512
  // Rows shorter than a page: the next four rows (contiguous) prefetched in address order, at once as each four
  // start where the four fit in a page (rows of up to 1 KiB), else swept a step at a time (two prefetch forms,
  // each the faster where it is used: docs/platform.md). Rows of a page or more: the hardware prefetcher's.
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
  const bool short_rows = row_bytes < kPageBytes, burst = 4 * row_bytes <= kPageBytes;
  for (; n + 4 <= n1; n += 4) {
    const char* sweep = nullptr;
    if (short_rows && n + 8 <= N) {
      if (burst) {
        prefetch_row(W + (n + 4) * K, static_cast<int>(4 * row_bytes));
      } else {
        sweep = reinterpret_cast<const char*>(W + (n + 4) * K);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float sums[4];
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, uint16_t>) {  // bf16 pair dot products: exact products, fp32 sums
        four_row_sums<32>(W + n * K, xbf + m * K, K, [](__m512 acc, const uint16_t* w, const uint16_t* x,
                                                         __mmask32 mask) {
          return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, w),
                                  (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
        }, sums, m == 0 ? sweep : nullptr);
      } else
#endif
      {
        (void)xbf;
        four_row_sums<16>(W + n * K, xf + m * K, K, [](__m512 acc, const T* w, const float* x, __mmask16 mask) {
          return _mm512_fmadd_ps(load16(w, mask), _mm512_maskz_loadu_ps(mask, x), acc);
        }, sums, m == 0 ? sweep : nullptr);
      }
      for (int j = 0; j < 4; ++j) store_out(y + m * N + n + j, sums[j] + (bias ? to_float(bias[n + j]) : 0.f));
    }
  }
#elif defined(SB_AVX2)
  (void)xbf;
  // four rows at a time where a row is a page or more; shorter rows are faster one after the other in the plain
  // loop below (Zen 3, docs/platform.md)
  const int64_t four_row_end = K * static_cast<int64_t>(sizeof(T)) >= kPageBytes ? n1 : n0;
  for (; n + 4 <= four_row_end; n += 4) {
    for (int64_t m = 0; m < M; ++m) {
      float sums[4];
      four_row_sums8(W + n * K, xf + m * K, K, sums);
      for (int j = 0; j < 4; ++j) store_out(y + m * N + n + j, sums[j] + (bias ? to_float(bias[n + j]) : 0.f));
    }
  }
#else
  (void)xbf;
#endif
  for (; n < n1; ++n) {
    const T* w = W + n * K;
#ifdef SB_AVX2
    // short rows, one after the other: the row 4 ahead prefetched
    if (n + 4 < n1) prefetch_row(W + (n + 4) * K, static_cast<int>(K * sizeof(T)));
#endif
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xf + m * K;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += to_float(w[k]) * xm[k];
      store_out(y + m * N + n, acc + (bias ? to_float(bias[n]) : 0.f));
    }
  }
}

constexpr int64_t kLinearBytesPerThread = int64_t{2} << 20;  // below this much weight a helper costs what it saves

template <typename T>
void linear(const T* x, const T* W, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int threads) {
  threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(threads, N * K * static_cast<int64_t>(sizeof(T)) / kLinearBytesPerThread)));
  thread_local std::vector<float> xf;
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
  const float* xp = xf.data();
  pool().run((N + kLinearRows - 1) / kLinearRows, threads, [&](int64_t task) {
    const int64_t n0 = task * kLinearRows;
    linear_rows(xp, x, W, bias, y, M, N, K, n0, std::min(N, n0 + kLinearRows));
  });
}

// ------------------------------------------------------------------------------------------ decode prologue
// HF's RMSNorm (LlamaRMSNorm and its copies): w * (x * rsqrt(mean(x^2) + eps)), the sum in fp32 and the normalised
// row rounded to the model dtype before the weight multiplies it, as HF does.
template <typename T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t n, T* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    T normed;
    store_out(&normed, to_float(x[i]) * inv);
    store_out(out + i, to_float(w[i]) * to_float(normed));
  }
}

// HF's rotate-half RoPE of one head in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1].
template <typename T>
void rope_row(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x[i + half]);
    store_out(x + i, a * to_float(cos[i]) - b * to_float(sin[i]));
    store_out(x + i + half, b * to_float(cos[i + half]) + a * to_float(sin[i + half]));
  }
}

// One decode step's attention prologue for M rows: q = RoPE(q_norm(normed Wq^T + bq)) [M, Hq, D] and, with wk,
// k = RoPE(k_norm(normed Wk^T + bk)), v = normed Wv^T + bv [M, Hkv, D]; norms where their weights are given;
// cos/sin [M, D]. One call for the ~45 torch ops of HF's prologue.
template <typename T>
void attention_prologue(int64_t M, int64_t hidden, const T* normed, const T* wq, const T* bq, const T* wk,
                        const T* bk, const T* wv, const T* bv, int64_t Hq, int64_t Hkv, int64_t D, const T* qn_w,
                        const T* kn_w, float qk_eps, const T* cos, const T* sin, T* q, T* k, T* v, int threads) {
  linear(normed, wq, bq, q, M, Hq * D, hidden, threads);
  if (wk != nullptr) {
    linear(normed, wk, bk, k, M, Hkv * D, hidden, threads);
    linear(normed, wv, bv, v, M, Hkv * D, hidden, threads);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < Hq; ++h) {
      T* row = q + (m * Hq + h) * D;
      if (qn_w != nullptr) rms_norm_row(row, qn_w, qk_eps, D, row);
      rope_row(row, cos + m * D, sin + m * D, D);
    }
    if (wk == nullptr) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      T* row = k + (m * Hkv + h) * D;
      if (kn_w != nullptr) rms_norm_row(row, kn_w, qk_eps, D, row);
      rope_row(row, cos + m * D, sin + m * D, D);
    }
  }
}

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

// y = x W^T (+ bias): x [M, K], W [N, K], bias [N] or null, y [M, N], all contiguous in one dtype. 0 on success.
int sb_linear(int dtype, int64_t M, int64_t N, int64_t K, const void* x, const void* W, const void* bias, void* y,
              int threads) {
  if ((dtype != kF32 && dtype != kBF16) || M < 0 || N < 0 || K < 0) return 1;
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    linear(static_cast<const T*>(x), static_cast<const T*>(W), static_cast<const T*>(bias), static_cast<T*>(y), M, N,
           K, threads);
  });
  return 0;
}

// out [rows, n] = HF's RMSNorm of x [rows, n] with weight w [n]. 0 on success.
int sb_rms_norm(int dtype, int64_t rows, int64_t n, const void* x, const void* w, float eps, void* out) {
  if ((dtype != kF32 && dtype != kBF16) || rows < 0 || n <= 0) return 1;
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < rows; ++r)
      rms_norm_row(static_cast<const T*>(x) + r * n, static_cast<const T*>(w), eps, n, static_cast<T*>(out) + r * n);
  });
  return 0;
}

// attention_prologue() above; wk null: q only (wv, bk, bv, kn_w, k, v unused); any bias or norm weight may be null.
int sb_attention_prologue(int dtype, int64_t M, int64_t hidden, const void* normed, const void* wq, const void* bq,
                          const void* wk, const void* bk, const void* wv, const void* bv, int64_t Hq, int64_t Hkv,
                          int64_t D, const void* qn_w, const void* kn_w, float qk_eps, const void* cos,
                          const void* sin, void* q, void* k, void* v, int threads) {
  if ((dtype != kF32 && dtype != kBF16) || M < 0 || hidden <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2) return 1;
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    attention_prologue<T>(M, hidden, static_cast<const T*>(normed), static_cast<const T*>(wq),
                          static_cast<const T*>(bq), static_cast<const T*>(wk), static_cast<const T*>(bk),
                          static_cast<const T*>(wv), static_cast<const T*>(bv), Hq, Hkv, D,
                          static_cast<const T*>(qn_w), static_cast<const T*>(kn_w), qk_eps,
                          static_cast<const T*>(cos), static_cast<const T*>(sin), static_cast<T*>(q),
                          static_cast<T*>(k), static_cast<T*>(v), threads);
  });
  return 0;
}

}  // extern "C"
