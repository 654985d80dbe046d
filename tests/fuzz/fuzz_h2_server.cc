// libFuzzer target: the native front end's connection as a whole
// (proxy/h2: nghttp2's session, tandem's streams, the gRPC message
// assembly, the calls' own checks, the outboxes and the close). Two
// H2Servers on 127.0.0.1 for the process, one plaintext and one with
// security.public_tls (h2_tls.cc: OpenSSL under tandem's reads and writes),
// over one real Frontend over scripted
// workers in this process (server_fuzz.h, fuzz_workers.h: a Generate that
// passes every check is routed and runs its lifecycle: tokens, retries,
// migrations, the workers' errors and stalls, chosen by its prompt); each
// input is what one client sends on one connection, then the client's end
// of the TCP stream is closed. What must hold for every input:
//   - no crash or sanitizer report (the server runs in this process);
//   - the server closes the connection after the client's end (a read of
//     the connection that waits more than 8 s is a hang, and a trap);
//   - every admitted call's slot is freed and every worker call has ended
//     once its connection is gone (Frontend::inflight() and
//     FuzzWorkers::live() back to 0 within 8 s each, else a trap);
//   - after the client's preface, the server's first frame is SETTINGS;
//   - the server still answers: every 256th input, and after any input
//     that it cut short, a health Check on a new connection to the same
//     server gets SERVING.
// The first input byte: bit 0 sends the client preface and an empty
// SETTINGS before the rest (most seeds start from there), bit 1 sends the
// rest one byte per write, bit 2 sends a PING after the rest and keeps the
// client's end open until the server has answered it and every admitted
// call has ended (their replies written; else the close cancels them, as
// a client that goes away does), bit 3 speaks TLS (ALPN h2) to the TLS
// server, the input inside TLS records (one per byte with bit 1). Not in
// CI's fuzz build (it compiles the
// proxy, the router and the RPC layer, 51 more files, with coverage and
// ASan: ~4 minutes of one core here); `tools/fuzz.sh long h2_server RUNS`
// configures and builds it (docs/security.md, "Fuzzing"). CI's unit suite
// runs its seeds through it, built without libFuzzer against the normal
// build's proxy (fuzz_seeds_h2_server: tests/CMakeLists.txt).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "proxy/h2/h2_server.h"
#include "server_fuzz.h"

namespace {

using namespace tandem;
using namespace tandem::fuzz;

const std::string kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
// The PING sent after an input whose calls are waited for, and its ACK.
const std::string kPingPayload = "fuzzwait";
const std::string kPingAck = std::string("\0\0\x08\x06\x01\0\0\0\0", 9) + kPingPayload;

const std::string kAlpn = "\x02h2";

struct Server {
  FuzzProxy* proxy = nullptr;
  // [0] plaintext, [1] with security.public_tls (h2_tls.cc), one Frontend.
  std::unique_ptr<proxy::h2::H2Server> h2[2];
  uint16_t port[2] = {0, 0};
};

Server& Get() {
  static Server* s = [] {
    auto* s = new Server();  // never destroyed: its threads outlive the inputs
    s->proxy = StartFuzzProxy();
    proxy::h2::H2ServerLimits limits;
    limits.max_connections = 64;
    limits.handshake_timeout = 2000ms;
    const TlsFiles tls[2] = {{}, FuzzTlsFiles()};
    for (int i : {0, 1}) {
      auto h2 = proxy::h2::H2Server::Start("127.0.0.1:0", s->proxy->frontend.get(), tls[i], limits);
      if (!h2.ok()) std::abort();
      s->h2[i] = std::move(h2).value();
      s->h2[i]->SetServing(true);
      s->port[i] = PortOf(s->h2[i]->address());
    }
    return s;
  }();
  return *s;
}

void Frame(std::string* out, uint8_t type, uint8_t flags, uint32_t stream, const std::string& p) {
  const uint32_t len = static_cast<uint32_t>(p.size());
  out->push_back(static_cast<char>(len >> 16));
  out->push_back(static_cast<char>(len >> 8));
  out->push_back(static_cast<char>(len));
  out->push_back(static_cast<char>(type));
  out->push_back(static_cast<char>(flags));
  for (int shift : {24, 16, 8, 0}) out->push_back(static_cast<char>(stream >> shift));
  out->append(p);
}

// A literal header field without indexing, new name (RFC 7541 6.2.2),
// lengths below 127.
std::string Literal(const std::string& name, const std::string& value) {
  std::string h(1, '\0');
  h.push_back(static_cast<char>(name.size()));
  h += name;
  h.push_back(static_cast<char>(value.size()));
  h += value;
  return h;
}

// A health Check on a fresh connection gets its reply: the message
// HealthCheckResponse{status: SERVING} (08 01) after its 5-byte prefix.
void CheckAlive(const Server& s, bool tls) {
  std::string c = kPreface;
  Frame(&c, 0x4, 0, 0, "");
  std::string h = "\x83";  // :method POST (RFC 7541's static table)
  h += Literal(":path", "/grpc.health.v1.Health/Check") + Literal(":scheme", "http") +
       Literal(":authority", "fuzz") + Literal("content-type", "application/grpc") +
       Literal("te", "trailers");
  Frame(&c, 0x1, 0x4, 1, h);
  Frame(&c, 0x0, 0x1, 1, std::string(5, '\0'));  // an empty HealthCheckRequest
  ExpectAnswer(s.port[tls], tls ? &kAlpn : nullptr, c,
               std::string("\x00\x00\x00\x00\x02\x08\x01", 7));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  static uint64_t inputs = 0;
  Server& s = Get();
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  std::string out;
  if (flags & 1) {
    out = kPreface;
    Frame(&out, 0x4, 0, 0, "");
  }
  out.append(reinterpret_cast<const char*>(data + 1), size - 1);
  if (flags & 4) Frame(&out, 0x6, 0, 0, kPingPayload);
  const bool tls = flags & 8;
  const Connection c = OneConnection(s.port[tls], tls ? &kAlpn : nullptr, out, flags & 2,
                                     (flags & 4) ? &kPingAck : nullptr, *s.proxy);
  // After a client preface the server's first frame is its SETTINGS.
  if ((flags & 1) && !c.got.empty() && (c.got.size() < 9 || c.got[3] != 0x4)) __builtin_trap();
  if (!c.whole || ++inputs % 256 == 0) CheckAlive(s, tls);
  return 0;
}
