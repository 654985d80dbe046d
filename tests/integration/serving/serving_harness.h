// Helpers for the worker integration tests: a fleet file in a temp folder,
// real `tandem prefill|decode|both` processes, a gRPC client that plays the
// proxy, /metrics scraping, and the in-process engine as the reference.
#pragma once

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/supervisor.h"
#include "common/net.h"
#include "common/tls.h"
#include "common/tls_certs.h"
#include "engine/engine.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::serving_test {

namespace fs = std::filesystem;
namespace pb = ::tandem::v1;
using namespace std::chrono_literals;

// The bundled model once it is complete, else the tiny golden Llama.
inline std::string ModelDir() {
  const fs::path kjv = fs::path(TANDEM_SOURCE_DIR) / "models" / "tandem-kjv";
  if (fs::exists(kjv / "config.json") && fs::exists(kjv / "model.safetensors")) return kjv.string();
  return (fs::path(TANDEM_SOURCE_DIR) / "tests" / "fixtures" / "golden" / "tiny-llama").string();
}

constexpr uint32_t kBlockSize = 16;
constexpr uint32_t kDecoderBlocks = 40;
constexpr double kLeaseSeconds = 4.0;

// `transport_extra`: more keys of the transport section ("  encrypt: true\n").
inline std::string WriteFleetFile(const fs::path& dir, const std::string& transport_extra = "") {
  fs::create_directories(dir);
  const fs::path path = dir / "fleet.yaml";
  std::ofstream out(path);
  out << "model:\n  path: " << ModelDir() << "\n  backend: cpu\n"
      << "cache:\n  block_size: " << kBlockSize << "\n  num_blocks: 256\n"
      << "scheduler:\n  max_num_seqs: 16\n  max_batched_tokens: 64\n  max_waiting: 16\n"
      << "transport:\n  backend: ucx\n  lease_seconds: " << kLeaseSeconds << "\n"
      << transport_extra
      << "logging:\n  level: warn\n"
      << "prefill:\n  replicas: 1\n"
      << "decode:\n  replicas: 1\n  num_blocks: " << kDecoderBlocks << "\n";
  return path.string();
}

// The internal plane is mutual TLS (the default, security.internal_tls
// auto): the tests play `tandem launch` and issue each process a
// certificate of a fleet CA kept in "tls/" next to the fleet file.
inline TlsFiles IssueIdentity(const std::string& fleet, const std::string& name) {
  auto ca = FleetCa::OpenOrCreate((fs::path(fleet).parent_path() / "tls").string(), "test fleet CA");
  EXPECT_TRUE(ca.ok()) << ca.status().ToString();
  if (!ca.ok()) return {};
  auto f = ca->Issue(name, {"127.0.0.1", "localhost"});
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? *f : TlsFiles{};
}

inline std::vector<std::string> TlsArgs(const TlsFiles& f) {
  return {"--tls-ca", f.ca_file, "--tls-cert", f.cert_file, "--tls-key", f.key_file};
}

// A channel to a worker as the proxy dials it (identity "test-proxy").
inline std::shared_ptr<grpc::Channel> InternalChannel(const std::string& fleet,
                                                      const std::string& address) {
  auto creds = RpcCredentials::MutualTls(IssueIdentity(fleet, "test-proxy"));
  EXPECT_TRUE(creds.ok()) << creds.status().ToString();
  return creds.ok() ? creds->Dial(address) : nullptr;
}

inline Result<cli::Child*> StartWorker(cli::Supervisor& sup, const std::string& fleet,
                                       const std::string& role, const std::string& name) {
  cli::ChildSpec spec;
  spec.name = name;
  spec.role = role;
  spec.argv = {std::string(TANDEM_BINARY_DIR) + "/tandem", "--log-level", "warn", role, "--config",
               fleet, "--name", name, "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0"};
  for (auto& a : TlsArgs(IssueIdentity(fleet, name))) spec.argv.push_back(std::move(a));
  return sup.Start(std::move(spec), 60s);
}

// GET http://address/metrics, the body only.
inline std::string Scrape(const std::string& address) {
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp->port);
  inet_pton(AF_INET, hp->host.c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  return body == std::string::npos ? resp : resp.substr(body + 4);
}

// The value of the first sample of `name` (exact metric name, any labels).
inline std::optional<double> MetricValue(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != '{' && next != ' ') continue;
    const size_t sp = line.rfind(' ');
    return std::stod(line.substr(sp + 1));
  }
  return std::nullopt;
}

// Polls /metrics (levels are sampled about every 150 ms) until `name`
// satisfies `ok`; returns its last value (nullopt if never seen).
template <class Pred>
std::optional<double> WaitForMetric(const std::string& address, const std::string& name, Pred ok,
                                    std::chrono::milliseconds timeout = 5s) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  std::optional<double> v;
  while (true) {
    v = MetricValue(Scrape(address), name);
    if ((v && ok(*v)) || std::chrono::steady_clock::now() >= give_up) return v;
    std::this_thread::sleep_for(50ms);
  }
}

// Waits until the worker reports no KV in use, nothing reserved, parked,
// queued or running. Returns the last scrape for messages.
inline std::string WaitForIdle(const std::string& metrics_address,
                               std::chrono::milliseconds timeout = 10s) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  std::string text;
  while (std::chrono::steady_clock::now() < give_up) {
    text = Scrape(metrics_address);
    auto usage = MetricValue(text, "tandem_kv_cache_usage_ratio");
    auto res = MetricValue(text, "tandem_kv_reservations");
    auto parked = MetricValue(text, "tandem_kv_parked_prefills");
    auto running = MetricValue(text, "tandem_num_requests_running");
    auto waiting = MetricValue(text, "tandem_num_requests_waiting");
    auto queued = MetricValue(text, "tandem_prefill_queue_requests");
    if (usage && *usage == 0 && res && *res == 0 && parked && *parked == 0 && running &&
        *running == 0 && waiting && *waiting == 0 && queued && *queued == 0) {
      return "";
    }
    std::this_thread::sleep_for(50ms);
  }
  return text.empty() ? "no metrics" : text;
}

inline std::vector<uint32_t> Prompt(uint32_t n, uint32_t seed, uint32_t vocab) {
  std::vector<uint32_t> p;
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (uint32_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p.push_back(3 + static_cast<uint32_t>(x % (vocab - 3)));
  }
  return p;
}

struct Reference {
  model::ModelConfig config;
  model::ModelWeights weights;

  // Greedy tokens of the in-process engine (no network, no transfer).
  std::vector<uint32_t> Generate(const std::vector<uint32_t>& prompt, uint32_t max_tokens,
                                 bool ignore_eos) const {
    engine::EngineOptions o;
    o.block_size = kBlockSize;
    o.num_blocks = 128;
    auto e = engine::Engine::Create(config, weights, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    std::vector<uint32_t> out;
    engine::GenerateRequest r;
    r.request_id = "ref";
    r.prompt_ids = prompt;
    r.sampling.temperature = 0;
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = ignore_eos;
    r.sampling.seed = 1;
    r.on_output = [&](const engine::RequestOutput& o) {
      out.insert(out.end(), o.token_ids.begin(), o.token_ids.end());
    };
    EXPECT_TRUE((*e)->Submit(std::move(r)).ok());
    (*e)->RunUntilIdle();
    return out;
  }
};

inline pb::EngineParams Greedy(uint32_t max_tokens, bool ignore_eos) {
  pb::EngineParams p;
  p.set_max_tokens(max_tokens);
  p.set_temperature(0);
  p.set_top_p(1);
  p.set_seed(1);
  p.set_ignore_eos(ignore_eos);
  return p;
}

// What the proxy sees of one request.
struct Outcome {
  bool registered = false;
  std::vector<uint32_t> tokens;
  bool indices_ok = true;  // every chunk's first_index continues the last
  std::optional<pb::DecodeFinished> finished;
  std::optional<pb::ErrorInfo> error;
  grpc::Status decode_status;
  grpc::Status prefill_status;
  pb::PrefillResponse prefill;
};

// An open Decode stream (the proxy's step 2).
class DecodeCall {
 public:
  DecodeCall(pb::Decoder::Stub& stub, const pb::DecodeRequest& req) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 60s);
    reader_ = stub.Decode(&ctx_, req);
  }
  // Reads the first message; true when it is `registered`.
  bool ReadRegistered() {
    pb::DecodeResponse m;
    return reader_->Read(&m) && m.has_registered() && m.registered();
  }
  // Reads up to `max_messages` messages (all when 0) into `out`.
  void ReadInto(Outcome& out, size_t max_messages = 0) {
    pb::DecodeResponse m;
    size_t n = 0;
    while ((max_messages == 0 || n < max_messages) && reader_->Read(&m)) {
      ++n;
      if (m.has_tokens()) {
        if (m.tokens().first_index() != out.tokens.size()) out.indices_ok = false;
        out.tokens.insert(out.tokens.end(), m.tokens().token_ids().begin(),
                          m.tokens().token_ids().end());
      } else if (m.has_finished()) {
        out.finished = m.finished();
      } else if (m.has_error()) {
        out.error = m.error();
      }
    }
  }
  grpc::Status Finish() { return reader_->Finish(); }
  void Cancel() { ctx_.TryCancel(); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<pb::DecodeResponse>> reader_;
};

}  // namespace tandem::serving_test
