// The `sse` workload's client: a small HTTP/1.1 client on ONE thread (epoll
// over non-blocking loopback sockets), as asyncio/aiohttp clients such as
// vLLM's benchmark and aiperf are, and as floor-tcp's reader is
// (bench_proxy_floor.cc), so that the proxy's cost per token is measured
// against the same reader shape as its floor. Connections are kept alive
// and reused (at most one request on a connection at a time, no
// pipelining); the chunked event stream is decoded here, each SSE event
// with text is timed as one message of one token for ITL (as
// loadgen/http_client.h does), and the output token count comes from the
// final usage event.
#include "cli/bench_proxy_sse.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "loadgen/http_client.h"

namespace tandem::cli {
namespace {

namespace lg = tandem::loadgen;
using nlohmann::json;

constexpr size_t kMaxIdleConnections = 1024;
constexpr size_t kMaxResponseHeadBytes = 64 << 10;

Status FromHttp(int code, const std::string& body) {
  std::string msg = fmt::format("HTTP {}", code);
  const auto j = json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.contains("error") && j["error"].is_object()) {
    msg += ": " + j["error"].value("message", std::string());
  }
  switch (code) {
    case 400:
      return InvalidArgumentError(msg);
    case 429:
      return ResourceExhaustedError(msg);
    case 503:
      return UnavailableError(msg);
    case 504:
      return DeadlineExceededError(msg);
    default:
      return InternalError(msg);
  }
}

class SseClient final : public lg::Client {
 public:
  SseClient(sockaddr_in addr, std::string address, uint32_t vocab)
      : addr_(addr), address_(std::move(address)) {
    lg::HttpClientOptions o;
    o.address = address_;
    o.vocab_size = vocab;
    info_ = lg::MakeHttpClient(o);
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake_;
    epoll_ctl(ep_, EPOLL_CTL_ADD, wake_, &ev);
    loop_ = std::thread([this] { Loop(); });
  }

  ~SseClient() override {
    stop_ = true;
    Wake();
    loop_.join();
    close(wake_);
    close(ep_);
  }

  void Start(lg::Request request, std::function<void(lg::Reply)> done) override {
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(request), std::move(done)});
    }
    Wake();
  }

  void CancelAll() override {
    cancel_ = true;
    Wake();
  }

  Result<lg::ModelInfo> GetModelInfo(const std::string& model) override {
    return info_->GetModelInfo(model);
  }

  std::string Describe() const override {
    return "HTTP OpenAI /v1/completions (SSE, one epoll thread, keep-alive) at " + address_;
  }

 private:
  struct Call {
    lg::Request request;
    std::function<void(lg::Reply)> done;
  };
  enum class State { kConnecting, kHead, kChunkSize, kChunkData, kChunkEnd, kBody };
  struct Conn {
    int fd = -1;
    State state = State::kHead;
    std::optional<Call> call;  // empty: idle, kept alive
    lg::Reply reply;
    lg::Clock::time_point deadline;
    std::string out;     // request bytes not yet sent
    std::string in;      // response bytes not yet parsed
    std::string events;  // SSE text not yet split into events
    size_t need = 0;     // kChunkData / kBody: bytes left
    int status = 0;
    bool close_after = false, finished = false;
  };

  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_, &one, sizeof one);
  }

  void Loop() {
    epoll_event evs[64];
    while (!stop_) {
      const int n = epoll_wait(ep_, evs, 64, 100);
      for (int i = 0; i < n; ++i) {
        const int fd = evs[i].data.fd;
        if (fd == wake_) {
          uint64_t v;
          [[maybe_unused]] ssize_t r = read(wake_, &v, sizeof v);
          continue;
        }
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        if (evs[i].events & EPOLLOUT) OnWritable(it->second);
        if (conns_.count(fd) && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
          OnReadable(conns_.at(fd));
        }
      }
      TakeNewCalls();
      Expire();
    }
    // Whatever is still in flight ends CANCELLED.
    std::vector<int> fds;
    for (auto& [fd, c] : conns_) fds.push_back(fd);
    for (int fd : fds) Fail(conns_.at(fd), CancelledError("client stopped"));
  }

  void TakeNewCalls() {
    std::deque<Call> calls;
    {
      std::lock_guard lock(mu_);
      calls.swap(queue_);
    }
    for (Call& call : calls) {
      if (cancel_) {
        lg::Reply r;
        r.status = CancelledError("cancelled");
        r.sent = r.done = lg::Clock::now();
        call.done(std::move(r));
        continue;
      }
      Conn* c = IdleConn();
      if (c == nullptr) {
        lg::Reply r;
        r.status = UnavailableError(
            fmt::format("cannot connect to {}: {}", address_, std::strerror(errno)));
        r.sent = r.done = lg::Clock::now();
        call.done(std::move(r));
        continue;
      }
      Begin(*c, std::move(call));
    }
    if (cancel_) {
      std::vector<int> busy;
      for (auto& [fd, c] : conns_) {
        if (c.call) busy.push_back(fd);
      }
      for (int fd : busy) Fail(conns_.at(fd), CancelledError("cancelled"));
    }
  }

  // An idle kept-alive connection, or a new one (nullptr: connect failed).
  Conn* IdleConn() {
    for (auto& [fd, c] : conns_) {
      if (!c.call && c.state == State::kHead) return &c;
    }
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return nullptr;
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Conn c;
    c.fd = fd;
    c.state = State::kHead;
    if (connect(fd, reinterpret_cast<const sockaddr*>(&addr_), sizeof addr_) != 0) {
      if (errno != EINPROGRESS) {
        const int e = errno;
        close(fd);
        errno = e;
        return nullptr;
      }
      c.state = State::kConnecting;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
    ev.data.fd = fd;
    epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev);
    return &(conns_[fd] = std::move(c));
  }

  void Begin(Conn& c, Call call) {
    const lg::Request& r = call.request;
    json body = {{"model", r.model},
                 {"prompt", r.prompt_token_ids},
                 {"max_tokens", r.max_tokens},
                 {"ignore_eos", r.ignore_eos},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    if (r.temperature) body["temperature"] = *r.temperature;
    if (r.seed) body["seed"] = *r.seed;
    if (r.priority) body["priority"] = *r.priority;
    const std::string text = body.dump();
    c.out = fmt::format(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\n{}{}\r\n{}",
        address_, text.size(),
        r.api_key.empty() ? "" : fmt::format("Authorization: Bearer {}\r\n", r.api_key),
        r.request_id.empty() ? "" : fmt::format("X-Request-Id: {}\r\n", r.request_id), text);
    c.reply = lg::Reply{};
    c.reply.sent = lg::Clock::now();
    c.deadline = c.reply.sent + r.timeout;
    c.in.clear();
    c.events.clear();
    c.finished = false;
    c.close_after = false;
    c.status = 0;
    c.call = std::move(call);
    if (c.state != State::kConnecting) OnWritable(c);
  }

  void OnWritable(Conn& c) {
    if (c.state == State::kConnecting) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        return Fail(c,
                    UnavailableError(fmt::format("connect {}: {}", address_, std::strerror(err))));
      }
      c.state = State::kHead;
    }
    while (!c.out.empty()) {
      const ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return Fail(c, UnavailableError(fmt::format("send: {}", std::strerror(errno))));
      }
      c.out.erase(0, static_cast<size_t>(n));
    }
    // Writable interest only while bytes wait (level-triggered epoll).
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (c.out.empty() ? 0u : uint32_t{EPOLLOUT});
    ev.data.fd = c.fd;
    epoll_ctl(ep_, EPOLL_CTL_MOD, c.fd, &ev);
  }

  void OnReadable(Conn& c) {
    char buf[65536];
    for (;;) {
      const ssize_t n = recv(c.fd, buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      // Closed (or reset) by the server: what came before it still counts.
      const int fd = c.fd;
      if (c.call) Parse(c);  // may complete the call, and may drop `c`
      auto it = conns_.find(fd);
      if (it == conns_.end()) return;
      if (it->second.call) {
        return Fail(it->second, UnavailableError("the server closed the connection mid-response"));
      }
      return Drop(it->second);
    }
    if (!c.call) {
      c.in.clear();  // nothing is expected on an idle connection
      return;
    }
    Parse(c);
  }

  // Consumes what `c.in` holds; ends the call when the response is complete.
  void Parse(Conn& c) {
    size_t pos = 0;
    for (;;) {
      if (c.state == State::kHead) {
        const size_t end = c.in.find("\r\n\r\n", pos);
        if (end == std::string::npos) {
          if (c.in.size() - pos > kMaxResponseHeadBytes) {
            return Fail(c, InternalError("response head too large"));
          }
          break;
        }
        std::string head = c.in.substr(pos, end - pos);
        pos = end + 4;
        for (char& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (head.rfind("http/1.1 ", 0) != 0 || head.size() < 12) {
          return Fail(c, InternalError("not an HTTP/1.1 response"));
        }
        c.status = std::atoi(head.c_str() + 9);
        if (c.status == 100) continue;  // 100 Continue: the real head follows
        c.close_after = head.find("\r\nconnection: close") != std::string::npos;
        if (head.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
          c.state = State::kChunkSize;
        } else {
          const size_t cl = head.find("\r\ncontent-length:");
          c.need = cl == std::string::npos ? 0 : std::strtoull(head.c_str() + cl + 17, nullptr, 10);
          c.state = State::kBody;
        }
        continue;
      }
      if (c.state == State::kChunkSize) {
        const size_t eol = c.in.find("\r\n", pos);
        if (eol == std::string::npos) break;
        c.need = std::strtoull(c.in.c_str() + pos, nullptr, 16);
        pos = eol + 2;
        c.state = c.need == 0 ? State::kChunkEnd : State::kChunkData;
        continue;
      }
      if (c.state == State::kChunkData) {
        if (c.in.size() - pos < c.need + 2) break;
        if (c.status == 200) Events(c, std::string_view(c.in).substr(pos, c.need));
        pos += c.need + 2;
        c.state = State::kChunkSize;
        continue;
      }
      if (c.state == State::kChunkEnd) {
        if (c.in.size() - pos < 2) break;  // the last chunk's CRLF (no trailers)
        pos += 2;
        c.in.erase(0, pos);
        return Complete(c, "");
      }
      if (c.state == State::kBody) {
        if (c.in.size() - pos < c.need) break;
        std::string body = c.in.substr(pos, c.need);
        pos += c.need;
        c.in.erase(0, pos);
        return Complete(c, body);
      }
      break;
    }
    c.in.erase(0, pos);
  }

  // SSE events in a chunk's data.
  void Events(Conn& c, std::string_view data) {
    c.events.append(data);
    size_t end;
    while ((end = c.events.find("\n\n")) != std::string::npos) {
      std::string_view ev(c.events.data(), end);
      if (ev.rfind("data: ", 0) == 0) Event(c, ev.substr(6));
      c.events.erase(0, end + 2);
    }
  }

  void Event(Conn& c, std::string_view data) {
    if (data == "[DONE]") {
      c.finished = true;
      return;
    }
    const auto j = json::parse(data, nullptr, false);
    if (j.is_discarded()) return;
    lg::Reply& r = c.reply;
    if (j.contains("error") && j["error"].is_object()) {
      r.status = InternalError("error event: " + j["error"].value("message", std::string()));
      return;
    }
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const json& ch = j["choices"][0];
      if (ch.contains("text") && ch["text"].is_string() &&
          !ch["text"].get_ref<const std::string&>().empty()) {
        r.chunks.push_back({lg::Clock::now(), 1});
      }
      if (ch.contains("finish_reason") && ch["finish_reason"].is_string()) {
        r.finish_reason = ch["finish_reason"].get<std::string>();
      }
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const json& u = j["usage"];
      r.has_usage = true;
      r.prompt_tokens = u.value("prompt_tokens", 0u);
      r.completion_tokens = u.value("completion_tokens", 0u);
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
        r.cached_prompt_tokens = u["prompt_tokens_details"].value("cached_tokens", 0u);
      }
    }
  }

  void Complete(Conn& c, const std::string& body) {
    lg::Reply r = std::move(c.reply);
    if (c.status != 200) {
      r.status = FromHttp(c.status, body);
    } else if (r.status.ok() && !c.finished) {
      r.status = DataLossError("the event stream ended without data: [DONE]");
    }
    r.done = lg::Clock::now();
    Call call = std::move(*c.call);
    c.call.reset();
    c.state = State::kHead;
    size_t idle = 0;
    for (auto& [fd, o] : conns_) idle += o.call ? 0 : 1;
    if (c.close_after || idle > kMaxIdleConnections) Drop(c);
    call.done(std::move(r));
  }

  void Fail(Conn& c, Status st) {
    std::optional<Call> call = std::move(c.call);
    lg::Reply r = std::move(c.reply);
    Drop(c);
    if (!call) return;
    r.status = std::move(st);
    if (r.sent == lg::Clock::time_point{}) r.sent = lg::Clock::now();
    r.done = lg::Clock::now();
    call->done(std::move(r));
  }

  void Drop(Conn& c) {
    const int fd = c.fd;
    epoll_ctl(ep_, EPOLL_CTL_DEL, fd, nullptr);
    close(fd);
    conns_.erase(fd);  // `c` is gone from here
  }

  void Expire() {
    const auto now = lg::Clock::now();
    std::vector<int> late;
    for (auto& [fd, c] : conns_) {
      if (c.call && now > c.deadline) late.push_back(fd);
    }
    for (int fd : late) Fail(conns_.at(fd), DeadlineExceededError("request timed out"));
  }

  const sockaddr_in addr_;
  const std::string address_;
  std::unique_ptr<lg::Client> info_;  // GetModelInfo only
  int ep_ = -1, wake_ = -1;
  std::atomic<bool> stop_{false}, cancel_{false};
  std::mutex mu_;
  std::deque<Call> queue_;     // guarded by mu_
  std::map<int, Conn> conns_;  // loop thread only
  std::thread loop_;
};

}  // namespace

Result<std::unique_ptr<loadgen::Client>> MakeSseBenchClient(const std::string& http_address,
                                                            uint32_t vocab_size) {
  if (http_address.empty()) {
    return InvalidArgumentError(
        "workload sse: the fleet's state file has no proxy.http (set proxy.http in the config)");
  }
  const size_t colon = http_address.rfind(':');
  const std::string host =
      colon == std::string::npos ? http_address : http_address.substr(0, colon);
  const int port = colon == std::string::npos ? 0 : std::atoi(http_address.c_str() + colon + 1);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string ip = host == "localhost" ? "127.0.0.1" : host;
  if (inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) != 1 ||
      (ntohl(addr.sin_addr.s_addr) >> 24) != 127 || port <= 0 || port > 65535) {
    return InvalidArgumentError(fmt::format(
        "workload sse: proxy.http is '{}'; the bench drives an IPv4 loopback address only",
        http_address));
  }
  return std::unique_ptr<loadgen::Client>(new SseClient(addr, http_address, vocab_size));
}

}  // namespace tandem::cli
