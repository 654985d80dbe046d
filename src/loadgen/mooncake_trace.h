// Reader of the Mooncake trace format (one JSON object per line:
// {"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]})
// and its mapping to token ids for replay.
//
// Every hash id stands for one prefix block of 512 tokens; equal ids mean
// equal blocks. Replay maps id h to a deterministic block of token ids
// seeded by h (the same block wherever h appears), concatenates the blocks
// of a request and cuts the last one to the request's length. Lengths can
// be scaled down for a model with a small context: `block_tokens` < 512
// scales every input length by block_tokens / 512 (so the prefix structure
// is kept exactly: a shared id is still a shared block, now of block_tokens
// tokens), and output lengths by their own factor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

inline constexpr uint32_t kMooncakeBlockTokens = 512;

struct TraceRecord {
  uint64_t timestamp_ms = 0;
  uint32_t input_length = 0;
  uint32_t output_length = 0;
  std::vector<uint64_t> hash_ids;
  uint32_t line = 0;  // 1-based line in the file
};

// Parses the text of a trace; `name` prefixes error messages
// ("trace.jsonl:17: field 'hash_ids' has 3 ids; input_length 2000 needs 4").
// Blank lines are skipped. At most `max_records` records are read (0: all).
Result<std::vector<TraceRecord>> ParseMooncakeTrace(const std::string& text,
                                                    const std::string& name,
                                                    size_t max_records = 0);
Result<std::vector<TraceRecord>> ReadMooncakeTrace(const std::string& path,
                                                   size_t max_records = 0);

// The token ids of hash block `hash_id`: `n` ids seeded by the id.
std::vector<uint32_t> HashBlockTokens(uint64_t hash_id, uint32_t n, uint32_t vocab);

struct TraceReplayOptions {
  uint32_t block_tokens = kMooncakeBlockTokens;  // tokens per hash block after scaling
  double output_scale = 1.0;                     // factor on output_length (rounded, >= 1)
  double time_scale = 1.0;                       // factor on timestamps (0.5 = twice as fast)
  uint32_t vocab = 0;
  uint32_t max_model_len = 0;  // prompt + completion limit; 0 = none
};

struct TraceReplay {
  std::vector<Session> sessions;  // one single-turn session per record
  uint64_t truncated_prompts = 0;  // prompts cut to fit max_model_len
  uint64_t clamped_outputs = 0;    // outputs cut to fit max_model_len
  std::string description;
};

// The scaled input length of a record: ceil(input_length * block_tokens / 512).
uint32_t ScaledInputLength(uint32_t input_length, uint32_t block_tokens);

// Builds the sessions of a replay. A record whose scaled prompt plus output
// does not fit max_model_len keeps its leading tokens (so its shared
// prefix is kept) and is counted in truncated_prompts.
Result<TraceReplay> BuildTraceReplay(const std::vector<TraceRecord>& records,
                                     const TraceReplayOptions& o);

}  // namespace tandem::loadgen
