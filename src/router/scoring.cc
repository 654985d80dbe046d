#include "router/scoring.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>

namespace tandem::router {
namespace {

struct Side {
  std::array<uint32_t, kMaxWorkers> idx;  // [n]: indices into the candidates
  uint32_t n = 0;
};

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
  out->room_by_report = false;
  out->seat_deferred = 0;
  out->prefill_scores.clear();
  out->decode_scores.clear();
  const int64_t prompt_blocks = out->prompt_blocks;

  Side ps, ds;
  std::array<double, kMaxWorkers> prefill_load;  // [workers]: queued prefill blocks
  std::array<double, kMaxWorkers> decode_load;   // [workers]: active decode blocks
  std::array<int64_t, kMaxWorkers> need;         // [workers]: blocks the decoder must receive
  std::array<int64_t, kMaxWorkers> keep;         // [workers]: blocks its growth reserve keeps
  std::array<bool, kMaxWorkers> room;            // [workers]
  uint32_t with_room = 0;                        // decoders with room
  for (uint32_t i = 0; i < w.size(); ++i) {
    const Candidate& c = w[i];
    prefill_load[i] = static_cast<double>(std::max<int64_t>(0, c.load.queued_prefill_tokens)) / bs;
    decode_load[i] = static_cast<double>(std::max<int64_t>(0, c.load.active_decode_blocks));
    need[i] = std::max<int64_t>(0, prompt_blocks - c.overlap_blocks - (kv ? c.tier_blocks : 0));
    // Blocks the decoder's growth reserve keeps free, for the requests
    // there and for this one's own growth, are not room (its Reserve would
    // wait for them: docs/engine.md "Growth reserve").
    keep[i] = c.load.growth_reserve_blocks +
              OwnGrowthBlocks(c.load.growth_ratio, prompt_tokens, params.max_tokens, bs);
    room[i] = !c.load.free_known || c.load.free_blocks - keep[i] >= need[i];
    if (CanPrefill(c.role)) ps.idx[ps.n++] = i;
    if (CanDecode(c.role)) {
      ds.idx[ds.n++] = i;
      with_room += room[i] ? 1 : 0;
    }
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
    const double ovl = out->hot_prefix_prefill ? 0 : w[i].overlap_blocks + w[i].tier_credit_blocks;
    pc[i] = kv ? params.prefill_weight * std::max(0.0, static_cast<double>(prompt_blocks) - ovl) +
                     prefill_load[i]
               : prefill_load[i];
    out->prefill_scores.push_back({w[i].id, pc[i], w[i].overlap_blocks, false});
  }
  if (with_room == 0) {
    // Only the estimate may be wrong (predictions of routes the workers
    // have not reported yet): the decoders whose last report alone has room
    // stay candidates, and their Reserve decides (it waits for blocks in
    // use to come free, or refuses holding nothing when none do).
    for (uint32_t k = 0; k < ds.n; ++k) {
      const Candidate& c = w[ds.idx[k]];
      room[ds.idx[k]] = c.load.reported_free_blocks - keep[ds.idx[k]] >= need[ds.idx[k]];
      with_room += room[ds.idx[k]] ? 1 : 0;
    }
    out->room_by_report = with_room > 0;
  }
  if (with_room == 0) {
    // Full by its own report too: a decoder whose whole pool holds the
    // blocks still takes the request; its Reserve waits for them to come
    // free (docs/serving-workers.md "Decode seats"), as vLLM's scheduler
    // keeps a request waiting until its blocks can be allocated. Only a
    // prompt no decoder's pool could hold (or pools not known) is refused.
    int64_t largest_pool = 0;
    for (uint32_t k = 0; k < ds.n; ++k) {
      const uint32_t i = ds.idx[k];
      largest_pool = std::max<int64_t>(largest_pool, w[i].pool_blocks);
      room[i] = w[i].pool_blocks > 0 && w[i].pool_blocks >= need[i];
      with_room += room[i] ? 1 : 0;
    }
    if (with_room == 0) {
      int64_t most_free = INT64_MIN, most_reported = INT64_MIN;
      for (uint32_t k = 0; k < ds.n; ++k) {
        most_free = std::max(most_free, w[ds.idx[k]].load.free_blocks);
        most_reported = std::max(most_reported, w[ds.idx[k]].load.reported_free_blocks);
      }
      std::string pools;
      if (largest_pool > 0) pools = "; the largest decoder holds " + std::to_string(largest_pool) + " in all";
      return ResourceExhaustedError("no decoder has room: the prompt needs up to " + std::to_string(prompt_blocks) +
                                    " blocks; the most free on any decoder is " + std::to_string(most_reported) +
                                    " by its last load report (" + std::to_string(most_free) +
                                    " counting the routes made since)" + pools);
    }
    out->room_by_wait = true;
  }
  // Whether p's KV can reach d (their rank layouts, issue 18).
  const uint64_t* compat = params.layout_compat;
  auto compatible = [&](uint32_t p, uint32_t d) {
    return compat == nullptr || p == d || ((compat[w[p].layout_id] >> w[d].layout_id) & 1) != 0;
  };
  // Whether p may prefill for d, room aside: a 'both' prefiller keeps the request.
  auto serves = [&](uint32_t p, uint32_t d) {
    return w[p].role == WorkerRole::kBoth ? p == d : compatible(p, d);
  };
  if (kv) {
    // Decode seats: the decoders with room in the lowest seat round. A
    // request there waits fewer generations of decode batches than on any
    // other, which outweighs any KV cost difference between them. Only a
    // decoder some prefiller here can serve sets the lowest round (one that
    // none reaches must not leave the others out).
    auto reachable = [&](uint32_t d) {
      for (uint32_t a = 0; a < ps.n; ++a) {
        if (serves(ps.idx[a], d)) return true;
      }
      return false;
    };
    int64_t lowest = INT64_MAX;
    std::array<int64_t, kMaxWorkers> round;  // [workers]
    for (uint32_t k = 0; k < ds.n; ++k) {
      const uint32_t i = ds.idx[k];
      const uint32_t seats = w[i].decode_seats;
      round[i] = seats == 0 ? 0 : std::max<int64_t>(0, w[i].load.seat_demand) / seats;
      if (room[i] && round[i] < lowest && reachable(i)) lowest = round[i];
    }
    for (uint32_t k = 0; k < ds.n; ++k) {
      const uint32_t i = ds.idx[k];
      if (room[i] && round[i] > lowest) {
        room[i] = false;
        ++out->seat_deferred;
      }
    }
  }
  for (uint32_t k = 0; k < ds.n; ++k) {
    const uint32_t i = ds.idx[k];
    const double ovl = out->hot_prefix_decode ? 0 : w[i].overlap_blocks + w[i].tier_credit_blocks;
    dc[i] = kv ? decode_load[i] + std::max(0.0, static_cast<double>(prompt_blocks) - ovl) : decode_load[i];
    out->decode_scores.push_back({w[i].id, dc[i], w[i].overlap_blocks, !room[i]});
  }

  // Transfer cost per decoder and link class (0: same node, 1: same zone,
  // 2: across zones), so that the pair loop only adds.
  std::array<std::array<double, 3>, kMaxWorkers> tcd;  // [workers][class]
  std::array<uint32_t, kMaxWorkers> roomy;             // decoders with room, [n_roomy]
  uint32_t n_roomy = 0;
  for (uint32_t k = 0; k < ds.n; ++k) {
    const uint32_t d = ds.idx[k];
    if (!room[d]) continue;
    roomy[n_roomy++] = d;
    const uint64_t block_bytes = w[d].block_bytes ? w[d].block_bytes : o.default_block_bytes;
    const double cost_bytes = kv ? o.transfer_cost_per_ms * 1e3 * static_cast<double>(need[d]) *
                                       static_cast<double>(block_bytes)
                                 : 0.0;
    tcd[d] = {cost_bytes / o.same_node_bandwidth_bytes_per_s, cost_bytes / o.cross_node_bandwidth_bytes_per_s,
              cost_bytes / o.cross_zone_bandwidth_bytes_per_s};
  }
  auto link = [&](uint32_t p, uint32_t d) -> uint32_t {
    return w[p].node_id == w[d].node_id ? 0 : (w[p].zone_id == w[d].zone_id ? 1 : 2);
  };
  auto transfer = [&](uint32_t p, uint32_t d) { return p == d ? 0.0 : tcd[d][link(p, d)]; };
  auto allowed = [&](uint32_t p, uint32_t d) { return room[d] && serves(p, d); };

  uint32_t bp = UINT32_MAX, bd = UINT32_MAX;
  if (params.policy == Policy::kKvAware || params.policy == Policy::kLeastLoaded) {
    const bool sample = kv && params.temperature > 0;
    if (sample) state->scratch.clear();
    double best = 0, best_hi = 0;  // best_hi: costs above it cannot tie
    int64_t best_running = 0;
    auto consider = [&](uint32_t p, uint32_t d, double cost) {
      if (sample) state->scratch.push_back({p, d, cost});
      if (bp != UINT32_MAX && cost > best_hi) return;
      const int64_t running = w[p].load.running_requests + (p == d ? 0 : w[d].load.running_requests);
      // Among equal costs: fewer running requests, then the emptier caches
      // (cold prefixes spread), then the lower ids.
      auto tie_better = [&] {
        if (running != best_running) return running < best_running;
        if (w[p].cache_fill != w[bp].cache_fill) return w[p].cache_fill < w[bp].cache_fill;
        if (p != d && bp != bd && w[d].cache_fill != w[bd].cache_fill) return w[d].cache_fill < w[bd].cache_fill;
        return w[p].id < w[bp].id || (w[p].id == w[bp].id && w[d].id < w[bd].id);
      };
      const bool better = bp == UINT32_MAX || CostLess(cost, best) || tie_better();
      if (better) {
        bp = p;
        bd = d;
        best = cost;
        best_hi = cost + 1e-9 * std::max(1.0, std::abs(cost));
        best_running = running;
      }
    };
    // Prefillers in increasing prefill cost: once pc[p] plus the cheapest
    // possible decode side exceeds the best pair (beyond a tie), no later
    // prefiller can win, so the loop stops (not when sampling: every pair
    // then has a probability).
    std::array<uint32_t, kMaxWorkers> by_cost;  // [ps.n]: indices into the candidates
    std::copy(ps.idx.begin(), ps.idx.begin() + ps.n, by_cost.begin());
    std::sort(by_cost.begin(), by_cost.begin() + ps.n, [&](uint32_t x, uint32_t y) { return pc[x] < pc[y]; });
    double decode_floor = std::numeric_limits<double>::infinity();  // cheapest decode side + transfer
    for (uint32_t b = 0; b < n_roomy; ++b) {
      const uint32_t d = roomy[b];
      decode_floor = std::min(decode_floor, dc[d] + std::min({tcd[d][0], tcd[d][1], tcd[d][2]}));
    }
    for (uint32_t b = 0; b < ds.n; ++b) {  // a 'both' prefiller keeps the request: no transfer
      if (room[ds.idx[b]] && w[ds.idx[b]].role == WorkerRole::kBoth) decode_floor = std::min(decode_floor, dc[ds.idx[b]]);
    }
    // The decoders with room, packed for the inner loop.
    std::array<uint32_t, kMaxWorkers> roomy_node, roomy_zone;  // [n_roomy]
    std::array<std::array<double, 4>, kMaxWorkers> roomy_cost;  // [n_roomy]: dc, then transfer per class
    for (uint32_t b = 0; b < n_roomy; ++b) {
      const uint32_t d = roomy[b];
      roomy_node[b] = w[d].node_id;
      roomy_zone[b] = w[d].zone_id;
      roomy_cost[b] = {dc[d], tcd[d][0], tcd[d][1], tcd[d][2]};
    }
    for (uint32_t a = 0; a < ps.n; ++a) {
      const uint32_t p = by_cost[a];
      if (!sample && bp != UINT32_MAX && pc[p] + decode_floor > best_hi) break;
      if (w[p].role == WorkerRole::kBoth) {
        if (room[p]) consider(p, p, pc[p] + dc[p]);
        continue;
      }
      const uint32_t p_node = w[p].node_id, p_zone = w[p].zone_id;
      for (uint32_t b = 0; b < n_roomy; ++b) {
        if (compat != nullptr && !compatible(p, roomy[b])) continue;
        const uint32_t cls = roomy_node[b] == p_node ? 0 : (roomy_zone[b] == p_zone ? 1 : 2);
        const double cost = pc[p] + roomy_cost[b][0] + roomy_cost[b][cls + 1];
        if (sample || bp == UINT32_MAX || cost <= best_hi) consider(p, roomy[b], cost);
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
    bool any_pair = false;  // ignoring room: does any prefiller reach any decoder?
    for (uint32_t a = 0; a < ps.n && !any_pair; ++a) {
      for (uint32_t b = 0; b < ds.n && !any_pair; ++b) {
        any_pair = serves(ps.idx[a], ds.idx[b]);
      }
    }
    if (!any_pair) {
      return UnavailableError("no prefiller's KV layout (tensor_parallel, pipeline_parallel) is "
                              "compatible with any decoder's; the proxy's log says why at "
                              "registration");
    }
    return ResourceExhaustedError("no (prefiller, decoder) pair has room for a prompt of " +
                                  std::to_string(prompt_blocks) + " blocks");
  }

  out->prefill = w[bp].id;
  out->decode = w[bd].id;
  out->prefill_overlap_blocks = w[bp].overlap_blocks;
  out->decode_overlap_blocks = w[bd].overlap_blocks;
  out->prefill_tier_blocks = w[bp].tier_blocks;
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
