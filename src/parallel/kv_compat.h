// Which prefiller the proxy may pair with which decoder, by their rank
// layouts (issue 18, docs/parallelism.md "Rank processes"). The router pairs
// a prefiller with a decoder only when KvLayoutsPairable holds, and the
// proxy's log says why (KvPairingRefusal) for every registered pair that
// does not.
//
// Two conditions: the layouts can exchange KV at all
// (parallel/kv_slices.h KvLayoutsCompatible: both split the model), and
// this build moves KV between them: equal layouts rank by rank, different
// layouts by the slice push (kvtransfer/slice_push.h, wired in the worker
// ranks). This is the one place that decides.
//
// Pure functions, no state.
#pragma once

#include <string>

#include "parallel/parallel_layout.h"

namespace tandem::parallel {

// Why a prefiller of layout `prefill` cannot send KV to a decoder of layout
// `decode` for a model of `dims` (num_layers and num_kv_heads are read;
// zero: unknown, only the layouts are compared), in one line for the
// proxy's log; "" when it can.
std::string KvPairingRefusal(const ParallelLayout& prefill, const ParallelLayout& decode,
                             const ModelDims& dims);

inline bool KvLayoutsPairable(const ParallelLayout& prefill, const ParallelLayout& decode,
                              const ModelDims& dims) {
  return KvPairingRefusal(prefill, decode, dims).empty();
}

}  // namespace tandem::parallel
