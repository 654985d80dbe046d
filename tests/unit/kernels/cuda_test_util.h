// Helpers for the CUDA kernel tests (label gpu): skipping without a device,
// device buffers with guard regions and NaN-prefilled contents, and host
// bf16 conversion. Each test compares a kernel with its kernels/reference
// counterpart run on the same bf16-representable inputs.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/common.h"
#include "kernels/cuda/device.h"
#include "tests/unit/kernels/test_util.h"

namespace tandem::kernels::cuda::testing {

// Skips the test, saying why, when no CUDA device is usable.
#define TANDEM_REQUIRE_CUDA_DEVICE()                                                          \
  do {                                                                                        \
    char why_[256] = "";                                                                      \
    if (::tandem::kernels::cuda::DeviceCount(why_, sizeof(why_)) == 0) {                      \
      GTEST_SKIP() << "no CUDA device (" << why_ << "): GPU test not run";                    \
    }                                                                                         \
  } while (0)

#define ASSERT_CUDA_OK(expr)                                                                  \
  do {                                                                                        \
    const cudaError_t e_ = (expr);                                                            \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);                    \
  } while (0)

#define ASSERT_KERNEL_OK(expr)                                                                \
  do {                                                                                        \
    const ::tandem::kernels::cuda::KernelStatus s_ = (expr);                                  \
    char buf_[512];                                                                           \
    ASSERT_TRUE(s_.ok()) << #expr << ": "                                                     \
                         << ::tandem::kernels::cuda::DescribeStatus(s_, buf_, sizeof(buf_));  \
  } while (0)

// bf16 <-> f32 on the host, round to nearest even (as __float2bfloat16).
inline uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float RoundBf16(float f) { return Bf16ToFloat(Bf16Bits(f)); }
// Rounds every element to bf16 in place; returns the bf16 bits.
inline std::vector<uint16_t> ToBf16(std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = Bf16Bits(v[i]);
    v[i] = Bf16ToFloat(out[i]);
  }
  return out;
}
inline std::vector<float> FromBf16(const std::vector<uint16_t>& b) {
  std::vector<float> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = Bf16ToFloat(b[i]);
  return out;
}

// Device memory of n elements of T between two guard regions of kGuardBytes
// filled with 0xA5; the elements start as all-ones bytes (NaN as bf16 or
// f32) so that anything a kernel fails to write shows up as NaN.
template <typename T>
class DeviceBuffer {
 public:
  static constexpr size_t kGuardBytes = 256;
  explicit DeviceBuffer(size_t n) : n_(n) {
    total_ = n_ * sizeof(T) + 2 * kGuardBytes;
    if (cudaMalloc(&raw_, total_) != cudaSuccess) {
      raw_ = nullptr;
      return;
    }
    std::vector<unsigned char> init(total_, 0xFF);
    std::memset(init.data(), 0xA5, kGuardBytes);
    std::memset(init.data() + kGuardBytes + n_ * sizeof(T), 0xA5, kGuardBytes);
    cudaMemcpy(raw_, init.data(), total_, cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() {
    if (raw_) cudaFree(raw_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool ok() const { return raw_ != nullptr; }
  T* get() { return reinterpret_cast<T*>(static_cast<unsigned char*>(raw_) + kGuardBytes); }
  size_t size() const { return n_; }
  void Upload(const std::vector<T>& v) {
    cudaMemcpy(get(), v.data(), std::min(v.size(), n_) * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() {
    std::vector<T> v(n_);
    cudaMemcpy(v.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  bool GuardsIntact() {
    std::vector<unsigned char> all(total_);
    cudaMemcpy(all.data(), raw_, total_, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (all[i] != 0xA5 || all[kGuardBytes + n_ * sizeof(T) + i] != 0xA5) return false;
    }
    return true;
  }

 private:
  size_t n_;
  size_t total_ = 0;
  void* raw_ = nullptr;
};

// Compare (test_util.h) of bf16 results against an f32 reference; zero
// mismatches beyond `tol` and no NaN allowed.
inline void ExpectClose(const std::vector<uint16_t>& got_bf16, const std::vector<float>& want,
                        double tol, double floor, const std::string& what) {
  const std::vector<float> got = FromBf16(got_bf16);
  ASSERT_EQ(got.size(), want.size()) << what;
  const auto s = kernels::testing::Compare(got.data(), want.data(), got.size(), tol, floor);
  EXPECT_EQ(s.nans, 0u) << what << ": " << s.first;
  EXPECT_EQ(s.mismatches, 0u) << what << ": max normalized error " << s.max_err << ", "
                              << s.first;
}

}  // namespace tandem::kernels::cuda::testing
