#include "router/scoring.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

namespace tandem::router {
namespace {

struct Side {
  std::array<uint32_t, kMaxWorkers> idx;  // [n]: indices into the candidates
  uint32_t n = 0;
};

double Bandwidth(const Candidate& p, const Candidate& d, const RouterOptions& o) {
  if (p.node_id == d.node_id) return o.same_node_bandwidth_bytes_per_s;
  if (p.zone_id == d.zone_id) return o.cross_node_bandwidth_bytes_per_s;
  return o.cross_zone_bandwidth_bytes_per_s;
}

// Hot-prefix guard for one side: true when the worker with the longest
// cached prefix is loaded past (1 + threshold) x the side's mean and past
// the floor.
bool HotPrefix(std::span<const Candidate> w, const Side& side, const double* load,
               const RouterOptions& o) {
  if (side.n < 2) return false;
  uint32_t best = UINT32_MAX;
  double sum = 0;
  for (uint32_t k = 0; k < side.n; ++k) {
    const uint32_t i = side.idx[k];
    sum += load[i];
    if (w[i].overlap_blocks > 0 && (best == UINT32_MAX || w[i].overlap_blocks > w[best].overlap_blocks)) best = i;
  }
  if (best == UINT32_MAX) return false;
  const double mean = sum / side.n;
  return load[best] > (1.0 + o.hot_prefix_threshold) * mean && load[best] > o.hot_prefix_min_load_blocks;
}

bool CostLess(double a, double b) { return a < b - 1e-9 * std::max(1.0, std::abs(b)); }

}  // namespace

Status Score(std::span<const Candidate> w, uint32_t prompt_tokens, const ScoringParams& params,
             PolicyState* state, RouteDecision* out) {
  const RouterOptions& o = *params.options;
  const uint32_t bs = o.block_size_tokens;
  const bool kv = params.policy == Policy::kKvAware;

  out->policy = params.policy;
  out->prefill = out->decode = kNoWorker;
  out->local_prefill = out->conditional_local = false;
  out->hot_prefix_prefill = out->hot_prefix_decode = false;
  out->prompt_tokens = prompt_tokens;
  out->prompt_blocks = (prompt_tokens + bs - 1) / bs;
  out->prefill_overlap_blocks = out->decode_overlap_blocks = out->transfer_blocks = 0;
  out->prefill_cost = out->decode_cost = out->transfer_cost = out->cost = 0;
  out->prefill_scores.clear();
  out->decode_scores.clear();
  const int64_t prompt_blocks = out->prompt_blocks;

  Side ps, ds;
  std::array<double, kMaxWorkers> prefill_load;  // [workers]: queued prefill blocks
  std::array<double, kMaxWorkers> decode_load;   // [workers]: active decode blocks
  std::array<int64_t, kMaxWorkers> need;         // [workers]: blocks the decoder must receive
  std::array<bool, kMaxWorkers> room;            // [workers]
  for (uint32_t i = 0; i < w.size(); ++i) {
    const Candidate& c = w[i];
    prefill_load[i] = static_cast<double>(std::max<int64_t>(0, c.load.queued_prefill_tokens)) / bs;
    decode_load[i] = static_cast<double>(std::max<int64_t>(0, c.load.active_decode_blocks));
    need[i] = std::max<int64_t>(0, prompt_blocks - c.overlap_blocks);
    room[i] = !c.load.free_known || c.load.free_blocks >= need[i];
    if (CanPrefill(c.role)) ps.idx[ps.n++] = i;
    if (CanDecode(c.role)) ds.idx[ds.n++] = i;
  }
  if (ps.n == 0) return UnavailableError("no prefill-capable worker is registered");
  if (ds.n == 0) return UnavailableError("no decode-capable worker is registered");

  if (kv) {
    out->hot_prefix_prefill = HotPrefix(w, ps, prefill_load.data(), o);
    out->hot_prefix_decode = HotPrefix(w, ds, decode_load.data(), o);
  }
  std::array<double, kMaxWorkers> pc, dc;  // [workers]: side costs
  for (uint32_t k = 0; k < ps.n; ++k) {
    const uint32_t i = ps.idx[k];
    const int64_t ovl = out->hot_prefix_prefill ? 0 : w[i].overlap_blocks;
    pc[i] = kv ? params.prefill_weight * static_cast<double>(std::max<int64_t>(0, prompt_blocks - ovl)) +
                     prefill_load[i]
               : prefill_load[i];
    out->prefill_scores.push_back({w[i].id, pc[i], w[i].overlap_blocks, false});
  }
  int64_t most_free = INT64_MIN;
  uint32_t with_room = 0;
  for (uint32_t k = 0; k < ds.n; ++k) {
    const uint32_t i = ds.idx[k];
    const int64_t ovl = out->hot_prefix_decode ? 0 : w[i].overlap_blocks;
    dc[i] = kv ? decode_load[i] + static_cast<double>(std::max<int64_t>(0, prompt_blocks - ovl)) : decode_load[i];
    out->decode_scores.push_back({w[i].id, dc[i], w[i].overlap_blocks, !room[i]});
    most_free = std::max(most_free, w[i].load.free_blocks);
    with_room += room[i] ? 1 : 0;
  }
  if (with_room == 0) {
    return ResourceExhaustedError("no decoder has room: the prompt needs up to " + std::to_string(prompt_blocks) +
                                  " blocks; the most free on any decoder is " + std::to_string(most_free));
  }

  auto transfer = [&](uint32_t p, uint32_t d) {
    if (p == d || !kv) return 0.0;
    const uint64_t block_bytes = w[d].block_bytes ? w[d].block_bytes : o.default_block_bytes;
    const double ms = static_cast<double>(need[d]) * static_cast<double>(block_bytes) / Bandwidth(w[p], w[d], o) * 1e3;
    return o.transfer_cost_per_ms * ms;
  };
  // Whether p may prefill for d: a 'both' prefiller keeps the request.
  auto allowed = [&](uint32_t p, uint32_t d) {
    return room[d] && (w[p].role == WorkerRole::kBoth ? p == d : true);
  };

  uint32_t bp = UINT32_MAX, bd = UINT32_MAX;
  if (params.policy == Policy::kKvAware || params.policy == Policy::kLeastLoaded) {
    const bool sample = kv && params.temperature > 0;
    if (sample) state->scratch.clear();
    double best = 0;
    int64_t best_running = 0;
    for (uint32_t a = 0; a < ps.n; ++a) {
      const uint32_t p = ps.idx[a];
      for (uint32_t b = 0; b < ds.n; ++b) {
        const uint32_t d = ds.idx[b];
        if (!allowed(p, d)) continue;
        const double cost = pc[p] + dc[d] + transfer(p, d);
        if (sample) state->scratch.push_back({p, d, cost});
        const int64_t running = w[p].load.running_requests + (p == d ? 0 : w[d].load.running_requests);
        const bool better =
            bp == UINT32_MAX || CostLess(cost, best) ||
            (!CostLess(best, cost) &&
             (running < best_running ||
              (running == best_running && (w[p].id < w[bp].id || (w[p].id == w[bp].id && w[d].id < w[bd].id)))));
        if (better) {
          bp = p;
          bd = d;
          best = cost;
          best_running = running;
        }
      }
    }
    if (sample && bp != UINT32_MAX) {
      // softmax(-cost / T), shifted by the minimum so exp() cannot overflow.
      double total = 0;
      for (auto& pair : state->scratch) {
        pair.cost = std::exp(-(pair.cost - best) / params.temperature);
        total += pair.cost;
      }
      double u = std::uniform_real_distribution<double>(0.0, total)(state->rng);
      for (const auto& pair : state->scratch) {
        bp = pair.p;
        bd = pair.d;
        if (u < pair.cost) break;
        u -= pair.cost;
      }
    }
  } else {
    // round_robin / random: the prefiller by turn or by lot among those with
    // a valid decoder; then the decoder likewise.
    std::array<uint32_t, kMaxWorkers> valid_p;
    uint32_t np = 0;
    for (uint32_t a = 0; a < ps.n; ++a) {
      const uint32_t p = ps.idx[a];
      bool ok = false;
      for (uint32_t b = 0; b < ds.n && !ok; ++b) ok = allowed(p, ds.idx[b]);
      if (ok) valid_p[np++] = p;
    }
    if (np > 0) {
      const bool rr = params.policy == Policy::kRoundRobin;
      bp = valid_p[rr ? state->rr_prefill++ % np : std::uniform_int_distribution<uint32_t>(0, np - 1)(state->rng)];
      std::array<uint32_t, kMaxWorkers> valid_d;
      uint32_t nd = 0;
      for (uint32_t b = 0; b < ds.n; ++b) {
        if (allowed(bp, ds.idx[b])) valid_d[nd++] = ds.idx[b];
      }
      bd = valid_d[rr ? state->rr_decode++ % nd : std::uniform_int_distribution<uint32_t>(0, nd - 1)(state->rng)];
    }
  }
  if (bp == UINT32_MAX) {
    return ResourceExhaustedError("no (prefiller, decoder) pair has room for a prompt of " +
                                  std::to_string(prompt_blocks) + " blocks");
  }

  out->prefill = w[bp].id;
  out->decode = w[bd].id;
  out->prefill_overlap_blocks = w[bp].overlap_blocks;
  out->decode_overlap_blocks = w[bd].overlap_blocks;
  out->prefill_cost = pc[bp];
  out->decode_cost = dc[bd];
  out->transfer_cost = transfer(bp, bd);
  out->local_prefill = bp == bd;
  out->transfer_blocks = out->local_prefill ? 0 : static_cast<uint32_t>(need[bd]);

  // Conditional disaggregation: the decoder prefills a short uncached tail
  // itself rather than waiting for a prefiller and a transfer.
  const int64_t uncached_tokens =
      std::max<int64_t>(0, static_cast<int64_t>(prompt_tokens) - static_cast<int64_t>(w[bd].overlap_blocks) * bs);
  if (!out->local_prefill && params.local_prefill_threshold_tokens > 0 &&
      uncached_tokens < params.local_prefill_threshold_tokens && room[bd]) {
    out->local_prefill = out->conditional_local = true;
    out->prefill = out->decode;
    out->prefill_overlap_blocks = out->decode_overlap_blocks;
    out->prefill_cost = 0;
    out->transfer_cost = 0;
    out->transfer_blocks = 0;
  }
  out->cost = out->prefill_cost + out->decode_cost + out->transfer_cost;
  return Status::Ok();
}

}  // namespace tandem::router
