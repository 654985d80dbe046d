// KV transfer between different layouts (issue 18, docs/parallelism.md,
// "KV transfer between different layouts"): which bytes of each prefill
// rank's KV block go where in each decode rank's block.
//
// Every rank's pool block holds only its own slice of the model's KV, in the
// pool's fixed order (engine/kv_pool.h)
//   [local layer][K,V][local kv_head][token][head_dim]
// where the local layers are its pipeline stage's (StageLayers) and the
// local kv heads its tensor rank's (TpKvHeads; one replicated head when
// kv_heads < tp). A slice plan lists, for every (prefill rank → decode rank)
// pair that exchanges anything, the contiguous byte runs
// (src offset in the prefill rank's block, dst offset in the decode rank's
// block, length). Applying every run of every pair to one block writes every
// byte of every decode rank's block exactly once:
//   - each (layer, K/V, kv head) a decode rank holds comes from exactly one
//     prefill rank: the one whose stage holds the layer and, among its
//     tensor ranks holding the head (several when the head is replicated on
//     the prefill side), the lowest;
//   - a head replicated on the decode side goes to every decode copy.
// Adjacent runs (both offsets contiguous) are merged, so identical layouts
// give one run per rank pair (the whole block).
//
// Pure values and functions; no state.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "parallel/parallel_layout.h"

namespace tandem::parallel {

// The model's KV geometry (the parts a layout splits plus the block shape).
struct KvDims {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_size = 0;      // tokens per block
  uint32_t bytes_per_elem = 4;  // f32 pool
};

// What one rank's pool block holds: model layers [layers) and kv heads
// [kv_heads) in the order above.
struct RankKvShape {
  Range layers;
  Range kv_heads;
  // Bytes of one K (or V) plane of one head: block_size * head_dim * elem.
  uint64_t head_plane_bytes = 0;
  uint64_t block_bytes() const {
    return uint64_t{layers.size()} * 2 * kv_heads.size() * head_plane_bytes;
  }
  // Offset of (model layer, kv, model head) in this rank's block; the
  // layer and head must be held.
  uint64_t offset(uint32_t layer, uint32_t kv, uint32_t head) const {
    return ((uint64_t{layer - layers.begin} * 2 + kv) * kv_heads.size() + (head - kv_heads.begin)) *
           head_plane_bytes;
  }
};
RankKvShape RankKvShapeOf(const ParallelLayout& layout, const KvDims& dims, uint32_t rank);

struct KvSliceRun {
  uint64_t src_offset_bytes = 0;  // in the prefill rank's block
  uint64_t dst_offset_bytes = 0;  // in the decode rank's block
  uint64_t bytes = 0;
  bool operator==(const KvSliceRun&) const = default;
};

struct KvRankPairPlan {
  uint32_t src_rank = 0;         // prefill rank
  uint32_t dst_rank = 0;         // decode rank
  std::vector<KvSliceRun> runs;  // ascending dst offset
};

struct KvSlicePlan {
  ParallelLayout src, dst;
  KvDims dims;
  // Sorted by (src_rank, dst_rank); only pairs with at least one run.
  std::vector<KvRankPairPlan> pairs;

  // The pairs prefill rank `src_rank` pushes (possibly none).
  std::vector<const KvRankPairPlan*> FromRank(uint32_t src_rank) const;
};

// Whether a prefiller with layout `prefill` can push KV into a decoder with
// layout `decode` for a model of `dims`/`kv`: both layouts split the model
// (CheckLayout) and the KV dims are sane. INVALID_ARGUMENT naming the side
// and the dimension otherwise. (Block size and dtype equality are checked by
// registration, as for single-rank workers.)
Status KvLayoutsCompatible(const ParallelLayout& prefill, const ParallelLayout& decode,
                           const ModelDims& dims);

// The plan for moving one block from `prefill` ranks to `decode` ranks.
// INVALID_ARGUMENT when a layout cannot split `dims` (zero dims, tp neither
// dividing nor a multiple of kv heads, pp above the layer count).
Result<KvSlicePlan> PlanKvSlices(const ParallelLayout& prefill, const ParallelLayout& decode,
                                 const KvDims& dims);

}  // namespace tandem::parallel
