#include "parallel/kv_compat.h"

#include <fmt/format.h>

#include "parallel/kv_slices.h"

namespace tandem::parallel {

std::string KvPairingRefusal(const ParallelLayout& prefill, const ParallelLayout& decode,
                             const ModelDims& dims) {
  if (prefill == decode) return "";  // rank r's slice goes to rank r
  if (dims.num_layers != 0 && dims.num_kv_heads != 0) {
    if (Status s = KvLayoutsCompatible(prefill, decode, dims); !s.ok()) {
      return std::string(s.message());
    }
  }
  return fmt::format("prefill layout {} differs from decode layout {}: this build moves KV only "
                     "between equal tensor_parallel/pipeline_parallel layouts",
                     ToString(prefill), ToString(decode));
}

}  // namespace tandem::parallel
