// Token selection on the GPU: argmax and seeded temperature / top-k / top-p
// sampling over f32 logits, one CTA per row. Counterparts of ref::Argmax and
// of the engine's CPU Sampler (src/engine/sampler.h), whose rules they
// follow: candidates are the non-NaN logits ordered by (value desc, id asc);
// top_k keeps the first k; top_p keeps the shortest prefix whose mass
// reaches top_p of the kept mass; the draw u = UniformDraw(seed, index) *
// mass picks the first token whose cumulative mass exceeds u.
//
// Probabilities exp((logit - max) / temperature) are summed in 64-bit fixed
// point (2^-44 units of the largest probability): integer sums are exact and
// order-free, so the result does not depend on thread scheduling. They can
// differ from the CPU Sampler's double sums only when a draw falls within
// ~1e-12 (relative) of a boundary between two tokens.
#pragma once

#include "kernels/cuda/common.h"

namespace tandem::kernels::cuda {

// out[i] = index of the largest logits[i][j], the lowest index on ties; NaN
// entries are never chosen (an all-NaN row gives 0).
KernelStatus Argmax(const float* logits,  // [m][vocab]
                    int32_t* out,         // [m]
                    int m, int vocab, cudaStream_t stream);

// One row's sampling parameters (mirrors engine::SamplingParams).
struct SampleParams {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  uint32_t top_k = 0;        // 0: off; 1: greedy
  uint32_t reserved = 0;
  uint64_t seed = 0;
  uint64_t index = 0;  // which draw of this seed (the request's n-th token)
};

KernelStatus Sample(const float* logits,         // [m][vocab]
                    const SampleParams* params,  // [m] device memory
                    int32_t* out,                // [m]
                    int m, int vocab, cudaStream_t stream);

// The same counter-based uniform draw as engine::UniformDraw (host side, for
// tests and callers that need it).
double UniformDrawHost(uint64_t seed, uint64_t index);

}  // namespace tandem::kernels::cuda
