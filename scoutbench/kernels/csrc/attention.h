// The decode-attention kernels' contract (attention.cpp documents it) and what the portable, AVX-512 and AVX2
// kernels share: the call's arguments, a work item and its partial state, the walk over a row's blocks, and the
// vector kernels' softmax step and software prefetch.
#pragma once

#include "common.h"

#pragma GCC visibility push(hidden)
namespace sb {

constexpr float kLog2e = 1.4426950408889634f;

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

using AttendFn = void (*)(const Args&, const Item&, State);

#if defined(SB_AVX512) || defined(SB_AVX2)
// ------------------------------------------------------------------------------------------ vector kernels' schedule
// What the AVX-512 and AVX2 kernels share: the softmax step, the software prefetch and its distance.
constexpr int kMaxGroup = 32;  // queries per row on the vector paths (stack arrays); larger groups: portable
// Tokens per softmax step: the QK of every query over the step's tiles first (independent work, no chain through
// the running max), then one max update and rescale per query, then PV over the whole step (docs/platform.md has
// the measurements of 16, 32 and 64).
constexpr int kStepTokens = 32;
// Software prefetch, issued a share at a time through the step's QK tiles and PV tiles, so that the memory system
// sees an even demand while the core computes: spread so, the reads overlap the arithmetic, where a burst of a
// tile's rows in the first query's pass leaves a call's time its compute plus its DRAM reads. It follows the row's
// blocks, which the hardware prefetcher does not follow from one selected block to the next. Two forms, by what the
// CPU's prefetch hints do (docs/platform.md has the measurements of both):
// - where a hint can fill L2 alone (AVX-512 CPUs: Zen 4 and Intel's), the K and V rows kFarTokens ahead into L2
//   (_MM_HINT_T2) and kNearTokens ahead into L1. An L1 prefetch holds one of the core's few L1 miss buffers until
//   DRAM answers (about 24 on Zen 4: a core then reads 12-15 GB/s at DRAM's latency), an L2 prefetch one of L2's
//   many; the near one then waits for L2 only, and a step's rows and those prefetched for the next fit Zen 4's 32 KiB
//   L1, where 32 tokens ahead (16 KiB in bf16, 32 in fp32) do not;
// - elsewhere (Zen 2 and 3, where every hint fills L1 and a second, farther prefetch made calls slower) the rows
//   kStepTokens ahead into L1, fp32 V rows only for the first kFp32VHeadTokens tokens of each block and of each item:
//   the hardware prefetcher follows that 512-byte-a-token stream within a block, and software prefetches beside it
//   slowed full calls (sparse selections' 32-token blocks need the start).
constexpr int64_t kNearTokens = 8;
constexpr int64_t kFarTokens = 64;
constexpr int64_t kFp32VHeadTokens = 8;

// One item's walk, as both vector kernels make it: the K and V cursors of its tokens, and cursors that run ahead
// and prefetch the rows of the tokens up to prefetch_until's position plus their distance (above); the constructor
// prefetches the first ones.
template <typename T, int D>
struct PrefetchedRows {
  static constexpr bool kBF16 = std::is_same_v<T, uint16_t>;
  Cursor<T> k, v, k_near, v_near, k_far, v_far;
  int64_t begin, end, near_done, far_done;
  bool far;

  PrefetchedRows(const Args& a, const RowView<T>& rv, const Item& item)
      : k(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin),
        v(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin),
        k_near(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin),
        v_near(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin),
        k_far(rv.k, rv.ids, a.kid, a.ktok, a.block_size, item.begin),
        v_far(rv.v, rv.ids, a.vid, a.vtok, a.block_size, item.begin),
        begin(item.begin), end(item.end), near_done(item.begin), far_done(item.begin), far(l2_prefetch_hints()) {
    prefetch_until(begin);
  }

  // prefetch the rows due once the tokens before `position` are consumed
  void prefetch_until(int64_t position) {
    if (far) {
      for (const int64_t stop = std::min(position + kFarTokens, end); far_done < stop; ++far_done) {
        prefetch_row<_MM_HINT_T2>(k_far.next_token(), D * sizeof(T));
        prefetch_row<_MM_HINT_T2>(v_far.next_token(), D * sizeof(T));
      }
    }
    const int64_t distance = far ? kNearTokens : kStepTokens;
    for (const int64_t stop = std::min(position + distance, end); near_done < stop; ++near_done) {
      prefetch_row(k_near.next_token(), D * sizeof(T));
      const bool v_head = v_near.offset < kFp32VHeadTokens || near_done < begin + kFp32VHeadTokens;
      const T* v_row = v_near.next_token();
      if (kBF16 || far || v_head) prefetch_row(v_row, D * sizeof(T));
    }
  }
};
#endif

#ifdef SB_AVX512
// The AVX-512 kernel for head_dim D (64, 128 or 256), or null (attention_avx512.cpp).
AttendFn avx512_kernel(bool bf16, int64_t D);
#endif
#ifdef SB_AVX2
// The AVX2 kernel for head_dim D (64, 128 or 256), or null (attention_avx2.cpp).
AttendFn avx2_kernel(bool bf16, int64_t D);
#endif

}  // namespace sb
#pragma GCC visibility pop
