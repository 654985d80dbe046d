// The rank-group side of KV pushes between different layouts (issue 18,
// docs/parallelism.md "KV transfer between different layouts"): what the
// ranks of one worker tell each other over their world communicator.
//
//   - Decoder (and prefiller) start-up: every rank registers its own pool
//     with its own transport; ExchangeRankDescriptors gives rank 0 every
//     rank's descriptor by rank (DecoderOptions::rank_descriptors).
//   - A sliced push on a multi-rank prefiller: rank 0 sends the followers
//     the SlicePushSpec (the step plan's push_kv kind, extension tag
//     kPushKvSpecTag carrying SlicePushSpec::Encode()); each follower runs
//     RunFollowerPush — its part on its own transport, then one report to
//     rank 0 — and rank 0, after its own part, CollectPushReports: the
//     notice goes only when every report is in and OK.
//
// Wire (Send/Recv between ranks of one build): a descriptor is an 8-byte
// little-endian length then the bytes; a push report is a fixed
// kPushReportBytes message (magic "TKPR", status code, bytes, writes, the
// message truncated to fit).
//
// Thread-safety: the Communicator's rule — the calling rank's one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvtransfer/slice_push.h"
#include "parallel/communicator.h"

namespace tandem::kvtransfer {

// The step plan extension tag (parallel/step_plan.h, tags 16-31 are
// kv-reshard's) carrying SlicePushSpec::Encode() in a push_kv plan.
inline constexpr uint16_t kPushKvSpecTag = 16;
inline constexpr size_t kPushReportBytes = 1024;

// Collective over `world` (every rank calls): rank 0 returns every rank's
// descriptor, indexed by rank (its own `mine` at 0); the others return an
// empty vector once theirs was sent. A descriptor above 1 MiB is refused.
Result<std::vector<std::string>> ExchangeRankDescriptors(parallel::Communicator& world,
                                                         const std::string& mine);

// Follower rank: runs its part of the push `spec_bytes` describes (an
// undecodable spec is reported as the error) and sends rank 0 its report.
// Returns non-OK only when the report could not be sent (the group is
// broken: the follower should exit).
Status RunFollowerPush(std::span<const std::byte> spec_bytes, RankSlicePusher& pusher,
                       parallel::Communicator& world);

// Rank 0: one report from each of ranks 1 .. world.size() - 1 (every
// follower sends one for every push_kv plan, even when it had nothing to
// push), merged: bytes and writes summed, the first failure (naming the
// rank) or OK. A communicator failure is reported as the failure.
RankSlicePusher::Outcome CollectPushReports(parallel::Communicator& world);

// Rank 0 of a multi-rank prefiller (the body of PrefillerOptions::
// follower_push), on the thread that owns `world` — the engine thread: a
// push's Finish runs from the prefill's last output. `send_plan` sends every
// follower a push_kv step plan carrying `spec.Encode()` under
// kPushKvSpecTag (pp-runtime's ParallelBackend::BroadcastPlan); then every
// follower's report is collected. Blocks the engine thread until the
// followers' writes ended (milliseconds for a prompt's KV on one host).
RankSlicePusher::Outcome PushThroughFollowers(
    const SlicePushSpec& spec, const std::function<Status(std::string spec_bytes)>& send_plan,
    parallel::Communicator& world);

// The report's encoding (exposed for tests).
std::vector<std::byte> EncodePushReport(const RankSlicePusher::Outcome& outcome);
Result<RankSlicePusher::Outcome> DecodePushReport(std::span<const std::byte> bytes);

}  // namespace tandem::kvtransfer
