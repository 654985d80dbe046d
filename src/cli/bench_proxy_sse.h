// The `sse` workload of `tandem bench proxy` (docs/bench-serve.md): the
// `stream` workload's shape sent over the proxy's OpenAI HTTP API
// (POST /v1/completions, "stream": true, server-sent events) instead of
// gRPC, so that the proxy CPU per token of the two front ends can be
// compared in one run.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "loadgen/client.h"

namespace tandem::cli {

// A client of the HTTP API at `http_address` (host:port, the state file's
// proxy.http): one epoll thread, keep-alive connections (bench_proxy_sse.cc).
// `vocab_size` comes from the gRPC GetModelInfo (the HTTP API does not
// report it). Refuses a fleet without an HTTP API, and an address that is
// not IPv4 loopback: the bench drives its own machine only.
Result<std::unique_ptr<loadgen::Client>> MakeSseBenchClient(const std::string& http_address,
                                                            uint32_t vocab_size);

}  // namespace tandem::cli
