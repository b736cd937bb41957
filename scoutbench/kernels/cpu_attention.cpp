// CPU decode attention with log-sum-exp, full or index-driven (selected blocks attended in place), bf16 or fp32.
//
// Compiled on first use by scoutbench/kernels/cpu_attention.py (g++ -O3 -march=native, cached by source hash and
// CPU flags) and called through ctypes with raw pointers; the Python side documents the contract. In short:
//   rows r = b * H + h (H selection rows per sequence, row h reads KV head h / rows_per_kv), G queries per row,
//   q [B*H, G, D] in the KV dtype; token p < len[r] of row r lives in block j = p / block_size at
//   k + b*kb + h_kv*kh + id(r, j)*kid + (p % block_size)*ktok, id = ids ? ids[b*ids_b + h*ids_h + j] : j
//   out o [B*H, G, D] fp32, lse [B*H, G] fp32 (natural log; an empty row: o = 0, lse = -inf),
//   optionally probs [B*H, G, probs_width] fp32: softmax within the row, 0 past len[r].
// Work is split over (row, chunk of tokens) items (flash-decoding split-K), merged exactly by LSE; the threads
// are this library's own (std::thread), never OpenMP: torch bundles its own OpenMP runtime. Concurrent callers
// (ScoutAttention's worker beside the main thread) share the pool: each runs its own items, then the other's.
//
// The library also holds a decode step's other CPU kernels, on the same pool (each section says why): the decode
// linear, HF's RMSNorm and attention prologue (kernels/cpu_decode.py), Quest digest scores with their top-k
// (kernels/digest_native.py), InfiniGen's token top-n, and the two-part LSE merge (kernels/cpu_attention.py).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
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

namespace {

constexpr int kTile = 16;  // tokens per tile: one 16-lane vector of scores per query
constexpr int64_t kMinParallelWork = 4096;  // (token, query) pairs below which a call runs on the caller alone
constexpr int64_t kMinParallelCopyBytes = 256 * 1024;  // likewise for a row copy
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum DType : int { kF32 = 0, kBF16 = 1 };

struct Args {
  int dtype;
  int64_t B, H, rows_per_kv, G, D;
  const void* q;
  const void* k;
  const void* v;
  int64_t kb, kh, kid, ktok, vb, vh, vid, vtok;  // element strides
  int64_t block_size;
  const int64_t* ids;
  int64_t ids_b, ids_h;
  const int64_t* lens;  // [B*H] or null: every row holds max_tokens
  int64_t max_tokens;
  float scale;
  float* out;
  float* lse;
  float* probs;
  int64_t probs_width;
};

struct Item {
  int64_t row, begin, end;
  int64_t slot;  // its partial state in the scratch buffer (merged per row afterwards)
};

// A partial state: running max m (base-2 logits), sum l, unnormalised accumulator acc [G, D] (for bf16 on the
// AVX-512 path each 32-element chunk is stored as its 16 even then its 16 odd elements; store_row() undoes it).
struct State {
  float* m;
  float* l;
  float* acc;
};

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

// Walks the tokens of one row in order: the current block's base pointer, advanced without divisions and looked
// up lazily (a row that ends on a block boundary never reads the id after its last block); fill() hands out a tile's
// pointers a run of consecutive tokens at a time.
template <typename T>
struct Cursor {
  const T* base;
  const int64_t* ids;
  int64_t id_stride, tok_stride, block_size, block, offset;
  const T* block_ptr = nullptr;

  Cursor(const T* row_base, const int64_t* row_ids, int64_t sid, int64_t stok, int64_t bs, int64_t position)
      : base(row_base), ids(row_ids), id_stride(sid), tok_stride(stok), block_size(bs), block(position / bs),
        offset(position % bs) {}

  // the next n token pointers into out: one block lookup per run of consecutive tokens
  void fill(const T** out, int n) {
    int i = 0;
    while (i < n) {
      if (block_ptr == nullptr) block_ptr = base + (ids ? ids[block] : block) * id_stride;
      const int64_t run = std::min<int64_t>(n - i, block_size - offset);
      const T* p = block_ptr + offset * tok_stride;
      for (int64_t j = 0; j < run; ++j, p += tok_stride) out[i++] = p;
      offset += run;
      if (offset == block_size) {
        offset = 0;
        ++block;
        block_ptr = nullptr;
      }
    }
  }

  const T* next_token() {
    if (block_ptr == nullptr) block_ptr = base + (ids ? ids[block] : block) * id_stride;
    const T* p = block_ptr + offset * tok_stride;
    if (++offset == block_size) {
      offset = 0;
      ++block;
      block_ptr = nullptr;
    }
    return p;
  }
};

template <typename T>
struct RowView {
  const T* k;
  const T* v;
  const int64_t* ids;
};

template <typename T>
RowView<T> row_view(const Args& a, int64_t row) {
  const int64_t b = row / a.H, h = row % a.H, kv = h / a.rows_per_kv;
  RowView<T> view;
  view.k = static_cast<const T*>(a.k) + b * a.kb + kv * a.kh;
  view.v = static_cast<const T*>(a.v) + b * a.vb + kv * a.vh;
  view.ids = a.ids ? a.ids + b * a.ids_b + h * a.ids_h : nullptr;
  return view;
}

inline int64_t row_len(const Args& a, int64_t row) {
  if (a.lens == nullptr) return a.max_tokens;
  return std::min(std::max<int64_t>(a.lens[row], 0), a.max_tokens);
}

// ------------------------------------------------------------------------------------------ portable kernel
// Any head_dim, any x86/ARM CPU: plain loops the compiler vectorises (-O3 -march=native, omp simd pragmas).
template <typename T>
void attend_portable(const Args& a, const Item& item, State st) {
  const int64_t G = a.G, D = a.D;
  RowView<T> rv = row_view<T>(a, item.row);
  const T* q = static_cast<const T*>(a.q) + item.row * G * D;
  std::vector<float> qf(G * D), s(G * kTile);
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float<T>(q[i]);
  const float scale2 = a.scale * kLog2e;
  for (int64_t g = 0; g < G; ++g) {
    st.m[g] = kNegInf;
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + G * D, 0.f);
  Cursor<T> kc(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin);
  Cursor<T> vc(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin);
  float* probs_row = a.probs ? a.probs + item.row * G * a.probs_width : nullptr;
  for (int64_t t0 = item.begin; t0 < item.end; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, item.end - t0));
    const T* kp[kTile];
    const T* vp[kTile];
    for (int i = 0; i < n; ++i) {
      kp[i] = kc.next_token();
      vp[i] = vc.next_token();
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf.data() + g * D;
      float tile_max = kNegInf;
      for (int i = 0; i < n; ++i) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float<T>(kp[i][d]);
        s[g * kTile + i] = dot * scale2;
        tile_max = std::max(tile_max, s[g * kTile + i]);
      }
      if (probs_row) std::memcpy(probs_row + g * a.probs_width + t0, &s[g * kTile], n * sizeof(float));
      float* acc = st.acc + g * D;
      if (tile_max > st.m[g]) {
        const float alpha = std::exp2(st.m[g] - tile_max);
        st.l[g] *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
        st.m[g] = tile_max;
      }
      for (int i = 0; i < n; ++i) {
        const float p = std::exp2(s[g * kTile + i] - st.m[g]);
        st.l[g] += p;
        const T* vr = vp[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float<T>(vr[d]);
      }
    }
  }
}

using AttendFn = void (*)(const Args&, const Item&, State);

// Where element d of a row sits in the vector paths' bf16 layout: each chunk of `chunk` elements stored as its even
// elements, then its odd ones (how a shift and a mask widen bf16 pairs). The AVX-512 kernel lays out q by it (the
// AVX2 kernel widens q as it widens K, which puts each element there), and store_row reads the accumulators back.
constexpr int64_t even_odd_slot(int64_t d, int64_t chunk) {
  return (d / chunk) * chunk + (d % 2) * (chunk / 2) + (d % chunk) / 2;
}

#if defined(SB_AVX512) || defined(SB_AVX2)
// ------------------------------------------------------------------------------------------ vector kernels' schedule
// What the AVX-512 and AVX2 kernels share: the softmax step, the software prefetch and its distance.
inline void prefetch_row(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

constexpr int kMaxGroup = 32;  // queries per row on the vector paths (stack arrays); larger groups: portable
// Tokens per softmax step: the QK of every query over the step's tiles first (independent work, no chain through
// the running max), then one max update and rescale per query, then PV over the whole step. 32: a bf16 step's K and
// V rows (16 KiB) and the rows prefetched for the next one fit the 48 KiB L1 together (64-token steps, twice that,
// measured 7% slower on sparse bf16 calls, 2-5% on full ones; fp32 the same either way).
constexpr int kStepTokens = 32;
// Software prefetch: the K and V rows of the tokens kPrefetchTokens ahead, issued a share at a time through the
// step's QK tiles and PV tiles, so that the memory system sees an even demand while the core computes. Issued in
// bursts (all of a tile's rows in the first query's pass), the reads barely overlapped the arithmetic: a full call's
// time was its compute plus its DRAM reads, on one core and two. Spread evenly they overlap: measured on 64k full
// calls 16% (bf16) and 8% (fp32) faster, on sparse 2048-token selections 24% faster (bf16), than the bursts. One
// step ahead (16 or 24 tokens: 5-14% slower; 64 with 64-token steps: the L1 note above), for long runs and for the
// sparse selections' 32-token blocks alike, which the hardware prefetcher does not follow from block to block.
constexpr int64_t kPrefetchTokens = kStepTokens;
// fp32 V rows (512 bytes a token at head_dim 128) are the exception: the hardware prefetcher follows that stream
// within a block, and software prefetches beside it slowed full calls by 5-7% (issue 19: with V prefetched only for
// the first 8 tokens of each block and of each item, B/A 0.931-0.950 on 64k full fp32 calls, 0.975-0.997 on sparse
// ones; with no V prefetch at all 0.930-0.956 full but 1.028 sparse, whose 32-token blocks need the start). bf16
// V rows (256 bytes) need every prefetch: V only at block heads gave 1.30 on full and sparse bf16 calls; fp32 K and
// V both only at block heads gave 1.11-1.13.
constexpr int64_t kFp32VHeadTokens = 8;

// One item's walk, as both vector kernels make it: the K and V cursors of its tokens, and a second pair that runs
// ahead and prefetches the rows of the tokens before prefetch_until's stop (K always, V as said above); the
// constructor prefetches the first kPrefetchTokens.
template <typename T, int D>
struct PrefetchedRows {
  Cursor<T> k, v, k_ahead, v_ahead;
  int64_t begin, end, prefetched;

  PrefetchedRows(const Args& a, const RowView<T>& rv, const Item& item)
      : k(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin),
        v(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin),
        k_ahead(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin),
        v_ahead(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin),
        begin(item.begin), end(item.end), prefetched(item.begin) {
    prefetch_until(begin + kPrefetchTokens);
  }

  void prefetch_until(int64_t stop) {
    constexpr bool kBF16 = std::is_same_v<T, uint16_t>;
    for (stop = std::min(stop, end); prefetched < stop; ++prefetched) {
      prefetch_row(k_ahead.next_token(), D * sizeof(T));
      const bool v_stream_start = v_ahead.offset < kFp32VHeadTokens || prefetched < begin + kFp32VHeadTokens;
      const T* v_row = v_ahead.next_token();
      if (kBF16 || v_stream_start) prefetch_row(v_row, D * sizeof(T));
    }
  }
};
#endif

#ifdef SB_AVX512
// ------------------------------------------------------------------------------------------ AVX-512 kernel
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
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
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

// QK of one query against a tile of 16 token rows: scores (base-2 logits) of the tile, in token order. The loops
// run token-major, so the first query's pass reads each row in address order: a stream the hardware prefetcher
// follows (column-major, a tile's lines arrive in a stride-of-a-row order it did not, and DRAM latency showed).
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
  alignas(64) float qf[kMaxGroup * D];  // fp32 q; bf16 without AVX512-BF16: each 32-chunk as even | odd
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d) {
      qf[g * D + (BF16 ? even_odd_slot(d, 32) : d)] = to_float<T>(q[g * D + d]);
    }
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
      rows.prefetch_until(t0 + kPrefetchTokens + int64_t{n} * (pass + 1) / shares);
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
#endif  // SB_AVX512

#ifdef SB_AVX2
// ------------------------------------------------------------------------------------------ AVX2 kernel
// CPUs with AVX2 and FMA but no AVX-512: AMD Zen 2 and 3 (the EPYC hosts of DGX A100 and of many GPU servers, and
// our CI machines), Intel's client cores and its servers before Skylake-SP. The AVX-512 kernel's schedule (softmax
// steps, QK tiles, the spread software prefetch) on 8-lane vectors: a tile is 8 tokens, and bf16 is widened by a
// shift and a mask into its even and odd elements (16-element chunks stored as even | odd, as store_row undoes).
// The portable loop it replaces here read 64k-token KV at 0.08-0.12 of the machine's read bandwidth.
constexpr int kTile8 = 8;  // tokens per AVX2 tile: one 8-lane vector of scores per query

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

// QK of one query against a tile of n <= 8 token rows: the tile's scores (unscaled), in token order. q is fp32 (bf16
// K: each 16-chunk as even | odd, matching bf16_even_odd8). fp32 runs token-major, each K row read in address order
// (as on AVX-512; chunk-major measured 1.05 slower on Zen 3), bf16 chunk-major, each q chunk pair loaded once for the
// tile's rows (token-major measured 1.05-1.07 slower on full calls).
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
    if constexpr (BF16) {  // widened as K is; placed element by element, it took 5-8 us of an 8-row sparse call
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
      rows.prefetch_until(t0 + kPrefetchTokens + int64_t{n} * (pass + 1) / shares);
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
#endif  // SB_AVX2

struct Kernel {
  AttendFn attend;
  int even_odd_chunk;  // > 0: accumulators hold bf16 chunks of this many elements as even | odd elements
};

Kernel kernel_for(const Args& a) {
#ifdef SB_AVX512
  if (a.G <= kMaxGroup) {
    AttendFn fn = a.dtype == kBF16 ? avx512_for<true>(a.D) : avx512_for<false>(a.D);
    if (fn) return {fn, a.dtype == kBF16 ? 32 : 0};
  }
#endif
#ifdef SB_AVX2
  if (a.G <= kMaxGroup) {
    AttendFn fn = a.dtype == kBF16 ? avx2_for<true>(a.D) : avx2_for<false>(a.D);
    if (fn) return {fn, a.dtype == kBF16 ? 16 : 0};
  }
#endif
  return {a.dtype == kBF16 ? attend_portable<uint16_t> : attend_portable<float>, 0};
}

// ------------------------------------------------------------------------------------------ thread pool
// Concurrent callers share one set of helper threads. A call publishes its items as a job, runs them itself, and
// while its last items finish on other threads it takes items of the other published jobs instead of spinning.
// Helpers take items of any published job, but only while fewer callers than the call's thread count are inside
// the pool: on 2 cores ScoutAttention's main thread and its worker then each keep a core and the helper waits,
// where a third runnable thread made every call's last item wait for a time slice.
class Pool {
 public:
  template <typename Fn>
  void run(int64_t n_tasks, int threads, Fn&& fn) {
    if (threads <= 1 || n_tasks <= 1) {
      for (int64_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    Job job;
    job.task = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    job.ctx = &fn;
    job.n_tasks = n_tasks;
    job.threads = threads;
    callers_.fetch_add(1);
    Slot* slot = publish(&job);
    if (slot == nullptr) {  // kSlots calls already inside: this one runs alone
      callers_.fetch_sub(1);
      for (int64_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ensure_workers(threads - 1);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    while (take_item(job)) {
    }
    for (int spins = 0; job.done.load(std::memory_order_acquire) < n_tasks; ++spins) {
      if (help(&job, -1)) {
        spins = 0;
      } else if (spins < 4096) {
        _mm_pause_portable();
      } else {
        std::this_thread::yield();
      }
    }
    callers_.fetch_sub(1);
    slot->job.store(nullptr);
    while (slot->users.load() != 0) _mm_pause_portable();  // a helper that read the pointer lets go of it
  }

  // How long a helper stays awake after a job: SCOUTBENCH_KERNEL_SPIN_US (microseconds, 0: sleep at once), read
  // once; 1000 by default. benchmarks/ab_kernel_builds.py sets 0 to time single calls of two builds in one process,
  // where each build's awake helper would take a core from the other's calls.
  static int spin_us() {
    static const int value = [] {
      const char* text = std::getenv("SCOUTBENCH_KERNEL_SPIN_US");
      return text != nullptr && *text != '\0' ? std::max(0, std::atoi(text)) : 1000;
    }();
    return value;
  }

  void reset_after_fork() {
    // the child has none of the parent's threads: forget them (their objects are leaked, not joined)
    new (&mu_) std::mutex();
    new (&cv_) std::condition_variable();
    for (Slot& s : slots_) {
      s.job.store(nullptr);
      s.users.store(0);
    }
    callers_.store(0);
    workers_started_ = 0;
    generation_.store(0);
  }

 private:
  struct Job {
    void (*task)(void*, int64_t) = nullptr;
    void* ctx = nullptr;
    int64_t n_tasks = 0;
    int threads = 1;
    std::atomic<int64_t> next{0}, done{0};
  };
  // a published job; `users` counts the threads that may still read `job`, so its caller returns only after them
  struct Slot {
    std::atomic<Job*> job{nullptr};
    std::atomic<int> users{0};
  };
  static constexpr int kSlots = 4;

  static void _mm_pause_portable() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  Slot* publish(Job* job) {
    for (Slot& s : slots_) {
      Job* expected = nullptr;
      if (s.job.compare_exchange_strong(expected, job)) return &s;
    }
    return nullptr;
  }

  static bool take_item(Job& job) {
    const int64_t i = job.next.fetch_add(1, std::memory_order_acq_rel);
    if (i >= job.n_tasks) return false;
    job.task(job.ctx, i);
    job.done.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }

  // one item of a published job other than `own`; a helper (`helper` >= 0) only of a job whose thread count
  // leaves it room beside the callers inside the pool. Whether it ran one.
  bool help(const Job* own, int helper) {
    for (Slot& s : slots_) {
      s.users.fetch_add(1);
      Job* job = s.job.load();
      const bool ran = job != nullptr && job != own && (helper < 0 || helper + callers_.load() < job->threads) &&
                       take_item(*job);
      s.users.fetch_sub(1);
      if (ran) return true;
    }
    return false;
  }

  void ensure_workers(int n) {  // under mu_
    while (workers_started_ < n) {
      const int index = workers_started_++;
      std::thread([this, index] { loop(index); }).detach();
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      if (!spin_for_job(seen)) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      while (help(nullptr, index)) {
      }
    }
  }

  // Whether a job was published within spin_us() of the helper's last one. A helper asleep on the condition
  // variable took 30-70 us to start on these VMs, so a call of a few hundred microseconds ran mostly on its caller
  // (a 4 MB linear: 67-70 us asleep, 34-38 us awake); a decode step's calls come tens to hundreds of microseconds
  // apart, and ScoutAttention's CPU part once per layer. The helper yields between checks, so any other runnable
  // thread (the worker's Python, an OpenMP team) takes the core before it.
  bool spin_for_job(uint64_t seen) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
    for (int i = 0;; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return true;
      std::this_thread::yield();
      if ((i & 15) == 15 && std::chrono::steady_clock::now() >= until) return false;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  Slot slots_[kSlots];
  std::atomic<int> callers_{0};
  int workers_started_ = 0;
  std::atomic<uint64_t> generation_{0};
};

Pool& pool() {
  static Pool* instance = [] {
    Pool* p = new Pool();  // never destroyed: detached helpers may outlive static destruction
    pthread_atfork(nullptr, nullptr, [] { pool().reset_after_fork(); });
    return p;
  }();
  return *instance;
}

// ------------------------------------------------------------------------------------------ decode linear
// y [M, N] = x [M, K] W^T (+ bias [N]) with W [N, K] row-major (nn.Linear's weight), fp32 or bf16, accumulated in
// fp32; a bf16 result is rounded to nearest even, as torch rounds. At decode M is the batch, so a linear is a read
// of W: MKL's sgemv read it at ~12 GB/s on our AMD machines (its AVX-512 paths are Intel's), four rows of W
// against each row of x at a time read it at 25-28 GB/s on one core. Tasks are runs of kLinearRows rows of W.
constexpr int64_t kLinearRows = 64;

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

template <typename T>
inline void store_out(T* dst, float value) {
  if constexpr (std::is_same_v<T, float>) {
    *dst = value;
  } else {
    *dst = float_to_bf16(value);
  }
}

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
// adds one step's products (the last step masked to K).
template <int Lanes, typename TW, typename TX, typename Dot>
inline void four_row_sums(const TW* w0, const TX* x, int64_t K, Dot dot, float* sums) {
  using Mask = std::conditional_t<Lanes == 32, __mmask32, __mmask16>;
  const int64_t body = K - K % Lanes;
  const Mask full = static_cast<Mask>(~Mask{0});
  const Mask tail = static_cast<Mask>((uint64_t{1} << (K % Lanes)) - 1u);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < body; k += Lanes)
    for (int j = 0; j < 4; ++j) acc[j] = dot(acc[j], w0 + j * K + k, x + k, full);
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

constexpr int64_t kFourRowMinBytes = 4096;

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
  for (; n + 4 <= n1; n += 4) {
    for (int64_t m = 0; m < M; ++m) {
      float sums[4];
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, uint16_t>) {  // bf16 pair dot products: exact products, fp32 sums
        four_row_sums<32>(W + n * K, xbf + m * K, K, [](__m512 acc, const uint16_t* w, const uint16_t* x,
                                                         __mmask32 mask) {
          return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, w),
                                  (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
        }, sums);
      } else
#endif
      {
        (void)xbf;
        four_row_sums<16>(W + n * K, xf + m * K, K, [](__m512 acc, const T* w, const float* x, __mmask16 mask) {
          return _mm512_fmadd_ps(load16(w, mask), _mm512_maskz_loadu_ps(mask, x), acc);
        }, sums);
      }
      for (int j = 0; j < 4; ++j) store_out(y + m * N + n + j, sums[j] + (bias ? to_float(bias[n + j]) : 0.f));
    }
  }
#elif defined(SB_AVX2)
  (void)xbf;
  // rows under a page read four at a time ran 1.2-1.7x slower than the plain loop below, one row after the other
  // (Zen 3: 4 MB fp32 at K = 256, 2 threads), rows of a page or more 1.1-1.4x faster
  const int64_t four_row_end = K * static_cast<int64_t>(sizeof(T)) >= kFourRowMinBytes ? n1 : n0;
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
    // short rows, one after the other: the row 4 ahead prefetched (4 MB fp32 at K = 256: 230-238 vs 247-268 us)
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

// ------------------------------------------------------------------------------------------ Quest digest scores
// For each row r (a (sequence, KV head) pair) and block j, with digest d = [max + min | max - min] (2D floats) and
// the row's G query heads expanded to b_g = [q_g | |q_g|]: score[r, j] = 0.5 * max_g (d . b_g) (digest.py says why
// this is Quest's upper bound). Rows are the pool's tasks: the main thread scores while ScoutAttention's worker
// attends the previous layer's CPU part on its own thread.
constexpr int64_t kDigestLanes = 16;

// GQA group 4: each digest chunk is loaded once for the four query heads (lane-wise partial sums, reduced once).
// emit(j, score) takes each block's score as it is computed.
template <typename Emit>
void scores_g4(const float* row, const float* both, int64_t width, int64_t num_blocks, Emit&& emit) {
  for (int64_t j = 0; j < num_blocks; ++j) {
    const float* d = row + j * width;
    float acc[4][kDigestLanes] = {};
    for (int64_t c0 = 0; c0 < width; c0 += kDigestLanes) {
      for (int g = 0; g < 4; ++g) {
        const float* bg = both + g * width + c0;
#pragma omp simd
        for (int64_t l = 0; l < kDigestLanes; ++l) acc[g][l] += d[c0 + l] * bg[l];
      }
    }
    float best = -std::numeric_limits<float>::infinity();
    for (int g = 0; g < 4; ++g) {
      float sum = 0.0f;
      for (int64_t l = 0; l < kDigestLanes; ++l) sum += acc[g][l];
      best = std::max(best, sum);
    }
    emit(j, 0.5f * best);
  }
}

#ifdef SB_AVX2
// scores_g4 on 8-lane vectors, two blocks at a time (8 independent FMA chains), with a prefetch 16 blocks ahead:
// 8.4 MB of digests (bench-attn16's layer at 32k) in 0.66-0.69 ms against the compiler-vectorised scores_g4's
// 0.75-0.84 (Zen 3, 2 threads, alternating processes); without the prefetch 1.33 ms, 8 blocks ahead alike.
constexpr int64_t kDigestPrefetchBlocks = 16;

template <typename Emit>
void scores_g4_avx2(const float* row, const float* both, int64_t width, int64_t num_blocks, Emit&& emit) {
  const int64_t block_bytes = width * static_cast<int64_t>(sizeof(float));
  int64_t j = 0;
  for (; j + 2 <= num_blocks; j += 2) {
    if (j + kDigestPrefetchBlocks + 2 <= num_blocks)
      prefetch_row(row + (j + kDigestPrefetchBlocks) * width, static_cast<int>(2 * block_bytes));
    const float* d0 = row + j * width;
    const float* d1 = d0 + width;
    __m256 acc[2][4];
    for (int b = 0; b < 2; ++b)
      for (int g = 0; g < 4; ++g) acc[b][g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < width; c += 8) {
      const __m256 x0 = _mm256_loadu_ps(d0 + c), x1 = _mm256_loadu_ps(d1 + c);
      for (int g = 0; g < 4; ++g) {
        const __m256 bg = _mm256_loadu_ps(both + g * width + c);
        acc[0][g] = _mm256_fmadd_ps(x0, bg, acc[0][g]);
        acc[1][g] = _mm256_fmadd_ps(x1, bg, acc[1][g]);
      }
    }
    for (int b = 0; b < 2; ++b) {
      float best = kNegInf;
      for (int g = 0; g < 4; ++g) best = std::max(best, hsum8(acc[b][g]));
      emit(j + b, 0.5f * best);
    }
  }
  if (j < num_blocks) scores_g4(row + j * width, both, width, num_blocks - j, [&](int64_t i, float score) {
    emit(j + i, score);
  });
}
#endif

// Row r's scores, block by block to emit(j, score): q's G heads expanded once to [q | |q|] (both, scratch of
// G * 2D floats).
template <typename Emit>
void row_scores(const float* row, const float* q_row, int64_t group, int64_t dim, int64_t num_blocks, float* both,
                Emit&& emit) {
  const int64_t width = 2 * dim;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q_row + g * dim;
    float* bg = both + g * width;
    for (int64_t c = 0; c < dim; ++c) {
      bg[c] = qg[c];
      bg[dim + c] = std::fabs(qg[c]);
    }
  }
  if (group == 4 && width % kDigestLanes == 0) {
#ifdef SB_AVX2
    scores_g4_avx2(row, both, width, num_blocks, emit);
#else
    scores_g4(row, both, width, num_blocks, emit);
#endif
    return;
  }
  for (int64_t j = 0; j < num_blocks; ++j) {
    const float* d = row + j * width;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < group; ++g) {
      const float* bg = both + g * width;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < width; ++c) acc += d[c] * bg[c];
      best = std::max(best, acc);
    }
    emit(j, 0.5f * best);
  }
}

// The k best (score, block) pairs of a row so far, worst on top: a block below the worst costs one comparison,
// made while the next digests stream in (a top-k after the row's scoring cost 10 us per row on its own).
class TopK {
 public:
  using Entry = std::pair<float, int64_t>;
  // a function object, not a function: std::push_heap then inlines it (a function pointer cost 4x)
  struct Better {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    }
  };
  static constexpr Better better{};

  void reset(int64_t k) {
    k_ = k;
    heap_.clear();
  }

  void offer(float score, int64_t j) {
    const Entry entry{score, j};
    if (static_cast<int64_t>(heap_.size()) < k_) {
      heap_.push_back(entry);
      std::push_heap(heap_.begin(), heap_.end(), better);
    } else if (k_ > 0 && better(entry, heap_.front())) {
      std::pop_heap(heap_.begin(), heap_.end(), better);
      heap_.back() = entry;
      std::push_heap(heap_.begin(), heap_.end(), better);
    }
  }

  // the ids, best first, then 0 up to k
  void write(int64_t* out) {
    std::sort_heap(heap_.begin(), heap_.end(), better);
    const int64_t n = static_cast<int64_t>(heap_.size());
    for (int64_t i = 0; i < n; ++i) out[i] = heap_[i].second;
    std::fill(out + n, out + k_, int64_t{0});
  }

 private:
  int64_t k_ = 0;
  std::vector<Entry> heap_;
};

// ------------------------------------------------------------------------------------------ token top-n
// InfiniGen's speculation on a CPU: for each row r (a (sequence, KV head) pair), token t < len of its partial keys
// k [t, P] scores max_g q_g . k_t over the row's G partial queries; the n best tokens (ties by lower index) are
// written in ascending token order, so that the attention reading them in place walks the tier in address order.
// torch's path (a [G, P] x [P, N] matmul with P = 26 channels, a mask, a group max and topk over 32k tokens) took
// ~4 ms per layer on bench-attn16 at 32k: a narrow matmul MKL reads at a third of the memory rate, then the top-k.
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
// no comparison branches (std::nth_element's mispredicted ones cost 0.3 ms per 32k-token row here).
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

// ------------------------------------------------------------------------------------------ ScoutAttention's split
// One layer's split of a selection between the device pool and the CPU part (BlockTable.split, the CPU-first order,
// SplitPlan.pack and BlockTable.slot_mask in one pass per row; ~28 torch ops per layer before). Per row r:
// slot = block_slot[clamp(id)], resident = valid && slot >= 0, ready = slot_ready[resident ? slot : trash],
// on_device = resident && ready, pending = resident && !ready, on_cpu = valid && !on_device.
void split_row(int64_t k, const int64_t* ids, const uint8_t* valid, const int64_t* block_slot, int64_t max_blocks,
               const uint8_t* slot_ready, const int64_t* slot_block, int64_t num_slots, const int64_t* victims,
               int64_t available, int64_t* data, uint8_t* pool_use) {
  thread_local std::vector<uint8_t> on_cpu, pending;
  on_cpu.assign(k, 0);
  pending.assign(k, 0);
  int64_t n_cpu = 0, n_selected = 0, n_resident = 0;
  std::fill(pool_use, pool_use + num_slots, uint8_t{0});
  for (int64_t i = 0; i < k; ++i) {
    const bool is_valid = valid[i] != 0;
    const int64_t slot = block_slot[std::min(std::max<int64_t>(ids[i], 0), max_blocks)];
    const bool resident = is_valid && slot >= 0;
    const bool ready = slot_ready[resident ? slot : num_slots] != 0;
    on_cpu[i] = is_valid && !(resident && ready);
    pending[i] = resident && !ready;
    if (resident && ready) pool_use[slot] = 1;
    n_cpu += on_cpu[i];
    n_selected += is_valid;
  }
  // the CPU blocks first, then the others, each in selection order (a stable sort on on_cpu, descending)
  int64_t cpu_at = 0, other_at = n_cpu;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t at = on_cpu[i] ? cpu_at++ : other_at++;
    data[at] = ids[i];
    data[k + at] = pending[i];
  }
  for (int64_t s = 0; s < num_slots; ++s) n_resident += slot_block[s] >= 0;
  std::copy(victims, victims + k, data + 2 * k);
  int64_t* counts = data + 3 * k;
  counts[0] = n_cpu;
  counts[1] = n_selected;
  counts[2] = available;
  counts[3] = n_resident;
}

// ------------------------------------------------------------------------------------------ driver
// Undo the even | odd order of bf16 accumulators (vector paths: chunks of `chunk` elements, 0 for none) while
// writing `x * inv` to `dst`.
template <int64_t Chunk>
void store_row_as(float* dst, const float* acc, int64_t D, float inv) {
  for (int64_t d = 0; d < D; ++d) dst[d] = acc[Chunk ? even_odd_slot(d, Chunk) : d] * inv;
}

// the chunk as a constant: even_odd_slot's divisions by a run-time chunk took 5-6 us of a bf16 sparse call's 8 rows
void store_row(float* dst, const float* acc, int64_t D, float inv, int chunk) {
  switch (chunk) {
    case 16: return store_row_as<16>(dst, acc, D, inv);
    case 32: return store_row_as<32>(dst, acc, D, inv);
    default: return store_row_as<0>(dst, acc, D, inv);
  }
}

}  // namespace

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

// Returns 0 on success, nonzero on a bad argument (the caller checks shapes; this is a last guard).
int sb_attention(int dtype, int64_t B, int64_t H, int64_t rows_per_kv, int64_t G, int64_t D, const void* q,
                 const void* k, const void* v, int64_t kb, int64_t kh, int64_t kid, int64_t ktok, int64_t vb,
                 int64_t vh, int64_t vid, int64_t vtok, int64_t block_size, const int64_t* ids, int64_t ids_b,
                 int64_t ids_h, const int64_t* lens, int64_t max_tokens, float scale, float* out, float* lse,
                 float* probs, int64_t probs_width, int threads) {
  if ((dtype != kF32 && dtype != kBF16) || B < 0 || H <= 0 || rows_per_kv <= 0 || G <= 0 || D <= 0 ||
      block_size <= 0 || max_tokens < 0)
    return 1;
  Args a{dtype, B, H, rows_per_kv, G, D, q, k, v, kb, kh, kid, ktok, vb, vh, vid, vtok, block_size, ids, ids_b,
         ids_h, lens, max_tokens, scale, out, lse, probs, probs_width};
  const int64_t rows = B * H;
  const Kernel kernel = kernel_for(a);
  // items: each row split into chunks of a common size, so that the threads get ~8 items each
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) total += row_len(a, r);
  if (total * G < kMinParallelWork) threads = 1;  // a few microseconds of work: waking a helper costs as much
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (threads > 1) {
    chunk = std::max<int64_t>(256, (total + 8 * threads - 1) / (8 * threads));
    chunk = (chunk + kTile - 1) / kTile * kTile;
  }
  thread_local std::vector<Item> items;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> first_item;
  items.clear();
  first_item.assign(rows + 1, 0);
  int64_t slots = 0;
  for (int64_t r = 0; r < rows; ++r) {
    first_item[r] = static_cast<int64_t>(items.size());
    const int64_t n = row_len(a, r);
    for (int64_t begin = 0; begin < n; begin += std::min(chunk, n))
      items.push_back({r, begin, std::min(n, begin + std::min(chunk, n)), slots++});
  }
  first_item[rows] = static_cast<int64_t>(items.size());
  const int64_t state_floats = G * (D + 2);
  if (static_cast<int64_t>(scratch.size()) < slots * state_floats) scratch.resize(slots * state_floats);
  float* scratch_base = scratch.data();
  const Item* item_base = items.data();
  auto state_of = [&](int64_t slot) {
    float* base = scratch_base + slot * state_floats;
    return State{base, base + G, base + 2 * G};
  };
  pool().run(static_cast<int64_t>(items.size()), threads,
             [&](int64_t i) { kernel.attend(a, item_base[i], state_of(item_base[i].slot)); });
  // merge each row's items by LSE, normalise, and turn the stored logits into probabilities
  const int64_t* first = first_item.data();
  pool().run(rows, threads, [&](int64_t r) {
    float* o = out + r * G * D;
    float* l_out = lse + r * G;
    const int64_t begin = first[r], end = first[r + 1];
    std::vector<float> acc(D);
    for (int64_t g = 0; g < G; ++g) {
      float m = kNegInf;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, state_of(item_base[i].slot).m[g]);
      float total_l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = begin; i < end; ++i) {
        State st = state_of(item_base[i].slot);
        const float w = std::exp2(st.m[g] - m);
        total_l += st.l[g] * w;
        const float* src = st.acc + g * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * src[d];
      }
      if (end == begin || total_l == 0.f) {
        std::fill(o + g * D, o + (g + 1) * D, 0.f);
        l_out[g] = kNegInf;
      } else {
        store_row(o + g * D, acc.data(), D, 1.f / total_l, kernel.even_odd_chunk);
        l_out[g] = (m + std::log2(total_l)) * kLn2;
      }
      if (probs) {
        float* pr = probs + (r * G + g) * probs_width;
        const int64_t n = std::min(row_len(a, r), probs_width);
        const float lse2 = l_out[g] / kLn2;
        for (int64_t t = 0; t < n; ++t) pr[t] = std::exp2(pr[t] - lse2);
        std::fill(pr + n, pr + probs_width, 0.f);
      }
    }
  });
  return 0;
}


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


// Quest scores of block digests: row r's blocks start at digests + r * row_stride, block j at + j * 2D (contiguous
// 2D floats); q: [rows, G, D] contiguous; scores: [rows, num_blocks]. With ids (k > 0): also each row's top k
// selectable blocks, ids [rows, k] int64: the blocks with blocked[r / heads * blocked_b + (r % heads) * blocked_h
// + j] == 0 by descending score, ties by lower id, then 0 (CandidateBlocks.top where its count says, padding after).
// 0 on success.
int sb_digest_scores(int64_t rows, int64_t heads, int64_t group, int64_t dim, int64_t num_blocks, const float* digests,
                     int64_t row_stride, const float* q, const uint8_t* blocked, int64_t blocked_b, int64_t blocked_h,
                     int64_t k, float* scores, int64_t* ids, int threads) {
  if (rows < 0 || heads < 1 || group < 1 || dim < 1 || num_blocks < 0 || k < 0 || (ids && !blocked)) return 1;
  pool().run(rows, threads, [&](int64_t r) {
    thread_local std::vector<float> both;
    thread_local TopK top;
    both.resize(group * 2 * dim);
    float* dst = scores + r * num_blocks;
    const float* row = digests + r * row_stride;
    const float* q_row = q + r * group * dim;
    if (ids == nullptr) {
      row_scores(row, q_row, group, dim, num_blocks, both.data(), [dst](int64_t j, float score) { dst[j] = score; });
      return;
    }
    const uint8_t* mask = blocked + (r / heads) * blocked_b + (r % heads) * blocked_h;
    top.reset(k);
    row_scores(row, q_row, group, dim, num_blocks, both.data(), [&](int64_t j, float score) {
      dst[j] = score;
      if (!mask[j]) top.offer(score, j);
    });
    top.write(ids + r * k);
  });
  return 0;
}


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


// ScoutAttention's split (split_row above) of rows selections of k blocks: ids, valid [rows, k]; the table's
// block_slot [rows, max_blocks + 1], slot_ready and slot_block [rows, num_slots + 1]; victims [rows, k] and
// available [rows] pass through into data [rows, 3k + 4] (SplitPlan's layout); pool_use [rows, num_slots].
int sb_split_plan(int64_t rows, int64_t k, const int64_t* ids, const uint8_t* valid, const int64_t* block_slot,
                  int64_t max_blocks, const uint8_t* slot_ready, const int64_t* slot_block, int64_t num_slots,
                  const int64_t* victims, const int64_t* available, int64_t* data, uint8_t* pool_use) {
  if (rows < 0 || k < 0 || max_blocks < 0 || num_slots < 0) return 1;
  for (int64_t r = 0; r < rows; ++r)
    split_row(k, ids + r * k, valid + r * k, block_slot + r * (max_blocks + 1), max_blocks,
              slot_ready + r * (num_slots + 1), slot_block + r * (num_slots + 1), num_slots, victims + r * k,
              available[r], data + r * (3 * k + 4), pool_use + r * num_slots);
  return 0;
}

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
