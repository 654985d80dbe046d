#include "parallel/kv_compat.h"

#include <fmt/format.h>

namespace tandem::parallel {

bool KvLayoutsCompatible(const ParallelLayout& prefill, const ParallelLayout& decode,
                         const ModelDims& dims) {
  return KvLayoutsIncompatibility(prefill, decode, dims).empty();
}

std::string KvLayoutsIncompatibility(const ParallelLayout& prefill, const ParallelLayout& decode,
                                     const ModelDims& /*dims*/) {
  // Equal layouts only until the slice push between layouts exists (see
  // the header); the model's dimensions then decide which pairs work.
  if (prefill == decode) return "";
  return fmt::format("prefill layout {} differs from decode layout {} (KV transfer between "
                     "different tensor_parallel/pipeline_parallel degrees is not supported by "
                     "this build)",
                     ToString(prefill), ToString(decode));
}

}  // namespace tandem::parallel
