// Paged prefill attention, flash-style: one CTA (4 warps) per (64 query
// rows of one sequence, query head). Keys are visited in tiles of 64 from the
// paged cache; S = Q K^T and O += P V run on bf16 tensor cores (WMMA, f32
// accumulation); the online softmax keeps a running max and sum per row.
// Warp w owns query rows [16w, 16w + 16) of the tile from S to O, so only the
// K/V tile loads need the whole CTA to synchronize. O lives in shared memory
// (f32) because WMMA's accumulator layout is opaque and each row needs
// rescaling by its softmax correction.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/device_util.cuh"

namespace tandem::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;
constexpr int kBlockM = 64;  // query rows per CTA
constexpr int kBlockN = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory layout (element strides padded against bank conflicts; every
// WMMA pointer stays 32-byte aligned).
template <int HD>
struct Smem {
  static constexpr int kQkLd = HD + 8;      // bf16 rows of Q, K, V
  static constexpr int kSLd = kBlockN + 4;  // f32 scores
  static constexpr int kPLd = kBlockN + 8;  // bf16 probabilities
  static constexpr int kOLd = HD + 4;       // f32 output accumulator
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(bf16) * kBlockM * kQkLd;
  static constexpr size_t kV = kK + sizeof(bf16) * kBlockN * kQkLd;
  static constexpr size_t kS = kV + sizeof(bf16) * kBlockN * kQkLd;
  static constexpr size_t kP = kS + sizeof(float) * kBlockM * kSLd;
  static constexpr size_t kO = kP + sizeof(bf16) * kBlockM * kPLd;
  static constexpr size_t kBytes = kO + sizeof(float) * kBlockM * kOLd;
  static_assert(kK % 32 == 0 && kV % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0);
};

// Loads `rows` rows of HD bf16 (16 bytes per thread step) into dst; rows past
// `valid` are zero so that no garbage (possibly NaN) reaches the MMAs.
template <int HD, typename RowPtr>
__device__ __forceinline__ void LoadTile(bf16* dst, int ld, int valid, RowPtr row_ptr) {
  constexpr int kChunks = HD / 8;
  for (int c = threadIdx.x; c < kBlockN * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid) v = *reinterpret_cast<const uint4*>(row_ptr(r) + col);
    *reinterpret_cast<uint4*>(dst + r * ld + col) = v;
  }
}

template <int HD>
__global__ void __launch_bounds__(kThreads)
    PrefillKernel(DeviceKvView view, int layer, const bf16* __restrict__ q, bf16* __restrict__ out,
                  const int32_t* __restrict__ block_tables, const int32_t* __restrict__ q_starts,
                  const int32_t* __restrict__ cu_q_lens, int heads, int group, int q_row_stride,
                  int max_blocks_per_seq, float scale_log2) {
  using L = Smem<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* ks = reinterpret_cast<bf16*>(smem + L::kK);
  bf16* vs = reinterpret_cast<bf16*>(smem + L::kV);
  float* ss = reinterpret_cast<float*>(smem + L::kS);
  bf16* ps = reinterpret_cast<bf16*>(smem + L::kP);
  float* os = reinterpret_cast<float*>(smem + L::kO);

  const int seq = blockIdx.z;
  const int head = blockIdx.y;
  const int kvh = head / group;
  const int q_begin = cu_q_lens[seq];
  const int q_len = cu_q_lens[seq + 1] - q_begin;
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= q_len) return;
  const int rows = min(kBlockM, q_len - m0);
  const int pos0 = q_starts[seq] + m0;  // position of the tile's row 0
  const int kv_end = pos0 + rows;       // keys [0, kv_end) are visible to some row
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks_per_seq;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  LoadTile<HD>(qs, L::kQkLd, rows, [&](int r) {
    return q + static_cast<size_t>(q_begin + m0 + r) * q_row_stride + static_cast<size_t>(head) * HD;
  });
  for (int e = threadIdx.x; e < kBlockM * L::kOLd; e += kThreads) os[e] = 0.0f;

  // Row r = 16 * warp + lane / 2 is owned by two lanes; each takes 32 of the
  // tile's 64 columns and HD / 2 of the output columns.
  const int my_row = 16 * warp + (lane >> 1);
  const int half = lane & 1;
  const int my_pos = pos0 + my_row;
  float run_m = -INFINITY;
  float run_l = 0.0f;

  for (int n0 = 0; n0 < kv_end; n0 += kBlockN) {
    const int valid = min(kBlockN, kv_end - n0);
    __syncthreads();  // the previous tile's K/V are no longer read
    LoadTile<HD>(ks, L::kQkLd, valid, [&](int r) {
      const int j = n0 + r;
      return view.K(table[j / view.block_size], layer, kvh, j % view.block_size);
    });
    LoadTile<HD>(vs, L::kQkLd, valid, [&](int r) {
      const int j = n0 + r;
      return view.V(table[j / view.block_size], layer, kvh, j % view.block_size);
    });
    __syncthreads();

    // S[16w.., :] = Q K^T for this warp's 16 rows.
#pragma unroll
    for (int jn = 0; jn < kBlockN / 16; ++jn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag;
      wmma::fill_fragment(s_frag, 0.0f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
        wmma::load_matrix_sync(a, qs + 16 * warp * L::kQkLd + 16 * kk, L::kQkLd);
        wmma::load_matrix_sync(b, ks + 16 * jn * L::kQkLd + 16 * kk, L::kQkLd);
        wmma::mma_sync(s_frag, a, b, s_frag);
      }
      wmma::store_matrix_sync(ss + 16 * warp * L::kSLd + 16 * jn, s_frag, L::kSLd,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of my row's 32 columns, combined with the partner lane.
    float* srow = ss + my_row * L::kSLd + 32 * half;
    float tile_max = -INFINITY;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const int j = n0 + 32 * half + c;
      const float s = (j <= my_pos && j < kv_end) ? srow[c] * scale_log2 : -INFINITY;
      srow[c] = s;
      tile_max = fmaxf(tile_max, s);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(detail::kFullMask, tile_max, 1));
    const float m_new = fmaxf(run_m, tile_max);
    // A row can see no key of a tile (its keys all lie in earlier tiles).
    const float alpha = m_new == -INFINITY ? 1.0f : exp2f(run_m - m_new);
    bf16* prow = ps + my_row * L::kPLd + 32 * half;
    float sum = 0.0f;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float p = m_new == -INFINITY ? 0.0f : exp2f(srow[c] - m_new);
      const bf16 pb = __float2bfloat16(p);
      prow[c] = pb;
      sum += __bfloat162float(pb);  // the sum of what P . V actually weights
    }
    sum += __shfl_xor_sync(detail::kFullMask, sum, 1);
    run_l = run_l * alpha + sum;
    run_m = m_new;
    float* orow = os + my_row * L::kOLd + (HD / 2) * half;
#pragma unroll 8
    for (int c = 0; c < HD / 2; ++c) orow[c] *= alpha;
    __syncwarp();

    // O[16w.., :] += P V.
#pragma unroll
    for (int dn = 0; dn < HD / 16; ++dn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_frag;
      float* optr = os + 16 * warp * L::kOLd + 16 * dn;
      wmma::load_matrix_sync(o_frag, optr, L::kOLd, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
        wmma::load_matrix_sync(a, ps + 16 * warp * L::kPLd + 16 * kk, L::kPLd);
        wmma::load_matrix_sync(b, vs + 16 * kk * L::kQkLd + 16 * dn, L::kQkLd);
        wmma::mma_sync(o_frag, a, b, o_frag);
      }
      wmma::store_matrix_sync(optr, o_frag, L::kOLd, wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (my_row < rows) {
    const float inv = 1.0f / run_l;  // > 0: key 0 is visible to every row
    const float* orow = os + my_row * L::kOLd + (HD / 2) * half;
    bf16* dst = out + (static_cast<size_t>(q_begin + m0 + my_row) * heads + head) * HD +
                (HD / 2) * half;
    for (int c = 0; c < HD / 2; ++c) dst[c] = __float2bfloat16(orow[c] * inv);
  }
}

template <int HD>
KernelStatus Launch(const DeviceKvView& view, int layer, const bf16* q, bf16* out,
                    const int32_t* block_tables, const int32_t* q_starts, const int32_t* cu_q_lens,
                    int num_seqs, int heads, int q_row_stride, int max_blocks_per_seq,
                    int max_q_len, float scale, cudaStream_t stream) {
  constexpr size_t kBytes = Smem<HD>::kBytes;
  // Opt in to more than 48 KiB of dynamic shared memory (idempotent, cheap).
  cudaError_t err = cudaFuncSetAttribute(PrefillKernel<HD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kBytes));
  if (err != cudaSuccess) return FromCuda(err, "PagedPrefillAttention: shared memory opt-in");
  const dim3 grid((max_q_len + kBlockM - 1) / kBlockM, heads, num_seqs);
  PrefillKernel<HD><<<grid, kThreads, kBytes, stream>>>(
      view, layer, q, out, block_tables, q_starts, cu_q_lens, heads, heads / view.kv_heads,
      q_row_stride, max_blocks_per_seq, scale * kLog2e);
  return detail::LaunchStatus("PagedPrefillAttention launch");
}

}  // namespace

KernelStatus PagedPrefillAttention(const DeviceKvView& view, int layer, const bf16* q, bf16* out,
                                   const int32_t* block_tables, const int32_t* q_starts,
                                   const int32_t* cu_q_lens, int num_seqs, int heads,
                                   int q_row_stride, int max_blocks_per_seq, int max_q_len,
                                   float scale, cudaStream_t stream) {
  if (view.pool == nullptr || layer < 0 || layer >= view.num_layers || view.block_size <= 0 ||
      view.kv_heads <= 0 || num_seqs < 0 || heads <= 0 || max_q_len < 0) {
    return InvalidArgument("PagedPrefillAttention: pool, layer, block_size, heads, max_q_len");
  }
  if (heads % view.kv_heads != 0) {
    return InvalidArgument("PagedPrefillAttention: heads must be a multiple of kv_heads");
  }
  if (q_row_stride < heads * view.head_dim) {
    return InvalidArgument("PagedPrefillAttention: q_row_stride < heads * head_dim");
  }
  if (view.head_dim != 16 && view.head_dim != 32 && view.head_dim != 64 && view.head_dim != 128) {
    return Unsupported("PagedPrefillAttention: head_dim must be 16, 32, 64 or 128");
  }
  if (q_row_stride % 8 != 0 || view.block_stride % 8 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(view.pool) % 16 != 0) {
    return Unsupported("PagedPrefillAttention: q rows and cache blocks must be 16-byte aligned");
  }
  if (num_seqs == 0 || max_q_len == 0) return KernelStatus::Ok();
  if (num_seqs > 65535 || heads > 65535) {
    return Unsupported("PagedPrefillAttention: at most 65535 sequences and heads");
  }
#define TANDEM_PREFILL_HD(HD)                                                                \
  return Launch<HD>(view, layer, q, out, block_tables, q_starts, cu_q_lens, num_seqs, heads, \
                    q_row_stride, max_blocks_per_seq, max_q_len, scale, stream)
  switch (view.head_dim) {
    case 16: TANDEM_PREFILL_HD(16);
    case 32: TANDEM_PREFILL_HD(32);
    case 64: TANDEM_PREFILL_HD(64);
    default: TANDEM_PREFILL_HD(128);
  }
#undef TANDEM_PREFILL_HD
}

}  // namespace tandem::kernels::cuda
