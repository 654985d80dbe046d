// Paged decode attention, flash-decoding style: one CTA per (sequence, group
// of query heads sharing a kv head, 512-token split of the context). K/V
// rows are read once per CTA for the whole head group; a second kernel
// combines the splits of contexts longer than one split.
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/device_util.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;  // tokens scored before the softmax update
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void Unpack8(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// Template: HD head_dim, GMAX the most query heads per CTA (gc <= GMAX at run
// time). Lanes: LPT lanes hold one token's row, 8 elements (16 bytes) each.
template <int HD, int GMAX>
__global__ void __launch_bounds__(kThreads)
    DecodeKernel(DeviceKvView view, int layer, const bf16* __restrict__ q, bf16* __restrict__ out,
                 const int32_t* __restrict__ block_tables, const int32_t* __restrict__ context_lens,
                 int heads, int group, int gc, int q_row_stride, int max_blocks_per_seq,
                 float scale_log2, int max_splits, float* __restrict__ part_o,
                 float* __restrict__ part_m, float* __restrict__ part_l) {
  constexpr int LPT = HD / 8;           // lanes per token
  constexpr int TPP = kThreads / LPT;   // tokens per pass
  constexpr int PASSES = kTile / TPP;
  __shared__ float probs[GMAX][kTile];
  __shared__ float alpha_s[GMAX];
  __shared__ float red[TPP][GMAX][HD];

  const int split = blockIdx.x;
  const int seq = blockIdx.z;
  const int h0 = blockIdx.y * gc;  // first query head of this CTA
  const int kvh = h0 / group;
  const int ctx = context_lens[seq];
  const int t_begin = split * kDecodeSplitTokens;
  if (t_begin >= ctx) return;
  const int t_end = min(ctx, t_begin + kDecodeSplitTokens);
  const int num_splits = (ctx + kDecodeSplitTokens - 1) / kDecodeSplitTokens;

  const int tid = threadIdx.x;
  const int grp = tid / LPT;
  const int lane_in = tid % LPT;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks_per_seq;

  float qr[GMAX][8];
#pragma unroll
  for (int h = 0; h < GMAX; ++h) {
    if (h < gc) {
      const uint4 raw = *reinterpret_cast<const uint4*>(
          q + static_cast<size_t>(seq) * q_row_stride + static_cast<size_t>(h0 + h) * HD +
          8 * lane_in);
      Unpack8(raw, qr[h]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qr[h][i] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qr[h][i] = 0.0f;
    }
  }
  float acc[GMAX][8];
#pragma unroll
  for (int h = 0; h < GMAX; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }
  // Running max (base 2) and sum per head; every warp keeps its own heads'.
  float run_m[2] = {-INFINITY, -INFINITY};
  float run_l[2] = {0.0f, 0.0f};

  for (int tile = t_begin; tile < t_end; tile += kTile) {
    // Scores: q . K for every token of the tile and every head of the group.
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const int local = pass * TPP + grp;
      const int tok = tile + local;
      float dot[GMAX];
#pragma unroll
      for (int h = 0; h < GMAX; ++h) dot[h] = 0.0f;
      if (tok < t_end) {
        const bf16* krow = view.K(table[tok / view.block_size], layer, kvh, tok % view.block_size);
        float k8[8];
        Unpack8(*reinterpret_cast<const uint4*>(krow + 8 * lane_in), k8);
#pragma unroll
        for (int h = 0; h < GMAX; ++h) {
#pragma unroll
          for (int i = 0; i < 8; ++i) dot[h] = fmaf(qr[h][i], k8[i], dot[h]);
        }
      }
#pragma unroll
      for (int h = 0; h < GMAX; ++h) {
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) dot[h] += __shfl_xor_sync(detail::kFullMask, dot[h], o);
      }
      if (lane_in == 0) {
#pragma unroll
        for (int h = 0; h < GMAX; ++h) {
          // Unused head slots (h >= gc) get probability 0, never a score.
          probs[h][local] = h >= gc ? 0.0f : (tok < t_end ? dot[h] : -INFINITY);
        }
      }
    }
    __syncthreads();
    // Online softmax update: warp w owns heads w and w + 4.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = warp + 4 * i;
      if (h < gc) {
        const float s0 = probs[h][lane];
        const float s1 = probs[h][lane + 32];
        const float tile_max = detail::WarpMax(fmaxf(s0, s1));
        const float m_new = fmaxf(run_m[i], tile_max);  // finite: the tile has a valid token
        const float alpha = exp2f(run_m[i] - m_new);
        const float p0 = exp2f(s0 - m_new);
        const float p1 = exp2f(s1 - m_new);
        probs[h][lane] = p0;
        probs[h][lane + 32] = p1;
        run_l[i] = run_l[i] * alpha + detail::WarpSum(p0 + p1);
        run_m[i] = m_new;
        if (lane == 0) alpha_s[h] = alpha;
      }
    }
    __syncthreads();
    // Accumulate P . V.
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
      const float a = h < gc ? alpha_s[h] : 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= a;
    }
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const int local = pass * TPP + grp;
      const int tok = tile + local;
      if (tok < t_end) {
        const bf16* vrow = view.V(table[tok / view.block_size], layer, kvh, tok % view.block_size);
        float v8[8];
        Unpack8(*reinterpret_cast<const uint4*>(vrow + 8 * lane_in), v8);
#pragma unroll
        for (int h = 0; h < GMAX; ++h) {
          const float p = probs[h][local];  // 0 for h >= gc: never read below
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p, v8[i], acc[h][i]);
        }
      }
    }
    __syncthreads();
  }

  // Sum the token groups in a fixed order.
#pragma unroll
  for (int h = 0; h < GMAX; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) red[grp][h][8 * lane_in + i] = acc[h][i];
  }
  // Each warp publishes its heads' m and l through alpha_s/probs scratch.
  __shared__ float m_s[GMAX];
  __shared__ float l_s[GMAX];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int h = warp + 4 * i;
    if (h < gc && lane == 0) {
      m_s[h] = run_m[i];
      l_s[h] = run_l[i];
    }
  }
  __syncthreads();
  for (int e = tid; e < gc * HD; e += kThreads) {
    const int h = e / HD;
    const int d = e % HD;
    float o = 0.0f;
#pragma unroll
    for (int g = 0; g < TPP; ++g) o += red[g][h][d];
    const int head = h0 + h;
    if (num_splits == 1) {
      out[(static_cast<size_t>(seq) * heads + head) * HD + d] = __float2bfloat16(o / l_s[h]);
    } else {
      const size_t part = (static_cast<size_t>(seq) * heads + head) * max_splits + split;
      part_o[part * HD + d] = o;
      if (d == 0) {
        part_m[part] = m_s[h];
        part_l[part] = l_s[h];
      }
    }
  }
}

// Combines the splits of one (sequence, head): o = sum_i 2^(m_i - M) o_i /
// sum_i 2^(m_i - M) l_i, in split order.
template <int HD>
__global__ void CombineKernel(const int32_t* __restrict__ context_lens, int heads, int max_splits,
                              const float* __restrict__ part_o, const float* __restrict__ part_m,
                              const float* __restrict__ part_l, bf16* __restrict__ out) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int ctx = context_lens[seq];
  const int num_splits = (ctx + kDecodeSplitTokens - 1) / kDecodeSplitTokens;
  if (num_splits <= 1) return;
  const size_t base = (static_cast<size_t>(seq) * heads + head) * max_splits;
  float m = -INFINITY;
  for (int i = 0; i < num_splits; ++i) m = fmaxf(m, part_m[base + i]);
  float l = 0.0f;
  for (int i = 0; i < num_splits; ++i) l += exp2f(part_m[base + i] - m) * part_l[base + i];
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < num_splits; ++i) {
      o += exp2f(part_m[base + i] - m) * part_o[(base + i) * HD + d];
    }
    out[(static_cast<size_t>(seq) * heads + head) * HD + d] = __float2bfloat16(o / l);
  }
}

int MaxSplits(int max_context_len) {
  return (max_context_len + kDecodeSplitTokens - 1) / kDecodeSplitTokens;
}

// Largest divisor of group that is <= 8: the query heads one CTA serves.
int HeadsPerCta(int group) {
  for (int g = 8; g > 1; --g) {
    if (group % g == 0) return g;
  }
  return 1;
}

template <int HD, int GMAX>
KernelStatus LaunchDecode(const DeviceKvView& view, int layer, const bf16* q, bf16* out,
                          const int32_t* block_tables, const int32_t* context_lens, int num_seqs,
                          int heads, int group, int gc, int q_row_stride, int max_blocks_per_seq,
                          int max_splits, float scale, float* part_o, float* part_m, float* part_l,
                          cudaStream_t stream) {
  const dim3 grid(max_splits, heads / gc, num_seqs);
  DecodeKernel<HD, GMAX><<<grid, kThreads, 0, stream>>>(
      view, layer, q, out, block_tables, context_lens, heads, group, gc, q_row_stride,
      max_blocks_per_seq, scale * kLog2e, max_splits, part_o, part_m, part_l);
  KernelStatus st = detail::LaunchStatus("PagedDecodeAttention launch");
  if (!st.ok() || max_splits <= 1) return st;
  CombineKernel<HD><<<dim3(heads, num_seqs), HD, 0, stream>>>(context_lens, heads, max_splits,
                                                              part_o, part_m, part_l, out);
  return detail::LaunchStatus("PagedDecodeAttention combine launch");
}

template <int HD>
KernelStatus DispatchGroup(int gc, const DeviceKvView& view, int layer, const bf16* q, bf16* out,
                           const int32_t* block_tables, const int32_t* context_lens, int num_seqs,
                           int heads, int group, int q_row_stride, int max_blocks_per_seq,
                           int max_splits, float scale, float* part_o, float* part_m,
                           float* part_l, cudaStream_t stream) {
#define TANDEM_DECODE(G)                                                                         \
  return LaunchDecode<HD, G>(view, layer, q, out, block_tables, context_lens, num_seqs, heads,  \
                             group, gc, q_row_stride, max_blocks_per_seq, max_splits, scale,    \
                             part_o, part_m, part_l, stream)
  if (gc == 1) TANDEM_DECODE(1);
  if (gc == 2) TANDEM_DECODE(2);
  if (gc <= 4) TANDEM_DECODE(4);
  TANDEM_DECODE(8);
#undef TANDEM_DECODE
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int num_seqs, int heads, int head_dim, int max_context_len) {
  const int splits = MaxSplits(max_context_len);
  if (splits <= 1 || num_seqs <= 0 || heads <= 0) return 0;
  const size_t parts = static_cast<size_t>(num_seqs) * heads * splits;
  return parts * (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

KernelStatus PagedDecodeAttention(const DeviceKvView& view, int layer, const bf16* q, bf16* out,
                                  const int32_t* block_tables, const int32_t* context_lens,
                                  int num_seqs, int heads, int q_row_stride,
                                  int max_blocks_per_seq, int max_context_len, float scale,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (view.pool == nullptr || layer < 0 || layer >= view.num_layers || view.block_size <= 0 ||
      view.kv_heads <= 0 || num_seqs < 0 || heads <= 0 || max_context_len <= 0) {
    return InvalidArgument("PagedDecodeAttention: pool, layer, block_size, heads, max_context_len");
  }
  if (heads % view.kv_heads != 0) {
    return InvalidArgument("PagedDecodeAttention: heads must be a multiple of kv_heads");
  }
  if (q_row_stride < heads * view.head_dim) {
    return InvalidArgument("PagedDecodeAttention: q_row_stride < heads * head_dim");
  }
  if ((max_context_len + view.block_size - 1) / view.block_size > max_blocks_per_seq) {
    return InvalidArgument("PagedDecodeAttention: max_context_len needs more blocks than max_blocks_per_seq");
  }
  if (view.head_dim != 16 && view.head_dim != 32 && view.head_dim != 64 && view.head_dim != 128) {
    return Unsupported("PagedDecodeAttention: head_dim must be 16, 32, 64 or 128");
  }
  if (q_row_stride % 8 != 0 || view.block_stride % 8 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(view.pool) % 16 != 0) {
    return Unsupported("PagedDecodeAttention: q rows and cache blocks must be 16-byte aligned");
  }
  if (num_seqs == 0) return KernelStatus::Ok();
  if (num_seqs > 65535) return Unsupported("PagedDecodeAttention: at most 65535 sequences");
  const int max_splits = MaxSplits(max_context_len);
  const size_t need = DecodeAttentionWorkspaceBytes(num_seqs, heads, view.head_dim, max_context_len);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr)) {
    return InvalidArgument("PagedDecodeAttention: workspace smaller than DecodeAttentionWorkspaceBytes()");
  }
  const size_t parts = static_cast<size_t>(num_seqs) * heads * max_splits;
  float* part_o = static_cast<float*>(workspace);
  float* part_m = need > 0 ? part_o + parts * view.head_dim : nullptr;
  float* part_l = need > 0 ? part_m + parts : nullptr;
  const int group = heads / view.kv_heads;
  const int gc = HeadsPerCta(group);
#define TANDEM_DECODE_HD(HD)                                                                   \
  return DispatchGroup<HD>(gc, view, layer, q, out, block_tables, context_lens, num_seqs, heads, \
                           group, q_row_stride, max_blocks_per_seq, max_splits, scale, part_o,  \
                           part_m, part_l, stream)
  switch (view.head_dim) {
    case 16: TANDEM_DECODE_HD(16);
    case 32: TANDEM_DECODE_HD(32);
    case 64: TANDEM_DECODE_HD(64);
    default: TANDEM_DECODE_HD(128);
  }
#undef TANDEM_DECODE_HD
}

}  // namespace tandem::kernels::cuda
