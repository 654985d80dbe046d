// The floors of `tandem bench proxy`: bare Generate servers (callback API,
// async completion-queue API on one thread) and raw loopback TCP, streaming
// canned tokens at the sim's cadence. See bench_proxy_floor.h.
#include "cli/bench_proxy_floor.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "cli/bench_proxy_floor_step.h"
#include "cli/bench_proxy_relay_floor.h"
#include "cli/proc_stats.h"
#include "common/stream_writer.h"
#include "common/token_merge.h"
#include "loadgen/grpc_client.h"
#include "loadgen/runner.h"
#include "loadgen/workload.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::cli {
namespace {

namespace pb = ::tandem::v1;
namespace lg = ::tandem::loadgen;
using Clock = std::chrono::steady_clock;

// One canned token message as the proxy sends it: request id, one token id,
// its text (a short word piece).
void FillToken(pb::GenerateResponse& r, const std::string& id, uint32_t first, uint32_t n) {
  r.Clear();
  r.set_request_id(id);
  for (uint32_t i = 0; i < n; ++i) r.add_token_ids(100 + (first + i) % 1000);
  for (uint32_t i = 0; i < n; ++i) r.mutable_text()->append(" tok");
}

void FillFinal(pb::GenerateResponse& r, const std::string& id, uint32_t prompt, uint32_t n) {
  r.Clear();
  r.set_request_id(id);
  r.set_finish_reason(pb::FINISH_REASON_LENGTH);
  r.mutable_usage()->set_prompt_tokens(prompt);
  r.mutable_usage()->set_completion_tokens(n);
}

// ---------------------------------------------------------------- callback

class CbStream;

// Writes one token to every open stream per step, from a callback alarm:
// on one of gRPC's callback threads, as the proxy writes from the decode
// stream's read callback.
class CbTicker {
 public:
  explicit CbTicker(double step_ms)
      : step_(std::chrono::microseconds(int64_t(step_ms * 1000))),
        next_(std::chrono::system_clock::now()) {
    Arm();
  }
  void Add(CbStream* s) {
    std::lock_guard lock(mu_);
    streams_.push_back(s);
  }
  void Remove(CbStream* s) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] == s) {
        streams_[i] = streams_.back();
        streams_.pop_back();
        return;
      }
    }
  }

 private:
  void Arm() {
    next_ += step_;
    alarm_.Set(next_, [this](bool) { Tick(); });
  }
  void Tick();
  const std::chrono::system_clock::duration step_;
  std::chrono::system_clock::time_point next_;  // the alarm's
  grpc::Alarm alarm_;                           // runs until the process is killed
  std::mutex mu_;
  std::vector<CbStream*> streams_;  // guarded by mu_
};

class CbStream final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  CbStream(CbTicker* ticker, const pb::GenerateRequest& req)
      : ticker_(ticker),
        id_(req.request_id()),
        prompt_(uint32_t(req.prompt_token_ids_size())),
        max_(req.max_tokens() == 0 ? 1 : req.max_tokens()),
        writer_(this, &MergeGenerateDelta) {
    writer_.Open();
    ticker_->Add(this);
  }
  // On the ticker's thread with its lock held; true: the stream is done
  // with the ticker (finished or cancelled).
  bool Tick() {
    if (cancelled_.load()) return true;
    pb::GenerateResponse r;
    FillToken(r, id_, sent_, 1);
    writer_.Write(std::move(r));
    if (++sent_ < max_) return false;
    FillFinal(r, id_, prompt_, sent_);
    writer_.WriteAndFinish(std::move(r), grpc::Status::OK);
    return true;
  }
  void OnWriteDone(bool ok) override { writer_.OnWriteDone(ok); }
  void OnCancel() override {
    cancelled_ = true;
    writer_.OnCancel();
  }
  void OnDone() override {
    ticker_->Remove(this);
    delete this;
  }

 private:
  CbTicker* const ticker_;
  const std::string id_;
  const uint32_t prompt_, max_;
  uint32_t sent_ = 0;  // the ticker's
  std::atomic<bool> cancelled_{false};
  StreamWriter<pb::GenerateResponse> writer_;
};

void CbTicker::Tick() {
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < streams_.size();) {
      if (streams_[i]->Tick()) {
        streams_[i] = streams_.back();
        streams_.pop_back();
      } else {
        ++i;
      }
    }
  }
  Arm();
}

class CbService final : public pb::Generation::CallbackService {
 public:
  explicit CbService(double step_ms) : ticker_(step_ms) {}
  grpc::ServerWriteReactor<pb::GenerateResponse>* Generate(grpc::CallbackServerContext*,
                                                           const pb::GenerateRequest* req) override {
    return new CbStream(&ticker_, *req);
  }

 private:
  CbTicker ticker_;
};

// ------------------------------------------------------------------- async

struct CqCall;
enum class Kind { kNew, kWrite, kFinish, kDone, kTick };
struct Tag {
  CqCall* call;
  Kind kind;
};

struct CqCall {
  grpc::ServerContext ctx;
  pb::GenerateRequest req;
  grpc::ServerAsyncWriter<pb::GenerateResponse> writer{&ctx};
  Tag t_new{this, Kind::kNew}, t_write{this, Kind::kWrite}, t_finish{this, Kind::kFinish},
      t_done{this, Kind::kDone};
  pb::GenerateResponse msg;  // the message being written (reused)
  uint32_t max = 1, ready = 0, written = 0;
  bool writing = false, finishing = false, finished = false, done = false, broken = false;
};

// floor-cq+cb: Generate on the async API as in floor-cq, ListModels on the
// callback API (never called): the process then runs gRPC's callback
// threads too, as every tandem server does (health, reflection, ...).
using MixedService =
    pb::Generation::WithCallbackMethod_ListModels<pb::Generation::WithAsyncMethod_Generate<pb::Generation::Service>>;

// One thread: new calls, write completions and the per-step alarm all come
// through one completion queue.
template <class Service>
int ServeAsync(Service& service, grpc::ServerCompletionQueue* cq, double step_ms) {
  std::vector<CqCall*> active;
  const auto request_next = [&] {
    auto* c = new CqCall();
    c->ctx.AsyncNotifyWhenDone(&c->t_done);
    service.RequestGenerate(&c->ctx, &c->req, &c->writer, cq, cq, &c->t_new);
  };
  const auto pump = [&](CqCall* c) {
    if (c->writing || c->finishing) return;
    if (c->broken) {
      c->finishing = true;
      c->writer.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"), &c->t_finish);
      return;
    }
    if (c->written < c->ready) {
      FillToken(c->msg, c->req.request_id(), c->written, c->ready - c->written);
      c->written = c->ready;
      c->writing = true;
      c->writer.Write(c->msg, &c->t_write);
    } else if (c->written == c->max) {
      c->finishing = true;
      FillFinal(c->msg, c->req.request_id(), uint32_t(c->req.prompt_token_ids_size()), c->max);
      c->writer.WriteAndFinish(c->msg, grpc::WriteOptions(), grpc::Status::OK, &c->t_finish);
    }
  };
  const auto maybe_delete = [](CqCall* c) {
    if (c->done && (c->finished || (!c->writing && !c->finishing))) delete c;
  };
  // Takes `c` off the per-step list (order does not matter).
  const auto deactivate = [&active](CqCall* c) {
    auto it = std::find(active.begin(), active.end(), c);
    if (it == active.end()) return;
    *it = active.back();
    active.pop_back();
  };
  request_next();
  const auto step = std::chrono::microseconds(int64_t(step_ms * 1000));
  auto next = std::chrono::system_clock::now() + step;
  Tag tick{nullptr, Kind::kTick};
  grpc::Alarm alarm;
  alarm.Set(cq, next, &tick);
  void* tag = nullptr;
  bool ok = false;
  while (cq->Next(&tag, &ok)) {
    Tag* t = static_cast<Tag*>(tag);
    CqCall* c = t->call;
    switch (t->kind) {
      case Kind::kTick:
        for (size_t i = 0; i < active.size();) {
          CqCall* a = active[i];
          if (a->ready < a->max) ++a->ready;
          pump(a);
          if (a->finishing) {
            active[i] = active.back();
            active.pop_back();
          } else {
            ++i;
          }
        }
        next += step;
        alarm.Set(cq, next, &tick);
        break;
      case Kind::kNew:
        if (!ok) return 1;  // shutting down
        request_next();
        c->max = c->req.max_tokens() == 0 ? 1 : c->req.max_tokens();
        active.push_back(c);
        break;
      case Kind::kWrite:
        c->writing = false;
        if (!ok) c->broken = true;
        if (!c->finishing) pump(c);
        if (c->finishing) deactivate(c);
        maybe_delete(c);
        break;
      case Kind::kFinish:
        c->finished = true;
        maybe_delete(c);
        break;
      case Kind::kDone:
        c->done = true;
        if (c->ctx.IsCancelled() && !c->finishing) {
          c->broken = true;
          if (!c->writing) {
            deactivate(c);
            pump(c);
          }
        }
        maybe_delete(c);
        break;
    }
  }
  return 0;
}

// --------------------------------------------------------------------- tcp

// Accepts `connections`, then sends `streams` messages of `bytes` per step,
// round-robin over the connections, `messages` in all; then closes them.
int ServeTcp(int listen_fd, uint32_t connections, uint32_t streams, uint64_t messages,
             uint32_t bytes, double step_ms) {
  const std::vector<int> fds = floor_detail::AcceptNoDelay(listen_fd, connections);
  if (fds.empty()) return 1;
  const std::string buf(bytes, 'x');
  const auto step = std::chrono::microseconds(int64_t(step_ms * 1000));
  auto next = Clock::now();
  uint64_t sent = 0;
  while (sent < messages) {
    next += step;
    std::this_thread::sleep_until(next);
    for (uint32_t i = 0; i < streams && sent < messages; ++i, ++sent) {
      if (send(fds[i % fds.size()], buf.data(), buf.size(), MSG_NOSIGNAL) != ssize_t(buf.size())) {
        return 1;
      }
    }
  }
  for (int fd : fds) close(fd);
  pause();  // CPU is read, then we are killed
  return 0;
}

struct ServerArgs {
  std::string mode = "callback";
  double step_ms = 6.4;
  uint32_t connections = 4, streams = 16, bytes = 64;
  uint64_t messages = 0;
};

int RunFloorServer(const ServerArgs& a) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (a.mode == "tcp" || a.mode == "step" || a.mode == "step-ack" || a.mode == "relay") {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(fd, 64) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      std::cerr << "proxy-floor-server: cannot listen on 127.0.0.1\n";
      return 1;
    }
    std::cout << "PORT " << ntohs(addr.sin_port) << std::endl;
    if (a.mode == "relay") return ServeRelayFloor(fd, a.messages, a.bytes);
    if (a.mode == "tcp") {
      return ServeTcp(fd, a.connections, a.streams, a.messages, a.bytes, a.step_ms);
    }
    return ServeStepFloor(fd, a.connections, a.streams, a.messages, a.bytes, a.mode == "step-ack");
  }
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (a.mode == "callback") {
    CbService service(a.step_ms);
    builder.RegisterService(&service);
    auto server = builder.BuildAndStart();
    if (!server || port == 0) return 1;
    std::cout << "PORT " << port << std::endl;
    server->Wait();
    return 0;
  }
  if (a.mode == "async") {
    pb::Generation::AsyncService service;
    builder.RegisterService(&service);
    auto cq = builder.AddCompletionQueue();
    auto server = builder.BuildAndStart();
    if (!server || port == 0) return 1;
    std::cout << "PORT " << port << std::endl;
    return ServeAsync(service, cq.get(), a.step_ms);
  }
  if (a.mode == "async-cb") {
    MixedService service;
    builder.RegisterService(&service);
    auto cq = builder.AddCompletionQueue();
    auto server = builder.BuildAndStart();
    if (!server || port == 0) return 1;
    std::cout << "PORT " << port << std::endl;
    return ServeAsync(service, cq.get(), a.step_ms);
  }
  std::cerr << "proxy-floor-server: --mode must be callback, async, async-cb, tcp, step, "
               "step-ack or relay\n";
  return 2;
}

// ------------------------------------------------------------------ parent

using floor_detail::Child;
using floor_detail::SpawnServer;
using floor_detail::StopChild;

Result<FloorRow> RunGrpcFloor(const std::string& self, const std::string& mode,
                              const FloorSpec& spec, const lg::ModelInfo& mi) {
  TANDEM_ASSIGN_OR_RETURN(Child child, SpawnServer(self, {"--mode", mode, "--step-ms",
                                                          fmt::format("{}", spec.step_ms)}));
  FloorRow row;
  row.name = mode == "callback" ? "floor-cb" : mode == "async" ? "floor-cq" : "floor-cq+cb";
  {
    auto client = lg::MakeGrpcClient({fmt::format("127.0.0.1:{}", child.port), "", 4});
    lg::SyntheticOptions so;
    so.input = {lg::LengthDist::Kind::kFixed, double(spec.input), 0};
    so.output = {lg::LengthDist::Kind::kFixed, double(spec.output), 0};
    so.seed = 1;
    so.vocab = mi.vocab_size;
    so.max_model_len = mi.max_model_len;
    auto source = lg::MakeSyntheticSource(so);
    lg::RunOptions ro;
    ro.num_requests = spec.requests;
    ro.duration_s = spec.duration_s;
    ro.arrival.kind = lg::ArrivalKind::kConcurrency;
    ro.arrival.concurrency = spec.concurrency;
    ro.ignore_eos = true;
    ro.model = mi.id;
    ro.request_id_prefix = fmt::format("bench-proxy-{}-{}", getpid(), row.name);
    ro.request_timeout = std::chrono::milliseconds(int64_t(spec.duration_s * 1000) + 60000);
    const double cpu0 = ProcessCpuSeconds(child.pid);
    const double load0 = LoadAverage1();
    auto run = lg::Run(*client, *source, ro);
    row.server_cpu_s = ProcessCpuSeconds(child.pid) - cpu0;
    row.load1 = (load0 + LoadAverage1()) / 2;
    if (!run.ok()) {
      StopChild(child);
      return run.status();
    }
    row.summary = lg::Summarize(run->records, {});
    row.tokens = row.summary.output_tokens;
    row.requests_ok = row.summary.ok;
    row.requests_failed = row.summary.failed;
  }
  StopChild(child);
  return row;
}

Result<FloorRow> RunTcpFloor(const std::string& self, const FloorSpec& spec) {
  const uint32_t bytes = floor_detail::TokenWireBytes();
  const uint64_t messages = uint64_t(spec.requests) * spec.output;
  constexpr uint32_t kConnections = 4;  // as the gRPC client's channels
  TANDEM_ASSIGN_OR_RETURN(
      Child child,
      SpawnServer(self, {"--mode", "tcp", "--step-ms", fmt::format("{}", spec.step_ms),
                         "--connections", std::to_string(kConnections), "--streams",
                         std::to_string(spec.concurrency), "--messages", std::to_string(messages),
                         "--bytes", std::to_string(bytes)}));
  auto fds = floor_detail::ConnectLoopback(child.port, kConnections);
  if (!fds.ok()) {
    StopChild(child);
    return UnavailableError("floor-tcp: cannot connect to the floor server");
  }
  FloorRow row;
  row.name = "floor-tcp";
  row.grpc = false;
  const double cpu0 = ProcessCpuSeconds(child.pid);
  const double load0 = LoadAverage1();
  const auto got = floor_detail::ReadUntilClosed(*fds, spec.duration_s, 0);
  row.summary.duration_s = got.duration_s;
  row.server_cpu_s = ProcessCpuSeconds(child.pid) - cpu0;
  row.load1 = (load0 + LoadAverage1()) / 2;
  for (int f : *fds) close(f);
  StopChild(child);
  row.tokens = got.bytes / bytes;
  row.summary.output_tokens = row.tokens;
  row.requests_ok = got.all_closed ? spec.requests : 0;
  row.requests_failed = got.all_closed ? 0 : spec.requests;
  return row;
}

}  // namespace

namespace floor_detail {

Result<Child> SpawnServer(const std::string& self, const std::vector<std::string>& args) {
  int p[2];
  if (pipe(p) != 0) return InternalError("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) return InternalError("fork failed");
  if (pid == 0) {
    dup2(p[1], 1);
    close(p[0]);
    close(p[1]);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>("tandem"));
    argv.push_back(const_cast<char*>("bench"));
    argv.push_back(const_cast<char*>("proxy-floor-server"));
    for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    execv(self.c_str(), argv.data());
    _exit(127);
  }
  close(p[1]);
  std::string line;
  pollfd pfd{p[0], POLLIN, 0};
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (line.find('\n') == std::string::npos && Clock::now() < until) {
    if (poll(&pfd, 1, 200) <= 0) continue;
    char buf[64];
    const ssize_t n = read(p[0], buf, sizeof buf);
    if (n <= 0) break;
    line.append(buf, size_t(n));
  }
  close(p[0]);
  Child c;
  c.pid = pid;
  if (line.rfind("PORT ", 0) != 0 || (c.port = std::atoi(line.c_str() + 5)) <= 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return UnavailableError("the floor server did not start (tandem bench proxy-floor-server)");
  }
  return c;
}

void StopChild(Child& c) {
  if (c.pid <= 0) return;
  kill(c.pid, SIGKILL);
  waitpid(c.pid, nullptr, 0);
  c.pid = -1;
}

std::vector<int> AcceptNoDelay(int listen_fd, uint32_t n) {
  std::vector<int> fds;
  while (fds.size() < n) {
    const int fd = accept(listen_fd, nullptr, nullptr);
    if (fd < 0) {
      for (int f : fds) close(f);
      return {};
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fds.push_back(fd);
  }
  return fds;
}

uint32_t TokenWireBytes() {
  pb::GenerateResponse r;
  FillToken(r, fmt::format("bench-proxy-{}-stream-{}", getpid(), 10), 0, 1);
  return uint32_t(r.ByteSizeLong()) + 5 + 9;
}

Result<std::vector<int>> ConnectLoopback(int port, uint32_t n) {
  std::vector<int> fds;
  for (uint32_t i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(uint16_t(port));
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      for (int f : fds) close(f);
      if (fd >= 0) close(fd);
      return UnavailableError(fmt::format("cannot connect to 127.0.0.1:{}", port));
    }
    fds.push_back(fd);
  }
  return fds;
}

ReadResult ReadUntilClosed(const std::vector<int>& fds, double duration_s, uint32_t ack_bytes) {
  const int ep = epoll_create1(0);
  for (int fd : fds) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }
  ReadResult r;
  const auto t0 = Clock::now();
  const auto until = t0 + std::chrono::milliseconds(int64_t(duration_s * 1000));
  size_t open = fds.size();
  std::vector<char> buf(1 << 16);
  const std::string ack(ack_bytes, '\0');
  while (open > 0 && Clock::now() < until) {
    epoll_event evs[8];
    const int n = epoll_wait(ep, evs, 8, 1000);
    for (int i = 0; i < n; ++i) {
      const int fd = evs[i].data.fd;
      const ssize_t got = read(fd, buf.data(), buf.size());
      if (got > 0) {
        r.bytes += uint64_t(got);
        if (ack_bytes > 0) send(fd, ack.data(), ack.size(), MSG_NOSIGNAL);
      } else {
        epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
        --open;
      }
    }
  }
  r.duration_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.all_closed = open == 0;
  close(ep);
  return r;
}

}  // namespace floor_detail

Result<std::vector<FloorRow>> RunProxyFloors(const std::string& self, const FloorSpec& spec,
                                             const lg::ModelInfo& model) {
  std::vector<FloorRow> rows;
  for (const char* mode : {"callback", "async", "async-cb"}) {
    TANDEM_ASSIGN_OR_RETURN(FloorRow r, RunGrpcFloor(self, mode, spec, model));
    rows.push_back(std::move(r));
  }
  TANDEM_ASSIGN_OR_RETURN(FloorRow t, RunTcpFloor(self, spec));
  rows.push_back(std::move(t));
  for (const bool ack : {false, true}) {
    TANDEM_ASSIGN_OR_RETURN(FloorRow r,
                            RunStepFloor(self, spec, ack, /*reader_per_connection=*/false));
    rows.push_back(std::move(r));
  }
  TANDEM_ASSIGN_OR_RETURN(FloorRow r,
                          RunStepFloor(self, spec, /*ack=*/true, /*reader_per_connection=*/true));
  rows.push_back(std::move(r));
  return rows;
}

void RegisterBenchProxyFloorServer(CLI::App& bench, int& exit_code) {
  auto* cmd = bench.add_subcommand("proxy-floor-server",
                                   "a floor server of tandem bench proxy (internal)");
  cmd->group("");  // hidden
  auto a = std::make_shared<ServerArgs>();
  cmd->add_option("--mode", a->mode, "callback, async, async-cb, tcp, step, step-ack or relay");
  cmd->add_option("--step-ms", a->step_ms, "one token per stream per step (step: the feeder's)");
  cmd->add_option("--connections", a->connections, "tcp, step: client connections to accept");
  cmd->add_option("--streams", a->streams, "tcp, step: messages per step");
  cmd->add_option("--messages", a->messages, "tcp, step: messages in all (relay: prompts)");
  cmd->add_option("--bytes", a->bytes, "tcp, step: bytes per message (relay: per prompt)");
  cmd->callback([a, &exit_code] { exit_code = RunFloorServer(*a); });
}

}  // namespace tandem::cli
