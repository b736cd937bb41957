// The AVX-512 decode-attention kernel (attention.h's schedule on 16-lane vectors; AVX512-BF16 dot products where
// the CPU has them).
#include "attention.h"

#ifdef SB_AVX512
namespace sb {
namespace {

inline __m512 exp2_ps(__m512 x) {
  // 2^x = 2^n * 2^f, n = round(x), f in [-0.5, 0.5]: degree-7 Taylor of e^(f ln 2), relative error < 1e-8
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));  // 2^-126: the smallest normal
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// QK of one query against a tile of 16 token rows: scores (base-2 logits) of the tile, in token order. The loops
// run token-major, so the first query's pass reads each row in address order: a stream the hardware prefetcher
// follows (column-major, a tile's lines arrive in a stride-of-a-row order it does not, and DRAM latency shows).
template <int D>
inline __m512 tile_scores_f32(const float* qg, const float* const* kp, int n) {
  constexpr int C = D / 16;
  __m512 acc[kTile];
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
  if (n == kTile) {
#pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i)
      for (int c = 0; c < C; ++c)
        acc[slot_of(i)] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(kp[i] + 16 * c),
                                          acc[slot_of(i)]);
  } else {
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < C; ++c)
        acc[slot_of(i)] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(kp[i] + 16 * c),
                                          acc[slot_of(i)]);
  }
  return reduce16(acc);
}

template <int D, bool FULL>
inline void tile_dots_bf16(const uint16_t* qg_bf16, const float* qg_even_odd, const uint16_t* const* kp, int n,
                           __m512* acc) {
  constexpr int C = D / 32;
  const int count = FULL ? kTile : n;
#ifdef __AVX512BF16__
  (void)qg_even_odd;
#pragma GCC unroll 16
  for (int i = 0; i < count; ++i)
    for (int c = 0; c < C; ++c)
      acc[slot_of(i)] = _mm512_dpbf16_ps(acc[slot_of(i)], (__m512bh)_mm512_loadu_si512(qg_bf16 + 32 * c),
                                         (__m512bh)_mm512_loadu_si512(kp[i] + 32 * c));
#else
  (void)qg_bf16;
#pragma GCC unroll 16
  for (int i = 0; i < count; ++i)
    for (int c = 0; c < C; ++c) {
      __m512 ke, ko;
      bf16_even_odd(kp[i] + 32 * c, ke, ko);
      acc[slot_of(i)] = _mm512_fmadd_ps(_mm512_loadu_ps(qg_even_odd + 32 * c), ke,
                                        _mm512_fmadd_ps(_mm512_loadu_ps(qg_even_odd + 32 * c + 16), ko,
                                                        acc[slot_of(i)]));
    }
#endif
}

template <int D>
inline __m512 tile_scores_bf16(const uint16_t* qg_bf16, const float* qg_even_odd, const uint16_t* const* kp,
                               int n) {
  __m512 acc[kTile];
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
  if (n == kTile) {
    tile_dots_bf16<D, true>(qg_bf16, qg_even_odd, kp, n, acc);
  } else {
    tile_dots_bf16<D, false>(qg_bf16, qg_even_odd, kp, n, acc);
  }
  return reduce16(acc);
}

// Columns and queries of one PV pass: whole rows up to 128 columns (the first pass reads each V row in address
// order, as the QK loops do), and as many queries as 32 vector registers hold beside the row.
constexpr int pv_cols(int D) { return D < 128 ? D : 128; }
constexpr int pv_queries(int D) { return pv_cols(D) <= 64 ? 4 : 2; }

// acc[g][pass columns] += sum_i p[g][i] * v[i][pass columns] for GB <= pv_queries(D) queries.
template <int D, int GB, bool BF16>
inline void tile_pv(float* const* accs, const float* const* probs, const void* const* vp, int n) {
  constexpr int W = pv_cols(D), V = W / 16;
  for (int d0 = 0; d0 < D; d0 += W) {
    __m512 acc[GB][V];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < V; ++c) acc[g][c] = _mm512_loadu_ps(accs[g] + d0 + 16 * c);
    for (int i = 0; i < n; ++i) {
      __m512 x[V];
      if constexpr (BF16) {
        const uint16_t* row = static_cast<const uint16_t*>(vp[i]) + d0;
        for (int c = 0; c < V; c += 2) bf16_even_odd(row + 16 * c, x[c], x[c + 1]);
      } else {
        const float* row = static_cast<const float*>(vp[i]) + d0;
        for (int c = 0; c < V; ++c) x[c] = _mm512_loadu_ps(row + 16 * c);
      }
      for (int g = 0; g < GB; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g][i]);
        for (int c = 0; c < V; ++c) acc[g][c] = _mm512_fmadd_ps(p, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(accs[g] + d0 + 16 * c, acc[g][c]);
  }
}

// tile_pv for gb (1 .. pv_queries(D)) queries
template <int D, bool BF16, int GB = pv_queries(D)>
void pv_dispatch(int gb, float* const* accs, const float* const* probs, const void* const* vp, int n) {
  if constexpr (GB > 1) {
    if (gb < GB) return pv_dispatch<D, BF16, GB - 1>(gb, accs, probs, vp, n);
  }
  tile_pv<D, GB, BF16>(accs, probs, vp, n);
}

template <int D, bool BF16>
void attend_avx512(const Args& a, const Item& item, State st) {
  using T = typename std::conditional<BF16, uint16_t, float>::type;
  const int G = static_cast<int>(a.G);
  RowView<T> rv = row_view<T>(a, item.row);
  const T* q = static_cast<const T*>(a.q) + item.row * G * D;
  // fp32 q; bf16 without AVX512-BF16: each 32-chunk as even | odd, widened a vector at a time (element by element
  // it was microseconds a call); with AVX512-BF16 the dot products read q as it is and qf is not read
  alignas(64) float qf[kMaxGroup * D];
  if constexpr (BF16) {
#ifndef __AVX512BF16__
    for (int i = 0; i < G * D; i += 32) {
      __m512 even, odd;
      bf16_even_odd(reinterpret_cast<const uint16_t*>(q) + i, even, odd);
      _mm512_store_ps(qf + i, even);
      _mm512_store_ps(qf + i + 16, odd);
    }
#endif
  } else {
    std::memcpy(qf, q, sizeof(float) * G * D);
  }
  const __m512 scale2 = _mm512_set1_ps(a.scale * kLog2e);
  for (int g = 0; g < G; ++g) {
    st.m[g] = kNegInf;
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + G * D, 0.f);
  alignas(64) float probs_step[kMaxGroup][kStepTokens];  // the step's logits, then its probabilities
  __m512 lsum[kMaxGroup];
  for (int g = 0; g < G; ++g) lsum[g] = _mm512_setzero_ps();
  float* probs_row = a.probs ? a.probs + item.row * G * a.probs_width : nullptr;
  PrefetchedRows<T, D> rows(a, rv, item);
  constexpr int GB = pv_queries(D);
  const int pv_groups = (G + GB - 1) / GB;
  for (int64_t t0 = item.begin; t0 < item.end; t0 += kStepTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kStepTokens, item.end - t0));
    const int tiles = (n + kTile - 1) / kTile;
    // the step's prefetches in equal shares, one before each of its (G + pv_groups) * tiles tile passes
    const int shares = (G + pv_groups) * tiles;
    auto prefetch_share = [&](int pass) {
      rows.prefetch_until(t0 + int64_t{n} * (pass + 1) / shares);
    };
    const T* kp[kStepTokens];
    const T* vp[kStepTokens];
    rows.k.fill(kp, n);
    rows.v.fill(vp, n);
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < tiles; ++j) {
        const int m = std::min(kTile, n - j * kTile);
        prefetch_share(g * tiles + j);
        __m512 s;
        if constexpr (BF16) {
          s = tile_scores_bf16<D>(reinterpret_cast<const uint16_t*>(q) + g * D, qf + g * D,
                                  reinterpret_cast<const uint16_t* const*>(kp + j * kTile), m);
        } else {
          s = tile_scores_f32<D>(qf + g * D, reinterpret_cast<const float* const*>(kp + j * kTile), m);
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1u);
        s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, _mm512_mul_ps(s, scale2));
        if (probs_row) _mm512_mask_storeu_ps(probs_row + g * a.probs_width + t0 + j * kTile, valid, s);
        _mm512_store_ps(probs_step[g] + j * kTile, s);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 vmax = _mm512_load_ps(probs_step[g]);
      for (int j = 1; j < tiles; ++j) vmax = _mm512_max_ps(vmax, _mm512_load_ps(probs_step[g] + j * kTile));
      const float step_max = _mm512_reduce_max_ps(vmax);
      if (step_max > st.m[g]) {
        const __m512 alpha = _mm512_set1_ps(std::exp2(st.m[g] - step_max));
        lsum[g] = _mm512_mul_ps(lsum[g], alpha);
        float* acc = st.acc + g * D;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), alpha));
        st.m[g] = step_max;
      }
      const __m512 m = _mm512_set1_ps(st.m[g]);
      for (int j = 0; j < tiles; ++j) {
        const __m512 s = _mm512_load_ps(probs_step[g] + j * kTile);
        // exp2_ps clamps its input, so a masked (-inf) logit's lane is zeroed here
        const __mmask16 valid = static_cast<__mmask16>((1u << std::min(kTile, n - j * kTile)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(s, m)));
        lsum[g] = _mm512_add_ps(lsum[g], p);
        _mm512_store_ps(probs_step[g] + j * kTile, p);
      }
    }
    for (int g0 = 0; g0 < G; g0 += GB) {
      const int gb = std::min(GB, G - g0);
      float* accs[GB];
      for (int g = 0; g < gb; ++g) accs[g] = st.acc + (g0 + g) * D;
      for (int j = 0; j < tiles; ++j) {
        prefetch_share((G + g0 / GB) * tiles + j);
        const float* ps[GB];
        for (int g = 0; g < gb; ++g) ps[g] = probs_step[g0 + g] + j * kTile;
        pv_dispatch<D, BF16>(gb, accs, ps, reinterpret_cast<const void* const*>(vp + j * kTile),
                             std::min(kTile, n - j * kTile));
      }
    }
  }
  for (int g = 0; g < G; ++g) st.l[g] = _mm512_reduce_add_ps(lsum[g]);
}

template <bool BF16>
AttendFn avx512_for(int64_t D) {
  switch (D) {
    case 64: return attend_avx512<64, BF16>;
    case 128: return attend_avx512<128, BF16>;
    case 256: return attend_avx512<256, BF16>;
    default: return nullptr;
  }
}

}  // namespace

AttendFn avx512_kernel(bool bf16, int64_t D) { return bf16 ? avx512_for<true>(D) : avx512_for<false>(D); }

}  // namespace sb
#endif  // SB_AVX512
