// transport.device_path (issue 16, docs/cuda.md): the choice between the
// direct UCX path and staging, from UCX's reported facts, and the real
// detection on this machine.
#include "kvtransfer/staging/device_path.h"

#include <gtest/gtest.h>

namespace tandem::kvtransfer {
namespace {

UcxCudaSupport Ucx(bool cuda) {
  UcxCudaSupport u;
  u.cuda_memory = cuda;
  u.ucx_version = "1.17.0";
  return u;
}

TEST(DevicePath, AutoIsDirectWhenUcxSupportsCudaAndStagedOtherwise) {
  auto d = ChooseDeviceTransferPath("auto", "ucx", Ucx(true));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->name, "direct");
  EXPECT_NE(d->detail.find("ucp_mem_map"), std::string::npos) << d->detail;
  auto s = ChooseDeviceTransferPath("auto", "ucx", Ucx(false));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->name, "staged");
  EXPECT_NE(s->detail.find("UCX 1.17.0 has no CUDA memory support"), std::string::npos)
      << s->detail;
  auto l = ChooseDeviceTransferPath("auto", "loopback", Ucx(true));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->name, "staged");
}

TEST(DevicePath, StagedIsStagedEvenWhenDirectIsPossible) {
  auto s = ChooseDeviceTransferPath("staged", "ucx", Ucx(true));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->name, "staged");
}

TEST(DevicePath, DirectWithoutTheCapabilityIsRefusedNamingKeyAndCapability) {
  auto ok = ChooseDeviceTransferPath("direct", "ucx", Ucx(true));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->name, "direct");

  auto r = ChooseDeviceTransferPath("direct", "ucx", Ucx(false));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("transport.device_path is direct but UCX 1.17.0 has no "
                                      "CUDA memory support"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("UCS_MEMORY_TYPE_CUDA"), std::string::npos);

  auto l = ChooseDeviceTransferPath("direct", "loopback", Ucx(true));
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("transport.backend is loopback"), std::string::npos)
      << l.status().message();

  UcxCudaSupport broken = Ucx(true);
  broken.error = "ucp_init: No such device";
  auto b = ChooseDeviceTransferPath("direct", "ucx", broken);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("ucp_init: No such device"), std::string::npos);

  auto bad = ChooseDeviceTransferPath("rdma", "ucx", Ucx(true));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

// The real UCX of this machine answers, with its version.
TEST(DevicePath, DetectionAsksThisMachinesUcx) {
  const UcxCudaSupport u = DetectUcxCudaSupport();
  EXPECT_TRUE(u.error.empty()) << u.error;
  EXPECT_FALSE(u.ucx_version.empty());
  auto p = ChooseDeviceTransferPath("auto", "ucx", u);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->name, u.cuda_memory ? "direct" : "staged");
}

}  // namespace
}  // namespace tandem::kvtransfer
