// The AVX2 decode-attention kernel, for CPUs with AVX2 and FMA but no AVX-512: AMD Zen 2 and 3 (the EPYC hosts of
// DGX A100 and of many GPU servers, and the CI machines), Intel's client cores and its servers before Skylake-SP.
// The AVX-512 kernel's schedule (softmax steps, QK tiles, the spread software prefetch) on 8-lane vectors: a tile is
// 8 tokens, and bf16 is widened by a shift and a mask into its even and odd elements (16-element chunks stored as
// even | odd, as store_row undoes). On these CPUs the portable loop reads KV at about a tenth of the machine's read
// bandwidth (docs/platform.md).
#include "attention.h"

#ifdef SB_AVX2
namespace sb {
namespace {

inline __m256 exp2_ps8(__m256 x) {
  // exp2_ps's polynomial; 2^n is built in the exponent field (AVX2 has no scalef)
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));  // 2^-126: the smallest normal
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// QK of one query against a tile of n <= 8 token rows: the tile's scores (unscaled), in token order. q is fp32 (bf16
// K: each 16-chunk as even | odd, matching bf16_even_odd8). fp32 runs token-major, each K row read in address order
// (as on AVX-512), bf16 chunk-major, each q chunk pair loaded once for the tile's rows: the faster order of each on
// Zen 3 (docs/platform.md).
template <int D, bool BF16, bool FULL>
inline __m256 tile_scores8(const float* qg, const void* const* kp, int n) {
  __m256 acc[kTile8];
  for (int i = 0; i < kTile8; ++i) acc[i] = _mm256_setzero_ps();
  const int count = FULL ? kTile8 : n;
  if constexpr (BF16) {
    for (int c = 0; c < D; c += 16) {
      const __m256 qe = _mm256_loadu_ps(qg + c), qo = _mm256_loadu_ps(qg + c + 8);
#pragma GCC unroll 8
      for (int i = 0; i < count; ++i) {
        __m256 ke, ko;
        bf16_even_odd8(static_cast<const uint16_t*>(kp[i]) + c, ke, ko);
        acc[i] = _mm256_fmadd_ps(qe, ke, _mm256_fmadd_ps(qo, ko, acc[i]));
      }
    }
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < count; ++i)
      for (int c = 0; c < D; c += 8)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(static_cast<const float*>(kp[i]) + c),
                                 acc[i]);
  }
  return reduce8(acc);
}

// PV passes of 32 columns for GB <= 2 queries: 8 accumulators, 4 row vectors and the broadcast probability fit the
// 16 vector registers. acc[g][pass columns] += sum_i p[g][i] * v[i][pass columns].
constexpr int kPv8Cols = 32;
constexpr int kPv8Queries = 2;

template <int D, int GB, bool BF16>
inline void tile_pv8(float* const* accs, const float* const* probs, const void* const* vp, int n) {
  constexpr int V = kPv8Cols / 8;
  for (int d0 = 0; d0 < D; d0 += kPv8Cols) {
    __m256 acc[GB][V];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < V; ++c) acc[g][c] = _mm256_loadu_ps(accs[g] + d0 + 8 * c);
    for (int i = 0; i < n; ++i) {
      __m256 x[V];
      if constexpr (BF16) {
        const uint16_t* row = static_cast<const uint16_t*>(vp[i]) + d0;
        for (int c = 0; c < V; c += 2) bf16_even_odd8(row + 8 * c, x[c], x[c + 1]);
      } else {
        const float* row = static_cast<const float*>(vp[i]) + d0;
        for (int c = 0; c < V; ++c) x[c] = _mm256_loadu_ps(row + 8 * c);
      }
      for (int g = 0; g < GB; ++g) {
        const __m256 p = _mm256_broadcast_ss(probs[g] + i);
        for (int c = 0; c < V; ++c) acc[g][c] = _mm256_fmadd_ps(p, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < V; ++c) _mm256_storeu_ps(accs[g] + d0 + 8 * c, acc[g][c]);
  }
}

template <int D, bool BF16>
void attend_avx2(const Args& a, const Item& item, State st) {
  using T = typename std::conditional<BF16, uint16_t, float>::type;
  const int G = static_cast<int>(a.G);
  RowView<T> rv = row_view<T>(a, item.row);
  const T* q = static_cast<const T*>(a.q) + item.row * G * D;
  alignas(32) float qf[kMaxGroup * D];  // fp32 q; bf16: each 16-chunk as even | odd (even_odd_slot's layout)
  for (int i = 0; i < G * D; i += 16) {
    if constexpr (BF16) {  // widened as K is, a vector at a time: element by element costs microseconds a call
      __m256 even, odd;
      bf16_even_odd8(reinterpret_cast<const uint16_t*>(q) + i, even, odd);
      _mm256_store_ps(qf + i, even);
      _mm256_store_ps(qf + i + 8, odd);
    } else {
      _mm256_store_ps(qf + i, _mm256_loadu_ps(reinterpret_cast<const float*>(q) + i));
      _mm256_store_ps(qf + i + 8, _mm256_loadu_ps(reinterpret_cast<const float*>(q) + i + 8));
    }
  }
  const __m256 scale2 = _mm256_set1_ps(a.scale * kLog2e);
  for (int g = 0; g < G; ++g) {
    st.m[g] = kNegInf;
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + G * D, 0.f);
  alignas(32) float probs_step[kMaxGroup][kStepTokens];  // the step's logits, then its probabilities
  float lsum[kMaxGroup] = {};
  float* probs_row = a.probs ? a.probs + item.row * G * a.probs_width : nullptr;
  PrefetchedRows<T, D> rows(a, rv, item);
  const int pv_groups = (G + kPv8Queries - 1) / kPv8Queries;
  for (int64_t t0 = item.begin; t0 < item.end; t0 += kStepTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kStepTokens, item.end - t0));
    const int tiles = (n + kTile8 - 1) / kTile8;
    const int shares = (G + pv_groups) * tiles;
    auto prefetch_share = [&](int pass) {
      rows.prefetch_until(t0 + int64_t{n} * (pass + 1) / shares);
    };
    const void* kp[kStepTokens];
    const void* vp[kStepTokens];
    rows.k.fill(reinterpret_cast<const T**>(kp), n);
    rows.v.fill(reinterpret_cast<const T**>(vp), n);
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < tiles; ++j) {
        const int m = std::min(kTile8, n - j * kTile8);
        prefetch_share(g * tiles + j);
        __m256 s = m == kTile8 ? tile_scores8<D, BF16, true>(qf + g * D, kp + j * kTile8, m)
                               : tile_scores8<D, BF16, false>(qf + g * D, kp + j * kTile8, m);
        const __m256 valid = lanes_below(m);
        s = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_mul_ps(s, scale2), valid);
        if (probs_row)
          _mm256_maskstore_ps(probs_row + g * a.probs_width + t0 + j * kTile8, _mm256_castps_si256(valid), s);
        _mm256_store_ps(probs_step[g] + j * kTile8, s);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m256 vmax = _mm256_load_ps(probs_step[g]);
      for (int j = 1; j < tiles; ++j) vmax = _mm256_max_ps(vmax, _mm256_load_ps(probs_step[g] + j * kTile8));
      const float step_max = hmax8(vmax);
      if (step_max > st.m[g]) {
        const float alpha = std::exp2(st.m[g] - step_max);
        lsum[g] *= alpha;
        const __m256 alpha8 = _mm256_set1_ps(alpha);
        float* acc = st.acc + g * D;
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), alpha8));
        st.m[g] = step_max;
      }
      const __m256 mx = _mm256_set1_ps(st.m[g]);
      __m256 step_sum = _mm256_setzero_ps();
      for (int j = 0; j < tiles; ++j) {
        // exp2_ps8 clamps its input, so a masked (-inf) logit's lane is zeroed here
        const __m256 valid = lanes_below(std::min(kTile8, n - j * kTile8));
        const __m256 p = _mm256_and_ps(valid, exp2_ps8(_mm256_sub_ps(_mm256_load_ps(probs_step[g] + j * kTile8), mx)));
        step_sum = _mm256_add_ps(step_sum, p);
        _mm256_store_ps(probs_step[g] + j * kTile8, p);
      }
      lsum[g] += hsum8(step_sum);
    }
    for (int g0 = 0; g0 < G; g0 += kPv8Queries) {
      const int gb = std::min(kPv8Queries, G - g0);
      float* accs[kPv8Queries];
      for (int g = 0; g < gb; ++g) accs[g] = st.acc + (g0 + g) * D;
      for (int j = 0; j < tiles; ++j) {
        prefetch_share((G + g0 / kPv8Queries) * tiles + j);
        const float* ps[kPv8Queries];
        for (int g = 0; g < gb; ++g) ps[g] = probs_step[g0 + g] + j * kTile8;
        const int m = std::min(kTile8, n - j * kTile8);
        if (gb == 2) {
          tile_pv8<D, 2, BF16>(accs, ps, vp + j * kTile8, m);
        } else {
          tile_pv8<D, 1, BF16>(accs, ps, vp + j * kTile8, m);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) st.l[g] = lsum[g];
}

template <bool BF16>
AttendFn avx2_for(int64_t D) {
  switch (D) {
    case 64: return attend_avx2<64, BF16>;
    case 128: return attend_avx2<128, BF16>;
    case 256: return attend_avx2<256, BF16>;
    default: return nullptr;
  }
}

}  // namespace

AttendFn avx2_kernel(bool bf16, int64_t D) { return bf16 ? avx2_for<true>(D) : avx2_for<false>(D); }

}  // namespace sb
#endif  // SB_AVX2
