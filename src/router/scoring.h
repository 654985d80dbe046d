// The policies proper: given every worker's load and cached prefix for one
// request, choose the (prefiller, decoder) pair. Pure functions of their
// inputs plus PolicyState (round-robin cursors, the seeded RNG).
//
// kv_aware (DESIGN.md section 5), per candidate pair (p, d):
//   prefill(p)  = prefill_weight * max(0, prompt_blocks - overlap_p - tier_credit_p) + queued_prefill_blocks_p
//   decode(d)   = active_blocks_d + max(0, prompt_blocks - overlap_d - tier_credit_d)
//                 new_blocks_d = max(0, prompt_blocks - overlap_d - tier_blocks_d)
//   (tier_credit: the host/disk-tier blocks right after the device overlap,
//    each worth 1 - its onboarding cost in blocks of prefill; tier_blocks:
//    their number — the decoder onboards them instead of receiving them)
//                 d is rejected when its free blocks < new_blocks_d (the
//                 estimate; when that rejects every decoder, the last
//                 report's free blocks alone: RouteDecision::room_by_report;
//                 when that rejects every decoder too, its whole pool:
//                 RouteDecision::room_by_wait, its Reserve waits for blocks)
//   transfer    = transfer_cost_per_ms * new_blocks_d * block_bytes / bandwidth(p, d) in ms
//                 (0 when p == d)
//   cost        = prefill(p) + decode(d) + transfer
// Decode seats (kv_aware only): a decoder's seat round is
// load.seat_demand / decode_seats (whole rounds: 0 = the request gets a
// seat at once, 1 = it waits for one batch of the decoder's requests to
// end, ...). Only the decoders with room in the lowest round are candidates,
// so that a decoder whose seats are all taken gets no request while another
// has one free, and saturated decoders fill in proportion to their seats.
// The minimum wins; ties go to the pair with fewer running requests, then
// the prefiller whose cache is least full, then the decoder likewise (so
// prefixes no worker holds yet spread over the fleet's capacity instead of
// all landing on the lowest id; once cached, the overlap keeps them where
// they are), then the lowest prefiller id, then the lowest decoder id. With temperature T > 0
// the pair is drawn with probability proportional to exp(-cost / T).
//
// Pairs: a 'prefill' worker pairs with any decode-capable worker whose KV
// layout is compatible with its own (ScoringParams::layout_compat); a 'both'
// worker that prefills also decodes (aggregated: one worker, no transfer).
//
// Thread-safety: none; Router calls Score under its mutex.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "common/status.h"
#include "router/load_tracker.h"
#include "router/route_decision.h"
#include "router/router_options.h"
#include "router/types.h"

namespace tandem::router {

// One registered worker as the scorer sees it.
struct Candidate {
  WorkerId id = kNoWorker;
  WorkerRole role = WorkerRole::kBoth;
  uint32_t node_id = 0;
  uint32_t zone_id = 0;
  uint64_t block_bytes = 0;
  WorkerLoad load;
  uint32_t overlap_blocks = 0;  // leading prompt blocks it caches (device tier)
  uint32_t tier_blocks = 0;     // host/disk-tier blocks right after those
  double tier_credit_blocks = 0;  // tier_blocks weighted by 1 - onboarding cost
  // Share of its KV pool its cached (device-tier) blocks fill: the index's
  // count over the registered pool size (the raw count when the size is
  // unknown). Breaks ties between equal-cost pairs, so cold prefixes spread.
  double cache_fill = 0;
  uint32_t layout_id = 0;  // its rank layout, a row/column of ScoringParams::layout_compat
  uint32_t decode_seats = 0;  // WorkerInfo::decode_seats (0: unknown, seats ignored)
  uint32_t pool_blocks = 0;   // WorkerInfo::num_blocks, its whole KV pool (0: unknown)
};

struct ScoringParams {
  Policy policy = Policy::kKvAware;
  double prefill_weight = 1.0;
  double temperature = 0.0;
  uint32_t local_prefill_threshold_tokens = 0;
  const RouterOptions* options = nullptr;  // never null
  // Rank layouts (issue 18): bit layout_id(d) of row layout_id(p) set when
  // prefiller p may send KV to decoder d (WorkerSet::layout_compat); null:
  // every pair is compatible. A worker prefilling for itself needs no transfer.
  const uint64_t* layout_compat = nullptr;
  // The request's max_tokens (0: unknown): a decoder's growth reserve keeps
  // a share of what it may generate free too (OwnGrowthBlocks), not room.
  uint32_t max_tokens = 0;
};

struct PolicyState {
  explicit PolicyState(uint64_t seed) : rng(seed) {}
  uint64_t rr_prefill = 0;
  uint64_t rr_decode = 0;
  std::mt19937_64 rng;
  struct Pair {
    uint32_t p;  // index into the candidates
    uint32_t d;
    double cost;
  };
  std::vector<Pair> scratch;  // temperature sampling
};

// Fills `out` (vectors reused). Errors: Unavailable when no worker can
// prefill or decode; ResourceExhausted when no decoder's pool can hold the
// request's blocks (or no decoder has room and the pools are not known).
Status Score(std::span<const Candidate> workers, uint32_t prompt_tokens, const ScoringParams& params,
             PolicyState* state, RouteDecision* out);

}  // namespace tandem::router
