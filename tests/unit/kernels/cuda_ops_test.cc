// CUDA row-wise kernels and copies against kernels/reference on the same
// bf16-representable inputs: embedding gather (bit-exact), add + RMSNorm,
// RoPE, SwiGLU (bf16 output: normalized error <= 1e-2 with floor 1e-2, i.e.
// about 2.5 bf16 ulps), KV writes into the block-major cache (bit-exact,
// other slots untouched), f32<->bf16 and block copies device <-> pinned host
// (bit-exact). Outputs start as NaN and sit between guard regions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/cuda_test_util.h"

namespace tandem::kernels::cuda {
namespace {

using kernels::testing::Random;
using testing::DeviceBuffer;
using testing::ExpectClose;
using testing::FromBf16;
using testing::ToBf16;

constexpr double kBf16Tol = 1e-2, kBf16Floor = 1e-2;

TEST(CudaOps, EmbeddingGatherIsExactAndZeroesBadIds) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int d : {64, 100, 4096}) {
    const int vocab = 1000, t = 37;
    std::vector<float> table = Random(static_cast<size_t>(vocab) * d, 1);
    const std::vector<uint16_t> table_b = ToBf16(table);
    std::vector<int32_t> ids(t);
    std::mt19937 rng(2);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
    ids[3] = -1;
    ids[5] = vocab;  // out of range: a zero row
    DeviceBuffer<uint16_t> dt(table_b.size()), dout(static_cast<size_t>(t) * d);
    DeviceBuffer<int32_t> did(t);
    dt.Upload(table_b);
    did.Upload(ids);
    ASSERT_KERNEL_OK(EmbeddingGather(reinterpret_cast<bf16*>(dt.get()), did.get(),
                                     reinterpret_cast<bf16*>(dout.get()), t, d, vocab, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = dout.Download();
    for (int i = 0; i < t; ++i) {
      for (int j = 0; j < d; ++j) {
        const uint16_t want = (ids[i] < 0 || ids[i] >= vocab)
                                  ? uint16_t{0}
                                  : table_b[static_cast<size_t>(ids[i]) * d + j];
        ASSERT_EQ(got[static_cast<size_t>(i) * d + j], want) << "d " << d << " row " << i;
      }
    }
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

TEST(CudaOps, AddRmsNormMatchesReference) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int d : {64, 256, 4096, 5120}) {
    for (int m : {1, 7, 64}) {
      std::vector<float> residual = Random(static_cast<size_t>(m) * d, 3, -2.0f, 2.0f);
      std::vector<float> x = Random(residual.size(), 4);
      std::vector<float> w = Random(d, 5, 0.5f, 1.5f);
      const auto xb = ToBf16(x);
      const auto wb = ToBf16(w);
      std::vector<float> ref_res = residual, ref_out(residual.size());
      ref::AddRmsNorm(ref_res.data(), x.data(), w.data(), 1e-5f, ref_out.data(), m, d);
      DeviceBuffer<float> dres(residual.size());
      DeviceBuffer<uint16_t> dx(xb.size()), dw(wb.size()), dout(residual.size());
      dres.Upload(residual);
      dx.Upload(xb);
      dw.Upload(wb);
      ASSERT_KERNEL_OK(AddRmsNorm(dres.get(), reinterpret_cast<bf16*>(dx.get()),
                                  reinterpret_cast<bf16*>(dw.get()), 1e-5f,
                                  reinterpret_cast<bf16*>(dout.get()), m, d, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      const std::string what = "d " + std::to_string(d) + " m " + std::to_string(m);
      EXPECT_EQ(dres.Download(), ref_res) << what << ": residual += x is one f32 add";
      ExpectClose(dout.Download(), ref_out, kBf16Tol, kBf16Floor, what);
      EXPECT_TRUE(dres.GuardsIntact() && dout.GuardsIntact()) << what;

      // Without x: plain RmsNorm of residual, which stays unchanged.
      std::vector<float> ref_plain(residual.size());
      ref::RmsNorm(ref_res.data(), w.data(), 1e-5f, ref_plain.data(), m, d);
      ASSERT_KERNEL_OK(AddRmsNorm(dres.get(), nullptr, reinterpret_cast<bf16*>(dw.get()), 1e-5f,
                                  reinterpret_cast<bf16*>(dout.get()), m, d, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(dres.Download(), ref_res) << what;
      ExpectClose(dout.Download(), ref_plain, kBf16Tol, kBf16Floor, what + " (no add)");
    }
  }
}

TEST(CudaOps, AddRmsNormRowBitsDoNotDependOnTheBatch) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  const int d = 4096, m = 64;
  std::vector<float> residual = Random(static_cast<size_t>(m) * d, 6);
  std::vector<float> x = Random(residual.size(), 7), w = Random(d, 8);
  const auto xb = ToBf16(x);
  const auto wb = ToBf16(w);
  DeviceBuffer<float> dres(residual.size());
  DeviceBuffer<uint16_t> dx(xb.size()), dw(wb.size()), dout(residual.size());
  dres.Upload(residual);
  dx.Upload(xb);
  dw.Upload(wb);
  ASSERT_KERNEL_OK(AddRmsNorm(dres.get(), reinterpret_cast<bf16*>(dx.get()),
                              reinterpret_cast<bf16*>(dw.get()), 1e-6f,
                              reinterpret_cast<bf16*>(dout.get()), m, d, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto batch = dout.Download();
  // Row 37 alone.
  DeviceBuffer<float> r1(d);
  DeviceBuffer<uint16_t> x1(d), o1(d);
  r1.Upload(std::vector<float>(residual.begin() + 37 * d, residual.begin() + 38 * d));
  x1.Upload(std::vector<uint16_t>(xb.begin() + 37 * d, xb.begin() + 38 * d));
  ASSERT_KERNEL_OK(AddRmsNorm(r1.get(), reinterpret_cast<bf16*>(x1.get()),
                              reinterpret_cast<bf16*>(dw.get()), 1e-6f,
                              reinterpret_cast<bf16*>(o1.get()), 1, d, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(o1.Download(), std::vector<uint16_t>(batch.begin() + 37 * d, batch.begin() + 38 * d));
}

TEST(CudaOps, RopeMatchesReferenceOnStridedRows) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int hd : {64, 128}) {
    for (int group : {1, 4, 8}) {
      const int kv_heads = 2, heads = kv_heads * group, t = 33;
      const int stride = (heads + 2 * kv_heads) * hd;  // one fused QKV row
      std::vector<float> qkv = Random(static_cast<size_t>(t) * stride, 9);
      const auto qkv_b = ToBf16(qkv);
      std::vector<int32_t> pos(t);
      for (int i = 0; i < t; ++i) pos[i] = i * 251;  // up to 8032
      std::vector<float> inv_freq(hd / 2);
      ref::RopeInvFreq(inv_freq.data(), hd, 500000.0);
      // Reference on packed copies of q and k.
      std::vector<float> q(static_cast<size_t>(t) * heads * hd), k(static_cast<size_t>(t) * kv_heads * hd);
      for (int i = 0; i < t; ++i) {
        std::copy_n(qkv.begin() + static_cast<size_t>(i) * stride, heads * hd, q.begin() + static_cast<size_t>(i) * heads * hd);
        std::copy_n(qkv.begin() + static_cast<size_t>(i) * stride + heads * hd, kv_heads * hd,
                    k.begin() + static_cast<size_t>(i) * kv_heads * hd);
      }
      ref::Rope(q.data(), k.data(), pos.data(), inv_freq.data(), t, heads, kv_heads, hd);
      std::vector<float> want = qkv;
      for (int i = 0; i < t; ++i) {
        std::copy_n(q.begin() + static_cast<size_t>(i) * heads * hd, heads * hd, want.begin() + static_cast<size_t>(i) * stride);
        std::copy_n(k.begin() + static_cast<size_t>(i) * kv_heads * hd, kv_heads * hd,
                    want.begin() + static_cast<size_t>(i) * stride + heads * hd);
      }
      DeviceBuffer<uint16_t> dqkv(qkv_b.size());
      DeviceBuffer<int32_t> dpos(t);
      DeviceBuffer<float> dfreq(inv_freq.size());
      dqkv.Upload(qkv_b);
      dpos.Upload(pos);
      dfreq.Upload(inv_freq);
      bf16* base = reinterpret_cast<bf16*>(dqkv.get());
      ASSERT_KERNEL_OK(Rope(base, base + heads * hd, dpos.get(), dfreq.get(), t, heads, kv_heads,
                            hd, stride, stride, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      // V (the last kv_heads * hd of each row) must come back untouched.
      ExpectClose(dqkv.Download(), want, kBf16Tol, kBf16Floor,
                  "hd " + std::to_string(hd) + " group " + std::to_string(group));
      EXPECT_TRUE(dqkv.GuardsIntact());
    }
  }
}

TEST(CudaOps, SiluMulMatchesReferenceOnFusedGateUp) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int n : {688, 14336}) {
    for (int m : {1, 64}) {
      std::vector<float> gate_up = Random(static_cast<size_t>(m) * 2 * n, 10, -6.0f, 6.0f);
      const auto gub = ToBf16(gate_up);
      std::vector<float> gate(static_cast<size_t>(m) * n), up(gate.size()), want(gate.size());
      for (int i = 0; i < m; ++i) {
        std::copy_n(gate_up.begin() + static_cast<size_t>(i) * 2 * n, n, gate.begin() + static_cast<size_t>(i) * n);
        std::copy_n(gate_up.begin() + static_cast<size_t>(i) * 2 * n + n, n, up.begin() + static_cast<size_t>(i) * n);
      }
      ref::SiluMul(gate.data(), up.data(), want.data(), m, n);
      DeviceBuffer<uint16_t> din(gub.size()), dout(want.size());
      din.Upload(gub);
      bf16* in = reinterpret_cast<bf16*>(din.get());
      ASSERT_KERNEL_OK(SiluMul(in, in + n, reinterpret_cast<bf16*>(dout.get()), m, n, 2 * n, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      ExpectClose(dout.Download(), want, kBf16Tol, kBf16Floor,
                  "n " + std::to_string(n) + " m " + std::to_string(m));
      EXPECT_TRUE(dout.GuardsIntact());
    }
  }
}

TEST(CudaOps, WriteKvMatchesReferenceLayout) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int hd : {64, 128}) {
    for (int bs : {16, 32}) {
      const int layers = 3, kv_heads = 4, blocks = 9, t = 50, layer = 1;
      const size_t block_elems = KvBlockFloats(layers, kv_heads, hd, bs);
      std::vector<float> pool(block_elems * blocks, 0.25f);
      KvCacheView view{pool.data(), block_elems, layers, kv_heads, hd, bs};
      std::vector<float> k = Random(static_cast<size_t>(t) * kv_heads * hd, 11);
      std::vector<float> v = Random(k.size(), 12);
      const auto kb = ToBf16(k);
      const auto vb = ToBf16(v);
      std::vector<int32_t> slots(t);
      std::vector<int32_t> perm(blocks * bs);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), std::mt19937(13));
      std::copy_n(perm.begin(), t, slots.begin());
      ref::WriteKv(view, layer, k.data(), v.data(), slots.data(), t);
      slots[7] = -1;  // a padding row: skipped
      std::vector<float> want = pool;
      {
        std::vector<float> again(block_elems * blocks, 0.25f);
        KvCacheView v2{again.data(), block_elems, layers, kv_heads, hd, bs};
        ref::WriteKv(v2, layer, k.data(), v.data(), slots.data(), 7);
        ref::WriteKv(v2, layer, k.data() + 8 * kv_heads * hd, v.data() + 8 * kv_heads * hd,
                     slots.data() + 8, t - 8);
        want = again;
      }
      std::vector<float> init(block_elems * blocks, 0.25f);
      DeviceBuffer<uint16_t> dpool(init.size()), dk(kb.size()), dv(vb.size());
      DeviceBuffer<int32_t> dslots(t);
      dpool.Upload(ToBf16(init));
      dk.Upload(kb);
      dv.Upload(vb);
      dslots.Upload(slots);
      DeviceKvView dview{reinterpret_cast<bf16*>(dpool.get()), block_elems, layers, kv_heads, hd, bs};
      ASSERT_KERNEL_OK(WriteKv(dview, layer, reinterpret_cast<bf16*>(dk.get()),
                               reinterpret_cast<bf16*>(dv.get()), dslots.get(), t, kv_heads * hd,
                               nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(FromBf16(dpool.Download()), want) << "hd " << hd << " bs " << bs;
      EXPECT_TRUE(dpool.GuardsIntact());
    }
  }
}

TEST(CudaOps, ConversionsAndBlockCopiesThroughPinnedHost) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  const size_t block_bytes = 4096 + 64, stride = 8192;
  const int blocks = 16;
  std::vector<float> src = Random(stride * blocks / 4, 14);
  DeviceBuffer<float> dsrc(src.size());
  dsrc.Upload(src);
  void* host = nullptr;
  ASSERT_CUDA_OK(cudaHostAlloc(&host, stride * blocks, cudaHostAllocDefault));
  std::memset(host, 0x5A, stride * blocks);
  const std::vector<int32_t> src_ids = {3, 4, 5, 9, 0, 15};
  const std::vector<int32_t> dst_ids = {10, 11, 12, 1, 2, 7};
  ASSERT_KERNEL_OK(CopyBlocks(host, stride, dsrc.get(), stride, src_ids.data(), dst_ids.data(),
                              static_cast<int>(src_ids.size()), block_bytes, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto* h = static_cast<const unsigned char*>(host);
  const auto* s = reinterpret_cast<const unsigned char*>(src.data());
  for (size_t i = 0; i < src_ids.size(); ++i) {
    EXPECT_EQ(std::memcmp(h + dst_ids[i] * stride, s + src_ids[i] * stride, block_bytes), 0) << i;
    EXPECT_EQ(h[dst_ids[i] * stride + block_bytes], 0x5A) << "copied past block_bytes";
  }
  EXPECT_EQ(h[6 * stride], 0x5A) << "a block not named was written";
  // And back into a fresh device pool.
  DeviceBuffer<float> dback(src.size());
  ASSERT_KERNEL_OK(CopyBlocks(dback.get(), stride, host, stride, dst_ids.data(), src_ids.data(),
                              static_cast<int>(src_ids.size()), block_bytes, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto back = dback.Download();
  const auto* b = reinterpret_cast<const unsigned char*>(back.data());
  for (size_t i = 0; i < src_ids.size(); ++i) {
    EXPECT_EQ(std::memcmp(b + src_ids[i] * stride, s + src_ids[i] * stride, block_bytes), 0) << i;
  }
  EXPECT_TRUE(dback.GuardsIntact());
  ASSERT_CUDA_OK(cudaFreeHost(host));

  // f32 -> bf16 -> f32 equals host rounding.
  std::vector<float> vals = Random(10001, 15, -1e4f, 1e4f);
  DeviceBuffer<float> df(vals.size()), dr(vals.size());
  DeviceBuffer<uint16_t> db(vals.size());
  df.Upload(vals);
  ASSERT_KERNEL_OK(F32ToBf16(df.get(), reinterpret_cast<bf16*>(db.get()), vals.size(), nullptr));
  ASSERT_KERNEL_OK(Bf16ToF32(reinterpret_cast<bf16*>(db.get()), dr.get(), vals.size(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> want = vals;
  ToBf16(want);
  EXPECT_EQ(dr.Download(), want);
}

TEST(CudaOps, LaunchersRefuseBadShapesWithoutLaunching) {
  // Host-side checks: no device needed.
  EXPECT_EQ(SiluMul(nullptr, nullptr, nullptr, 1, 8, 4, nullptr).code, KernelCode::kInvalidArgument);
  EXPECT_EQ(Rope(nullptr, nullptr, nullptr, nullptr, 1, 2, 1, 7, 14, 7, nullptr).code,
            KernelCode::kInvalidArgument);
  DeviceKvView view;
  EXPECT_EQ(WriteKv(view, 0, nullptr, nullptr, nullptr, 1, 0, nullptr).code,
            KernelCode::kInvalidArgument);
  const int32_t ids[1] = {-1};
  EXPECT_EQ(CopyBlocks(nullptr, 16, nullptr, 16, ids, ids, 1, 16, nullptr).code,
            KernelCode::kInvalidArgument);
  EXPECT_EQ(CopyBlocks(nullptr, 16, nullptr, 16, ids, ids, 1, 32, nullptr).code,
            KernelCode::kInvalidArgument);
  EXPECT_TRUE(EmbeddingGather(nullptr, nullptr, nullptr, 0, 8, 8, nullptr).ok());
}

}  // namespace
}  // namespace tandem::kernels::cuda
