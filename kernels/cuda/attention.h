// Paged attention on the GPU: causal, grouped-query (heads / kv_heads query
// heads share one kv head), reading K/V from the block-major cache
// (DeviceKvView). Counterpart of ref::PagedAttention / PagedAttentionBatch.
//
// Supported shapes: head_dim 64 or 128 (the sizes of real models; 16 and 32
// also, for the small test models); heads a multiple of kv_heads; q rows
// and cache blocks 16-byte aligned (q_row_stride and block_stride multiples
// of 8 elements). Others return kUnsupported.
//
// Reduction order: decode splits a context into fixed 512-token pieces
// whatever the batch, so a sequence's output bits do not depend on the other
// sequences of the launch (docs/cuda.md). Prefill tiles 64 query rows by 64
// keys; its bits depend on where a chunk starts, not on the batch.
#pragma once

#include "kernels/cuda/common.h"

namespace tandem::kernels::cuda {

// Tokens of one decode split (flash-decoding): contexts longer than this are
// split and the pieces combined by a second kernel.
inline constexpr int kDecodeSplitTokens = 512;

// Workspace PagedDecodeAttention needs for these sizes (0 when no context is
// longer than kDecodeSplitTokens).
size_t DecodeAttentionWorkspaceBytes(int num_seqs, int heads, int head_dim, int max_context_len);

// One query row per sequence (a decode step): sequence s's query sits at
// position context_lens[s] - 1 and attends to keys 0 .. context_lens[s] - 1,
// which must already be in the cache (WriteKv first).
KernelStatus PagedDecodeAttention(const DeviceKvView& view, int layer,
                                  const bf16* q,  // [num_seqs][q_row_stride], heads * head_dim used
                                  bf16* out,      // [num_seqs][heads][head_dim]
                                  const int32_t* block_tables,  // [num_seqs][max_blocks_per_seq]
                                  const int32_t* context_lens,  // [num_seqs], each in [1, max_context_len]
                                  int num_seqs, int heads, int q_row_stride,
                                  int max_blocks_per_seq, int max_context_len, float scale,
                                  void* workspace,  // [DecodeAttentionWorkspaceBytes(...)] bytes
                                  size_t workspace_bytes, cudaStream_t stream);

// Prefill chunks of several sequences (any q_len, over a cached prefix):
// sequence s owns query rows cu_q_lens[s] .. cu_q_lens[s + 1] - 1; its row r
// sits at position q_starts[s] + r and attends to keys 0 .. q_starts[s] + r.
// Tiled flash-style (64 x 64, online softmax, bf16 tensor cores with f32
// accumulation).
KernelStatus PagedPrefillAttention(const DeviceKvView& view, int layer,
                                   const bf16* q,  // [total_q][q_row_stride], heads * head_dim used
                                   bf16* out,      // [total_q][heads][head_dim]
                                   const int32_t* block_tables,  // [num_seqs][max_blocks_per_seq]
                                   const int32_t* q_starts,      // [num_seqs]
                                   const int32_t* cu_q_lens,     // [num_seqs + 1], cu_q_lens[0] = 0
                                   int num_seqs, int heads, int q_row_stride,
                                   int max_blocks_per_seq, int max_q_len, float scale,
                                   cudaStream_t stream);

}  // namespace tandem::kernels::cuda
