// Elementwise and row-wise CUDA kernels of the Llama forward pass, and the
// KV-cache writes and block copies. Counterparts of kernels/reference/ops.h
// (same formulas; bf16 storage, f32 math). Conventions: kernels/cuda/common.h.
//
// Thread-safety: launchers are stateless; any thread may launch on its own
// stream.
#pragma once

#include "kernels/cuda/common.h"

namespace tandem::kernels::cuda {

// out[i] = table[ids[i]] (a zero row when ids[i] is outside [0, vocab)).
KernelStatus EmbeddingGather(const bf16* table,   // [vocab][d]
                             const int32_t* ids,  // [t]
                             bf16* out,           // [t][d]
                             int t, int d, int vocab, cudaStream_t stream);

// residual += x (f32), then out = RmsNorm(residual) * weight (as
// ref::AddRmsNorm). With x == nullptr it is ref::RmsNorm of residual, which
// is left unchanged. One block per row: the sum of squares runs in a fixed
// order for a given d.
KernelStatus AddRmsNorm(float* residual,    // [m][d] in/out
                        const bf16* x,      // [m][d] or nullptr
                        const bf16* weight, // [d]
                        float eps,
                        bf16* out,  // [m][d]
                        int m, int d, cudaStream_t stream);

// Rotary embedding in place, HF rotate_half convention (ref::Rope): angle =
// float(position) * inv_freq[i], cos/sin of the f32 angle. Rows may be
// strided (q and k inside one fused QKV buffer).
KernelStatus Rope(bf16* q,                  // [t][q_row_stride], heads * head_dim used
                  bf16* k,                  // [t][k_row_stride], kv_heads * head_dim used
                  const int32_t* positions, // [t]
                  const float* inv_freq,    // [head_dim / 2]
                  int t, int heads, int kv_heads, int head_dim, int q_row_stride,
                  int k_row_stride, cudaStream_t stream);

// out = silu(gate) * up (ref::SiluMul); gate and up may be the two halves of
// one fused gate_up row.
KernelStatus SiluMul(const bf16* gate,  // [m][in_row_stride], n used
                     const bf16* up,    // [m][in_row_stride], n used
                     bf16* out,         // [m][n]
                     int m, int n, int in_row_stride, cudaStream_t stream);

// Copies t tokens' K and V of one layer into their cache slots (ref::WriteKv);
// a negative slot is skipped (padding rows).
KernelStatus WriteKv(const DeviceKvView& view, int layer,
                     const bf16* k,         // [t][row_stride], kv_heads * head_dim used
                     const bf16* v,         // [t][row_stride], kv_heads * head_dim used
                     const int32_t* slots,  // [t]
                     int t, int row_stride, cudaStream_t stream);

// dst[i] = bf16(src[i]) (round to nearest even) and back.
KernelStatus F32ToBf16(const float* src,  // [n]
                       bf16* dst,         // [n]
                       size_t n, cudaStream_t stream);
KernelStatus Bf16ToF32(const bf16* src,  // [n]
                       float* dst,       // [n]
                       size_t n, cudaStream_t stream);

// Block copies between two pools (device or pinned host, any direction; the
// pointers must be known to CUDA: device memory or cudaHostAlloc'ed /
// cudaHostRegister'ed host memory). Copies block src_ids[i] of src to block
// dst_ids[i] of dst, block_bytes each; runs of consecutive ids on both sides
// become one cudaMemcpyAsync. The id arrays are host memory, read before the
// call returns.
KernelStatus CopyBlocks(void* dst,                // [dst blocks][dst_stride_bytes]
                        size_t dst_stride_bytes,  //
                        const void* src,          // [src blocks][src_stride_bytes]
                        size_t src_stride_bytes,
                        const int32_t* src_ids,   // [n] host
                        const int32_t* dst_ids,   // [n] host
                        int n, size_t block_bytes, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
