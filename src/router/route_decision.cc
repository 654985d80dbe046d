#include "router/route_decision.h"

#include <cstdio>

namespace tandem::router {

std::string_view PolicyName(Policy p) {
  switch (p) {
    case Policy::kKvAware: return "kv_aware";
    case Policy::kLeastLoaded: return "least_loaded";
    case Policy::kRoundRobin: return "round_robin";
    case Policy::kRandom: return "random";
  }
  return "?";
}

Result<Policy> ParsePolicy(std::string_view name) {
  for (Policy p : {Policy::kKvAware, Policy::kLeastLoaded, Policy::kRoundRobin, Policy::kRandom}) {
    if (PolicyName(p) == name) return p;
  }
  return InvalidArgumentError("unknown router policy '" + std::string(name) +
                              "'; expected kv_aware, least_loaded, round_robin or random");
}

namespace {

void Append(std::string* s, const char* fmt, auto... args) {
  char buf[160];
  const int n = std::snprintf(buf, sizeof buf, fmt, args...);
  if (n > 0) s->append(buf, static_cast<size_t>(std::min<int>(n, static_cast<int>(sizeof buf) - 1)));
}

std::string WorkerStr(WorkerId w) { return w == kNoWorker ? "-" : std::to_string(w); }

}  // namespace

std::string RouteDecision::DebugString() const {
  std::string s;
  s.reserve(96 + 20 * (prefill_scores.size() + decode_scores.size()));
  Append(&s, "policy=%s p=%s d=%s local=%d%s cost=%.2f(p=%.2f d=%.2f t=%.2f) ovl p=%u d=%u/%u xfer=%u guard=%c%c%s%s |P",
         std::string(PolicyName(policy)).c_str(), WorkerStr(prefill).c_str(), WorkerStr(decode).c_str(),
         local_prefill ? 1 : 0, conditional_local ? "(cond)" : "", cost, prefill_cost, decode_cost, transfer_cost,
         prefill_overlap_blocks, decode_overlap_blocks, prompt_blocks, transfer_blocks,
         hot_prefix_prefill ? 'P' : '-', hot_prefix_decode ? 'D' : '-', room_by_report ? " room=report" : room_by_wait ? " room=wait" : "",
         seat_deferred > 0 ? " seats=deferred" : "");
  if (predicted_ttft_ms >= 0) Append(&s, " ttft=%.1fms", predicted_ttft_ms);
  for (const WorkerScore& w : prefill_scores) Append(&s, " %u:%.2f/%u", w.worker, w.cost, w.overlap_blocks);
  s += " |D";
  for (const WorkerScore& w : decode_scores) {
    if (w.no_room) {
      Append(&s, " %u:full/%u", w.worker, w.overlap_blocks);
    } else {
      Append(&s, " %u:%.2f/%u", w.worker, w.cost, w.overlap_blocks);
    }
  }
  return s;
}

}  // namespace tandem::router
