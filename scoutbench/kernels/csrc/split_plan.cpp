// ScoutAttention's split of a selection between the device pool and the CPU part (runtime/block_table.py's
// split_selection_native).
#include "common.h"

namespace sb {
namespace {

// ------------------------------------------------------------------------------------------ ScoutAttention's split
// One layer's split of a selection between the device pool and the CPU part (BlockTable.locate, the CPU-first order,
// SplitPlan.pack and BlockTable.slot_mask in one pass per row, where the torch path makes ~28 ops per layer).
// Per row r:
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

}  // namespace
}  // namespace sb

using namespace sb;

extern "C" {

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

}  // extern "C"
