// The `sse` workload's client: the load generator's HTTP client
// (loadgen/http_client.h: one connection and one thread per request,
// Beast's parser reading the chunked event stream, each SSE event with text
// timed as one message for ITL, output tokens from the final usage chunk).
// A connection per request costs the proxy one accept and one session per
// 1,000 tokens in the default shape; the per-token cost, which this
// workload measures, is the same as on a kept-alive connection.
#include "cli/bench_proxy_sse.h"

#include <fmt/format.h>

#include "loadgen/http_client.h"

namespace tandem::cli {

Result<std::unique_ptr<loadgen::Client>> MakeSseBenchClient(const std::string& http_address,
                                                            uint32_t vocab_size) {
  if (http_address.empty()) {
    return InvalidArgumentError(
        "workload sse: the fleet's state file has no proxy.http (set proxy.http in the config)");
  }
  const size_t colon = http_address.rfind(':');
  const std::string host = colon == std::string::npos ? http_address : http_address.substr(0, colon);
  if (host != "127.0.0.1" && host != "localhost" && host != "[::1]" && host != "::1") {
    return InvalidArgumentError(fmt::format(
        "workload sse: proxy.http is {}; the bench drives a loopback address only", http_address));
  }
  loadgen::HttpClientOptions o;
  o.address = http_address;
  o.vocab_size = vocab_size;
  return loadgen::MakeHttpClient(o);
}

}  // namespace tandem::cli
