// The floors of `tandem bench proxy` (issue 23): what streaming one token per
// stream per step costs a server on this machine without any of the proxy's
// work, measured in the same run as the proxy. Seven rows, each a server in
// its own process (`tandem bench proxy-floor-server`, hidden) so that its
// CPU time is its own (the same subcommand also serves prompt-floor's
// relay-tcp channel, bench_proxy_relay_floor.h):
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
//              reader that sleeps in epoll_wait between steps;
//   floor-step, floor-step+ack: the floor of the proxy's structure, woken
//              once per step by a feeder and sending once per client
//              connection per step (bench_proxy_floor_step.h);
//   floor-4r+ack: floor-step+ack with a reader thread per client
//              connection, so that each send wakes a thread of its own.
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
  std::string name;           // floor-cb, floor-cq, floor-cq+cb, floor-tcp, floor-step, ...
  bool grpc = true;           // a gRPC server: the summary has the client's ITL
  double server_cpu_s = 0;    // CPU time of the floor server's process (ProcessCpuSeconds)
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

// Shared by the raw TCP floors (bench_proxy_floor.cc, bench_proxy_floor_step.cc).
namespace floor_detail {

struct Child {
  int pid = -1;
  int port = 0;
};
// Runs `self bench proxy-floor-server ARGS` and reads its "PORT n" line.
Result<Child> SpawnServer(const std::string& self, const std::vector<std::string>& args);
void StopChild(Child& c);

// Accepts `n` connections (TCP_NODELAY), in the order they connected;
// empty on failure.
std::vector<int> AcceptNoDelay(int listen_fd, uint32_t n);

// The wire size of one token message as the gRPC floors send it: the
// protobuf, gRPC's 5-byte message prefix, HTTP/2's 9-byte DATA header.
uint32_t TokenWireBytes();

// `n` blocking loopback connections to 127.0.0.1:`port`.
Result<std::vector<int>> ConnectLoopback(int port, uint32_t n);

struct ReadResult {
  uint64_t bytes = 0;       // received over all connections
  bool all_closed = false;  // every connection saw the server's EOF in time
  double duration_s = 0;
};
// One reader thread for all `fds`: sleeps in epoll_wait, reads what
// arrives until every connection is closed by the server (or `duration_s`
// passes). `ack_bytes` > 0: after every read, sends that many bytes back on
// the same connection (a client's WINDOW_UPDATE). Closes no fd.
ReadResult ReadUntilClosed(const std::vector<int>& fds, double duration_s, uint32_t ack_bytes);

}  // namespace floor_detail

}  // namespace tandem::cli
