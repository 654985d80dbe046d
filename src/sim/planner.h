// `tandem plan`: from a timing model, a link and a workload, recommends an
// aggregated or a disaggregated fleet, the P:D ratio and whether the KV
// transfer stays under 30 % of the prefill it offloads (DESIGN.md section
// 1). Steady-state arithmetic on the same TimingModel the `sim` backend
// sleeps by; docs/sim.md gives every formula.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/timing_model.h"

namespace tandem::sim {

// Token counts: mean and max (a fixed length has mean == max).
struct LengthDist {
  double mean = 0;
  uint64_t max = 0;
};

// "512" (fixed) or "128-4096" (uniform range). Errors name `what`.
Result<LengthDist> ParseLengthDist(const std::string& text, const std::string& what);

struct Workload {
  double rate_per_s = 1.0;  // Poisson arrivals
  LengthDist input;         // prompt tokens
  LengthDist output;        // generated tokens
  double prefix_reuse = 0;  // share of prompt tokens found in a prefix cache, [0, 1)
};

struct PlanOptions {
  LinkParams link;
  Workload workload;
  uint32_t max_batched_tokens = 512;  // aggregated chunked-prefill budget per step
  uint32_t max_num_seqs = 256;        // running sequences per worker
  uint32_t block_size = 16;
  double itl_slo_s = 0.05;            // inter-token latency target
  double target_utilization = 0.8;    // of a prefiller's compute time
  uint32_t max_workers = 256;         // search limit per role
  double overhead_limit = 0.3;        // the 30 % rule
};

struct PlanRow {
  std::string quantity, value, note;
};

struct DecodeFit {
  bool feasible = false;
  uint32_t workers = 0;
  double batch = 0;           // running sequences per worker
  double itl_s = 0;           // mean inter-token latency
  double itl_spike_s = 0;     // a step that carries a prefill chunk (aggregated only)
  std::string why_not;        // when infeasible
};

struct Plan {
  // Prefill of one mean prompt (uncached part, after the cached prefix).
  double prefill_s = 0;
  double prefill_max_s = 0;   // the longest prompt
  double transfer_s = 0;      // its uncached KV over the link
  double overhead_ratio = 0;  // transfer_s / prefill_s
  bool overhead_ok = false;   // overhead_ratio <= overhead_limit
  // Disaggregated.
  uint32_t prefillers = 0;
  double prefill_utilization = 0;
  DecodeFit decode;
  double disagg_ttft_s = 0;
  // Aggregated.
  DecodeFit aggregated;
  double agg_ttft_s = 0;
  // The answer.
  bool disaggregate = false;
  std::string reason;
  std::vector<PlanRow> rows;  // the reasoning, in order
};

Result<Plan> MakePlan(const TimingModel& model, const PlanOptions& options);

// Issue 18: which tensor_parallel x pipeline_parallel layout per worker.
// Every layout tp x pp (powers of two, tp * pp <= max_gpus_per_worker) the
// shape allows and the memory holds is planned with MakePlan; the answer is
// the feasible one needing the fewest GPUs in all, then the lowest ITL,
// then the fewest GPUs per worker. Ranks fill nodes in order
// (`base.gpus_per_node`), so a layout whose TP group spans nodes pays the
// inter-node link in every all-reduce, and one whose stages span nodes pays
// it once per stage boundary: with a slow inter-node link the answer keeps
// TP inside a node and spreads stages across nodes.
struct LayoutCandidate {
  uint32_t tp = 1, pp = 1;
  bool fits = false;           // the layout splits the shape and the weights fit
  std::string why_not;         // when it does not fit, or misses the SLO
  uint32_t nodes = 1;          // nodes one worker spans
  std::string tp_link, pp_link;
  bool feasible = false;       // its plan meets the SLO
  uint32_t gpus = 0;           // GPUs of the whole fleet it plans
  double itl_s = 0;            // decode ITL of that plan
  uint64_t kv_tokens = 0;      // KV capacity per worker
  Plan plan;
};

struct ParallelRecommendation {
  std::vector<LayoutCandidate> candidates;
  int best = -1;               // index into candidates; -1: nothing fits
  std::string reason;
  std::vector<PlanRow> rows;   // one per candidate, then the answer
};

Result<ParallelRecommendation> RecommendParallel(const TimingParams& base,
                                                 const PlanOptions& options,
                                                 uint32_t max_gpus_per_worker);

// The rows as an aligned text table.
std::string FormatPlan(const Plan& plan);

}  // namespace tandem::sim
