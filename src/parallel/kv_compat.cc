#include "parallel/kv_compat.h"

#include <fmt/format.h>

#include "parallel/kv_slices.h"

namespace tandem::parallel {

std::string KvPairingRefusal(const ParallelLayout& prefill, const ParallelLayout& decode,
                             const ModelDims& dims) {
  if (prefill == decode) return "";  // rank r's slice goes to rank r
  // Different layouts: the slice push (kvtransfer/slice_push.h) moves every
  // (layer, K/V, kv head) to the decode ranks holding it, as long as both
  // layouts split the model. Unknown dims (an older worker): each worker
  // checked its own layout against the model at start-up.
  if (dims.num_layers != 0 && dims.num_kv_heads != 0) {
    if (Status s = KvLayoutsCompatible(prefill, decode, dims); !s.ok()) {
      return std::string(s.message());
    }
  }
  return "";
}

}  // namespace tandem::parallel
