// The paged KV cache as kernels see it (DESIGN.md section 4).
//
// One block is one contiguous range of floats holding that block's K and V
// for every layer, in the fixed order [layer][K,V][kv_head][token][head_dim].
// The same order is the wire format, so CPU, CUDA and sim workers
// interoperate. Block b starts at pool + b * block_stride; block_stride may
// exceed KvBlockFloats() (padding for alignment), never be smaller.
//
// A slot names one token position in the pool: slot = block_id * block_size
// + offset_in_block.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem::kernels {

// Floats one block needs for the given shape.
inline size_t KvBlockFloats(int num_layers, int kv_heads, int head_dim, int block_size) {
  return static_cast<size_t>(num_layers) * 2 * static_cast<size_t>(kv_heads) *
         static_cast<size_t>(block_size) * static_cast<size_t>(head_dim);
}

struct KvCacheView {
  float* pool = nullptr;    // [num_blocks][block_stride]; borrowed
  size_t block_stride = 0;  // floats between consecutive blocks (>= KvBlockFloats)
  int num_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;  // tokens per block

  // Floats of one [kv_head][token][head_dim] plane (the K or the V of a layer).
  size_t PlaneFloats() const {
    return static_cast<size_t>(kv_heads) * static_cast<size_t>(block_size) *
           static_cast<size_t>(head_dim);
  }
  // K row of (block, layer, kv_head, token_in_block): [head_dim].
  float* K(int32_t block, int layer, int kv_head, int token) const {
    return pool + static_cast<size_t>(block) * block_stride +
           (static_cast<size_t>(layer) * 2) * PlaneFloats() +
           (static_cast<size_t>(kv_head) * static_cast<size_t>(block_size) +
            static_cast<size_t>(token)) * static_cast<size_t>(head_dim);
  }
  // V row of (block, layer, kv_head, token_in_block): [head_dim].
  float* V(int32_t block, int layer, int kv_head, int token) const {
    return K(block, layer, kv_head, token) + PlaneFloats();
  }
};

}  // namespace tandem::kernels
