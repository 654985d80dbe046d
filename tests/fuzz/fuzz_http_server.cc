// libFuzzer target: the OpenAI HTTP API's connection as a whole (http/:
// Boost.Beast's parser under tandem's session, the routes, the request
// bodies, the replies and SSE streams, pipelining, the close). Two
// HttpServers on 127.0.0.1 for the process, one plaintext and one with
// security.public_tls (Beast's TLS stream), over the same Frontend and
// scripted workers as fuzz_h2_server (server_fuzz.h: a completion that
// passes every check runs its lifecycle); each input is what one client
// sends on one connection, then the client's end of the TCP stream is
// closed. What must hold for every input:
//   - no crash or sanitizer report (the server runs in this process);
//   - the server closes the connection after the client's end (within 8 s,
//     else a trap), and its count of open connections is back to 0;
//   - every admitted request's slot is freed (Frontend::inflight() back
//     to 0 within 8 s, else a trap);
//   - what the server sends starts as an HTTP/1.1 response;
//   - the server still answers: every 256th input, and after any input that
//     it cut short, GET /v1/models on a new connection gets the model list.
// The first input byte: bit 1 sends the rest one byte per write, bit 2
// sends `GET /fuzz-wait` after the rest and keeps the client's end open
// until its 404 (which names the path) has come and every admitted request
// has ended (their replies written; else the close cancels them, as a
// client that goes away does), bit 3 speaks TLS to the TLS server, bit 4
// sets the first request's Content-Length to the bytes after its header
// (added when it has none), so that a mutation that changes the body's
// length still reaches the body's parser and the request's lifecycle
// instead of a short or overlong body (tests/fuzz/dict/http_server.dict
// gives such mutations the API's names). Not in
// CI's fuzz build, as fuzz_h2_server
// (tests/fuzz/CMakeLists.txt); `tools/fuzz.sh long http_server RUNS`
// configures and builds it; CI's unit suite runs its seeds
// (fuzz_seeds_http_server: tests/CMakeLists.txt).
#include <strings.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/config.h"
#include "common/metrics.h"
#include "fuzz_util.h"
#include "http/http_server.h"
#include "proxy/proxy_server.h"
#include "server_fuzz.h"

namespace {

using namespace tandem;
using namespace tandem::fuzz;

const std::string kWait = "GET /fuzz-wait HTTP/1.1\r\nHost: fuzz\r\n\r\n";
const std::string kWaitAnswer = "/fuzz-wait";

struct Server {
  FuzzProxy* proxy = nullptr;
  FleetConfig config;
  std::unique_ptr<MetricsRegistry> metrics;
  // [0] plaintext, [1] with security.public_tls, one Frontend.
  std::unique_ptr<http::HttpServer> http[2];
  uint16_t port[2] = {0, 0};
};

const std::string kAlpn = "\x08http/1.1";

Server& Get() {
  static Server* s = [] {
    auto* s = new Server();  // never destroyed: its threads outlive the inputs
    s->proxy = StartFuzzProxy();
    s->config.model.path = TANDEM_SOURCE_DIR "/models/tandem-kjv";
    s->metrics = std::make_unique<MetricsRegistry>(MetricLabels{"tandem-kjv", "proxy", "proxy"});
    proxy::HttpContext ctx;
    ctx.config = &s->config;
    ctx.frontend = s->proxy->frontend.get();
    ctx.fleet = s->proxy->fleet.get();
    ctx.metrics = s->metrics.get();
    // The server's limits come from the fleet file's proxy section.
    s->config.proxy.limits.max_connections = 64;
    http::ServerOptions options;
    for (int i : {0, 1}) {
      if (i == 1) ctx.public_tls = FuzzTlsFiles();
      auto server = http::HttpServer::Start("127.0.0.1:0", ctx, options);
      if (!server.ok()) std::abort();
      s->http[i] = std::move(server).value();
      s->port[i] = PortOf(s->http[i]->address());
    }
    return s;
  }();
  return *s;
}

// Bit 4: the first request's Content-Length names the bytes after its
// header's end, to the end of the input (a pipelined request after it is
// its body).
void FitContentLength(std::string& s) {
  const size_t end = s.find("\r\n\r\n");
  if (end == std::string::npos) return;
  const std::string n = std::to_string(s.size() - (end + 4));
  constexpr std::string_view kName = "content-length:";
  for (size_t line = s.find("\r\n"); line < end; line = s.find("\r\n", line + 2)) {
    const size_t at = line + 2;
    if (s.size() - at < kName.size() ||
        strncasecmp(s.data() + at, kName.data(), kName.size()) != 0) {
      continue;
    }
    const size_t value = at + kName.size();
    const size_t value_end = s.find("\r\n", value);
    s.replace(value, value_end - value, " " + n);
    return;
  }
  s.insert(end + 2, "Content-Length: " + n + "\r\n");
}

void CheckAlive(const Server& s, bool tls) {
  ExpectAnswer(s.port[tls], tls ? &kAlpn : nullptr, "GET /v1/models HTTP/1.1\r\nHost: fuzz\r\n\r\n",
               "\"tandem-kjv\"");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  static uint64_t inputs = 0;
  Server& s = Get();
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  std::string out(reinterpret_cast<const char*>(data + 1), size - 1);
  if (flags & 16) FitContentLength(out);
  if (flags & 4) out += kWait;
  const bool tls = flags & 8;
  const Connection c = OneConnection(s.port[tls], tls ? &kAlpn : nullptr, out, flags & 2,
                                     (flags & 4) ? &kWaitAnswer : nullptr, *s.proxy);
  if (!c.got.empty() && !c.got.starts_with("HTTP/1.1 ")) __builtin_trap();
  // Else a connection leaked (woken by the server's last session's end).
  if (!s.http[tls]->WaitForNoConnections(std::chrono::duration<double>(kPatience).count())) {
    __builtin_trap();
  }
  if (!c.whole || ++inputs % 256 == 0) CheckAlive(s, tls);
  return 0;
}
