// Argmax and seeded sampling, one CTA per row, in the CPU Sampler's order:
// with a top-k or top-p cut the candidates are ranked (value desc, id asc),
// without one they are walked in id order. Ranking uses a 64-bit key
// (order-preserving bits of the logit above, ~id below), so "k-th largest"
// and "first token whose cumulative mass crosses x" are radix selections: 8
// passes of 8-bit digits, each a histogram in shared memory over the row;
// the id-order walk is a block prefix sum. Masses are 64-bit fixed point, so
// every sum is exact.
#include <cmath>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/sampling.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr double kFixedOne = 17592186044416.0;  // 2^44: fixed-point unit of the largest probability

__host__ __device__ inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__host__ __device__ inline double UniformDrawImpl(uint64_t seed, uint64_t index) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ SplitMix64(index + 0x632BE59BD9B4E019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// 0 for NaN (never a candidate); otherwise larger key = earlier in the order.
__device__ __forceinline__ uint64_t Key(float v, int id) {
  if (isnan(v)) return 0;
  uint32_t bits = __float_as_uint(v);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ int KeyId(uint64_t key) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFu));
}

__device__ __forceinline__ uint64_t WarpMaxU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(detail::kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ uint64_t WarpSumU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(detail::kFullMask, v, o);
  return v;
}

// Block-wide max / sum of uint64; every thread gets the result.
__device__ uint64_t BlockMaxU64(uint64_t v, uint64_t* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpMaxU64(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return WarpMaxU64(lane < (kThreads >> 5) ? scratch[lane] : 0);
}

__device__ uint64_t BlockSumU64(uint64_t v, uint64_t* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSumU64(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return WarpSumU64(lane < (kThreads >> 5) ? scratch[lane] : 0);
}

// Block-wide exclusive prefix sum of uint64 in thread order.
__device__ uint64_t BlockExclusiveScanU64(uint64_t v, uint64_t* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  uint64_t inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t n = __shfl_up_sync(detail::kFullMask, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const uint64_t w = lane < (kThreads >> 5) ? scratch[lane] : 0;
    uint64_t winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t n = __shfl_up_sync(detail::kFullMask, winc, o);
      if (lane >= o) winc += n;
    }
    if (lane < (kThreads >> 5)) scratch[lane] = winc - w;
  }
  __syncthreads();
  return scratch[warp] + inc - v;
}

struct RowCtx {
  const float* row;
  int vocab;
  uint64_t min_key;  // candidates are keys >= min_key (top-k cut; 1 = all non-NaN)
  float max_logit;
  double inv_t;
};

// Fixed-point weight of one logit (w <= 1 because logit <= max).
__device__ __forceinline__ uint64_t Weight(const RowCtx& c, float v) {
  const double w = exp((static_cast<double>(v) - static_cast<double>(c.max_logit)) * c.inv_t);
  return static_cast<uint64_t>(w * kFixedOne);
}

enum class Cross { kCountAtLeast, kMassAtLeast, kMassAbove };

// Descending through the candidates' keys, returns the first key K at which
// the cumulative measure (count or mass of keys >= K) crosses `target`
// (>= target or > target as `mode` says); *above receives the measure of the
// keys > K. When nothing crosses (rounding at the very end) the smallest
// candidate key is returned.
__device__ uint64_t RadixSelect(const RowCtx& c, Cross mode, double target, uint64_t* above_out,
                                uint64_t* hist, uint64_t* bcast) {
  uint64_t prefix = 0;
  uint64_t above = 0;
  for (int pass = 0; pass < 8; ++pass) {
    const int shift = 56 - 8 * pass;
    const uint64_t mask = pass == 0 ? 0 : (~0ull << (shift + 8));
    for (int b = threadIdx.x; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < c.vocab; j += kThreads) {
      const float v = c.row[j];
      const uint64_t key = Key(v, j);
      if (key < c.min_key || (key & mask) != (prefix & mask)) continue;
      const uint64_t w = mode == Cross::kCountAtLeast ? 1 : Weight(c, v);
      atomicAdd(reinterpret_cast<unsigned long long*>(&hist[(key >> shift) & 0xFF]),
                static_cast<unsigned long long>(w));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1;
      int lowest = -1;
      uint64_t acc = above;
      for (int b = 255; b >= 0; --b) {
        const uint64_t h = hist[b];
        if (h == 0) continue;
        lowest = b;
        const double cum = static_cast<double>(acc + h);
        const bool crossed = mode == Cross::kMassAbove ? cum > target : cum >= target;
        if (crossed) {
          chosen = b;
          break;
        }
        acc += h;
      }
      if (chosen < 0) {  // nothing crossed: go to the smallest key of this range
        chosen = lowest < 0 ? 0 : lowest;
        acc = above;
        for (int b = 255; b > chosen; --b) acc += hist[b];
      }
      bcast[0] = prefix | (static_cast<uint64_t>(chosen) << shift);
      bcast[1] = acc;
    }
    __syncthreads();
    prefix = bcast[0];
    above = bcast[1];
    __syncthreads();
  }
  *above_out = above;
  return prefix;
}

__global__ void __launch_bounds__(kThreads)
    ArgmaxKernel(const float* __restrict__ logits, int32_t* __restrict__ out, int vocab) {
  __shared__ uint64_t scratch[32];
  const float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  uint64_t best = 0;
  for (int j = threadIdx.x; j < vocab; j += kThreads) {
    const uint64_t k = Key(row[j], j);
    best = k > best ? k : best;
  }
  best = BlockMaxU64(best, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = best == 0 ? 0 : KeyId(best);
}

__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* __restrict__ logits, const SampleParams* __restrict__ params,
                 int32_t* __restrict__ out, int vocab) {
  __shared__ uint64_t scratch[32];
  __shared__ uint64_t hist[256];
  __shared__ uint64_t bcast[2];
  const SampleParams p = params[blockIdx.x];
  RowCtx c;
  c.row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  c.vocab = vocab;
  c.min_key = 1;

  uint64_t best = 0;
  uint64_t count = 0;
  for (int j = threadIdx.x; j < vocab; j += kThreads) {
    const uint64_t k = Key(c.row[j], j);
    best = k > best ? k : best;
    count += k != 0;
  }
  best = BlockMaxU64(best, scratch);
  count = BlockSumU64(count, scratch);
  const int greedy_id = best == 0 ? 0 : KeyId(best);
  if (p.temperature == 0.0f || p.top_k == 1 || count == 0) {
    if (threadIdx.x == 0) out[blockIdx.x] = greedy_id;
    return;
  }
  c.max_logit = c.row[greedy_id];
  if (!isfinite(c.max_logit)) {  // as the CPU sampler: no usable distribution
    if (threadIdx.x == 0) out[blockIdx.x] = greedy_id;
    return;
  }
  c.inv_t = 1.0 / static_cast<double>(p.temperature);

  uint64_t above = 0;
  if (p.top_k > 0 && p.top_k < count) {
    c.min_key = RadixSelect(c, Cross::kCountAtLeast, static_cast<double>(p.top_k), &above, hist,
                            bcast);
  }
  uint64_t total = 0;
  for (int j = threadIdx.x; j < vocab; j += kThreads) {
    const float v = c.row[j];
    if (Key(v, j) >= c.min_key) total += Weight(c, v);
  }
  total = BlockSumU64(total, scratch);
  if (p.top_p < 1.0f) {
    const double target = static_cast<double>(p.top_p) * static_cast<double>(total);
    const uint64_t cut = RadixSelect(c, Cross::kMassAtLeast, target, &above, hist, bcast);
    total = above + Weight(c, c.row[KeyId(cut)]);
    c.min_key = cut;
  }
  const double u = UniformDrawImpl(p.seed, p.index) * static_cast<double>(total);
  if (c.min_key != 1 || p.top_p < 1.0f) {
    // A top-k or top-p cut ranks the candidates (the CPU sampler sorts them):
    // walk them by value desc, id asc.
    const uint64_t pick = RadixSelect(c, Cross::kMassAbove, u, &above, hist, bcast);
    if (threadIdx.x == 0) out[blockIdx.x] = KeyId(pick);
    return;
  }
  // No cut: the CPU sampler walks the candidates in id order. Each thread
  // owns a contiguous range of ids; the one whose cumulative mass crosses u
  // walks its range. Nothing crossing (rounding at the very end) picks the
  // last candidate, as the CPU sampler does.
  const int per = (vocab + kThreads - 1) / kThreads;
  const int lo = min(vocab, static_cast<int>(threadIdx.x) * per);
  const int hi = min(vocab, lo + per);
  uint64_t mine = 0;
  uint64_t last = 0;  // 1 + the largest non-NaN id
  for (int j = lo; j < hi; ++j) {
    const float v = c.row[j];
    if (isnan(v)) continue;
    mine += Weight(c, v);
    last = static_cast<uint64_t>(j) + 1;
  }
  uint64_t cum = BlockExclusiveScanU64(mine, scratch);
  last = BlockMaxU64(last, scratch);
  __shared__ int picked;
  if (threadIdx.x == 0) picked = static_cast<int>(last) - 1;
  __syncthreads();
  if (!(static_cast<double>(cum) > u) && static_cast<double>(cum + mine) > u) {
    for (int j = lo; j < hi; ++j) {
      const float v = c.row[j];
      if (isnan(v)) continue;
      cum += Weight(c, v);
      if (static_cast<double>(cum) > u) {
        picked = j;
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = picked;
}

}  // namespace

double UniformDrawHost(uint64_t seed, uint64_t index) { return UniformDrawImpl(seed, index); }

KernelStatus Argmax(const float* logits, int32_t* out, int m, int vocab, cudaStream_t stream) {
  if (m < 0 || vocab <= 0) return InvalidArgument("Argmax: m >= 0 and vocab > 0");
  if (m == 0) return KernelStatus::Ok();
  if (m > 65535 * 32) return Unsupported("Argmax: too many rows");
  ArgmaxKernel<<<m, kThreads, 0, stream>>>(logits, out, vocab);
  return detail::LaunchStatus("Argmax launch");
}

KernelStatus Sample(const float* logits, const SampleParams* params, int32_t* out, int m,
                    int vocab, cudaStream_t stream) {
  if (m < 0 || vocab <= 0) return InvalidArgument("Sample: m >= 0 and vocab > 0");
  if (m == 0) return KernelStatus::Ok();
  if (m > 65535 * 32) return Unsupported("Sample: too many rows");
  SampleKernel<<<m, kThreads, 0, stream>>>(logits, params, out, vocab);
  return detail::LaunchStatus("Sample launch");
}

}  // namespace tandem::kernels::cuda
