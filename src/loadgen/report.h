// Output of a `tandem bench serve` run: the summary table (stdout), the
// JSON document (--json) and the self-contained HTML report (--report).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loadgen/runner.h"
#include "loadgen/stats.h"

namespace tandem::loadgen {

// What the run was, for the table header, the JSON and the report.
struct RunInfo {
  std::string label;       // --label
  std::string command;     // the command line
  std::string target;      // the client's Describe()
  std::string model;       // served model id
  uint32_t max_model_len = 0;
  std::string workload;    // the source's Describe()
  std::string arrival;     // Describe(ArrivalOptions)
  std::string bounds;      // "100 requests", "60 s", ...
  std::string started_utc; // ISO 8601
  Slo slo;
  bool ignore_eos = false;
  uint64_t dropped_turns = 0;
  uint64_t aborted_sessions = 0;
};

std::string FormatTable(const RunInfo& info, const Summary& s);

// Keys are stable (docs/bench-serve.md); times in milliseconds where the
// key says _ms, throughputs per second.
nlohmann::json ToJson(const RunInfo& info, const Summary& s,
                      const std::vector<RequestRecord>& records);

std::string HtmlReport(const RunInfo& info, const Summary& s,
                       const std::vector<RequestRecord>& records);

// The width of the throughput bins: about 60 bins over the run, at least
// 0.1 s.
double ThroughputBinSeconds(const std::vector<RequestRecord>& records);

}  // namespace tandem::loadgen
