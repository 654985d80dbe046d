// Per-request records and the summary of a run: the definitions of
// docs/bench-serve.md (TTFT, ITL, TPOT, e2e, goodput) in one place.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tandem::loadgen {

// One request as measured at the client. Times in seconds; `send_s` and
// `token_times_s` count from the start of the run.
struct RequestRecord {
  uint64_t session = 0;
  uint32_t turn = 0;
  double send_s = 0.0;
  bool ok = false;
  std::string error;     // status code name ("RESOURCE_EXHAUSTED") when !ok
  std::string message;   // the status message when !ok
  double ttft_s = -1.0;  // < 0: no token arrived
  double e2e_s = 0.0;
  // Gaps between consecutive tokens: a message carrying k tokens counts
  // its first token's gap to the previous token and k-1 gaps of 0, as the
  // proxy's tandem_inter_token_latency_seconds does.
  std::vector<double> itl_s;
  std::vector<double> chunk_times_s;     // [messages] arrival, from the start of the run
  std::vector<uint32_t> chunk_tokens;    // [messages] tokens in that message
  uint32_t prompt_tokens = 0;            // sent
  uint32_t requested_tokens = 0;         // max_tokens asked for
  uint32_t output_tokens = 0;            // received
  uint32_t usage_prompt_tokens = 0;      // usage.prompt_tokens (the server's count)
  uint32_t cached_prompt_tokens = 0;     // usage.cached_prompt_tokens
  std::string finish_reason;
  std::string tenant;               // --tenant-api-keys: the tenant's name ("" = none)
  std::optional<int32_t> priority;  // --priority: the value sent

  // (e2e - TTFT) / (output tokens - 1); nullopt with fewer than 2 tokens.
  std::optional<double> Tpot() const;
};

// Percentile with linear interpolation between closest ranks (NumPy's
// default, as vLLM's benchmark uses): p in [0, 100]. NaN when empty.
double Percentile(std::vector<double> values, double p);

struct Distribution {
  size_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, min = 0, max = 0;  // NaN when count is 0
};
Distribution Summarize(const std::vector<double>& values);

// Service-level objectives for goodput; unset ones are not checked.
struct Slo {
  std::optional<double> ttft_s;  // TTFT at most this
  std::optional<double> itl_s;   // every inter-token gap of the request at most this
  std::optional<double> tpot_s;  // the request's TPOT at most this
  std::optional<double> e2e_s;   // end-to-end latency at most this
  bool any() const { return ttft_s || itl_s || tpot_s || e2e_s; }
};

// A request counts towards goodput when it succeeded and meets every set SLO.
bool MeetsSlo(const RequestRecord& r, const Slo& slo);

// One tenant's or one priority's requests (--tenant-api-keys, --priority).
struct GroupSummary {
  std::string kind;   // "tenant" or "priority"
  std::string label;  // the tenant's name or the priority value
  size_t requests = 0, ok = 0;
  uint64_t output_tokens = 0;
  double output_throughput = 0;  // its output tokens / the run's duration
  Distribution ttft_s, tpot_s, e2e_s;
};

struct Summary {
  size_t requests = 0, ok = 0, failed = 0;
  std::map<std::string, size_t> failed_by_status;
  double duration_s = 0;  // first send to last completion
  uint64_t prompt_tokens = 0, output_tokens = 0, requested_tokens = 0, cached_prompt_tokens = 0;
  uint64_t usage_prompt_tokens = 0;  // prompt tokens as the server counted them
  Distribution ttft_s, itl_s, tpot_s, e2e_s;
  double request_throughput = 0;  // ok requests / s
  double output_throughput = 0;   // output tokens / s
  double total_token_throughput = 0;  // (prompt + output tokens of ok requests) / s
  size_t good = 0;
  double goodput = 0;  // good requests / s
  double cached_token_ratio = 0;  // cached prompt tokens / prompt tokens (ok requests, from usage)
  double max_inflight = 0;
  // By tenant, then by priority, when the records carry them.
  std::vector<GroupSummary> groups;
};

Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo);

// The first message of each failure status among `records` (status -> message):
// what a bench prints next to its counts of failed requests.
std::map<std::string, std::string> FirstFailureMessages(const std::vector<RequestRecord>& records);

// Output tokens received per time bin of `bin_s` seconds, from 0 to the
// last token: element i counts tokens arriving in [i*bin_s, (i+1)*bin_s).
std::vector<double> TokensPerBin(const std::vector<RequestRecord>& records, double bin_s);

}  // namespace tandem::loadgen
