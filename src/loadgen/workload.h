// Workloads of `tandem bench serve`: what each request sends.
//
// A workload is a stream of sessions. A session is one conversation: its
// turns run one after another, and turn k > 0 sends the prompt of turn k-1,
// the tokens the server answered to it, then its own new tokens (so every
// turn extends the last, as a chat client does). A single-turn request is a
// session of one turn. Sessions are produced lazily so that a duration-bound
// run does not need to know how many it will use.
//
// Thread use: a SessionSource is used by one thread (the runner's).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::loadgen {

struct Turn {
  std::vector<uint32_t> new_tokens;  // [n] appended to the conversation so far
  uint32_t max_tokens = 1;
};

struct Session {
  uint64_t id = 0;
  // Trace replay: seconds after the start of the run at which the session's
  // first turn is sent (already multiplied by the time scale). Ignored by
  // the other arrival processes.
  double start_s = 0.0;
  std::vector<Turn> turns;
};

class SessionSource {
 public:
  virtual ~SessionSource() = default;
  // The next session, or nullopt when the workload is exhausted.
  virtual std::optional<Session> Next() = 0;
  // One line describing the workload (for the table and the report).
  virtual std::string Describe() const = 0;
};

// A length distribution: "N" or "fixed:N", "uniform:LO:HI" (inclusive),
// "normal:MEAN:STDDEV" (rounded, clipped to [1, 2*MEAN]).
struct LengthDist {
  enum class Kind { kFixed, kUniform, kNormal };
  Kind kind = Kind::kFixed;
  double a = 0, b = 0;  // fixed: a; uniform: [a, b]; normal: mean a, stddev b

  // `flag` names the option in error messages.
  static Result<LengthDist> Parse(const std::string& spec, const std::string& flag);
  uint32_t Sample(std::mt19937_64& rng) const;
  double Mean() const;
  uint32_t Max() const;  // the largest value Sample can return
  std::string ToString() const;
};

// Token ids of a synthetic prompt are drawn uniformly from
// [kFirstTokenId, vocab): ids below it are the bundled tokenizer's special
// tokens (eos, bos, chat markers), which a random prompt should not contain.
inline constexpr uint32_t kFirstTokenId = 4;

// `n` token ids from a deterministic stream seeded by `seed` (SplitMix64,
// the same on every platform), each in [kFirstTokenId, vocab).
std::vector<uint32_t> SeededTokens(uint64_t seed, uint32_t n, uint32_t vocab);

struct SyntheticOptions {
  LengthDist input{LengthDist::Kind::kFixed, 128, 0};
  LengthDist output{LengthDist::Kind::kFixed, 128, 0};
  // Shared-prefix groups: session i belongs to group i % groups and its
  // first prompt starts with that group's prefix of prefix_len tokens.
  uint32_t prefix_groups = 0;
  uint32_t prefix_len = 0;
  uint32_t turns = 1;  // turns per conversation
  uint64_t seed = 0;
  uint32_t vocab = 0;          // from the server (ListModels)
  uint32_t max_model_len = 0;  // prompt + completion limit of the model
};

// Checks that a whole conversation of the largest lengths fits the context;
// the error names the flags and the limit.
Status ValidateSynthetic(const SyntheticOptions& o);
std::unique_ptr<SessionSource> MakeSyntheticSource(const SyntheticOptions& o);

// A source over a fixed list (trace replay, tests).
std::unique_ptr<SessionSource> MakeListSource(std::vector<Session> sessions,
                                              std::string description);

}  // namespace tandem::loadgen
