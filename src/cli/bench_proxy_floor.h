// The floors of `tandem bench proxy` (issue 23): what streaming one token per
// stream per step costs a server on this machine without any of the proxy's
// work, measured in the same run as the proxy. Three servers, each in its
// own process (`tandem bench proxy-floor-server`, hidden) so that its CPU
// time is its own:
//   floor-cb:  a bare tandem.v1.Generation/Generate server on gRPC's
//              callback API (as the proxy's), streaming canned tokens: a
//              callback alarm (run on gRPC's callback thread, where the
//              proxy reads the decode stream) writes one token to every
//              open stream per step;
//   floor-cq:  the same on the async completion-queue API, driven by one
//              thread of its own (a grpc::Alarm per step on the same queue);
//   floor-cq+cb: floor-cq with one callback-API method in the same service
//              (never called), so that gRPC's callback threads run in the
//              process, as in every tandem server;
//   floor-tcp: the kernel floor: one raw loopback TCP send of the same
//              message's wire size per token, at the same cadence, to a
//              reader that sleeps in epoll_wait between steps.
// The load generator's client is the one the proxy's rows use (4 channels).
// Docs: docs/bench-serve.md, "tandem bench proxy".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/client.h"
#include "loadgen/stats.h"

namespace CLI {
class App;
}

namespace tandem::cli {

struct FloorSpec {
  uint32_t requests = 32, input = 16, output = 1000, concurrency = 16;
  double step_ms = 6.4;  // the cadence: one token per stream per step
  double duration_s = 300;
};

struct FloorRow {
  std::string name;           // floor-cb, floor-cq, floor-cq+cb, floor-tcp
  double server_cpu_s = 0;    // utime + stime of the floor server's process
  uint64_t tokens = 0;        // tokens (messages, for tcp) delivered
  uint64_t requests_ok = 0, requests_failed = 0;
  loadgen::Summary summary;   // gRPC rows: the client's view (ITL); tcp: duration only
  double load1 = 0;
};

// `self`: this executable (the floor servers are `self bench proxy-floor-server`).
Result<std::vector<FloorRow>> RunProxyFloors(const std::string& self, const FloorSpec& spec,
                                             const loadgen::ModelInfo& model);

// The hidden `tandem bench proxy-floor-server` subcommand.
void RegisterBenchProxyFloorServer(CLI::App& bench, int& exit_code);

}  // namespace tandem::cli
