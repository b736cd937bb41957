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
// elements) read each digest line once for the four query heads, four blocks a pass (AVX-512; two on AVX2) so that
// each line of q is loaded once for four blocks and 16 independent sums hide the FMA latency, and prefetch the line
// kDigestPrefetchBytes ahead in each of the pass's blocks as they load theirs: one prefetch per line, spread
// through the pass (docs/platform.md has the measurements).
constexpr int64_t kDigestLanes = 16;
constexpr int64_t kLine = 64;
constexpr int64_t kDigestPrefetchBytes = 4096;

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
// The pass's NB blocks' sums against the four heads, acc[b][g] lane-wise; q in the layout the digest chunks widen to
// (fp32: as is; bf16 with AVX512-BF16: bf16 pairs in `qbf`; bf16 without: each 32-chunk's even | odd elements).
template <typename T, int NB>
inline void dots_g4_avx512(const T* d, const float* both, const uint16_t* qbf, int64_t width, const char* ahead,
                           __m512 (&acc)[NB][4]) {
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_ps();
  constexpr int64_t kChunk = kLine / sizeof(T);  // elements per line: one chunk
  const int64_t line_bytes_per_block = width * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < width; c += kChunk) {
    if (ahead != nullptr)
      for (int b = 0; b < NB; ++b) _mm_prefetch(ahead + b * line_bytes_per_block + c * sizeof(T), _MM_HINT_T0);
    if constexpr (std::is_same_v<T, float>) {
      (void)qbf;
      __m512 x[NB];
      for (int b = 0; b < NB; ++b) x[b] = _mm512_loadu_ps(d + b * width + c);
      for (int g = 0; g < 4; ++g) {
        const __m512 qv = _mm512_loadu_ps(both + g * width + c);
        for (int b = 0; b < NB; ++b) acc[b][g] = _mm512_fmadd_ps(x[b], qv, acc[b][g]);
      }
    } else {
#ifdef __AVX512BF16__
      (void)both;
      __m512i x[NB];
      for (int b = 0; b < NB; ++b) x[b] = _mm512_loadu_si512(d + b * width + c);
      for (int g = 0; g < 4; ++g) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qbf + g * width + c);
        for (int b = 0; b < NB; ++b) acc[b][g] = _mm512_dpbf16_ps(acc[b][g], qv, (__m512bh)x[b]);
      }
#else
      (void)qbf;
      __m512 even[NB], odd[NB];
      for (int b = 0; b < NB; ++b) bf16_even_odd(d + b * width + c, even[b], odd[b]);
      for (int g = 0; g < 4; ++g) {
        const __m512 qe = _mm512_loadu_ps(both + g * width + c), qo = _mm512_loadu_ps(both + g * width + c + 16);
        for (int b = 0; b < NB; ++b) acc[b][g] = _mm512_fmadd_ps(qe, even[b], _mm512_fmadd_ps(qo, odd[b], acc[b][g]));
      }
#endif
    }
  }
}

template <typename T, typename Emit>
void scores_g4_avx512(const T* row, const float* both, const uint16_t* qbf, int64_t width, int64_t first,
                      int64_t last, Emit&& emit) {
  const int64_t block_bytes = width * static_cast<int64_t>(sizeof(T));
  const char* end = reinterpret_cast<const char*>(row + last * width);
  auto ahead_of = [&](const T* d, int blocks) -> const char* {  // null past the row's last block
    const char* p = reinterpret_cast<const char*>(d) + kDigestPrefetchBytes;
    return p + blocks * block_bytes <= end ? p : nullptr;
  };
  int64_t j = first;
  for (; j + 4 <= last; j += 4) {
    const T* d = row + j * width;
    __m512 acc[4][4];
    dots_g4_avx512<T, 4>(d, both, qbf, width, ahead_of(d, 4), acc);
    __m512 sums[16];  // acc[b][g] at slot_of(4b + g): reduce16 then puts block b's four sums in lanes 4b .. 4b+3
    for (int b = 0; b < 4; ++b)
      for (int g = 0; g < 4; ++g) sums[slot_of(4 * b + g)] = acc[b][g];
    __m512 s = reduce16(sums);
    s = _mm512_max_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
    s = _mm512_max_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    alignas(64) float best[16];
    _mm512_store_ps(best, s);
    for (int b = 0; b < 4; ++b) emit(j + b, 0.5f * best[4 * b]);
  }
  for (; j < last; ++j) {
    const T* d = row + j * width;
    __m512 acc[1][4];
    dots_g4_avx512<T, 1>(d, both, qbf, width, ahead_of(d, 1), acc);
    float best = kNegInf;
    for (int g = 0; g < 4; ++g) best = std::max(best, _mm512_reduce_add_ps(acc[0][g]));
    emit(j, 0.5f * best);
  }
}
#endif  // SB_AVX512

#ifdef SB_AVX2
// The pass's NB blocks' sums against the four heads on 8-lane vectors (two blocks: 8 accumulators, the blocks'
// chunks and a q chunk in the 16 registers); bf16 widened by a shift and a mask, q in each 16-chunk's even | odd
// order.
template <typename T, int NB>
inline void dots_g4_avx2(const T* d, const float* both, int64_t width, const char* ahead, __m256 (&acc)[NB][4]) {
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm256_setzero_ps();
  constexpr int64_t kChunk = kLine / sizeof(T);
  const int64_t block_bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < width; c += kChunk) {
    if (ahead != nullptr)
      for (int b = 0; b < NB; ++b) _mm_prefetch(ahead + b * block_bytes + c * sizeof(T), _MM_HINT_T0);
    for (int64_t h = c; h < c + kChunk; h += 16) {  // 16 elements a step: two fp32 vectors, or one bf16 pair
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t e = h; e < h + 16; e += 8) {
          __m256 x[NB];
          for (int b = 0; b < NB; ++b) x[b] = _mm256_loadu_ps(d + b * width + e);
          for (int g = 0; g < 4; ++g) {
            const __m256 qv = _mm256_loadu_ps(both + g * width + e);
            for (int b = 0; b < NB; ++b) acc[b][g] = _mm256_fmadd_ps(x[b], qv, acc[b][g]);
          }
        }
      } else {
        __m256 even[NB], odd[NB];
        for (int b = 0; b < NB; ++b) bf16_even_odd8(d + b * width + h, even[b], odd[b]);
        for (int g = 0; g < 4; ++g) {
          const __m256 qe = _mm256_loadu_ps(both + g * width + h), qo = _mm256_loadu_ps(both + g * width + h + 8);
          for (int b = 0; b < NB; ++b) acc[b][g] = _mm256_fmadd_ps(qe, even[b], _mm256_fmadd_ps(qo, odd[b], acc[b][g]));
        }
      }
    }
  }
}

template <typename T, typename Emit>
void scores_g4_avx2(const T* row, const float* both, int64_t width, int64_t first, int64_t last, Emit&& emit) {
  const int64_t block_bytes = width * static_cast<int64_t>(sizeof(T));
  const char* end = reinterpret_cast<const char*>(row + last * width);
  auto ahead_of = [&](const T* d, int blocks) -> const char* {  // null past the row's last block
    const char* p = reinterpret_cast<const char*>(d) + kDigestPrefetchBytes;
    return p + blocks * block_bytes <= end ? p : nullptr;
  };
  int64_t j = first;
  for (; j + 2 <= last; j += 2) {
    const T* d = row + j * width;
    __m256 acc[2][4];
    dots_g4_avx2<T, 2>(d, both, width, ahead_of(d, 2), acc);
    for (int b = 0; b < 2; ++b) {
      float best = kNegInf;
      for (int g = 0; g < 4; ++g) best = std::max(best, hsum8(acc[b][g]));
      emit(j + b, 0.5f * best);
    }
  }
  for (; j < last; ++j) {
    const T* d = row + j * width;
    __m256 acc[1][4];
    dots_g4_avx2<T, 1>(d, both, width, nullptr, acc);
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
    return scores_g4_avx512<T>(row, both, qbf, width, 0, num_blocks, emit);
  }
#elif defined(SB_AVX2)
  if (vector) {
    if constexpr (kBF16) {
      thread_local std::vector<float> natural;
      natural.assign(both, both + group * width);
      for (int64_t i = 0; i < group * width; ++i) both[even_odd_slot(i, 16)] = natural[i];
    }
    return scores_g4_avx2<T>(row, both, width, 0, num_blocks, emit);
  }
#endif
  (void)qbf;
  (void)kBF16;
  (void)vector;
  scores_portable<T>(row, both, group, width, 0, num_blocks, emit);
}

// The k best (score, block) pairs of a row so far, worst on top: a block below the worst costs one comparison,
// made while the next digests stream in, so that the selection costs no pass of its own over the row's scores.
class TopK {
 public:
  using Entry = std::pair<float, int64_t>;
  // a function object, not a function: std::push_heap then inlines it (a function pointer is an indirect call)
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
