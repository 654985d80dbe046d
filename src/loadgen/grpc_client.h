// Client over tandem's public gRPC API (tandem.v1.Generation/Generate, server
// streaming), with the gRPC callback API: no thread per request.
#pragma once

#include <memory>
#include <string>

#include "loadgen/client.h"

namespace tandem::loadgen {

struct GrpcClientOptions {
  std::string address;  // host:port of the proxy
  std::string api_key;  // sent as `authorization: Bearer KEY` when set
  // Calls are spread over this many channels (each its own HTTP/2
  // connection), so that one connection's flow control does not shape
  // the measurement at high concurrency.
  int channels = 4;
  // Not empty: TLS, the server verified against this CA (PEM file; e.g. a
  // state file's public_ca_file). Unreadable: every call fails UNAVAILABLE.
  std::string tls_ca_file;
};

std::unique_ptr<Client> MakeGrpcClient(const GrpcClientOptions& o);

}  // namespace tandem::loadgen
