// What every kernel of the library shares: the vector ISA this build takes, element types and conversions, and the
// small vector helpers several kernels use (a tile's prefetch, reductions, bf16 widening).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SB_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SB_AVX2 1
#endif

#pragma GCC visibility push(hidden)  // the library's own symbols: only the extern "C" entry points are exported
namespace sb {

constexpr int kTile = 16;  // tokens per tile: one 16-lane vector of scores per query
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum DType : int { kF32 = 0, kBF16 = 1 };

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float to_float(T x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<uint16_t>(uint16_t x) { return bf16_to_float(x); }

// fn(T{}) with T the element type of `dtype` (kF32: float, kBF16: bf16 as uint16_t): one dispatch per entry point
template <typename Fn>
void with_dtype(int dtype, Fn&& fn) {
  if (dtype == kF32) {
    fn(float{});
  } else {
    fn(uint16_t{});
  }
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Where element d of a row sits in the vector paths' bf16 layout: each chunk of `chunk` elements stored as its even
// elements, then its odd ones (how a shift and a mask widen bf16 pairs). The AVX-512 attention kernel and the digest
// scorers lay out q by it (the AVX2 attention kernel widens q as it widens K, which puts each element there), and
// the attention's store_row undoes it when it writes the accumulators out.
constexpr int64_t even_odd_slot(int64_t d, int64_t chunk) {
  return (d / chunk) * chunk + (d % 2) * (chunk / 2) + (d % chunk) / 2;
}

template <typename T>
inline void store_out(T* dst, float value) {
  if constexpr (std::is_same_v<T, float>) {
    *dst = value;
  } else {
    *dst = float_to_bf16(value);
  }
}

#if defined(SB_AVX512) || defined(SB_AVX2)
// Whether this CPU's prefetch hints can fill L2 without L1 (Zen 4 and Intel's AVX-512 cores; Zen 2 and 3 fill L1 with
// every hint): AVX-512 (F) as the sign, asked at run time, so that the AVX2 path forced on such a CPU
// (SCOUTBENCH_CPU_ISA) prefetches as it would there. The kernels' software prefetch takes its form from it.
inline bool l2_prefetch_hints() {
  static const bool value = __builtin_cpu_supports("avx512f");
  return value;
}

// every line of [p, p + bytes) into L1 (_MM_HINT_T0), or as `Hint` says
template <int Hint = _MM_HINT_T0>
inline void prefetch_row(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(Hint));
}
#endif

#ifdef SB_AVX512
// Sums of 16 vectors, lane i = sum of acc[slot(i)], where token i's accumulator sits in slot 4 * (i % 4) + i / 4.
inline __m512 reduce16(const __m512* acc) {
  __m512 l1[8], l2[4], l3[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m512 a = acc[2 * i], b = acc[2 * i + 1];
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512 a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m512 a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int slot_of(int token) { return 4 * (token % 4) + token / 4; }

// bf16 -> fp32 of 32 elements as (even elements, odd elements): a shift and a mask, no lane crossing
inline void bf16_even_odd(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif  // SB_AVX512

#ifdef SB_AVX2
constexpr int kTile8 = 8;  // tokens per AVX2 tile: one 8-lane vector of scores per query

// lane i = the sum of acc[i]'s 8 lanes
inline __m256 reduce8(const __m256* acc) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: 4 partial sums each
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// lanes [0, n) set: a tile's valid tokens
inline __m256 lanes_below(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// bf16 -> fp32 of 16 elements as (even elements, odd elements): a shift and a mask, no lane crossing
inline void bf16_even_odd8(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif  // SB_AVX2

}  // namespace sb
#pragma GCC visibility pop
