#include "kernels/cuda/ops.h"

#include <cstdio>

#include "kernels/cuda/device_util.cuh"

namespace tandem::kernels::cuda {

using detail::LaunchStatus;

const char* DescribeStatus(const KernelStatus& status, char* buf, int buf_size) {
  if (buf == nullptr || buf_size <= 0) return "";
  switch (status.code) {
    case KernelCode::kOk:
      std::snprintf(buf, buf_size, "ok");
      break;
    case KernelCode::kCudaError:
      std::snprintf(buf, buf_size, "%s (cuda: %s)", status.message,
                    cudaGetErrorString(static_cast<cudaError_t>(status.detail)));
      break;
    case KernelCode::kCublasError:
      std::snprintf(buf, buf_size, "%s (cublas status %d)", status.message, status.detail);
      break;
    default:
      std::snprintf(buf, buf_size, "%s", status.message);
  }
  return buf;
}

namespace {

constexpr int kRowThreads = 256;

__global__ void EmbeddingKernel(const bf16* __restrict__ table, const int32_t* __restrict__ ids,
                                bf16* __restrict__ out, int d, int vocab) {
  const int row = blockIdx.x;
  const int id = ids[row];
  bf16* o = out + static_cast<size_t>(row) * d;
  if (id < 0 || id >= vocab) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = __float2bfloat16(0.0f);
    return;
  }
  const bf16* src = table + static_cast<size_t>(id) * d;
  if ((d & 7) == 0) {  // rows are 16-byte aligned: copy 8 elements at a time
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* dst = reinterpret_cast<uint4*>(o);
    for (int j = threadIdx.x; j < d / 8; j += blockDim.x) dst[j] = s[j];
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = src[j];
  }
}

__global__ void AddRmsNormKernel(float* __restrict__ residual, const bf16* __restrict__ x,
                                 const bf16* __restrict__ weight, float eps,
                                 bf16* __restrict__ out, int d) {
  __shared__ float scratch[32];
  const size_t base = static_cast<size_t>(blockIdx.x) * d;
  float* r = residual + base;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float v = r[j];
    if (x != nullptr) {
      v += __bfloat162float(x[base + j]);
      r[j] = v;
    }
    ss = fmaf(v, v, ss);
  }
  ss = detail::BlockSum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(d) + eps);
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    out[base + j] = __float2bfloat16(r[j] * inv * __bfloat162float(weight[j]));
  }
}

__global__ void RopeKernel(bf16* __restrict__ q, bf16* __restrict__ k,
                           const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, int heads, int kv_heads,
                           int head_dim, int q_row_stride, int k_row_stride) {
  const int row = blockIdx.x;
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[row]);
  const int pairs = (heads + kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half;
    const int i = p % half;
    bf16* v = head < heads
                  ? q + static_cast<size_t>(row) * q_row_stride + static_cast<size_t>(head) * head_dim
                  : k + static_cast<size_t>(row) * k_row_stride +
                        static_cast<size_t>(head - heads) * head_dim;
    const float angle = pos * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    const float a = __bfloat162float(v[i]);
    const float b = __bfloat162float(v[i + half]);
    v[i] = __float2bfloat16(a * c - b * s);
    v[i + half] = __float2bfloat16(b * c + a * s);
  }
}

__global__ void SiluMulKernel(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                              bf16* __restrict__ out, int n, int in_row_stride) {
  const size_t in = static_cast<size_t>(blockIdx.y) * in_row_stride;
  const size_t o = static_cast<size_t>(blockIdx.y) * n;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    const float g = __bfloat162float(gate[in + j]);
    const float u = __bfloat162float(up[in + j]);
    out[o + j] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void WriteKvKernel(DeviceKvView view, int layer, const bf16* __restrict__ k,
                              const bf16* __restrict__ v, const int32_t* __restrict__ slots,
                              int row_stride) {
  const int row = blockIdx.x;
  const int slot = slots[row];
  if (slot < 0) return;
  const int block = slot / view.block_size;
  const int offset = slot % view.block_size;
  const int hd = view.head_dim;
  const int n = view.kv_heads * hd;
  const bf16* ks = k + static_cast<size_t>(row) * row_stride;
  const bf16* vs = v + static_cast<size_t>(row) * row_stride;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int h = e / hd;
    const int j = e % hd;
    view.K(block, layer, h, offset)[j] = ks[e];
    view.V(block, layer, h, offset)[j] = vs[e];
  }
}

__global__ void F32ToBf16Kernel(const float* __restrict__ src, bf16* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16(src[i]);
  }
}

__global__ void Bf16ToF32Kernel(const bf16* __restrict__ src, float* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

unsigned GridFor(size_t n, int threads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
}

}  // namespace

KernelStatus EmbeddingGather(const bf16* table, const int32_t* ids, bf16* out, int t, int d,
                             int vocab, cudaStream_t stream) {
  if (t < 0 || d <= 0 || vocab <= 0) return InvalidArgument("EmbeddingGather: t, d, vocab");
  if (t == 0) return KernelStatus::Ok();
  EmbeddingKernel<<<t, kRowThreads, 0, stream>>>(table, ids, out, d, vocab);
  return LaunchStatus("EmbeddingGather launch");
}

KernelStatus AddRmsNorm(float* residual, const bf16* x, const bf16* weight, float eps, bf16* out,
                        int m, int d, cudaStream_t stream) {
  if (m < 0 || d <= 0) return InvalidArgument("AddRmsNorm: m must be >= 0 and d > 0");
  if (m == 0) return KernelStatus::Ok();
  // 1024 threads for wide rows (hidden 4096+), 256 otherwise; fixed per d.
  const int threads = d >= 4096 ? 1024 : kRowThreads;
  AddRmsNormKernel<<<m, threads, 0, stream>>>(residual, x, weight, eps, out, d);
  return LaunchStatus("AddRmsNorm launch");
}

KernelStatus Rope(bf16* q, bf16* k, const int32_t* positions, const float* inv_freq, int t,
                  int heads, int kv_heads, int head_dim, int q_row_stride, int k_row_stride,
                  cudaStream_t stream) {
  if (t < 0 || heads <= 0 || kv_heads < 0 || head_dim <= 0 || head_dim % 2 != 0) {
    return InvalidArgument("Rope: t >= 0, heads > 0, kv_heads >= 0, head_dim even");
  }
  if (q_row_stride < heads * head_dim || (kv_heads > 0 && k_row_stride < kv_heads * head_dim)) {
    return InvalidArgument("Rope: a row stride is smaller than the row");
  }
  if (t == 0) return KernelStatus::Ok();
  RopeKernel<<<t, kRowThreads, 0, stream>>>(q, k, positions, inv_freq, heads, kv_heads, head_dim,
                                             q_row_stride, k_row_stride);
  return LaunchStatus("Rope launch");
}

KernelStatus SiluMul(const bf16* gate, const bf16* up, bf16* out, int m, int n, int in_row_stride,
                     cudaStream_t stream) {
  if (m < 0 || n <= 0 || in_row_stride < n) {
    return InvalidArgument("SiluMul: m >= 0, n > 0, in_row_stride >= n");
  }
  if (m == 0) return KernelStatus::Ok();
  if (m > 65535) return Unsupported("SiluMul: at most 65535 rows per launch");
  const dim3 grid((n + kRowThreads - 1) / kRowThreads < 64 ? (n + kRowThreads - 1) / kRowThreads
                                                            : 64,
                  m);
  SiluMulKernel<<<grid, kRowThreads, 0, stream>>>(gate, up, out, n, in_row_stride);
  return LaunchStatus("SiluMul launch");
}

KernelStatus WriteKv(const DeviceKvView& view, int layer, const bf16* k, const bf16* v,
                     const int32_t* slots, int t, int row_stride, cudaStream_t stream) {
  if (view.pool == nullptr || layer < 0 || layer >= view.num_layers || t < 0 ||
      row_stride < view.kv_heads * view.head_dim || view.block_size <= 0) {
    return InvalidArgument("WriteKv: pool, layer in [0, num_layers), row_stride >= kv_heads * head_dim");
  }
  if (t == 0) return KernelStatus::Ok();
  WriteKvKernel<<<t, 128, 0, stream>>>(view, layer, k, v, slots, row_stride);
  return LaunchStatus("WriteKv launch");
}

KernelStatus F32ToBf16(const float* src, bf16* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return KernelStatus::Ok();
  F32ToBf16Kernel<<<GridFor(n, kRowThreads), kRowThreads, 0, stream>>>(src, dst, n);
  return LaunchStatus("F32ToBf16 launch");
}

KernelStatus Bf16ToF32(const bf16* src, float* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return KernelStatus::Ok();
  Bf16ToF32Kernel<<<GridFor(n, kRowThreads), kRowThreads, 0, stream>>>(src, dst, n);
  return LaunchStatus("Bf16ToF32 launch");
}

KernelStatus CopyBlocks(void* dst, size_t dst_stride_bytes, const void* src,
                        size_t src_stride_bytes, const int32_t* src_ids, const int32_t* dst_ids,
                        int n, size_t block_bytes, cudaStream_t stream) {
  if (n < 0 || block_bytes > dst_stride_bytes || block_bytes > src_stride_bytes) {
    return InvalidArgument("CopyBlocks: n >= 0 and block_bytes <= both strides");
  }
  // Runs of consecutive ids are contiguous on both sides only when each
  // stride equals block_bytes.
  const bool mergeable = dst_stride_bytes == block_bytes && src_stride_bytes == block_bytes;
  int i = 0;
  while (i < n) {
    if (src_ids[i] < 0 || dst_ids[i] < 0) return InvalidArgument("CopyBlocks: negative block id");
    int run = 1;
    while (mergeable && i + run < n && src_ids[i + run] == src_ids[i] + run &&
           dst_ids[i + run] == dst_ids[i] + run) {
      ++run;
    }
    char* d = static_cast<char*>(dst) + static_cast<size_t>(dst_ids[i]) * dst_stride_bytes;
    const char* s =
        static_cast<const char*>(src) + static_cast<size_t>(src_ids[i]) * src_stride_bytes;
    const cudaError_t err =
        cudaMemcpyAsync(d, s, block_bytes * static_cast<size_t>(run), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return FromCuda(err, "CopyBlocks: cudaMemcpyAsync");
    i += run;
  }
  return KernelStatus::Ok();
}

}  // namespace tandem::kernels::cuda
