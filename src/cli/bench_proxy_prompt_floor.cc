// The `prompt-floor` row of `tandem bench proxy` (bench_proxy_prompt_floor.h).
#include "cli/bench_proxy_prompt_floor.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <functional>
#include <vector>

#include "common/frame_server.h"
#include "common/rpc_server.h"
#include "common/tls.h"
#include "common/tls_certs.h"
#include "proxy/prefill_tcp_client.h"
#include "proxy/prompt_parts.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::cli {
namespace {

namespace pb = ::tandem::v1;
namespace fs = std::filesystem;

// Answers every Prefill at once: the request is parsed (by gRPC), nothing
// else happens.
class FloorPrefiller final : public pb::Prefiller::CallbackService {
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const pb::PrefillRequest* req,
                                    pb::PrefillResponse* resp) override {
    resp->set_first_token_id(req->prompt_token_ids_size() > 0 ? req->prompt_token_ids(0) : 0);
    resp->set_cached_prompt_tokens(0);
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
};

// The same over framed TCP (prefiller/prefill_tcp.h's protocol): every
// request frame is parsed and answered at once on the listener's thread.
class FloorFrameSession final : public FrameSession {
 public:
  explicit FloorFrameSession(std::shared_ptr<FrameConn> conn) : conn_(std::move(conn)) {}
  Status OnFrame(std::string_view payload) override {
    if (!in_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("not a PrefillFrame");
    }
    if (in_.kind_case() != pb::PrefillFrame::kRequest) return Status::Ok();
    out_.Clear();
    out_.set_call_id(in_.call_id());
    const auto& ids = in_.request().prompt_token_ids();
    out_.mutable_response()->set_request_id(in_.request().request_id());
    out_.mutable_response()->set_first_token_id(ids.empty() ? 0 : ids[0]);
    return conn_->Send(out_);
  }
  void OnClosed(const Status&) override {}

 private:
  std::shared_ptr<FrameConn> conn_;
  pb::PrefillFrame in_, out_;
};

double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto sec = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) * 1e-6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

void WriteAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// The child: certificates, two listeners, then wait for the parent.
[[noreturn]] void ServeChild(int ready_fd, int control_fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  char tmpl[] = "/tmp/tandem-prompt-floor-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  const auto fail = [&](const Status& s) {
    WriteAll(ready_fd, "error " + s.message() + "\n");
    if (dir != nullptr) {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
    _exit(1);
  };
  if (dir == nullptr) fail(InternalError("cannot make a temporary directory"));
  auto ca = FleetCa::OpenOrCreate(dir, "tandem-prompt-floor-ca");
  if (!ca.ok()) fail(ca.status());
  auto server_files = ca->Issue("floor-server", {"127.0.0.1"});
  if (!server_files.ok()) fail(server_files.status());
  if (auto client_files = ca->Issue("floor-client", {"127.0.0.1"}); !client_files.ok()) {
    fail(client_files.status());
  }
  auto mtls = RpcCredentials::MutualTls(*server_files);
  if (!mtls.ok()) fail(mtls.status());
  FloorPrefiller service;
  auto plain = RpcServer::Start("127.0.0.1:0", {&service}, RpcCredentials());
  if (!plain.ok()) fail(plain.status());
  auto tls = RpcServer::Start("127.0.0.1:0", {&service}, *mtls);
  if (!tls.ok()) fail(tls.status());
  auto frame_tls = InternalFrameTls(*mtls);
  if (!frame_tls.ok()) fail(frame_tls.status());
  auto framed = FrameServer::Start("127.0.0.1:0", *frame_tls, FrameOptions{},
                                   [](const std::shared_ptr<FrameConn>& conn) {
                                     return std::make_shared<FloorFrameSession>(conn);
                                   });
  if (!framed.ok()) fail(framed.status());
  WriteAll(ready_fd, fmt::format("ok {} {} {} {}\n", (*plain)->address(), (*tls)->address(), dir,
                                 (*framed)->address()));
  // 'c': report this process's CPU seconds (getrusage: microseconds, every
  // thread that ever ran); end of file: exit.
  char c;
  while (::read(control_fd, &c, 1) > 0) {
    if (c == 'c') WriteAll(ready_fd, fmt::format("{:.6f}\n", SelfCpuSeconds()));
  }
  (*plain)->Shutdown();
  (*tls)->Shutdown();
  (*framed)->Stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
  _exit(0);
}

struct Pass {
  double server_s = 0, client_s = 0, wall_s = 0;
  uint32_t ok = 0;
  size_t request_bytes = 0;  // framed: one request frame's payload (prompt included)
};

// `requests` Prefill calls, `concurrency` in flight, each a fresh request
// serialized by gRPC as the proxy's worker client does (worker_client_grpc.cc).
Result<Pass> Drive(const std::shared_ptr<grpc::Channel>& channel,
                   const std::function<double()>& server_cpu, uint32_t requests,
                   const std::vector<uint32_t>& ids, uint32_t concurrency, double rate_per_s) {
  auto stub = pb::Prefiller::NewStub(channel);
  {  // connect (and handshake) outside the measurement
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::PrefillRequest req;
    pb::PrefillResponse resp;
    const grpc::Status s = stub->Prefill(&ctx, req, &resp);
    if (!s.ok()) return UnavailableError(fmt::format("floor server: {}", s.error_message()));
  }
  struct CallState {
    grpc::ClientContext ctx;
    pb::PrefillRequest req;
    pb::PrefillResponse resp;
  };
  // Shared with the completions, which hold plain pointers only: every call
  // object (and with its ClientContext a reference to the channel) is
  // destroyed here, never on gRPC's callback thread (dropping a channel's
  // last reference there would shut gRPC's callback queue down from inside
  // one of its own threads). After a timeout it is left to leak.
  struct Shared {
    pb::Prefiller::Stub* stub = nullptr;
    const std::vector<uint32_t>* ids = nullptr;
    uint32_t requests = 0;
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::unique_ptr<CallState>> calls;  // guarded by mu
    uint32_t started = 0, done = 0, ok = 0;         // guarded by mu
    bool abandoned = false;                         // guarded by mu: start nothing more
  };
  auto sh = std::make_unique<Shared>();
  sh->stub = stub.get();
  sh->ids = &ids;
  sh->requests = requests;
  // With sh->mu held: starts the next call; its completion starts another.
  struct Starter {
    static void StartOne(Shared* sh) {
      const uint32_t i = sh->started++;
      CallState* call = sh->calls.emplace_back(std::make_unique<CallState>()).get();
      call->req.set_request_id(fmt::format("floor-{}", i));
      call->req.mutable_prompt_token_ids()->Add(sh->ids->begin(), sh->ids->end());
      call->req.mutable_params()->set_max_tokens(1);
      call->req.set_decoder_address("127.0.0.1:1");
      call->req.set_decoder_name("decode-0");
      sh->stub->async()->Prefill(&call->ctx, &call->req, &call->resp, [sh](grpc::Status s) {
        std::lock_guard lock(sh->mu);
        ++sh->done;
        if (s.ok()) ++sh->ok;
        if (sh->started < sh->requests && !sh->abandoned) StartOne(sh);
        sh->cv.notify_all();
      });
    }
  };
  const double server0 = server_cpu(), client0 = SelfCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  uint32_t ok = 0;
  {
    std::unique_lock lock(sh->mu);
    if (rate_per_s > 0) {
      // Paced: call i leaves at t0 + i / rate (the prompt workload's
      // cadence), so every call pays the wake-ups a lone request pays.
      sh->requests = 0;  // completions start nothing
      for (uint32_t i = 0; i < requests; ++i) {
        const auto at = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(i / rate_per_s));
        lock.unlock();
        std::this_thread::sleep_until(at);
        lock.lock();
        Starter::StartOne(sh.get());
      }
      sh->requests = requests;
    } else {
      while (sh->started < std::min(requests, concurrency)) Starter::StartOne(sh.get());
    }
    const bool finished = sh->cv.wait_for(lock, std::chrono::seconds(120),
                                          [&] { return sh->done == requests; });
    if (!finished) {
      sh->abandoned = true;
      lock.unlock();
      (void)sh.release();  // calls still in flight point into it
      (void)stub.release();
      return DeadlineExceededError("floor: calls did not finish within 120 s");
    }
    ok = sh->ok;
  }
  Pass p;
  p.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.server_s = server_cpu() - server0;
  p.client_s = SelfCpuSeconds() - client0;
  p.ok = ok;
  return p;
}

// The same calls over the framed TCP transport with the proxy's own client
// (proxy/prefill_tcp_client.h): one connection, the request's head built
// per call and the prompt sent as the proxy sends it since session 14: the
// client's packed varints (encoded once here, as the client's request
// brings them), written in parts after the head (PrefillRequestInParts),
// the reply read on the client's reader thread.
Result<Pass> DriveFramed(const std::string& address, std::shared_ptr<FrameTls> tls,
                         const std::function<double()>& server_cpu, uint32_t requests,
                         const std::vector<uint32_t>& ids, uint32_t concurrency, double rate_per_s) {
  auto client = proxy::PrefillTcpClient::Open(address, std::move(tls));
  struct Shared {
    std::shared_ptr<proxy::PrefillTcpClient> client;
    std::string varints;  // the prompt as the client encodes it; args.prompt_varints views it
    proxy::PrefillArgs args;
    uint32_t requests = 0;
    std::mutex mu;
    std::condition_variable cv;
    uint32_t started = 0, done = 0, ok = 0;  // guarded by mu
  };
  auto sh = std::make_shared<Shared>();
  sh->client = client;
  sh->args.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  for (const uint32_t id : ids) proxy::AppendVarint(id, &sh->varints);
  sh->args.prompt_varints = sh->varints;
  sh->args.params.max_tokens = 1;
  sh->args.deadline = std::chrono::system_clock::time_point::max();
  sh->args.decoder_address = "127.0.0.1:1";
  sh->args.decoder_name = "decode-0";
  struct Starter {
    // With sh->mu held.
    static void StartOne(const std::shared_ptr<Shared>& sh) {
      sh->args.request_id = fmt::format("floor-{}", sh->started++);
      auto call = sh->client->Start(sh->args, [sh](Result<proxy::PrefillResult> r) {
        std::lock_guard lock(sh->mu);
        ++sh->done;
        if (r.ok()) ++sh->ok;
        if (sh->started < sh->requests) StartOne(sh);
        sh->cv.notify_all();
      });
      if (!call) ++sh->done;  // the connection is gone
    }
  };
  {  // connect (and handshake) outside the measurement
    std::unique_lock lock(sh->mu);
    sh->requests = 1;
    Starter::StartOne(sh);
    if (!sh->cv.wait_for(lock, std::chrono::seconds(10), [&] { return sh->done == 1; }) ||
        sh->ok != 1) {
      lock.unlock();
      client->Stop();
      return UnavailableError("framed floor server: the first call failed");
    }
    sh->started = sh->done = sh->ok = 0;
  }
  const double server0 = server_cpu(), client0 = SelfCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  bool finished;
  {
    std::unique_lock lock(sh->mu);
    if (rate_per_s > 0) {
      sh->requests = 0;  // completions start nothing
      for (uint32_t i = 0; i < requests; ++i) {
        const auto at = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(i / rate_per_s));
        lock.unlock();
        std::this_thread::sleep_until(at);
        lock.lock();
        Starter::StartOne(sh);
      }
      sh->requests = requests;
    } else {
      sh->requests = requests;
      while (sh->started < std::min(requests, concurrency)) Starter::StartOne(sh);
    }
    finished = sh->cv.wait_for(lock, std::chrono::seconds(120), [&] { return sh->done == requests; });
  }
  Pass p;
  p.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.server_s = server_cpu() - server0;
  p.client_s = SelfCpuSeconds() - client0;
  if (proxy::PrefillRequestParts parts; proxy::PrefillRequestInParts(sh->args, 0, &parts)) {
    p.request_bytes = proxy::PrefillCallIdField(1).size() + parts.head.size() + parts.prompt.size();
  }
  {
    std::lock_guard lock(sh->mu);
    p.ok = sh->ok;
    sh->requests = 0;  // start nothing more
  }
  client->Stop();  // ends what is left (each `done` runs)
  if (!finished) return DeadlineExceededError("framed floor: calls did not finish within 120 s");
  return p;
}

}  // namespace

Result<std::unique_ptr<PromptFloor>> PromptFloor::Start() {
  int ready[2], control[2];
  if (pipe(ready) != 0) return InternalError("floor: pipe failed");
  if (pipe(control) != 0) {
    ::close(ready[0]);
    ::close(ready[1]);
    return InternalError("floor: pipe failed");
  }
  const pid_t pid = fork();
  if (pid < 0) return InternalError("floor: fork failed");
  if (pid == 0) {
    ::close(ready[0]);
    ::close(control[1]);
    ServeChild(ready[1], control[0]);
  }
  ::close(ready[1]);
  ::close(control[0]);
  std::unique_ptr<PromptFloor> f(new PromptFloor());
  f->pid_ = pid;
  f->control_fd_ = control[1];
  std::string line;
  char c;
  while (::read(ready[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  f->reply_fd_ = ready[0];
  std::istringstream in(line);
  std::string word;
  in >> word;
  if (word != "ok") {
    return UnavailableError(fmt::format("floor server did not start: {}", line.empty() ? "it exited" : line));
  }
  in >> f->plain_address_ >> f->tls_address_ >> f->dir_ >> f->framed_address_;
  return f;
}

PromptFloor::~PromptFloor() {
  if (control_fd_ >= 0) ::close(control_fd_);
  if (reply_fd_ >= 0) ::close(reply_fd_);
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
}

double PromptFloor::ServerCpuSeconds() {
  WriteAll(control_fd_, "c");
  std::string line;
  char c;
  while (::read(reply_fd_, &c, 1) == 1 && c != '\n') line.push_back(c);
  return line.empty() ? NAN : std::strtod(line.c_str(), nullptr);
}

Result<nlohmann::json> PromptFloor::Run(uint32_t requests, uint32_t ids, uint32_t concurrency,
                                        double rate_per_s) {
  if (requests == 0 || ids == 0 || concurrency == 0) {
    return InvalidArgumentError("prompt-floor: requests, prompt tokens and concurrency must be at least 1");
  }
  std::mt19937 rng(1);
  std::vector<uint32_t> prompt(ids);
  for (auto& t : prompt) t = rng() % 32000;  // 2-3 byte varints, as real vocabularies give
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);  // as the proxy's worker channels
  TlsFiles client{dir_ + "/ca.pem", dir_ + "/floor-client.pem", dir_ + "/floor-client.key"};
  auto mtls = RpcCredentials::MutualTls(client);
  if (!mtls.ok()) return mtls.status();
  nlohmann::json rows = nlohmann::json::array();
  struct Kind {
    const char* name;
    std::shared_ptr<grpc::Channel> channel;
  };
  const Kind kinds[] = {{"plaintext", RpcCredentials().Dial(plain_address_, args)},
                        {"mtls", mtls->Dial(tls_address_, args)}};
  // Back to back first (the per-call work alone), then, when the prompt
  // workload ran, at its cadence (what a lone call costs, wake-ups and the
  // processes' own background included).
  std::vector<double> rates = {0};
  if (rate_per_s > 0) rates.push_back(rate_per_s);
  for (const double rate : rates) {
    const std::string mode =
        rate > 0 ? fmt::format("paced {:.2f}/s", rate) : std::string("back-to-back");
    double estimate_us = 0, plain_server_us = 0;
    // Paced calls take as long as the prompt workload did: at most 64.
    const uint32_t n = rate > 0 ? std::min(requests, 64u) : requests;
    for (const Kind& k : kinds) {
      auto p = Drive(k.channel, [this] { return ServerCpuSeconds(); }, n, prompt, concurrency,
                     rate);
      if (!p.ok()) return p.status();
      if (p->ok != n) {
        return UnavailableError(fmt::format("prompt-floor ({}): {} of {} calls failed", k.name,
                                            n - p->ok, n));
      }
      const double server_us = p->server_s / n * 1e6;
      const double client_us = p->client_s / n * 1e6;
      estimate_us += k.channel == kinds[0].channel ? server_us : 2 * client_us;
      if (k.channel == kinds[0].channel) plain_server_us = server_us;
      std::cout << fmt::format(
          "pfloor  {:>5} {:>6} {:>6} {:>4}  {:<9} {:<14} wall {:.2f} s  server {:.1f} us/call  "
          "client {:.1f} us/call\n",
          n, ids, 1, rate > 0 ? 1 : concurrency, k.name, mode, p->wall_s, server_us,
          client_us);
      rows.push_back({{"workload", "prompt-floor"},
                      {"channel", k.name},
                      {"mode", rate > 0 ? "paced" : "back-to-back"},
                      {"requests_ok", p->ok},
                      {"input_len", ids},
                      {"concurrency", rate > 0 ? 0u : concurrency},
                      {"paced_per_s", rate},
                      {"duration_s", p->wall_s},
                      {"server_us_per_call", server_us},
                      {"client_us_per_call", client_us}});
    }
    // The Prefill call over the framed TCP transport (issue 23,
    // proxy.prefill_transport tcp), with the proxy's client.
    auto frame_tls = InternalFrameTls(*mtls);
    if (!frame_tls.ok()) return frame_tls.status();
    auto fp = DriveFramed(framed_address_, *frame_tls, [this] { return ServerCpuSeconds(); }, n,
                          prompt, concurrency, rate);
    if (!fp.ok()) return fp.status();
    if (fp->ok != n) {
      return UnavailableError(
          fmt::format("prompt-floor (framed-mtls): {} of {} calls failed", n - fp->ok, n));
    }
    const double framed_server_us = fp->server_s / n * 1e6;
    const double framed_client_us = fp->client_s / n * 1e6;
    std::cout << fmt::format(
        "pfloor  {:>5} {:>6} {:>6} {:>4}  {:<11} {:<14} wall {:.2f} s  server {:.1f} us/call  "
        "client {:.1f} us/call  request {} B (client varints)\n",
        n, ids, 1, rate > 0 ? 1 : concurrency, "framed-mtls", mode, fp->wall_s, framed_server_us,
        framed_client_us, fp->request_bytes);
    rows.push_back({{"workload", "prompt-floor"},
                    {"channel", "framed-mtls"},
                    {"mode", rate > 0 ? "paced" : "back-to-back"},
                    {"requests_ok", fp->ok},
                    {"input_len", ids},
                    {"concurrency", rate > 0 ? 0u : concurrency},
                    {"paced_per_s", rate},
                    {"duration_s", fp->wall_s},
                    {"server_us_per_call", framed_server_us},
                    {"client_us_per_call", framed_client_us},
                    {"request_bytes", fp->request_bytes}});
    std::cout << fmt::format(
        "pfloor  {:<14} proxy per prompt ~= plaintext server + 2 x mTLS client = {:.3f} ms\n",
        mode, estimate_us / 1e3);
    // Both worker calls framed (the decode stream's start and Prefill: the
    // default transports), the public call still a gRPC server's.
    const double framed_estimate_us = plain_server_us + 2 * framed_client_us;
    std::cout << fmt::format(
        "pfloor  {:<14} proxy per prompt ~= plaintext server + 2 x framed client = {:.3f} ms\n",
        mode, framed_estimate_us / 1e3);
    rows.push_back({{"workload", "prompt-floor"},
                    {"channel", "proxy-estimate-framed"},
                    {"mode", rate > 0 ? "paced" : "back-to-back"},
                    {"proxy_ms_per_request", framed_estimate_us / 1e3}});
    std::cout.flush();
    rows.push_back({{"workload", "prompt-floor"},
                    {"channel", "proxy-estimate"},
                    {"mode", rate > 0 ? "paced" : "back-to-back"},
                    {"proxy_ms_per_request", estimate_us / 1e3}});
  }
  return rows;
}

}  // namespace tandem::cli
