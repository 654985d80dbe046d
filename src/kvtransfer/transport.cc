#include "kvtransfer/transport.h"

#include <fmt/format.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdlib>

#include "kvtransfer/loopback/loopback_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"

namespace tandem::kvtransfer {

std::string_view XferStatusName(XferStatus s) {
  switch (s) {
    case XferStatus::kPrepared:
      return "PREPARED";
    case XferStatus::kInProgress:
      return "IN_PROGRESS";
    case XferStatus::kSuccess:
      return "SUCCESS";
    case XferStatus::kErrRemoteDisconnect:
      return "ERR_REMOTE_DISCONNECT";
    case XferStatus::kErrCanceled:
      return "ERR_CANCELED";
    case XferStatus::kErrStaleDescriptor:
      return "ERR_STALE_DESCRIPTOR";
    case XferStatus::kErrInvalidArgument:
      return "ERR_INVALID_ARGUMENT";
    case XferStatus::kErrBackend:
      return "ERR_BACKEND";
  }
  return "UNKNOWN";
}

std::vector<Segment> CoalesceBlocks(std::span<const BlockPair> pairs, uint64_t block_bytes) {
  std::vector<Segment> out;
  for (const BlockPair& p : pairs) {
    const uint64_t local = uint64_t{p.local_block} * block_bytes;
    const uint64_t remote = uint64_t{p.remote_slot} * block_bytes;
    if (!out.empty()) {
      Segment& last = out.back();
      if (last.local_offset_bytes + last.length_bytes == local &&
          last.remote_offset_bytes + last.length_bytes == remote) {
        last.length_bytes += block_bytes;
        continue;
      }
    }
    out.push_back({local, remote, block_bytes});
  }
  return out;
}

Result<XferId> Transport::PrepareBlockWrite(PeerId peer, std::span<const BlockPair> blocks,
                                            std::optional<std::string> notice) {
  for (const BlockPair& p : blocks) {
    if (p.local_block >= uint64_t{num_blocks_} + staging_blocks_) {
      return OutOfRangeError(fmt::format(
          "local block {} is outside the pool of {} blocks (+ {} staging blocks)", p.local_block,
          num_blocks_, staging_blocks_));
    }
  }
  // Remote slots are checked against the peer's pool by PrepareWrite.
  return PrepareWrite(peer, CoalesceBlocks(blocks, block_bytes_), std::move(notice));
}

uint64_t NewGeneration() {
  static std::atomic<uint64_t> last{0};
  const auto now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count());
  uint64_t prev = last.load();
  uint64_t next = 0;
  do {
    next = std::max(now, prev + 1);
  } while (!last.compare_exchange_weak(prev, next));
  return next;
}

namespace {

Result<std::unique_ptr<Transport>> CreateBackend(const TransportOptions& options) {
  if (options.agent_name.empty()) return InvalidArgumentError("transport needs an agent_name");
  if (options.block_bytes == 0 || options.num_blocks == 0) {
    return InvalidArgumentError(fmt::format("KV pool of {} blocks of {} bytes is empty",
                                            options.num_blocks, options.block_bytes));
  }
  if (options.max_put_bytes == 0) return InvalidArgumentError("max_put_bytes must be > 0");
  if (options.backend == "ucx") return CreateUcxTransport(options);
  if (options.external_pool != nullptr) {
    return InvalidArgumentError(fmt::format(
        "KV transport backend '{}' cannot register an external (device) pool; only ucx can",
        options.backend));
  }
  if (options.backend == "loopback") return CreateLoopbackTransport(options);
  return InvalidArgumentError(
      fmt::format("unknown KV transport backend '{}' (expected ucx or loopback)", options.backend));
}

}  // namespace

std::string KvFaultOptions::ToString() const {
  if (!enabled()) return "off";
  return fmt::format(
      "fail_every={},delay_ms={},delay_writes={},flip_block={},lose_peer_at={},"
      "stop_peer_at_import={}{}",
      fail_every, delay_ms, delay_writes, flip_block, lose_peer_at, stop_peer_at_import,
      agent.empty() ? "" : ",agent=" + agent);
}

Result<KvFaultOptions> ParseKvFault(std::string_view spec) {
  KvFaultOptions f;
  if (spec.empty() || spec == "off") return f;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string_view item = spec.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? "" : item.substr(eq + 1);
    if (key == "agent") {
      if (value.empty()) return InvalidArgumentError(fmt::format("{}: 'agent' needs a name", kKvFaultEnv));
      f.agent.assign(value);
      continue;
    }
    uint32_t* field = key == "fail_every"     ? &f.fail_every
                      : key == "delay_ms"     ? &f.delay_ms
                      : key == "delay_writes" ? &f.delay_writes
                      : key == "flip_block"   ? &f.flip_block
                      : key == "lose_peer_at" ? &f.lose_peer_at
                      : key == "stop_peer_at_import" ? &f.stop_peer_at_import
                                              : nullptr;
    if (field == nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: unknown key '{}' (expected fail_every, delay_ms, delay_writes, flip_block, "
          "lose_peer_at, stop_peer_at_import or agent)",
          kKvFaultEnv, key));
    }
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size() ||
        v > 3'600'000) {
      return InvalidArgumentError(fmt::format(
          "{}: '{}' needs a whole number from 0 to 3600000, got '{}'", kKvFaultEnv, key, value));
    }
    *field = static_cast<uint32_t>(v);
  }
  return f;
}

Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& requested) {
  TransportOptions options = requested;
  if (const char* env = std::getenv(kKvFaultEnv); env != nullptr && *env != '\0') {
    TANDEM_ASSIGN_OR_RETURN(KvFaultOptions fault, ParseKvFault(env));
    if (fault.agent.empty() || fault.agent == options.agent_name) options.fault = fault;
  }
  if (options.fault.enabled()) {
    spdlog::warn("kvtransfer: FAULT INJECTION ON for agent '{}' ({}): {} (tests only)",
                 options.agent_name, kKvFaultEnv, options.fault.ToString());
  }
  return CreateBackend(options);
}


}  // namespace tandem::kvtransfer
