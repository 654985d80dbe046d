// Token sampling: greedy, temperature, top-k, top-p, with a per-request
// seed. The random stream is counter-based: the draw for a request's n-th
// output token depends only on (seed, n), so a request gives the same tokens
// whatever the batch, the chunking, a preemption, or which worker (prefiller
// or decoder) samples which token.
//
// Thread-safety: pure functions; Sampler holds scratch space and may be used
// by one thread at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tandem::engine {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  uint32_t top_k = 0;        // 0: off
  std::optional<uint64_t> seed;  // unset: the engine draws one at admission
  uint32_t max_tokens = 16;      // >= 1
  std::vector<uint32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings, not emitted
  bool ignore_eos = false;
};

// Checks ranges; messages name the field and the allowed range.
Status ValidateSamplingParams(const SamplingParams& params);

// Uniform double in [0, 1) for the index-th draw of `seed`.
double UniformDraw(uint64_t seed, uint64_t index);

// The index of the largest non-NaN value, the lowest index on ties
// (-0.0 and +0.0 tie); 0 when every value is NaN. Greedy decoding's pick,
// in two branch-free passes (SSE lanes) (issue 23: the one-branch-per-logit
// loop was 5 % of a decoder's CPU per token).
uint32_t Argmax(std::span<const float> logits);

// Whether Sample() on a one-hot row (0.0 at one id, -1e30 at every other)
// returns that id for every seed and index: greedy and top_k 1 always;
// otherwise while exp(-1e30 / temperature) is exactly 0 in double, which
// holds far beyond temperature 1e20. The sim backend's rows are such rows
// (ComputeBackend::one_hot_logits): the engine then takes the hot id
// without filling or scanning the row.
bool OneHotPickIsCertain(const SamplingParams& params);

class Sampler {
 public:
  // logits: [vocab]. Greedy picks the largest logit, the lowest id on ties
  // (as torch.argmax). Otherwise: logits / temperature, keep the top_k
  // largest, keep the smallest prefix (by decreasing probability, ties by
  // id) whose mass reaches top_p, and draw by inverse CDF with
  // UniformDraw(seed, index). The order of every sum is fixed.
  uint32_t Sample(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                  uint64_t index);

 private:
  std::vector<std::pair<float, uint32_t>> cand_;  // scratch: (logit, id)
  std::vector<double> probs_;
};

}  // namespace tandem::engine
