#include "engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "common/splitmix.h"

namespace tandem::engine {
namespace {

// The plain loop: first non-NaN maximum.
uint32_t ArgmaxScalar(std::span<const float> logits) {
  uint32_t best = 0;
  float best_v = -INFINITY;
  bool found = false;
  for (uint32_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (std::isnan(v)) continue;
    if (!found || v > best_v) {
      best = i;
      best_v = v;
      found = true;
    }
  }
  return best;
}

}  // namespace

uint32_t Argmax(std::span<const float> logits) {
  // Pass 1: the largest value. A NaN never wins `v > m`, so it is skipped
  // without a branch; sixteen lanes (SSE) keep the comparisons independent.
  const size_t n = logits.size();
  const float* p = logits.data();
  size_t i = 0;
  float m = -INFINITY;
#if defined(__SSE2__)
  // MAXPS(v, acc) is `v > acc ? v : acc` lane by lane: a NaN in v keeps acc.
  __m128 acc0 = _mm_set1_ps(-INFINITY), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm_max_ps(_mm_loadu_ps(p + i), acc0);
    acc1 = _mm_max_ps(_mm_loadu_ps(p + i + 4), acc1);
    acc2 = _mm_max_ps(_mm_loadu_ps(p + i + 8), acc2);
    acc3 = _mm_max_ps(_mm_loadu_ps(p + i + 12), acc3);
  }
  alignas(16) float lane[16];
  _mm_store_ps(lane, acc0);
  _mm_store_ps(lane + 4, acc1);
  _mm_store_ps(lane + 8, acc2);
  _mm_store_ps(lane + 12, acc3);
  for (float l : lane) m = l > m ? l : m;
#endif
  for (; i < n; ++i) m = p[i] > m ? p[i] : m;
  // Every value -inf or NaN: the plain loop's rule (the first non-NaN).
  if (m == -INFINITY) return ArgmaxScalar(logits);
  // Pass 2: its first index (equal values, -0.0 and +0.0 included, tie).
  i = 0;
#if defined(__SSE2__)
  const __m128 target = _mm_set1_ps(m);
  for (; i + 4 <= n; i += 4) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(p + i), target));
    if (hit != 0) return static_cast<uint32_t>(i + static_cast<size_t>(__builtin_ctz(hit)));
  }
#endif
  for (; i < n; ++i) {
    if (p[i] == m) return static_cast<uint32_t>(i);
  }
  return 0;  // not reached
}

Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return InvalidArgumentError(fmt::format("temperature is {}; it must be >= 0", p.temperature));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return InvalidArgumentError(fmt::format("top_p is {}; it must be in (0, 1]", p.top_p));
  }
  if (p.max_tokens == 0) return InvalidArgumentError("max_tokens is 0; it must be at least 1");
  for (const auto& s : p.stop) {
    if (s.empty()) return InvalidArgumentError("a stop string is empty");
  }
  return Status::Ok();
}

bool OneHotPickIsCertain(const SamplingParams& p) {
  // (-1e30 - 0) / 1e20 = -1e10: exp underflows to +0.0 (below ~-745), so
  // every other id has probability 0, top_p keeps the hot id alone and the
  // inverse-CDF draw (u < cumulative mass) can only stop at it.
  return p.temperature == 0.0f || p.top_k == 1 || p.temperature <= 1e20f;
}

double UniformDraw(uint64_t seed, uint64_t index) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ SplitMix64(index + 0x632BE59BD9B4E019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

uint32_t Sampler::Sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed,
                         uint64_t index) {
  const uint32_t vocab = static_cast<uint32_t>(logits.size());
  auto greedy = [&] { return Argmax(logits); };
  if (p.temperature == 0.0f || p.top_k == 1) return greedy();

  cand_.clear();
  for (uint32_t i = 0; i < vocab; ++i) {
    if (!std::isnan(logits[i])) cand_.emplace_back(logits[i], i);
  }
  if (cand_.empty()) return 0;
  auto by_prob = [](const std::pair<float, uint32_t>& a, const std::pair<float, uint32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const bool use_top_k = p.top_k > 0 && p.top_k < cand_.size();
  if (use_top_k) {
    std::partial_sort(cand_.begin(), cand_.begin() + p.top_k, cand_.end(), by_prob);
    cand_.resize(p.top_k);
  } else if (p.top_p < 1.0f) {
    std::sort(cand_.begin(), cand_.end(), by_prob);
  }
  float max_logit = -INFINITY;
  for (const auto& c : cand_) max_logit = std::max(max_logit, c.first);
  if (!std::isfinite(max_logit)) return greedy();
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  probs_.resize(cand_.size());
  double total = 0.0;
  for (size_t i = 0; i < cand_.size(); ++i) {
    probs_[i] = std::exp((static_cast<double>(cand_[i].first) - max_logit) * inv_t);
    total += probs_[i];
  }
  size_t n = cand_.size();
  if (p.top_p < 1.0f) {
    // cand_ is sorted by decreasing probability here.
    const double target = static_cast<double>(p.top_p) * total;
    double cum = 0.0;
    size_t keep = 0;
    while (keep < n) {
      cum += probs_[keep++];
      if (cum >= target) break;
    }
    n = keep;
    total = cum;
  }
  const double u = UniformDraw(seed, index) * total;
  double cum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cum += probs_[i];
    if (u < cum) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace tandem::engine
