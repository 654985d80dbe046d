// The step plan rank 0 of a worker group broadcasts to every follower rank
// each engine step (issue 18, docs/parallelism.md "Pipeline parallel"): what
// to compute (the sequences' chunks and how they are cut into pipeline
// micro-batches), or that the followers push KV (kv-reshard's fields) or
// shut down.
//
// Wire format (little-endian, versioned, tagged so later fields do not break
// older parsers):
//   header: magic u32 "TSPL", version u16 (1), kind u8, reserved u8,
//           step u64, field count u32
//   field:  tag u16, reserved u16, length u32, `length` payload bytes
//   tag 1 (chunks):           count u32, then per chunk: start_pos u32,
//                             num_logits u32, n_tokens u32, n_blocks u32,
//                             tokens u32[n_tokens], block_table u32[n_blocks]
//   tag 2 (micro-batch ends): count u32, ends u32[count] (chunk indices,
//                             ascending, the last one == chunk count)
//   tags >= 16: extensions, carried through untouched (kv-reshard's push_kv
//               fields use 16-31); a parser keeps unknown tags in
//               StepPlan::extensions rather than failing.
//
// Over a communicator the plan travels as one fixed-size broadcast of
// kPlanInlineBytes (the size and the first bytes; a decode step's plan fits)
// plus, only when it is larger, a second broadcast of the rest.
//
// Pure values and functions; SendStepPlan/ReceiveStepPlan use the
// communicator from the caller's thread (Communicator's thread rule).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "parallel/communicator.h"

namespace tandem::parallel {

enum class StepKind : uint8_t {
  kForward = 1,   // compute `chunks` (ComputeBackend::Forward)
  kPushKv = 2,    // push KV slices to a decoder (kv-reshard's extension fields)
  kShutdown = 3,  // followers leave their loop and exit 0
};
const char* StepKindName(StepKind kind);

// One sequence's part of the step (engine::SeqChunk, owning its arrays).
struct PlanChunk {
  std::vector<uint32_t> tokens;       // [n]
  uint32_t start_pos = 0;
  std::vector<uint32_t> block_table;  // blocks covering [0, start_pos + n)
  uint32_t num_logits = 0;
  bool operator==(const PlanChunk&) const = default;
};

struct PlanField {
  uint16_t tag = 0;
  std::vector<std::byte> bytes;
  bool operator==(const PlanField&) const = default;
};

struct StepPlan {
  StepKind kind = StepKind::kForward;
  uint64_t step = 0;  // rank 0's step counter (for logs and mismatch checks)
  std::vector<PlanChunk> chunks;
  // Pipeline micro-batches: micro-batch i is chunks [ends[i-1], ends[i]).
  // Empty: the whole step is one micro-batch.
  std::vector<uint32_t> micro_batch_ends;
  std::vector<PlanField> extensions;  // tags >= kFirstExtensionTag
  bool operator==(const StepPlan&) const = default;
};

inline constexpr uint16_t kFirstExtensionTag = 16;
inline constexpr size_t kPlanInlineBytes = 4096;

std::vector<std::byte> SerializeStepPlan(const StepPlan& plan);
// INVALID_ARGUMENT naming what is wrong (magic, version, a truncated field,
// micro-batch ends out of order).
Result<StepPlan> ParseStepPlan(std::span<const std::byte> bytes);

// Cuts `tokens_per_chunk.size()` sequences into at most `max_micro_batches`
// contiguous, non-empty micro-batches of about equal token counts; returns
// their ends (see StepPlan::micro_batch_ends). At least one micro-batch when
// there is at least one chunk.
std::vector<uint32_t> SplitMicroBatches(std::span<const uint32_t> tokens_per_chunk,
                                        uint32_t max_micro_batches);

// Rank `root` of `world` sends the plan to every other rank (collective: all
// ranks call, the root SendStepPlan, the others ReceiveStepPlan).
Status SendStepPlan(Communicator& world, const StepPlan& plan, int root = 0);
Result<StepPlan> ReceiveStepPlan(Communicator& world, int root = 0);

}  // namespace tandem::parallel
