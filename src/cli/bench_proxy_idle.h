// `tandem bench proxy --workloads idle` (issue 23): what a fleet costs with
// no request at all — each process's CPU and voluntary context switches
// (thread wake-ups) per second. Docs: docs/bench-serve.md.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::cli {

struct IdleProc {
  std::string role;  // proxy | prefill | decode | both
  int pid = 0;
};

struct IdleRow {
  std::string role;
  int pid = 0;
  double cpu_ms_per_s = 0;   // CPU time (every thread's schedstat run time) per second
  double vcsw_per_s = 0;     // voluntary context switches of every thread per second
  int threads = 0;
};

// Waits `settle_s` (work still ending from start-up or an earlier
// workload), then measures every process over `seconds`.
Result<std::vector<IdleRow>> MeasureIdle(const std::vector<IdleProc>& procs, double settle_s,
                                         double seconds);

// The idle workload: measures, prints one row per process, appends one
// JSON object to `out`. Returns the exit code (1 on a measuring error).
int RunIdleWorkload(const std::vector<IdleProc>& procs, double seconds, nlohmann::json& out);

}  // namespace tandem::cli
