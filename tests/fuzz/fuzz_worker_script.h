// What a request meets at the server targets' scripted workers
// (fuzz_workers.h), chosen from its prompt so that the fuzzer steers it;
// shared with fuzz_make_seeds, which writes a seed for each.
#pragma once

#include <cstdint>
#include <vector>

namespace tandem::fuzz {

enum WorkerScript : int {
  // 0-4: a whole completion (odd: the decoder's first item before the
  // Prefill's reply).
  kPrefillUnavailable = 5,  // UNAVAILABLE: the proxy retries
  kPrefillNoRoom = 6,       // RESOURCE_EXHAUSTED: "the decoder has no room"
  kDecodeBreaks = 7,        // the stream breaks after 2 tokens: the proxy migrates
  kDecodeRefuses = 8,       // an in-band refusal at registration
  kDecodeStalls = 9,        // 3 tokens, then nothing until a cancel or the deadline
  kPrefillHangs = 10,       // no reply until a cancel or the deadline
  kDecodeFails = 11,        // an in-band INTERNAL after 1 token
  kWorkerScripts = 12,
};

// The script of a request's routing `attempt` (from 1) with this prompt.
inline int ScriptOf(const std::vector<uint32_t>& prompt, uint32_t attempt) {
  uint64_t h = prompt.size() * 0x9E3779B97F4A7C15ull + attempt;
  if (!prompt.empty()) h ^= (uint64_t{prompt.front()} << 32) ^ prompt.back() * 0xff51afd7ull;
  h ^= h >> 29;
  return static_cast<int>(h % kWorkerScripts);
}

}  // namespace tandem::fuzz
