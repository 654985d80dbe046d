#include "kvtransfer/slice_push_ranks.h"

#include <fmt/format.h>

#include <cstring>

namespace tandem::kvtransfer {
namespace {

constexpr char kReportMagic[4] = {'T', 'K', 'P', 'R'};
constexpr uint64_t kMaxDescriptorBytes = 1u << 20;
// magic 4 | code u32 | bytes u64 | writes u32 | message length u32 | message
constexpr size_t kReportHeader = 4 + 4 + 8 + 4 + 4;

void PutLe(std::byte* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
uint64_t GetLe(const std::byte* in, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in[i])} << (8 * i);
  return v;
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace

std::vector<std::byte> EncodePushReport(const RankSlicePusher::Outcome& o) {
  std::vector<std::byte> out(kPushReportBytes, std::byte{0});
  std::memcpy(out.data(), kReportMagic, 4);
  PutLe(out.data() + 4, static_cast<uint32_t>(o.status.code()), 4);
  PutLe(out.data() + 8, o.bytes, 8);
  PutLe(out.data() + 16, o.writes, 4);
  const std::string& msg = o.status.message();
  const size_t n = std::min(msg.size(), kPushReportBytes - kReportHeader);
  PutLe(out.data() + 20, n, 4);
  std::memcpy(out.data() + kReportHeader, msg.data(), n);
  return out;
}

Result<RankSlicePusher::Outcome> DecodePushReport(std::span<const std::byte> in) {
  if (in.size() != kPushReportBytes || std::memcmp(in.data(), kReportMagic, 4) != 0) {
    return InvalidArgumentError(
        fmt::format("KV push report: {} bytes or bad magic (want {} bytes, TKPR)", in.size(),
                    kPushReportBytes));
  }
  const uint32_t code = static_cast<uint32_t>(GetLe(in.data() + 4, 4));
  const size_t n = GetLe(in.data() + 20, 4);
  if (code > 16 || n > kPushReportBytes - kReportHeader) {
    return InvalidArgumentError(
        fmt::format("KV push report: status code {} or message length {} out of range", code, n));
  }
  RankSlicePusher::Outcome o;
  o.bytes = GetLe(in.data() + 8, 8);
  o.writes = static_cast<uint32_t>(GetLe(in.data() + 16, 4));
  if (code != 0) {
    o.status = Status(static_cast<StatusCode>(code),
                      std::string(reinterpret_cast<const char*>(in.data() + kReportHeader), n));
  }
  return o;
}

Result<std::vector<std::string>> ExchangeRankDescriptors(parallel::Communicator& world,
                                                         const std::string& mine) {
  if (mine.size() > kMaxDescriptorBytes) {
    return InvalidArgumentError(fmt::format("rank {}: a {}-byte KV transport descriptor exceeds {}",
                                            world.rank(), mine.size(), kMaxDescriptorBytes));
  }
  if (world.rank() != 0) {
    std::byte len[8];
    PutLe(len, mine.size(), 8);
    TANDEM_RETURN_IF_ERROR(world.Send(len, 0));
    TANDEM_RETURN_IF_ERROR(world.Send(AsBytes(mine), 0));
    return std::vector<std::string>{};
  }
  std::vector<std::string> all(world.size());
  all[0] = mine;
  for (int r = 1; r < world.size(); ++r) {
    std::byte len[8];
    TANDEM_RETURN_IF_ERROR(world.Recv(len, r));
    const uint64_t n = GetLe(len, 8);
    if (n > kMaxDescriptorBytes) {
      return InvalidArgumentError(
          fmt::format("rank {} announced a {}-byte KV transport descriptor (limit {})", r, n,
                      kMaxDescriptorBytes));
    }
    all[r].resize(n);
    TANDEM_RETURN_IF_ERROR(world.Recv({reinterpret_cast<std::byte*>(all[r].data()), n}, r));
  }
  return all;
}

Status RunFollowerPush(std::span<const std::byte> spec_bytes, RankSlicePusher& pusher,
                       parallel::Communicator& world) {
  RankSlicePusher::Outcome out;
  auto spec = SlicePushSpec::Decode(
      std::string_view(reinterpret_cast<const char*>(spec_bytes.data()), spec_bytes.size()));
  if (!spec.ok()) {
    out.status = spec.status().WithContext(fmt::format("prefill rank {}", pusher.rank()));
  } else {
    out = pusher.PushAndWait(*spec);
  }
  const std::vector<std::byte> report = EncodePushReport(out);
  return world.Send(report, 0).WithContext(
      fmt::format("prefill rank {} reporting its KV push to rank 0", pusher.rank()));
}

RankSlicePusher::Outcome CollectPushReports(parallel::Communicator& world) {
  RankSlicePusher::Outcome merged;
  std::vector<std::byte> buf(kPushReportBytes);
  for (int r = 1; r < world.size(); ++r) {
    Status got = world.Recv(buf, r);
    if (!got.ok()) {
      if (merged.status.ok()) {
        merged.status =
            got.WithContext(fmt::format("waiting for prefill rank {}'s KV push report", r));
      }
      // The group is broken: later ranks cannot answer either.
      break;
    }
    auto report = DecodePushReport(buf);
    if (!report.ok()) {
      if (merged.status.ok())
        merged.status = report.status().WithContext(fmt::format("prefill rank {}", r));
      continue;
    }
    merged.bytes += report->bytes;
    merged.writes += report->writes;
    if (!report->status.ok() && merged.status.ok()) {
      merged.status = report->status.WithContext(fmt::format("prefill rank {}", r));
    }
  }
  return merged;
}

RankSlicePusher::Outcome PushThroughFollowers(
    const SlicePushSpec& spec, const std::function<Status(std::string spec_bytes)>& send_plan,
    parallel::Communicator& world) {
  if (Status sent = send_plan(spec.Encode()); !sent.ok()) {
    RankSlicePusher::Outcome o;
    o.status = sent.WithContext(
        fmt::format("request '{}': sending the follower ranks the KV push", spec.request_id));
    return o;
  }
  return CollectPushReports(world);
}

}  // namespace tandem::kvtransfer
