// Quest's digest scores and their top-k (kernels/digest_native.py), over fp32 or bf16 digests.
#include "common.h"
#include "pool.h"

namespace sb {
namespace {

// ------------------------------------------------------------------------------------------ Quest digest scores
// For each row r (a (sequence, KV head) pair) and block j, with digest d = [max + min | max - min] (2D elements) and
// the row's G query heads expanded to b_g = [q_g | |q_g|]: score[r, j] = 0.5 * max_g (d . b_g) (digest.py says why
// this is Quest's upper bound). bf16 digests are scored against q rounded to bf16, as torch's path (q cast to the
// digests' dtype) and the CUDA kernel score them, with fp32 sums. Rows are the pool's tasks: the main thread scores
// while ScoutAttention's worker attends the previous layer's CPU part on its own thread.
//
// The vector scorers (GQA group 4, a row of whole 64-byte lines per block: 2D a multiple of 16 fp32 or 32 bf16
// elements) score NB blocks a pass (4 on AVX-512, 2 on AVX2), one from each of NB streams that walk the row's
// quarters (halves) in address order: each line of q is then loaded once for NB blocks, 16 (8) independent sums hide
// the multiply-add latency, and the hardware prefetcher follows NB sequential streams. On Zen 4, NB consecutive
// blocks a pass read each 4 KiB page in strides of a block, which the prefetcher does not follow (half the read rate
// from DRAM, software prefetches or not), and software prefetches beside the streams only slowed them
// (docs/platform.md has the measurements; Zen 2 and 3 keep the form measured there, scores_g4_avx2).
constexpr int64_t kLine = 64;

// b_g = [q_g | |q_g|] of the G heads (scratch of G * 2D floats); rounded to bf16 (kept in fp32) for bf16 digests
template <typename T>
void expand_queries(const float* q_row, int64_t group, int64_t dim, float* both) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < dim; ++c) {
      float x = q_row[g * dim + c];
      if constexpr (std::is_same_v<T, uint16_t>) x = bf16_to_float(float_to_bf16(x));
      both[g * 2 * dim + c] = x;
      both[g * 2 * dim + dim + c] = std::fabs(x);
    }
  }
}

// Any group and width: plain loops the compiler vectorises. emit(j, score) takes each block's score as it comes.
template <typename T, typename Emit>
void scores_portable(const T* row, const float* both, int64_t group, int64_t width, int64_t first, int64_t last,
                     Emit&& emit) {
  for (int64_t j = first; j < last; ++j) {
    const T* d = row + j * width;
    float best = kNegInf;
    for (int64_t g = 0; g < group; ++g) {
      const float* bg = both + g * width;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < width; ++c) acc += to_float<T>(d[c]) * bg[c];
      best = std::max(best, acc);
    }
    emit(j, 0.5f * best);
  }
}

#ifdef SB_AVX512
// `x`, kept in a register: the compiler may not fold its load into each instruction that reads it
inline __m512 in_register(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

// The pass's NB blocks' (ds[b]) sums against the four heads, acc[b][g] lane-wise; q in the layout the digest
// chunks widen to (fp32: as is; bf16 with AVX512-BF16: bf16 pairs in `qbf`; bf16 without: each 32-chunk's even | odd
// elements).
template <typename T, int NB>
inline void dots_g4_avx512(const T* const* ds, const float* both, const uint16_t* qbf, int64_t width,
                           __m512 (&acc)[NB][4]) {
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_ps();
  constexpr int64_t kChunk = kLine / sizeof(T);  // elements per line: one chunk
  for (int64_t c = 0; c < width; c += kChunk) {
    // the chunk's q vectors in registers, then each block's chunk loaded once for them: the loads the L1 serves (one
    // 64-byte load a cycle on Zen 4) stay at a quarter of the multiply-adds, where a q load folded into every one
    // (GCC's choice unless told, in_register) makes the loads, not the multiply-adds, bound the scorer
    if constexpr (std::is_same_v<T, float>) {
      (void)qbf;
      __m512 qv[4];
      for (int g = 0; g < 4; ++g) qv[g] = in_register(_mm512_loadu_ps(both + g * width + c));
      for (int b = 0; b < NB; ++b) {
        const __m512 x = in_register(_mm512_loadu_ps(ds[b] + c));
        for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_fmadd_ps(x, qv[g], acc[b][g]);
      }
    } else {
#ifdef __AVX512BF16__
      (void)both;
      __m512 qv[4];
      for (int g = 0; g < 4; ++g) qv[g] = in_register(_mm512_castsi512_ps(_mm512_loadu_si512(qbf + g * width + c)));
      for (int b = 0; b < NB; ++b) {
        const __m512bh x = (__m512bh)in_register(_mm512_castsi512_ps(_mm512_loadu_si512(ds[b] + c)));
        for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_dpbf16_ps(acc[b][g], (__m512bh)qv[g], x);
      }
#else
      (void)qbf;
      __m512 qe[4], qo[4];  // 16 accumulators, 8 q vectors and a chunk's two halves: 26 of the 32 registers
      for (int g = 0; g < 4; ++g) {
        qe[g] = in_register(_mm512_loadu_ps(both + g * width + c));
        qo[g] = in_register(_mm512_loadu_ps(both + g * width + c + 16));
      }
      for (int b = 0; b < NB; ++b) {
        __m512 even, odd;
        bf16_even_odd(ds[b] + c, even, odd);
        for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_fmadd_ps(qe[g], even, _mm512_fmadd_ps(qo[g], odd, acc[b][g]));
      }
#endif
    }
  }
}

template <typename T, typename Emit>
void scores_g4_avx512(const T* row, const float* both, const uint16_t* qbf, int64_t width, int64_t num_blocks,
                      Emit&& emit) {
  constexpr int NB = 4;
  const int64_t quarter = num_blocks / NB;
  for (int64_t i = 0; i < quarter; ++i) {
    const T* ds[NB];
    for (int b = 0; b < NB; ++b) ds[b] = row + (b * quarter + i) * width;
    __m512 acc[NB][4];
    dots_g4_avx512<T, NB>(ds, both, qbf, width, acc);
    __m512 sums[16];  // acc[b][g] at slot_of(4b + g): reduce16 then puts block b's four sums in lanes 4b .. 4b+3
    for (int b = 0; b < NB; ++b)
      for (int g = 0; g < 4; ++g) sums[slot_of(4 * b + g)] = acc[b][g];
    __m512 s = reduce16(sums);
    s = _mm512_max_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
    s = _mm512_max_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    alignas(64) float best[16];
    _mm512_store_ps(best, s);
    for (int b = 0; b < NB; ++b) emit(b * quarter + i, 0.5f * best[4 * b]);
  }
  for (int64_t j = NB * quarter; j < num_blocks; ++j) {
    const T* ds[1] = {row + j * width};
    __m512 acc[1][4];
    dots_g4_avx512<T, 1>(ds, both, qbf, width, acc);
    float best = kNegInf;
    for (int g = 0; g < 4; ++g) best = std::max(best, _mm512_reduce_add_ps(acc[0][g]));
    emit(j, 0.5f * best);
  }
}
#endif  // SB_AVX512

#ifdef SB_AVX2
// The pass's NB blocks' (ds[b]) sums against the four heads on 8-lane vectors (two blocks: 8 accumulators, the
// blocks' chunks and a q chunk in the 16 registers); bf16 widened by a shift and a mask, q in each 16-chunk's
// even | odd order.
template <typename T, int NB>
inline void dots_g4_avx2(const T* const* ds, const float* both, int64_t width, __m256 (&acc)[NB][4]) {
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm256_setzero_ps();
  for (int64_t h = 0; h < width; h += 16) {  // 16 elements a step: two fp32 vectors, or one bf16 pair
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t e = h; e < h + 16; e += 8) {
        __m256 x[NB];
        for (int b = 0; b < NB; ++b) x[b] = _mm256_loadu_ps(ds[b] + e);
        for (int g = 0; g < 4; ++g) {
          const __m256 qv = _mm256_loadu_ps(both + g * width + e);
          for (int b = 0; b < NB; ++b) acc[b][g] = _mm256_fmadd_ps(x[b], qv, acc[b][g]);
        }
      }
    } else {
      __m256 even[NB], odd[NB];
      for (int b = 0; b < NB; ++b) bf16_even_odd8(ds[b] + h, even[b], odd[b]);
      for (int g = 0; g < 4; ++g) {
        const __m256 qe = _mm256_loadu_ps(both + g * width + h), qo = _mm256_loadu_ps(both + g * width + h + 8);
        for (int b = 0; b < NB; ++b) acc[b][g] = _mm256_fmadd_ps(qe, even[b], _mm256_fmadd_ps(qo, odd[b], acc[b][g]));
      }
    }
  }
}

// Zen 2 and 3 (no L2-only prefetch hint: `l2_prefetch_hints`) read the row as one stream, two consecutive blocks a
// pass, with the blocks kZen3PrefetchBlocks ahead prefetched: measured there 0.66-0.69 ms a bench-attn16 layer at 32k
// against 1.33 without the prefetch. On Zen 4 the two streams without it read fp32 digests 1.3-2x faster than that
// form (bf16, bound by its widening there, within 10%).
constexpr int64_t kZen3PrefetchBlocks = 16;

template <typename T, typename Emit>
void scores_g4_avx2(const T* row, const float* both, int64_t width, int64_t num_blocks, Emit&& emit) {
  constexpr int NB = 2;
  const bool streams = l2_prefetch_hints();
  const int64_t half = num_blocks / NB;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t first[NB] = {streams ? i : 2 * i, streams ? half + i : 2 * i + 1};
    const T* ds[NB] = {row + first[0] * width, row + first[1] * width};
    if (!streams && 2 * i + kZen3PrefetchBlocks + NB <= num_blocks)
      prefetch_row(ds[0] + kZen3PrefetchBlocks * width, static_cast<int>(NB * width * sizeof(T)));
    __m256 acc[NB][4];
    dots_g4_avx2<T, NB>(ds, both, width, acc);
    for (int b = 0; b < NB; ++b) {
      float best = kNegInf;
      for (int g = 0; g < 4; ++g) best = std::max(best, hsum8(acc[b][g]));
      emit(first[b], 0.5f * best);
    }
  }
  for (int64_t j = NB * half; j < num_blocks; ++j) {
    const T* ds[1] = {row + j * width};
    __m256 acc[1][4];
    dots_g4_avx2<T, 1>(ds, both, width, acc);
    float best = kNegInf;
    for (int g = 0; g < 4; ++g) best = std::max(best, hsum8(acc[0][g]));
    emit(j, 0.5f * best);
  }
}
#endif  // SB_AVX2

// Row r's scores, block by block to emit(j, score). both: scratch of G * 2D floats; qbf: of G * 2D bf16.
template <typename T, typename Emit>
void row_scores(const T* row, const float* q_row, int64_t group, int64_t dim, int64_t num_blocks, float* both,
                uint16_t* qbf, Emit&& emit) {
  constexpr bool kBF16 = std::is_same_v<T, uint16_t>;
  const int64_t width = 2 * dim;
  expand_queries<T>(q_row, group, dim, both);
  const bool vector = group == 4 && (width * static_cast<int64_t>(sizeof(T))) % kLine == 0;
#if defined(SB_AVX512)
  if (vector) {
    if constexpr (kBF16) {
#ifdef __AVX512BF16__
      for (int64_t i = 0; i < group * width; ++i) qbf[i] = float_to_bf16(both[i]);  // exact: already bf16 values
#else
      thread_local std::vector<float> natural;  // each 32-chunk as its even | odd elements, as the digests widen
      natural.assign(both, both + group * width);
      for (int64_t i = 0; i < group * width; ++i) both[even_odd_slot(i, 32)] = natural[i];
#endif
    }
    return scores_g4_avx512<T>(row, both, qbf, width, num_blocks, emit);
  }
#elif defined(SB_AVX2)
  if (vector) {
    if constexpr (kBF16) {
      thread_local std::vector<float> natural;
      natural.assign(both, both + group * width);
      for (int64_t i = 0; i < group * width; ++i) both[even_odd_slot(i, 16)] = natural[i];
    }
    return scores_g4_avx2<T>(row, both, width, num_blocks, emit);
  }
#endif
  (void)qbf;
  (void)kBF16;
  (void)vector;
  scores_portable<T>(row, both, group, width, 0, num_blocks, emit);
}

// The k best (score, block) pairs of a row, selected as the scores come: a score below the k-th best of those kept
// so far costs one well-predicted comparison; the others are appended to a buffer that, when full, is cut back to its
// k best (nth_element), which raises the threshold. A heap of the k best costs each admitted score two sift passes of
// mispredicted branches instead: on random scores (k ln(n/k) admissions of n, 64 of 1024 blocks: about a quarter)
// a third of a DRAM-bound scorer's time.
class TopK {
 public:
  using Entry = std::pair<float, int64_t>;
  // a function object, not a function: the algorithms then inline it (a function pointer is an indirect call)
  struct Better {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    }
  };
  static constexpr Better better{};

  void reset(int64_t k) {
    k_ = k;
    threshold_ = kNegInf;
    kept_.clear();
    kept_.reserve(capacity());
  }

  void offer(float score, int64_t j) {
    if (score >= threshold_ && k_ > 0) {  // ties stay candidates: among equal scores the lower block wins
      kept_.emplace_back(score, j);
      if (static_cast<int64_t>(kept_.size()) == capacity()) cut();
    }
  }

  // the ids, best first, then 0 up to k
  void write(int64_t* out) {
    if (static_cast<int64_t>(kept_.size()) > k_) cut();
    std::sort(kept_.begin(), kept_.end(), better);
    const int64_t n = static_cast<int64_t>(kept_.size());
    for (int64_t i = 0; i < n; ++i) out[i] = kept_[i].second;
    std::fill(out + n, out + k_, int64_t{0});
  }

 private:
  int64_t capacity() const { return 2 * k_ + 64; }

  // keep the k best, and admit from now on only what could still be among them
  void cut() {
    std::nth_element(kept_.begin(), kept_.begin() + (k_ - 1), kept_.end(), better);
    kept_.resize(k_);
    threshold_ = kept_[k_ - 1].first;  // the k-th best: those before it score as high or higher
  }

  int64_t k_ = 0;
  float threshold_ = kNegInf;
  std::vector<Entry> kept_;
};

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

// Quest scores of block digests (dtype: kF32 or kBF16): row r's blocks start at digests + r * row_stride elements,
// block j at + j * 2D (contiguous 2D elements); q: [rows, G, D] fp32 contiguous; scores: [rows, num_blocks] fp32.
// With ids (k > 0): also each row's top k selectable blocks, ids [rows, k] int64: the blocks with
// blocked[r / heads * blocked_b + (r % heads) * blocked_h + j] == 0 by descending score, ties by lower id, then 0
// (CandidateBlocks.top where its count says, padding after). 0 on success.
int sb_digest_scores(int dtype, int64_t rows, int64_t heads, int64_t group, int64_t dim, int64_t num_blocks,
                     const void* digests, int64_t row_stride, const float* q, const uint8_t* blocked,
                     int64_t blocked_b, int64_t blocked_h, int64_t k, float* scores, int64_t* ids, int threads) {
  if ((dtype != kF32 && dtype != kBF16) || rows < 0 || heads < 1 || group < 1 || dim < 1 || num_blocks < 0 || k < 0 ||
      (ids && !blocked))
    return 1;
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    pool().run(rows, threads, [&](int64_t r) {
      thread_local std::vector<float> both;
      thread_local std::vector<uint16_t> qbf;
      thread_local TopK top;
      both.resize(group * 2 * dim);
      qbf.resize(group * 2 * dim);
      float* dst = scores + r * num_blocks;
      const T* row = static_cast<const T*>(digests) + r * row_stride;
      const float* q_row = q + r * group * dim;
      if (ids == nullptr) {
        row_scores(row, q_row, group, dim, num_blocks, both.data(), qbf.data(),
                   [dst](int64_t j, float score) { dst[j] = score; });
        return;
      }
      const uint8_t* mask = blocked + (r / heads) * blocked_b + (r % heads) * blocked_h;
      top.reset(k);
      row_scores(row, q_row, group, dim, num_blocks, both.data(), qbf.data(), [&](int64_t j, float score) {
        dst[j] = score;
        if (!mask[j]) top.offer(score, j);
      });
      top.write(ids + r * k);
    });
  });
  return 0;
}

}  // extern "C"
