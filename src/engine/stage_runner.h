// One rank's part of a step in a tensor × pipeline parallel group (issue 18,
// docs/parallelism.md "Pipeline parallel"), shared by rank 0's
// ParallelBackend and the follower ranks (parallel/follower.h):
//
//   for each micro-batch i of the step (pp > 1: up to pp of them):
//     stage > 0:  Recv hidden [T_i][hidden] from the same tensor rank of stage - 1
//     ForwardStage (this rank's layers and heads; TP all-reduces inside)
//     stage < last: Send hidden [T_i][hidden] to the same tensor rank of stage + 1
//     last stage, tensor rank 0: Send logits [R_i][vocab] to rank 0
//   rank 0 (pp > 1): Recv each micro-batch's logits into its rows.
//
// While stage s computes micro-batch i, stage s - 1 computes i + 1 (the
// micro-batches in flight). Rank 0 receives micro-batch i - (pp - 1)'s
// logits before sending micro-batch i, so the schedule needs no buffering in
// the communicator (a rendezvous Send is deadlock-free).
//
// Communicators of rank r (stage s, tensor rank t) of group G:
//   "G-world"  all ranks, rank r: the step plans (rank 0 broadcasts)
//   "G-tp<s>"  stage s's tensor ranks, rank t (tp > 1 only): all-reduces
//   "G-pp<t>"  tensor rank t of every stage, rank s (pp > 1 only):
//              activations, and logits from the last stage to stage 0
//
// Thread-safety: one thread (the rank's engine / follower thread) uses a
// StageRunner and its communicators.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "engine/llama_forward.h"
#include "kernels/cpu/thread_pool.h"
#include "parallel/communicator.h"
#include "parallel/parallel_layout.h"

namespace tandem::engine {

struct RankComms {
  std::unique_ptr<parallel::Communicator> world;  // all ranks
  std::unique_ptr<parallel::Communicator> tp;     // null when tp == 1
  std::unique_ptr<parallel::Communicator> pp;     // null when pp == 1
};

// Joins rank `rank`'s communicators (in the order world, tp, pp: every rank
// does the same, so joins cannot wait on each other in a cycle). Blocks
// until every member joined or `join_timeout_ms` passed.
Result<RankComms> JoinRankComms(const parallel::ParallelLayout& layout, uint32_t rank,
                                const std::string& group, int64_t join_timeout_ms);

class StageRunner {
 public:
  // All borrowed; must outlive the runner.
  StageRunner(const parallel::ParallelLayout& layout, uint32_t rank, LlamaForward* model,
              const KvPool* pool, RankComms* comms, kernels::cpu::ThreadPool* threads);

  // Runs this rank's part of the step. `micro_batch_ends` as
  // StepPlan::micro_batch_ends (empty: one micro-batch). `logits`: rank 0
  // only, [sum num_logits][vocab] in batch order; empty on the others.
  // `on_layer_done`: pp == 1 only (layer progress of the whole batch).
  Status Run(std::span<const SeqChunk> batch, std::span<const uint32_t> micro_batch_ends,
             std::span<float> logits, const std::function<void(uint32_t)>& on_layer_done = {});

 private:
  Status RecvLogits(std::span<float> logits, size_t row_begin, size_t rows);
  Status TpContext(Status st) const;

  parallel::ParallelLayout layout_;
  uint32_t rank_, stage_, tp_rank_;
  LlamaForward* model_;
  const KvPool* pool_;
  RankComms* comms_;
  kernels::cpu::ThreadPool* threads_;
  std::vector<float> hidden_in_, hidden_out_;  // [T_i][hidden]
  std::vector<float> logits_;                  // [R_i][vocab], last stage's tensor rank 0
};

}  // namespace tandem::engine
