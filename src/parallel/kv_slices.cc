#include "parallel/kv_slices.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

namespace tandem::parallel {
namespace {

Status CheckKvSide(const char* side, const ParallelLayout& l, const KvDims& d) {
  if (l.tp < 1 || l.pp < 1) {
    return InvalidArgumentError(fmt::format(
        "{} tensor_parallel {} and pipeline_parallel {} must be at least 1", side, l.tp, l.pp));
  }
  if (d.num_kv_heads % l.tp != 0 && l.tp % d.num_kv_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "{} tensor_parallel {} neither divides nor is a multiple of num_key_value_heads {}", side,
        l.tp, d.num_kv_heads));
  }
  if (l.pp > d.num_layers) {
    return InvalidArgumentError(fmt::format("{} pipeline_parallel {} exceeds num_hidden_layers {}",
                                            side, l.pp, d.num_layers));
  }
  return Status::Ok();
}

// The prefill rank that sends (layer, head): the stage holding the layer,
// the lowest tensor rank holding the head.
uint32_t SenderOf(const ParallelLayout& l, const KvDims& d, uint32_t layer, uint32_t head) {
  uint32_t stage = 0;
  while (!(StageLayers(l, d.num_layers, stage).end > layer)) ++stage;
  uint32_t tp_rank = 0;
  for (;; ++tp_rank) {
    const Range h = TpKvHeads(l, d.num_kv_heads, tp_rank);
    if (head >= h.begin && head < h.end) break;
  }
  return l.rank_of(stage, tp_rank);
}

}  // namespace

RankKvShape RankKvShapeOf(const ParallelLayout& layout, const KvDims& dims, uint32_t rank) {
  RankKvShape s;
  s.layers = StageLayers(layout, dims.num_layers, layout.stage_of(rank));
  s.kv_heads = TpKvHeads(layout, dims.num_kv_heads, layout.tp_rank_of(rank));
  s.head_plane_bytes = uint64_t{dims.block_size} * dims.head_dim * dims.bytes_per_elem;
  return s;
}

std::vector<const KvRankPairPlan*> KvSlicePlan::FromRank(uint32_t src_rank) const {
  std::vector<const KvRankPairPlan*> out;
  for (const auto& p : pairs) {
    if (p.src_rank == src_rank) out.push_back(&p);
  }
  return out;
}

Status KvLayoutsCompatible(const ParallelLayout& prefill, const ParallelLayout& decode,
                           const ModelDims& dims) {
  if (Status s = CheckLayout(prefill, dims); !s.ok()) {
    return InvalidArgumentError(
        fmt::format("prefill layout {}: {}", ToString(prefill), s.message()));
  }
  if (Status s = CheckLayout(decode, dims); !s.ok()) {
    return InvalidArgumentError(fmt::format("decode layout {}: {}", ToString(decode), s.message()));
  }
  return Status::Ok();
}

Result<KvSlicePlan> PlanKvSlices(const ParallelLayout& prefill, const ParallelLayout& decode,
                                 const KvDims& dims) {
  if (dims.num_layers == 0 || dims.num_kv_heads == 0 || dims.head_dim == 0 ||
      dims.block_size == 0 || dims.bytes_per_elem == 0) {
    return InvalidArgumentError(fmt::format(
        "KV dims must be non-zero: num_layers {}, num_kv_heads {}, head_dim {}, block_size {}, "
        "bytes_per_elem {}",
        dims.num_layers, dims.num_kv_heads, dims.head_dim, dims.block_size, dims.bytes_per_elem));
  }
  TANDEM_RETURN_IF_ERROR(CheckKvSide("prefill", prefill, dims));
  TANDEM_RETURN_IF_ERROR(CheckKvSide("decode", decode, dims));

  KvSlicePlan plan{.src = prefill, .dst = decode, .dims = dims, .pairs = {}};
  std::map<std::pair<uint32_t, uint32_t>, std::vector<KvSliceRun>> by_pair;
  for (uint32_t dst = 0; dst < decode.world(); ++dst) {
    const RankKvShape ds = RankKvShapeOf(decode, dims, dst);
    // Walk the destination block in its own (ascending offset) order.
    for (uint32_t layer = ds.layers.begin; layer < ds.layers.end; ++layer) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t head = ds.kv_heads.begin; head < ds.kv_heads.end; ++head) {
          const uint32_t src = SenderOf(prefill, dims, layer, head);
          const RankKvShape ss = RankKvShapeOf(prefill, dims, src);
          const KvSliceRun run{.src_offset_bytes = ss.offset(layer, kv, head),
                               .dst_offset_bytes = ds.offset(layer, kv, head),
                               .bytes = ds.head_plane_bytes};
          auto& runs = by_pair[{src, dst}];
          if (!runs.empty() &&
              runs.back().src_offset_bytes + runs.back().bytes == run.src_offset_bytes &&
              runs.back().dst_offset_bytes + runs.back().bytes == run.dst_offset_bytes) {
            runs.back().bytes += run.bytes;
          } else {
            runs.push_back(run);
          }
        }
      }
    }
  }
  plan.pairs.reserve(by_pair.size());
  for (auto& [key, runs] : by_pair) {
    plan.pairs.push_back({.src_rank = key.first, .dst_rank = key.second, .runs = std::move(runs)});
  }
  return plan;
}

}  // namespace tandem::parallel
