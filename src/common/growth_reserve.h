// What a KV growth reserve counts (docs/engine.md, "Growth reserve"): the
// engine keeps it, the router predicts it from a decoder's load report.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace tandem {

// Tokens one request may still generate that a reserve counts, at most
// (as SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).
inline constexpr uint32_t kGrowthClipTokens = 4096;

// Tokens a holder of `held_blocks` may still write past them when its KV
// ends at `kv_end` tokens (prompt + max_tokens - 1), at most kGrowthClipTokens.
inline uint64_t GrowthTokensPast(uint64_t kv_end, size_t held_blocks, uint32_t block_size) {
  const uint64_t capacity = uint64_t{held_blocks} * block_size;
  return kv_end > capacity ? std::min<uint64_t>(kv_end - capacity, kGrowthClipTokens) : 0;
}

}  // namespace tandem
