#include "common/kv_checksum.h"

#include <xxhash.h>
#if TANDEM_XXH3_DISPATCH
#include <xxh_x86dispatch.h>
#endif

namespace tandem {

uint64_t KvChecksum(const void* data, size_t bytes) {
#if TANDEM_XXH3_DISPATCH
  return XXH3_64bits_dispatch(data, bytes);
#else
  return XXH3_64bits(data, bytes);
#endif
}

const char* KvChecksumImplementation() { return TANDEM_XXH3_DISPATCH ? "xxh3-dispatch" : "xxh3"; }

}  // namespace tandem
