// The start-up refusal of a role a backend cannot serve (issue 16): a fake
// backend with one capability off. The real path (tandem launch of a cuda
// fleet) runs in tests/integration/fleet/cuda_launch_test.cc.
#include "worker/role_capabilities.h"

#include <gtest/gtest.h>

#include <set>

namespace tandem::worker {
namespace {

using engine::BackendFeature;

class FakeBackend final : public engine::ComputeBackend {
 public:
  FakeBackend(std::string name, std::set<BackendFeature> features)
      : name_(std::move(name)), features_(std::move(features)) {}
  std::string_view name() const override { return name_; }
  bool Supports(BackendFeature f) const override { return features_.count(f) != 0; }
  uint32_t vocab_size() const override { return 8; }
  size_t weight_bytes() const override { return 0; }
  Status Forward(std::span<const engine::SeqChunk>, std::span<float>) override {
    return Status::Ok();
  }

 private:
  std::string name_;
  std::set<BackendFeature> features_;
};

kvtransfer::Capabilities Transport(bool device_memory) {
  kvtransfer::Capabilities c;
  c.backend = "ucx";
  c.cross_process = true;
  c.device_memory = device_memory;
  return c;
}

TEST(RoleCapabilities, DeviceKvWithoutADeviceTransportIsRefusedForBothDisaggregatedRoles) {
  // A cuda-like backend: KV in device memory only.
  FakeBackend cuda("fakecuda", {BackendFeature::kRealMath, BackendFeature::kDeviceKvPool});
  for (const char* role : {"prefill", "decode"}) {
    const Status st = CheckRoleCapabilities(cuda, role, Transport(false));
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << role;
    EXPECT_NE(st.message().find(std::string("backend fakecuda cannot serve role ") + role +
                                ": missing capability transport device_memory"),
              std::string::npos)
        << st.message();
  }
  // Aggregated serving moves no KV; a device transport makes both roles fine.
  EXPECT_TRUE(CheckRoleCapabilities(cuda, "both", Transport(false)).ok());
  EXPECT_TRUE(CheckRoleCapabilities(cuda, "prefill", Transport(true)).ok());
  EXPECT_TRUE(CheckRoleCapabilities(cuda, "decode", Transport(true)).ok());
}

TEST(RoleCapabilities, HostKvOffIsRefusedNamingIt) {
  FakeBackend odd("odd", {BackendFeature::kRealMath});  // KV neither in host nor device pool
  const Status st = CheckRoleCapabilities(odd, "decode", Transport(false));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("backend odd cannot serve role decode: missing capability host_kv_pool"),
            std::string::npos)
      << st.message();
  FakeBackend cpu("cpu", {BackendFeature::kRealMath, BackendFeature::kHostKvPool});
  EXPECT_TRUE(CheckRoleCapabilities(cpu, "prefill", Transport(false)).ok());
  // A host backend behind a device-memory transport would push a pool it never wrote.
  const Status dev = CheckRoleCapabilities(cpu, "prefill", Transport(true));
  EXPECT_EQ(dev.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(dev.message().find("backend cpu cannot serve role prefill: missing capability device_kv_pool"),
            std::string::npos)
      << dev.message();
  EXPECT_EQ(CheckRoleCapabilities(cpu, "router", Transport(false)).code(),
            StatusCode::kInvalidArgument);
}

// A KV notice carries a checksum (8 bytes) and with transport.encrypt a tag
// (16) per pushed block: a context whose longest prompt's notice the
// transport cannot send is refused at start-up, naming the keys.
TEST(KvNoticeFits, TheLongestPromptsNoticeMustFitTheTransport) {
  kvtransfer::Capabilities ucx = Transport(false);
  ucx.max_notification_bytes = kvtransfer::kTransportNoticeBytes;
  // 128k tokens in 16-token blocks: 8,192 blocks (the 64 KiB the backends
  // sent before session 22 was too small for the checksums alone).
  EXPECT_EQ(MaxKvNoticeBytes(131072, 16, true, false), kKvNoticeFixedBytes + 8192 * 8);
  EXPECT_EQ(MaxKvNoticeBytes(131072, 16, true, true), kKvNoticeFixedBytes + 8192 * 24);
  EXPECT_EQ(MaxKvNoticeBytes(131073, 16, false, true), kKvNoticeFixedBytes + 8193 * 16);
  EXPECT_EQ(MaxKvNoticeBytes(131072, 16, false, false), kKvNoticeFixedBytes);
  EXPECT_TRUE(CheckKvNoticeFits("prefill", 131072, 16, true, true, ucx).ok());
  EXPECT_TRUE(CheckKvNoticeFits("decode", 1u << 20, 16, true, true, ucx).ok());  // 1.5 MiB
  kvtransfer::Capabilities small = ucx;
  small.max_notification_bytes = 65536;
  const Status st = CheckKvNoticeFits("prefill", 131072, 16, true, false, small);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  for (const char* part : {"model.max_model_len 131072", "8192 blocks", "cache.block_size 16",
                           "transport.checksum: 8 bytes", "69632 bytes", "65536 bytes"}) {
    EXPECT_NE(st.message().find(part), std::string::npos) << part << ": " << st.message();
  }
  // 1M tokens in blocks of 1 with both fields: 24 MiB, over any backend's.
  const Status huge = CheckKvNoticeFits("decode", 1u << 20, 1, true, true, ucx);
  EXPECT_EQ(huge.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(huge.message().find("transport.encrypt: 16 bytes"), std::string::npos) << huge.message();
  EXPECT_TRUE(CheckKvNoticeFits("decode", 1u << 20, 1, false, false, ucx).ok());
  EXPECT_TRUE(CheckKvNoticeFits("both", 1u << 20, 1, true, true, small).ok());  // no KV leaves
}

}  // namespace
}  // namespace tandem::worker
