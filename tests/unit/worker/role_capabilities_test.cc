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

}  // namespace
}  // namespace tandem::worker
