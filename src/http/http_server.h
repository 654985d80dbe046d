// The OpenAI-compatible HTTP/1.1 API of the proxy (docs/http-api.md):
// POST /v1/completions, POST /v1/chat/completions (SSE with stream: true),
// GET /v1/models, GET /health, GET /metrics.
//
// Boost.Beast parses requests and Asio runs every connection on a small
// fixed pool of I/O threads (no thread per connection); each connection's
// handlers run on its own strand. It is an adapter over the same path as the
// gRPC front end: proxy::Frontend validates and admits, and
// proxy::RequestLifecycle runs the request; the lifecycle's sink only posts
// to the connection's strand.
//
// With security.public_tls (HttpContext::public_tls) every connection
// speaks TLS (http_stream.h); ReloadTls swaps the certificate for new
// connections without touching open ones.
//
// Thread-safety: Start and Shutdown from the owning thread; ReloadTls from any.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"
#include "proxy/proxy_server.h"

namespace tandem::http {

// What the caller chooses. The limits (body, header, pipelined requests,
// connections) come from the fleet file's proxy.limits and the idle timeout
// from proxy.http_idle_timeout_seconds (HttpContext::config), so that one
// place sets them.
struct ServerOptions {
  int io_threads = 2;
  // A connection we close waits this long at most for the client's close
  // (reading and discarding what it still sends) before its socket closes
  // anyway; Shutdown waits as long at most for the open connections' ends.
  double linger_seconds = 2;
};

class HttpServer final : public proxy::HttpFrontEnd {
 public:
  // Listens on `address` ("host:port"; port 0 picks one) and loads the chat
  // template (proxy.chat_template; "auto" reads the model's
  // tokenizer_config.json). A model without a usable template still serves
  // everything but /v1/chat/completions, which answers 400 saying why.
  static Result<std::unique_ptr<HttpServer>> Start(const std::string& address,
                                                   const proxy::HttpContext& context,
                                                   const ServerOptions& options = {});
  ~HttpServer() override;

  const std::string& address() const override;
  void Shutdown() override;
  Status ReloadTls() override;
  // Connections open now (tests and the load test's report).
  size_t open_connections() const;
  // Waits until no connection is open, at most `seconds`; false if one
  // still is (Shutdown's wait for the connections it stopped; tests).
  bool WaitForNoConnections(double seconds) const;

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The factory `tandem proxy` hands to proxy::ProxyServer::Start.
proxy::HttpFactory Factory(const ServerOptions& options = {});

}  // namespace tandem::http
