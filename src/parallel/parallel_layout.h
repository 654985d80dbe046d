// How a worker's model is split over its ranks (issue 18,
// docs/parallelism.md): `tensor_parallel` (tp) × `pipeline_parallel` (pp)
// processes. Rank r is pipeline stage r / tp and tensor rank r % tp; rank 0
// (stage 0, tensor rank 0) owns the worker's gRPC endpoint, scheduler and
// prefix cache, and the others follow its step plan.
//
// Sharding (Megatron style): q/k/v/gate/up column-parallel, o/down
// row-parallel + all-reduce, vocab-parallel embedding and LM head. Attention
// heads are split evenly; KV heads are split when tp divides them and
// replicated otherwise (tp % kv_heads == 0: each KV head lives on
// tp / kv_heads consecutive tensor ranks). Layers are split into contiguous
// stages, the first `layers % pp` stages taking one more.
//
// Pure values and functions, no state; used by the engine, the transport
// (KV slices between different layouts), the router (compatibility) and the
// launcher.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace tandem::parallel {

struct Range {
  uint32_t begin = 0, end = 0;  // [begin, end)
  uint32_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

struct ParallelLayout {
  uint32_t tp = 1;
  uint32_t pp = 1;

  uint32_t world() const { return tp * pp; }
  uint32_t stage_of(uint32_t rank) const { return rank / tp; }
  uint32_t tp_rank_of(uint32_t rank) const { return rank % tp; }
  uint32_t rank_of(uint32_t stage, uint32_t tp_rank) const { return stage * tp + tp_rank; }
  bool operator==(const ParallelLayout&) const = default;
};

// The model dimensions a layout splits.
struct ModelDims {
  uint32_t num_layers = 0;
  uint32_t num_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t intermediate = 0;
  uint32_t vocab = 0;
};

// Whether `layout` can split `dims`: tp divides heads, intermediate and
// vocab; tp divides kv_heads or kv_heads divides tp; pp <= layers; tp and pp
// >= 1. INVALID_ARGUMENT naming the dimension and the degree otherwise
// (e.g. "tensor_parallel 3 does not divide num_attention_heads 8").
Status CheckLayout(const ParallelLayout& layout, const ModelDims& dims);

// Layers held by pipeline stage `stage`.
Range StageLayers(const ParallelLayout& layout, uint32_t num_layers, uint32_t stage);
// Attention (query) heads of tensor rank `tp_rank`.
Range TpHeads(const ParallelLayout& layout, uint32_t num_heads, uint32_t tp_rank);
// KV heads held by tensor rank `tp_rank` (one head, replicated, when
// kv_heads < tp).
Range TpKvHeads(const ParallelLayout& layout, uint32_t num_kv_heads, uint32_t tp_rank);
// Columns [begin, end) of a dimension `n` split evenly over tp (n % tp == 0).
Range TpSlice(const ParallelLayout& layout, uint32_t n, uint32_t tp_rank);

std::string ToString(const ParallelLayout& layout);  // "tp2pp1"

}  // namespace tandem::parallel
