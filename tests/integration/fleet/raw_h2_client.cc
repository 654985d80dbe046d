#include "raw_h2_client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "tandem/v1/generation.pb.h"

namespace tandem::testing {

std::string RawH2Client::Response::GrpcStatus() const {
  auto it = trailers.find("grpc-status");
  if (it != trailers.end()) return it->second;
  it = headers.find("grpc-status");
  return it == headers.end() ? "" : it->second;
}

std::string RawH2Client::Response::GrpcMessage() const {
  auto it = trailers.find("grpc-message");
  if (it != trailers.end()) return it->second;
  it = headers.find("grpc-message");
  return it == headers.end() ? "" : it->second;
}

RawH2Client::RawH2Client(const std::string& host_port, uint32_t window, bool auto_window) {
  const size_t colon = host_port.rfind(':');
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host_port.substr(0, colon).c_str(), host_port.substr(colon + 1).c_str(), &hints,
                  &res) != 0) {
    return;
  }
  fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool connected = fd_ >= 0 && connect(fd_, res->ai_addr, res->ai_addrlen) == 0;
  freeaddrinfo(res);
  if (!connected) return;
  nghttp2_session_callbacks* cb;
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_on_header_callback(cb, &OnHeader);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, &OnData);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, &OnClose);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, &OnFrame);
  nghttp2_option* opt;
  nghttp2_option_new(&opt);
  if (!auto_window) nghttp2_option_set_no_auto_window_update(opt, 1);
  nghttp2_session_client_new2(&session_, cb, this, opt);
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cb);
  const nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, window}};
  nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, iv, 1);
}

RawH2Client::~RawH2Client() {
  if (session_) nghttp2_session_del(session_);
  if (fd_ >= 0) close(fd_);
}

int32_t RawH2Client::Post(const std::string& path,
                          const std::vector<std::pair<std::string, std::string>>& headers,
                          std::string body) {
  std::vector<std::pair<std::string, std::string>> all = {
      {":method", "POST"}, {":scheme", "http"}, {":authority", "localhost"}, {":path", path}};
  all.insert(all.end(), headers.begin(), headers.end());
  std::vector<nghttp2_nv> nv;
  for (auto& [n, v] : all) {
    nv.push_back({reinterpret_cast<uint8_t*>(n.data()), reinterpret_cast<uint8_t*>(v.data()),
                  n.size(), v.size(), NGHTTP2_NV_FLAG_NONE});
  }
  nghttp2_data_provider p;
  p.read_callback = &ReadBody;
  p.source.ptr = nullptr;
  const int32_t id = nghttp2_submit_request(session_, nullptr, nv.data(), nv.size(), &p, this);
  if (id > 0) bodies_[id] = {std::move(body), 0};
  return id;
}

ssize_t RawH2Client::ReadBody(nghttp2_session*, int32_t id, uint8_t* buf, size_t length,
                              uint32_t* flags, nghttp2_data_source*, void* self) {
  auto& [body, sent] = static_cast<RawH2Client*>(self)->bodies_[id];
  const size_t n = std::min(length, body.size() - sent);
  std::memcpy(buf, body.data() + sent, n);
  sent += n;
  if (sent == body.size()) *flags |= NGHTTP2_DATA_FLAG_EOF;
  return static_cast<ssize_t>(n);
}

int RawH2Client::OnHeader(nghttp2_session*, const nghttp2_frame* f, const uint8_t* name,
                          size_t namelen, const uint8_t* value, size_t valuelen, uint8_t,
                          void* self) {
  auto& r = static_cast<RawH2Client*>(self)->responses_[f->hd.stream_id];
  auto& into = f->headers.cat == NGHTTP2_HCAT_RESPONSE ? r.headers : r.trailers;
  into[std::string(reinterpret_cast<const char*>(name), namelen)] =
      std::string(reinterpret_cast<const char*>(value), valuelen);
  return 0;
}

int RawH2Client::OnData(nghttp2_session* s, uint8_t, int32_t id, const uint8_t* data, size_t len,
                        void* self) {
  auto* c = static_cast<RawH2Client*>(self);
  c->responses_[id].data.append(reinterpret_cast<const char*>(data), len);
  if (c->consuming_all_) nghttp2_session_consume(s, id, len);
  return 0;
}

int RawH2Client::OnClose(nghttp2_session*, int32_t id, uint32_t code, void* self) {
  auto& r = static_cast<RawH2Client*>(self)->responses_[id];
  r.closed = true;
  r.close_code = code;
  return 0;
}

int RawH2Client::OnFrame(nghttp2_session*, const nghttp2_frame* f, void* self) {
  auto* c = static_cast<RawH2Client*>(self);
  if (f->hd.type == NGHTTP2_PING && (f->hd.flags & NGHTTP2_FLAG_ACK)) ++c->pings_acked_;
  if (f->hd.type == NGHTTP2_GOAWAY) {
    c->goaway_ = true;
    c->goaway_code_ = f->goaway.error_code;
  }
  return 0;
}

void RawH2Client::SetInitialWindow(uint32_t window) {
  const nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, window}};
  nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, iv, 1);
}

std::string RawH2Client::WindowUpdateFrame(int32_t stream, uint32_t increment) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  // length 4, type WINDOW_UPDATE (8), no flags, the stream id, the increment
  return std::string{0, 0, 4, 8, 0} + be32(static_cast<uint32_t>(stream)) + be32(increment);
}

void RawH2Client::Ping() { nghttp2_submit_ping(session_, NGHTTP2_FLAG_NONE, nullptr); }

void RawH2Client::UpdateWindow(int32_t stream, int32_t increment) {
  nghttp2_submit_window_update(session_, NGHTTP2_FLAG_NONE, stream, increment);
}

void RawH2Client::Consume(int32_t stream) {
  consuming_all_ = true;
  nghttp2_session_consume(session_, stream, responses_[stream].data.size());
}

bool RawH2Client::Pump(int timeout_ms) {
  for (;;) {
    const uint8_t* out;
    const ssize_t n = nghttp2_session_mem_send(session_, &out);
    if (n < 0) return false;
    if (n == 0) break;
    if (send(fd_, out, static_cast<size_t>(n), MSG_NOSIGNAL) != n) return false;
  }
  // nghttp2's output is whole frames, so the raw ones go in between frames.
  if (!raw_.empty()) {
    if (send(fd_, raw_.data(), raw_.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(raw_.size())) return false;
    raw_.clear();
  }
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return true;
  uint8_t buf[16384];
  const ssize_t n = recv(fd_, buf, sizeof buf, 0);
  if (n <= 0) return false;
  return nghttp2_session_mem_recv(session_, buf, static_cast<size_t>(n)) >= 0;
}

bool RawH2Client::RunUntil(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return done();
    if (!Pump(20)) {
      ended_ = true;
      return done();
    }
  }
  // What the last read made nghttp2 answer (acks, WINDOW_UPDATE) goes out.
  Pump(0);
  return true;
}

std::string RawH2Client::Frame(const std::string& message, bool compressed) {
  const uint32_t n = static_cast<uint32_t>(message.size());
  std::string out = {static_cast<char>(compressed ? 1 : 0), static_cast<char>(n >> 24),
                     static_cast<char>(n >> 16), static_cast<char>(n >> 8), static_cast<char>(n)};
  return out + message;
}

std::vector<std::string> RawH2Client::Messages(const std::string& data) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 5 <= data.size()) {
    const auto* p = reinterpret_cast<const uint8_t*>(data.data() + at);
    const uint32_t n = (uint32_t{p[1]} << 24) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 8) | p[4];
    if (at + 5 + n > data.size()) break;
    out.push_back(data.substr(at + 5, n));
    at += 5 + n;
  }
  return out;
}

std::string GreedyGenerateRequest(const std::vector<uint32_t>& prompt, uint32_t max_tokens) {
  tandem::v1::GenerateRequest r;
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0);
  r.set_ignore_eos(true);
  return r.SerializeAsString();
}

std::vector<uint32_t> GenerateTokens(const RawH2Client::Response& r) {
  std::vector<uint32_t> tokens;
  for (const auto& m : RawH2Client::Messages(r.data)) {
    tandem::v1::GenerateResponse g;
    if (!g.ParseFromString(m)) return {};  // (an empty answer fails the caller's comparison)
    tokens.insert(tokens.end(), g.token_ids().begin(), g.token_ids().end());
  }
  return tokens;
}

}  // namespace tandem::testing
