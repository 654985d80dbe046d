// A cuda worker's KV transport with transport.device_path direct on this
// machine's real UCX (issue 16): where UCX has no CUDA memory support the
// worker is refused before any CUDA call, naming the key and the missing
// capability (the `tandem launch` refusal runs in tests/integration/cli_test.cc).
#include "worker/kv_transport_setup.h"

#include <gtest/gtest.h>

#include "kvtransfer/staging/device_path.h"

namespace tandem::worker {
namespace {

kvtransfer::TransportOptions Options(const std::string& backend) {
  kvtransfer::TransportOptions o;
  o.backend = backend;
  o.agent_name = "decode-0";
  o.block_bytes = 4096;
  o.num_blocks = 8;
  return o;
}

TEST(WorkerKvTransport, DirectDevicePathOnAUcxWithoutCudaIsRefusedNamingTheKey) {
  if (kvtransfer::DetectUcxCudaSupport().cuda_memory) {
    GTEST_SKIP() << "this machine's UCX supports CUDA memory: direct is possible here";
  }
  auto w = CreateWorkerTransport("cuda", Options("ucx"), 2048, "direct");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(w.status().message().find("transport.device_path is direct but UCX "),
            std::string::npos)
      << w.status().message();
  EXPECT_NE(w.status().message().find("no CUDA memory support"), std::string::npos)
      << w.status().message();
}

TEST(WorkerKvTransport, DirectDevicePathWithLoopbackIsRefused) {
  auto w = CreateWorkerTransport("cuda", Options("loopback"), 2048, "direct");
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("transport.backend is loopback"), std::string::npos)
      << w.status().message();
}

TEST(WorkerKvTransport, HostBackendsIgnoreTheDevicePath) {
  auto w = CreateWorkerTransport("cpu", Options("loopback"), 2048, "auto");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->path, "host");
  EXPECT_FALSE(w->transport->capabilities().device_memory);
  EXPECT_EQ(w->device_kv_pool, nullptr);
}

}  // namespace
}  // namespace tandem::worker
