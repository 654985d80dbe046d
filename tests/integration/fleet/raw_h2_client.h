// A bare HTTP/2 client (nghttp2) for what gRPC clients never send: a wrong
// content-type, a malformed message, a stream whose flow-control window the
// client keeps closed. Blocking socket, bounded waits. Test use only.
#pragma once

#include <nghttp2/nghttp2.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tandem::testing {

class RawH2Client {
 public:
  struct Response {
    std::map<std::string, std::string> headers;   // the response HEADERS
    std::map<std::string, std::string> trailers;  // the trailing HEADERS
    std::string data;                             // DATA payload as received
    bool closed = false;
    uint32_t close_code = 0;
    // grpc-status: from the trailers, or from a Trailers-Only response.
    std::string GrpcStatus() const;
    std::string GrpcMessage() const;
  };

  // `window`: the client's SETTINGS_INITIAL_WINDOW_SIZE; `auto_window`
  // false: received DATA is not acknowledged (no WINDOW_UPDATE) until
  // Consume().
  RawH2Client(const std::string& host_port, uint32_t window = 65535, bool auto_window = true);
  ~RawH2Client();
  bool ok() const { return session_ != nullptr; }

  // A POST with these extra headers and body; returns the stream id.
  int32_t Post(const std::string& path, const std::vector<std::pair<std::string, std::string>>& headers,
               std::string body);
  // Reads and writes until `done` holds, the connection ends, or `limit`.
  bool RunUntil(const std::function<bool()>& done, std::chrono::milliseconds limit);
  // Acknowledges everything received on `stream` (and the connection), and
  // from now on acknowledges as data arrives.
  void Consume(int32_t stream);
  const Response& response(int32_t stream) { return responses_[stream]; }
  // Queues a PING (sent by the next RunUntil); pings_acked() counts the
  // server's PING ACKs.
  void Ping();
  // Queues a WINDOW_UPDATE of `stream` (0: the connection) by `increment`.
  void UpdateWindow(int32_t stream, int32_t increment);
  int pings_acked() const { return pings_acked_; }
  // Queues a SETTINGS frame that sets SETTINGS_INITIAL_WINDOW_SIZE (the
  // client's stream windows, open streams included, once acknowledged).
  void SetInitialWindow(uint32_t window);
  // Queues `bytes` (whole frames), written after what nghttp2 has to send:
  // frames nghttp2 itself would refuse to send. nghttp2 does not see them.
  void SendRaw(std::string bytes) { raw_ += std::move(bytes); }
  // A WINDOW_UPDATE frame's bytes (any increment, even an invalid one).
  static std::string WindowUpdateFrame(int32_t stream, uint32_t increment);
  // The server's GOAWAY: received, and its error code.
  bool goaway() const { return goaway_; }
  // The connection ended (the server closed it, or a read or write failed).
  bool ended() const { return ended_; }
  uint32_t goaway_code() const { return goaway_code_; }

  // `message` with the 5-byte gRPC prefix (`compressed` flag as given).
  static std::string Frame(const std::string& message, bool compressed = false);
  // Splits DATA into gRPC messages (their bodies).
  static std::vector<std::string> Messages(const std::string& data);

 private:
  static int OnHeader(nghttp2_session*, const nghttp2_frame*, const uint8_t*, size_t,
                      const uint8_t*, size_t, uint8_t, void*);
  static int OnData(nghttp2_session*, uint8_t, int32_t, const uint8_t*, size_t, void*);
  static int OnClose(nghttp2_session*, int32_t, uint32_t, void*);
  static int OnFrame(nghttp2_session*, const nghttp2_frame*, void*);
  static ssize_t ReadBody(nghttp2_session*, int32_t, uint8_t*, size_t, uint32_t*,
                          nghttp2_data_source*, void*);
  bool Pump(int timeout_ms);  // one poll round; false: the connection ended

  int fd_ = -1;
  nghttp2_session* session_ = nullptr;
  bool consuming_all_ = false;
  int pings_acked_ = 0;
  bool goaway_ = false;
  bool ended_ = false;
  uint32_t goaway_code_ = 0;
  std::string raw_;  // SendRaw's frames not yet written
  std::map<int32_t, Response> responses_;
  std::map<int32_t, std::pair<std::string, size_t>> bodies_;  // body, bytes sent
};

// A greedy tandem.v1 Generate request (ignore_eos) of these ids, serialized.
std::string GreedyGenerateRequest(const std::vector<uint32_t>& prompt, uint32_t max_tokens);
// The tokens of a Generate response's messages, in order.
std::vector<uint32_t> GenerateTokens(const RawH2Client::Response& r);

}  // namespace tandem::testing
