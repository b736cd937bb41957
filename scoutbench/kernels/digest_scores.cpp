// Quest upper-bound scores of block digests in one pass (scoutbench/kernels/digest_native.py says why and when).
//
// For each row r (a (sequence, KV head) pair) and block j, with digest d = [max + min | max - min] (2D floats) and
// the row's G query heads expanded to b_g = [q_g | |q_g|]: out[r, j] = 0.5 * max_g (d . b_g). One thread: a single
// core reads memory as fast as two on our machines, and the caller's other core runs the CPU attention worker.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

constexpr int64_t kLanes = 16;

// GQA group 4: each digest chunk is loaded once for the four query heads (lane-wise partial sums, reduced once).
// emit(j, score) takes each block's score as it is computed.
template <typename Emit>
static void scores_g4(const float* row, const float* both, int64_t width, int64_t num_blocks, Emit&& emit) {
    for (int64_t j = 0; j < num_blocks; ++j) {
        const float* d = row + j * width;
        float acc[4][kLanes] = {};
        for (int64_t c0 = 0; c0 < width; c0 += kLanes) {
            for (int g = 0; g < 4; ++g) {
                const float* bg = both + g * width + c0;
#pragma omp simd
                for (int64_t l = 0; l < kLanes; ++l) acc[g][l] += d[c0 + l] * bg[l];
            }
        }
        float best = -std::numeric_limits<float>::infinity();
        for (int g = 0; g < 4; ++g) {
            float sum = 0.0f;
            for (int64_t l = 0; l < kLanes; ++l) sum += acc[g][l];
            best = std::max(best, sum);
        }
        emit(j, 0.5f * best);
    }
}

// Row r's scores, block by block to emit(j, score): q's G heads expanded once to [q | |q|] (both, scratch of
// G * 2D floats).
template <typename Emit>
static void row_scores(const float* row, const float* q_row, int64_t group, int64_t dim, int64_t num_blocks,
                       float* both, Emit&& emit) {
  const int64_t width = 2 * dim;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q_row + g * dim;
    float* bg = both + g * width;
    for (int64_t c = 0; c < dim; ++c) {
      bg[c] = qg[c];
      bg[dim + c] = std::fabs(qg[c]);
    }
  }
  if (group == 4 && width % kLanes == 0) {
    scores_g4(row, both, width, num_blocks, emit);
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

extern "C" {

int sb_digest_abi_version() { return 2; }

// digests: row r's blocks start at digests + r * row_stride, block j at + j * 2D (contiguous 2D floats).
// q: [rows, G, D] contiguous. out: [rows, num_blocks] contiguous.
int sb_digest_scores(int64_t rows, int64_t group, int64_t dim, int64_t num_blocks, const float* digests,
                     int64_t row_stride, const float* q, float* out) {
  if (rows < 0 || group < 1 || dim < 1 || num_blocks < 0) return 1;
  std::vector<float> both(group * 2 * dim);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + r * num_blocks;
    row_scores(digests + r * row_stride, q + r * group * dim, group, dim, num_blocks, both.data(),
               [dst](int64_t j, float score) { dst[j] = score; });
  }
  return 0;
}

// The scores as above, and each row's top k selectable blocks: ids [rows, k] int64, the row's selectable blocks
// (blocked[r / heads * blocked_b + (r % heads) * blocked_h + j] == 0) by descending score, ties by lower id, then
// 0 past the selectable ones (what CandidateBlocks.top returns where its `count` says, and padding after it).
int sb_digest_top(int64_t rows, int64_t heads, int64_t group, int64_t dim, int64_t num_blocks, const float* digests,
                  int64_t row_stride, const float* q, const uint8_t* blocked, int64_t blocked_b, int64_t blocked_h,
                  int64_t k, float* scores, int64_t* ids) {
  if (rows < 0 || heads < 1 || group < 1 || dim < 1 || num_blocks < 0 || k < 0) return 1;
  std::vector<float> both(group * 2 * dim);
  TopK top;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = scores + r * num_blocks;
    const uint8_t* mask = blocked + (r / heads) * blocked_b + (r % heads) * blocked_h;
    top.reset(k);
    row_scores(digests + r * row_stride, q + r * group * dim, group, dim, num_blocks, both.data(),
               [&](int64_t j, float score) {
                 dst[j] = score;
                 if (!mask[j]) top.offer(score, j);
               });
    top.write(ids + r * k);
  }
  return 0;
}

}  // extern "C"
