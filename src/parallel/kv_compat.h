// Which prefiller may send its KV to which decoder, by their rank layouts
// (issue 18, docs/parallelism.md "Rank processes"). The proxy's router pairs
// a prefiller with a decoder only when this holds, and says why in its log
// when a registered pair does not.
//
// Today compatible means EQUAL layouts (same tensor_parallel and
// pipeline_parallel): each prefill rank then pushes its own slice to the
// decode rank of the same index. kv-reshard's slice push (KV re-sharded
// between different TP/PP degrees, parallel/kv_slices) widens this once it
// exists; this function is the one place that decides.
//
// Pure functions, no state.
#pragma once

#include <string>

#include "parallel/parallel_layout.h"

namespace tandem::parallel {

// Whether a prefiller with layout `prefill` can deliver the KV of a block
// to a decoder with layout `decode` for a model of `dims` (only
// num_layers and num_kv_heads are read).
bool KvLayoutsCompatible(const ParallelLayout& prefill, const ParallelLayout& decode,
                         const ModelDims& dims);

// Why not, in one line for the proxy's log ("" when compatible), e.g.
// "prefill layout tp2pp1 differs from decode layout tp1pp1 (KV between
// different layouts is not supported by this build)".
std::string KvLayoutsIncompatibility(const ParallelLayout& prefill, const ParallelLayout& decode,
                                     const ModelDims& dims);

}  // namespace tandem::parallel
