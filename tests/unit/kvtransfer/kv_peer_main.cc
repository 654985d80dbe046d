// kvtransfer_peer: the other process of the kvtransfer tests.
//
//   kvtransfer_peer target backend=ucx name=N block_bytes=B blocks=K
//     prints "DESC <hex>", then answers commands on stdin, one per line:
//       SUM <offset> <length>        -> "SUM <checksum>"
//       NOTICES <n> <timeout_ms>     -> "NOTICES <count> <payload,payload,...>"
//                                      once n notices arrived or the timeout passed
//       QUIT
//   kvtransfer_peer writer backend=ucx name=N block_bytes=B blocks=K target=<hex>
//                   requests=R seed=S
//     fills its pool from `seed`, prints "SUM <checksum of the pool>", then
//     writes the whole pool to the target's slots 0..K-1 R times (R = 0: until
//     killed, at most 60 s), each with the notice "<name>:<r>", printing
//     "DONE <r> <status>" after each; then "TRANSPORTS <list>" and "END", and
//     waits for stdin to close.
//   staged=1 (either mode): the transport is a StagedTransport over the
//     backend with the host stand-in copy engine; SUM then reads its
//     "device" pool, i.e. what the host->device copies delivered.
// Exit code 0 on success, 1 on a setup error.
#include <chrono>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/staging/host_copy_engine.h"
#include "kvtransfer/staging/staged_transport.h"
#include "kvtransfer/transport.h"

namespace kv = tandem::kvtransfer;
namespace kvt = tandem::kvtransfer::testing;

namespace {

int Fail(const std::string& what) {
  std::cout << "ERROR " << what << std::endl;
  return 1;
}

int RunTarget(kv::Transport& t) {
  std::cout << "DESC " << kv::ToHex(t.LocalDescriptor()) << std::endl;
  std::vector<kv::Notification> seen;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "SUM") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      if (off > t.pool_bytes() || len > t.pool_bytes() - off) {
        std::cout << "SUM out-of-range" << std::endl;
        continue;
      }
      std::cout << "SUM " << kvt::Checksum(t.pool() + off, len) << std::endl;
    } else if (cmd == "NOTICES") {
      size_t n = 0;
      int timeout_ms = 0;
      in >> n >> timeout_ms;
      kvt::WaitFor(
          [&] {
            for (auto& x : t.TakeNotifications()) seen.push_back(std::move(x));
            return seen.size() >= n;
          },
          std::chrono::milliseconds(timeout_ms));
      std::string list;
      for (const auto& x : seen) list += (list.empty() ? "" : ",") + x.payload;
      std::cout << "NOTICES " << seen.size() << " " << list << std::endl;
    } else if (cmd == "QUIT") {
      break;
    }
  }
  return 0;
}

int RunWriter(kv::Transport& t, const std::string& target_hex, int requests, uint64_t seed) {
  kvt::FillRandom(t.pool(), t.pool_bytes(), seed);
  std::cout << "SUM " << kvt::Checksum(t.pool(), t.pool_bytes()) << std::endl;
  auto desc = kv::FromHex(target_hex);
  if (!desc.ok()) return Fail(desc.status().ToString());
  auto peer = t.ImportPeer(*desc);
  if (!peer.ok()) return Fail(peer.status().ToString());
  std::vector<kv::BlockPair> pairs;
  for (uint32_t b = 0; b < t.num_blocks(); ++b) pairs.push_back({b, b});
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; requests == 0 || r < requests; ++r) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) break;
    auto x = t.PrepareBlockWrite(*peer, pairs, t.agent_name() + ":" + std::to_string(r));
    if (!x.ok()) return Fail(x.status().ToString());
    if (auto s = t.Post(*x); !s.ok()) return Fail(s.ToString());
    kvt::WaitFor([&] { return kv::IsTerminal(t.Poll(*x)); });
    tandem::Status detail;
    const kv::XferStatus st = t.Poll(*x, &detail);
    std::cout << "DONE " << r << " " << kv::XferStatusName(st) << std::endl;
    t.Release(*x).IgnoreError();
    if (st != kv::XferStatus::kSuccess) break;
  }
  auto tl = t.TransportsInUse(*peer);
  std::cout << "TRANSPORTS " << (tl.ok() ? *tl : tl.status().ToString()) << std::endl;
  std::cout << "END" << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "QUIT") break;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Fail("usage: kvtransfer_peer target|writer key=value...");
  const std::string mode = argv[1];
  std::map<std::string, std::string> kvs;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    if (eq != std::string::npos) kvs[a.substr(0, eq)] = a.substr(eq + 1);
  }
  kv::TransportOptions o;
  o.backend = kvs.count("backend") ? kvs["backend"] : "ucx";
  o.agent_name = kvs.count("name") ? kvs["name"] : "peer";
  o.block_bytes = std::stoull(kvs.count("block_bytes") ? kvs["block_bytes"] : "4096");
  o.num_blocks = static_cast<uint32_t>(std::stoul(kvs.count("blocks") ? kvs["blocks"] : "16"));
  tandem::Result<std::unique_ptr<kv::Transport>> t = tandem::InternalError("unset");
  if (kvs.count("staged") && kvs["staged"] == "1") {
    auto st = kv::CreateStagedTransport(o, std::make_unique<kv::HostCopyEngine>());
    if (st.ok()) {
      t = std::unique_ptr<kv::Transport>(std::move(st).value());
    } else {
      t = st.status();
    }
  } else {
    t = kv::CreateTransport(o);
  }
  if (!t.ok()) return Fail(t.status().ToString());
  if (mode == "target") return RunTarget(**t);
  if (mode == "writer") {
    return RunWriter(**t, kvs["target"], std::stoi(kvs.count("requests") ? kvs["requests"] : "1"),
                     std::stoull(kvs.count("seed") ? kvs["seed"] : "1"));
  }
  return Fail("unknown mode " + mode);
}
