// Drives a run of `tandem bench serve`: starts sessions by the arrival
// process, sends each turn through the Client, measures every reply and
// stops at the bounds.
//
// Threads: Run() blocks its caller; the runner's dispatch loop runs on the
// calling thread and replies arrive on the client's threads. A progress
// callback, when given, is called from the calling thread about twice a
// second.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/arrival.h"
#include "loadgen/client.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

struct RunOptions {
  ArrivalOptions arrival;
  // Bounds: stop sending after this many requests and/or after this many
  // seconds (0: no bound; at least one bound must be set unless the
  // workload is finite). Requests in flight at the bound are awaited.
  uint64_t num_requests = 0;
  double duration_s = 0;
  // Sampling of every request.
  std::optional<float> temperature = 0.0f;
  std::optional<uint64_t> seed;  // per-request seeds: seed + request index
  bool ignore_eos = false;
  std::string model;
  std::chrono::milliseconds request_timeout{300000};
  std::string request_id_prefix = "bench";
  // Mixes (--tenant-api-keys, --priority): session i takes the class at
  // i modulo the total weight, walking the classes in order (so 3:1 sends
  // sessions 0-2 as the first, 3 as the second, ...). Empty: none.
  struct TenantClass {
    std::string name;
    std::string api_key;
    uint32_t weight = 1;
  };
  struct PriorityClass {
    int32_t priority = 0;
    uint32_t weight = 1;
  };
  std::vector<TenantClass> tenants;
  std::vector<PriorityClass> priorities;
};

struct Progress {
  double elapsed_s = 0;
  uint64_t sent = 0, done = 0, failed = 0, inflight = 0;
  uint64_t output_tokens = 0;
  uint64_t num_requests = 0;  // the bound, 0 when none
  double duration_s = 0;      // the bound, 0 when none
};

struct RunResult {
  std::vector<RequestRecord> records;  // in the order they finished
  uint64_t dropped_turns = 0;  // follow-up turns not sent because a bound was reached
  // Conversations cut short because a turn failed.
  uint64_t aborted_sessions = 0;
};

Result<RunResult> Run(Client& client, SessionSource& source, const RunOptions& o,
                      const std::function<void(const Progress&)>& progress = {});

}  // namespace tandem::loadgen
