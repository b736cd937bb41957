// CPU decode attention with log-sum-exp, full or index-driven (selected blocks attended in place), bf16 or fp32.
//
// Compiled on first use with the library's other files by scoutbench/kernels/cpu_attention.py (g++ -O3
// -march=native, cached by the sources' hash and the CPU's flags) and called through ctypes with raw pointers; the
// Python side documents the contract. In short:
//   rows r = b * H + h (H selection rows per sequence, row h reads KV head h / rows_per_kv), G queries per row,
//   q [B*H, G, D] in the KV dtype; token p < len[r] of row r lives in block j = p / block_size at
//   k + b*kb + h_kv*kh + id(r, j)*kid + (p % block_size)*ktok, id = ids ? ids[b*ids_b + h*ids_h + j] : j
//   out o [B*H, G, D] fp32, lse [B*H, G] fp32 (natural log; an empty row: o = 0, lse = -inf),
//   optionally probs [B*H, G, probs_width] fp32: softmax within the row, 0 past len[r].
// Work is split over (row, chunk of tokens) items (flash-decoding split-K), merged exactly by LSE; the threads
// are this library's own (std::thread), never OpenMP: torch bundles its own OpenMP runtime. Concurrent callers
// (ScoutAttention's worker beside the main thread) share the pool: each runs its own items, then the other's.
#include "attention.h"
#include "pool.h"

namespace sb {
namespace {

constexpr int64_t kMinParallelWork = 4096;  // (token, query) pairs below which a call runs on the caller alone
constexpr float kLn2 = 0.6931471805599453f;

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

struct Kernel {
  AttendFn attend;
  int even_odd_chunk;  // > 0: accumulators hold bf16 chunks of this many elements as even | odd elements
};

Kernel kernel_for(const Args& a) {
#ifdef SB_AVX512
  if (a.G <= kMaxGroup) {
    AttendFn fn = avx512_kernel(a.dtype == kBF16, a.D);
    if (fn) return {fn, a.dtype == kBF16 ? 32 : 0};
  }
#endif
#ifdef SB_AVX2
  if (a.G <= kMaxGroup) {
    AttendFn fn = avx2_kernel(a.dtype == kBF16, a.D);
    if (fn) return {fn, a.dtype == kBF16 ? 16 : 0};
  }
#endif
  return {a.dtype == kBF16 ? attend_portable<uint16_t> : attend_portable<float>, 0};
}

// Undo the even | odd order of bf16 accumulators (vector paths: chunks of `chunk` elements, 0 for none) while
// writing `x * inv` to `dst`: each chunk's two halves interleaved (even_odd_slot's inverse) in a loop the compiler
// vectorises; a call writes rows * G * D of them, which element by element through even_odd_slot cost ~3 us of a
// 2048-token sparse call.
template <int64_t Chunk>
void store_row_as(float* dst, const float* acc, int64_t D, float inv) {
  if constexpr (Chunk == 0) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv;
  } else {
    constexpr int64_t kHalf = Chunk / 2;
    for (int64_t c = 0; c < D; c += Chunk) {
#pragma omp simd
      for (int64_t i = 0; i < kHalf; ++i) {
        dst[c + 2 * i] = acc[c + i] * inv;
        dst[c + 2 * i + 1] = acc[c + kHalf + i] * inv;
      }
    }
  }
}

// the chunk as a constant, so that store_row_as's loops have fixed bounds and vectorise
void store_row(float* dst, const float* acc, int64_t D, float inv, int chunk) {
  switch (chunk) {
    case 16: return store_row_as<16>(dst, acc, D, inv);
    case 32: return store_row_as<32>(dst, acc, D, inv);
    default: return store_row_as<0>(dst, acc, D, inv);
  }
}

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

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

}  // extern "C"
