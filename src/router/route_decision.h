// What the router decided for one request, and why: the chosen workers,
// their predicted cached prefixes, every candidate's cost, and a one-line
// debug string with the scores (built only when asked for).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "router/router_options.h"
#include "router/types.h"

namespace tandem::router {

struct RouteRequest {
  // HashBlocks of the prompt (its full blocks), tenant salt folded in.
  std::span<const uint64_t> block_hashes;
  uint32_t prompt_tokens = 0;
  // The request's TTFT SLO in ms (0: none). Prefillers whose predicted TTFT
  // exceeds it are left out of the choice while another one meets it
  // (router/ttft_predictor.h).
  double ttft_slo_ms = 0;
  // Workers the request must not go to (the proxy's retry excludes the ones
  // that failed it); null: none. Borrowed for the call.
  const WorkerMask* exclude = nullptr;
  // The request's max_tokens (less those already sent, on a migration); 0:
  // unknown. A decoder's growth reserve keeps a share of it free.
  uint32_t max_tokens = 0;
};

// Names the load one decision added (docs/router.md, "Load"): the prefill
// work on its prefilling worker, for Router::EndPrefill, and the decode
// blocks on `decode`, for Router::EndAttempt. id 0: none.
struct PrefillTicket {
  WorkerId worker = kNoWorker;
  uint64_t id = 0;
  WorkerId decode = kNoWorker;
  int64_t time_ns = 0;  // when it was routed (the router's clock)
};

// One worker's cost on one side of the pair (lower is better).
struct WorkerScore {
  WorkerId worker = kNoWorker;
  double cost = 0;              // side cost, without transfer
  uint32_t overlap_blocks = 0;  // leading prompt blocks it caches
  bool no_room = false;         // decode side: fewer free blocks than needed, or left out for its seat round
};

struct RouteDecision {
  Policy policy = Policy::kKvAware;
  WorkerId prefill = kNoWorker;  // == decode when local_prefill
  WorkerId decode = kNoWorker;
  // The decode worker prefills too: an aggregated ('both') worker, or
  // conditional disaggregation. No prefiller, no KV transfer.
  bool local_prefill = false;
  bool conditional_local = false;  // local because the uncached part was short
  bool hot_prefix_prefill = false;  // guard ignored the cache on the prefill side
  bool hot_prefix_decode = false;   // ... on the decode side

  uint32_t prompt_tokens = 0;
  uint32_t prompt_blocks = 0;           // ceil(prompt_tokens / block_size)
  uint32_t prefill_overlap_blocks = 0;  // predicted cached prefix on the prefiller
  uint32_t decode_overlap_blocks = 0;   // ... on the decoder
  uint32_t prefill_tier_blocks = 0;     // host/disk-tier blocks after the prefiller's overlap
  uint32_t transfer_blocks = 0;         // blocks the prefiller pushes to the decoder

  double prefill_cost = 0;
  double decode_cost = 0;
  double transfer_cost = 0;
  double cost = 0;  // prefill + decode + transfer
  // Predicted time to first token on the chosen pair (router/ttft_predictor.h);
  // < 0: unknown (the prefiller's rate is not measured yet).
  double predicted_ttft_ms = -1;
  uint32_t slo_excluded = 0;  // prefillers left out for a predicted TTFT over the SLO
  // No decoder had room by the router's estimate (last report minus the
  // predictions since), so the decoder was chosen by its last report alone:
  // its Reserve decides (docs/router.md, "Room").
  bool room_by_report = false;
  // No decoder had room by its last report either: the chosen one's whole
  // pool holds the blocks, and its Reserve waits for them to come free.
  bool room_by_wait = false;
  // Decode seats (kv_aware): decoders with room left out because their seat
  // round (requests registered / seats) was above the lowest one.
  uint32_t seat_deferred = 0;

  // Set by Router::Route (not by Score): the caller ends it with
  // Router::EndPrefill once this route's prefill is over, and with
  // Router::EndAttempt once the attempt is (finished, failed, abandoned,
  // or the decision not used).
  PrefillTicket prefill_ticket;

  std::vector<WorkerScore> prefill_scores;  // every prefill candidate, by id
  std::vector<WorkerScore> decode_scores;   // every decode candidate, by id

  // "policy=kv_aware p=3 d=7 local=0 cost=12.5(p=4 d=8 t=0.5) ovl p=10 d=2/16
  //  guard=-- | P 3:4.0/10 5:9.0/0 | D 7:8.0/2 9:x/0"
  std::string DebugString() const;
};

}  // namespace tandem::router
