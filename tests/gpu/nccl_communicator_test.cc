// The NCCL communicator (src/parallel/nccl_communicator.h), label gpu.
// Every CUDA call happens in forked children: the parent never initialises
// CUDA (a process that did cannot use it in a child after fork).
//   - RefusesADeviceThatIsNotThere: any machine (0 devices included).
//   - OneRankOnOneDevice: needs 1 device (skipped, saying so, otherwise).
//   - NcclCommunicatorTwoDevices.*: 2 processes on devices 0 and 1; skipped,
//     saying so, with fewer (tests/gpu/device_check.sh runs them only where
//     two devices exist).
#include "parallel/nccl_communicator.h"
#include "gpu_children.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/splitmix.h"

namespace tandem::parallel {
namespace {

std::string UniqueGroup(const std::string& what) { return gputest::UniqueGroup("gputest", what); }

std::vector<int> RunInChildren(int n, const std::function<int(int)>& body) {
  return gputest::RunInChildren(n, body, 120);
}

using gputest::DeviceCountInChild;

std::vector<float> Input(int rank, size_t n) {
  std::vector<float> v(n);
  uint64_t state = 7919ull * static_cast<uint64_t>(rank + 1) + n;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = SplitMix64Next(state);
    v[i] = (static_cast<float>(x & 0xffffff) / float(1 << 24) - 0.5f) *
           std::pow(10.0f, static_cast<float>(static_cast<int>((x >> 24) % 7) - 3));
  }
  return v;
}

// Device buffer for a test; freed at scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes == 0 ? 1 : bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  float* f() const { return static_cast<float*>(ptr); }
  std::byte* b() const { return static_cast<std::byte*>(ptr); }
};

#define CHILD_CHECK(cond, ...)      \
  do {                              \
    if (!(cond)) {                  \
      std::fprintf(stderr, __VA_ARGS__); \
      std::fprintf(stderr, "\n");   \
      return 10 + __LINE__ % 100;   \
    }                               \
  } while (0)

TEST(NcclCommunicator, RefusesADeviceThatIsNotThere) {
  const std::string group = UniqueGroup("nodevice");
  const auto codes = RunInChildren(1, [&](int) {
    const int devices = NcclDeviceCount();
    auto comm = CreateNcclCommunicator(group, 0, 1, devices, 10000);  // one past the last
    CHILD_CHECK(!comm.ok(), "device %d of %d was accepted", devices, devices);
    CHILD_CHECK(comm.status().code() == StatusCode::kUnavailable, "%s",
                comm.status().ToString().c_str());
    const std::string want = "needs CUDA device " + std::to_string(devices) +
                             ", this host has " + std::to_string(devices);
    CHILD_CHECK(comm.status().message().find(want) != std::string::npos, "%s",
                comm.status().ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
}

TEST(NcclCommunicator, OneRankOnOneDevice) {
  std::string why;
  const int devices = DeviceCountInChild(&why);
  if (devices < 1) GTEST_SKIP() << "needs 1 CUDA device, found 0: " << why;
  const std::string group = UniqueGroup("one");
  const auto codes = RunInChildren(1, [&](int) {
    auto comm = CreateNcclCommunicator(group, 0, 1, 0, 60000);
    CHILD_CHECK(comm.ok(), "%s", comm.status().ToString().c_str());
    CHILD_CHECK((*comm)->kind() == "nccl", "kind");
    const size_t n = 4099;
    const std::vector<float> in = Input(0, n);
    DeviceBuffer d(n * sizeof(float)), g(n * sizeof(float));
    CHILD_CHECK(d.ptr && g.ptr, "cudaMalloc");
    CHILD_CHECK(cudaMemcpy(d.ptr, in.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess, "h2d");
    Status s = (*comm)->AllReduceSum({d.f(), n});
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = (*comm)->AllGather({d.f(), n}, {g.f(), n});
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = (*comm)->Broadcast({d.b(), n * 4}, 0);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = (*comm)->Barrier();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    std::vector<float> out(n), gathered(n);
    CHILD_CHECK(cudaMemcpy(out.data(), d.ptr, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess, "d2h");
    CHILD_CHECK(cudaMemcpy(gathered.data(), g.ptr, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                "d2h");
    CHILD_CHECK(std::memcmp(out.data(), in.data(), n * 4) == 0, "one rank's sum is its input");
    CHILD_CHECK(std::memcmp(gathered.data(), in.data(), n * 4) == 0, "one rank's gather");
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
}

TEST(NcclCommunicatorTwoDevices, AllReduceAllGatherBroadcastSendRecvAcrossTwoProcesses) {
  std::string why;
  const int devices = DeviceCountInChild(&why);
  if (devices < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, found " << devices << (why.empty() ? "" : ": ")
                 << why;
  }
  const std::string group = UniqueGroup("two");
  const auto codes = RunInChildren(2, [&](int r) {
    auto comm = CreateNcclCommunicator(group, r, 2, r, 60000);
    CHILD_CHECK(comm.ok(), "rank %d: %s", r, comm.status().ToString().c_str());
    Communicator& c = **comm;
    for (size_t n : {size_t{1}, size_t{1000}, size_t{1} << 20}) {
      // AllReduceSum: with two ranks the sum is one rounded addition, so
      // NCCL's bits must equal r0 + r1 whatever its algorithm.
      const std::vector<float> in = Input(r, n);
      const std::vector<float> a = Input(0, n), b = Input(1, n);
      DeviceBuffer d(n * 4), g(2 * n * 4);
      CHILD_CHECK(d.ptr && g.ptr, "cudaMalloc");
      CHILD_CHECK(cudaMemcpy(d.ptr, in.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess,
                  "h2d");
      Status s = c.AllReduceSum({d.f(), n});
      CHILD_CHECK(s.ok(), "rank %d AllReduceSum(%zu): %s", r, n, s.ToString().c_str());
      std::vector<float> out(n);
      CHILD_CHECK(cudaMemcpy(out.data(), d.ptr, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                  "d2h");
      for (size_t i = 0; i < n; ++i) {
        const float want = a[i] + b[i];
        CHILD_CHECK(std::memcmp(&out[i], &want, 4) == 0, "rank %d AllReduceSum(%zu)[%zu]: %g != %g",
                    r, n, i, out[i], want);
      }
      // AllGather of each rank's input.
      CHILD_CHECK(cudaMemcpy(d.ptr, in.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess,
                  "h2d");
      s = c.AllGather({d.f(), n}, {g.f(), 2 * n});
      CHILD_CHECK(s.ok(), "rank %d AllGather(%zu): %s", r, n, s.ToString().c_str());
      std::vector<float> all(2 * n);
      CHILD_CHECK(cudaMemcpy(all.data(), g.ptr, 2 * n * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                  "d2h");
      CHILD_CHECK(std::memcmp(all.data(), a.data(), n * 4) == 0, "rank %d AllGather part 0", r);
      CHILD_CHECK(std::memcmp(all.data() + n, b.data(), n * 4) == 0, "rank %d AllGather part 1", r);
      // Broadcast rank 1's input; then rank 0 sends its input to rank 1.
      s = c.Broadcast({d.b(), n * 4}, 1);
      CHILD_CHECK(s.ok(), "rank %d Broadcast(%zu): %s", r, n, s.ToString().c_str());
      CHILD_CHECK(cudaMemcpy(out.data(), d.ptr, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                  "d2h");
      CHILD_CHECK(std::memcmp(out.data(), b.data(), n * 4) == 0, "rank %d Broadcast", r);
      if (r == 0) {
        CHILD_CHECK(cudaMemcpy(d.ptr, a.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess,
                    "h2d");
        s = c.Send({d.b(), n * 4}, 1);
      } else {
        s = c.Recv({d.b(), n * 4}, 0);
      }
      CHILD_CHECK(s.ok(), "rank %d Send/Recv(%zu): %s", r, n, s.ToString().c_str());
      if (r == 1) {
        CHILD_CHECK(cudaMemcpy(out.data(), d.ptr, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                    "d2h");
        CHILD_CHECK(std::memcmp(out.data(), a.data(), n * 4) == 0, "rank 1 Recv");
      }
      s = c.Barrier();
      CHILD_CHECK(s.ok(), "rank %d Barrier: %s", r, s.ToString().c_str());
    }
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

}  // namespace
}  // namespace tandem::parallel
