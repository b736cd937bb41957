// Quest's digest scores and their top-k (kernels/digest_native.py).
#include "common.h"
#include "pool.h"

namespace sb {
namespace {

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
// scores_g4 on 8-lane vectors, two blocks at a time (8 independent FMA chains, where the compiler's loop leaves one
// chain per query bound by the FMA latency), with a prefetch 16 blocks ahead (docs/platform.md has the timings).
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

}  // extern "C"
