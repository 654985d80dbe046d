// One request's KV push into a decoder's reservation (docs/kvtransfer.md,
// "Streaming push"): which bytes go when, and the rule that the notice
// travels only after every byte of the reservation landed.
//
// Streaming (transport.push: streaming): the engine reports KvProgress
// while it prefills (after each layer group of each chunk); every report
// posts the newly final bytes of the blocks the decoder lacks. Granularity:
// a block's bytes are pushed only once final for the tokens the block will
// ever hold in the prompt — a block is final for layer l once layer l of
// every prompt token in it was written, so a block the chunk boundary cuts
// waits for the next chunk. The unit of a put is one block's run of final
// layers: in the block layout [layer][K,V][kv_head][token][head_dim] a run
// of whole layers is one contiguous byte range (token rows would be strided
// per K/V and head). Runs that are contiguous both here and at the decoder
// (whole consecutive blocks) are merged into one segment.
// after_prefill: nothing moves before Finish, which pushes every block.
//
// Finish posts whatever is left together with the notice, as one transfer
// posted only once every earlier transfer of the stream has completed; if
// any failed, or the engine preempted the request (its blocks were freed
// while puts may have read them), the notice's transfer re-sends every
// block the decoder lacks instead (after the earlier ones ended), or the
// stream fails.
//
// transport.encrypt (EnableSealing, kv_sealer.h): a block is pushed only
// whole — once every layer of every prompt token in it is final — and is
// sealed into a staging block just before the write that carries it; the
// notice carries every pushed block's tag (SealRest seals whatever is left
// before the notice is built). Sealed blocks are immune to a preemption
// (the staging copy is ours), so they are never re-sealed or re-read;
// their checksums are taken from the same pool bytes when they are sealed,
// so the decoder verifies them over the plaintext it decrypts.
//
// Checksums (plan.checksum, transport.checksum): XXH3-64 of every pushed
// block, over its bytes in the local pool, computed when the block is final
// in every layer (streaming: in OnProgress, as it is posted; otherwise, or
// after a preemption, just before the notice's transfer) and handed to the
// notice builder in prompt order (blocks cached_blocks..).
//
// Threads: OnProgress on the engine thread; Finish and Abort on any thread;
// transfer callbacks on the transport's progress thread. `done` runs once,
// on whichever thread ends the stream. No lock is held across a transport
// call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/request.h"
#include "kvtransfer/kv_cipher.h"
#include "kvtransfer/slice_push.h"
#include "kvtransfer/transport.h"
#include "prefiller/kv_sealer.h"

namespace tandem::prefiller {

enum class PushMode { kStreaming, kAfterPrefill };

// Issue 18: runs the other prefill ranks' parts of a sliced push (the rank
// runtime sends each follower the spec in a push-KV step and collects
// their reports); `done` runs once, on any thread, with the first failure
// or OK and the bytes they posted, once none of their writes can land any
// more.
using FollowerPushFn = std::function<void(const kvtransfer::SlicePushSpec& spec,
                                          kvtransfer::RankSlicePusher::Done done)>;

struct PushPlan {
  kvtransfer::PeerId peer = 0;
  std::vector<uint32_t> slots;   // [prompt blocks] at the decoder
  uint32_t cached_blocks = 0;    // leading blocks the decoder already holds
  uint32_t prompt_tokens = 0;
  uint32_t block_size = 0;       // tokens per block
  uint32_t num_layers = 0;       // the block layout's; block_bytes % num_layers == 0
  uint64_t block_bytes = 0;
  bool checksum = false;  // compute XXH3-64 per pushed block for the notice
  // Issue 18 (docs/parallelism.md, "KV transfer between different
  // layouts"): set when the prefiller or the decoder has more than one
  // rank. Then the push is after-prefill only, unsealed and without
  // checksums (the prefiller refuses those settings at start-up): Finish
  // runs this rank's part (`pusher`, rank 0, on this transport) and
  // `followers` (the other ranks' parts) with `spec` plus the block ids,
  // and only once every rank's writes completed posts the notice alone to
  // `peer` (decode rank 0).
  struct Sliced {
    kvtransfer::SlicePushSpec spec;  // block_ids filled by Finish
    kvtransfer::RankSlicePusher* pusher = nullptr;  // borrowed
    FollowerPushFn followers;                       // empty: a single-rank prefiller
    uint32_t senders = 0;  // prefill ranks the slice plan has sending (KvNotice.ranks_pushed)
  };
  std::optional<Sliced> sliced;
};

class PushStream : public std::enable_shared_from_this<PushStream> {
 public:
  // kSuccess: the notice's transfer completed (every byte, then the
  // notice). Otherwise the first failure (or kErrCanceled after Abort), and
  // no byte of the stream can land any more.
  using DoneFn = std::function<void(kvtransfer::XferStatus, const Status&)>;
  // Builds the notice from the pushed blocks' checksums (empty without
  // plan.checksum). Runs once, under the stream's lock: it must not call it.
  using NoticeFn = std::function<std::string(std::vector<uint64_t> block_checksums)>;

  // Held by shared_ptr: transfer callbacks keep it alive.
  static std::shared_ptr<PushStream> Create(kvtransfer::Transport& transport, PushPlan plan,
                                            PushMode mode);
  PushStream(const PushStream&) = delete;
  PushStream& operator=(const PushStream&) = delete;

  // transport.encrypt: seal every pushed block with `key` (the
  // reservation's) into `sealer`'s staging blocks. Call once, before any
  // OnProgress. INVALID_ARGUMENT for a bad key.
  Status EnableSealing(KvSealer& sealer, std::string_view key, uint64_t reservation_id);
  bool sealing() const { return sealer_ != nullptr; }
  // Sealing only; the engine thread, before Finish with the same blocks:
  // seals every prompt block not sealed yet, and returns the tags of blocks
  // [cached_blocks, prompt blocks) in prompt order (KvNotice.kv_tags).
  Result<std::string> SealRest(std::span<const uint32_t> block_ids);
  // Returns the staging blocks to the sealer. Call once no byte of the
  // stream can be read any more (after `done`, or an Abort's `then`).
  void ReleaseStaging();

  // Engine thread. Posts the bytes that became final (streaming only).
  // `posting_allowed` false (e.g. the decoder's lease is too close) posts
  // nothing and leaves the bytes to Finish.
  void OnProgress(const engine::KvProgress& progress, bool posting_allowed = true);
  // Every prompt block is final in `block_ids` [prompt blocks]; pushes the
  // rest and then `notice`. `done` runs once (possibly inside this call).
  void Finish(std::vector<uint32_t> block_ids, std::string notice, DoneFn done);
  void Finish(std::vector<uint32_t> block_ids, NoticeFn notice, DoneFn done);
  // Stops every transfer; `then` runs once none of this stream's bytes can
  // land any more (possibly inside this call). A pending Finish's `done`
  // gets kErrCanceled instead. Later calls only add nothing.
  void Abort(std::function<void()> then);

  uint64_t bytes_posted() const;      // payload bytes posted so far
  uint32_t transfers_posted() const;  // data transfers, the notice's included

 private:
  PushStream(kvtransfer::Transport& transport, PushPlan plan, PushMode mode);
  struct Pending {  // what Finish left for the notice's transfer
    std::vector<uint32_t> block_ids;
    NoticeFn notice;
  };
  // Segments of layers [pushed_[b], final) of each block, merged; updates pushed_.
  std::vector<kvtransfer::Segment> TakeFinal(std::span<const uint32_t> block_table,
                                             const std::vector<uint32_t>& final_layers);
  // Posts one transfer counted in outstanding_; false when it could not.
  bool PostLocked(std::unique_lock<std::mutex>& lock, std::vector<kvtransfer::Segment> segments,
                  std::optional<std::string> notice, bool is_final);
  // Sliced: starts every rank's part (counted in outstanding_).
  void StartSlicesLocked(std::unique_lock<std::mutex>& lock);
  void OnSlicesDone(const kvtransfer::RankSlicePusher::Outcome& outcome, const char* whose);
  void OnDone(kvtransfer::XferId x, kvtransfer::XferStatus st, const Status& detail, bool is_final);
  // Runs what became due (the final transfer, `done`, the abort's `then`).
  void Advance(std::unique_lock<std::mutex>& lock);
  void Fail(kvtransfer::XferStatus st, Status why);  // under mu_
  // Sealing: seals prompt blocks `todo` from `block_table` (not under mu_,
  // engine thread) and records them (under mu_).
  Status SealBlocks(std::unique_lock<std::mutex>& lock, const std::vector<uint32_t>& todo,
                    std::span<const uint32_t> block_table);
  // Checksums of the blocks (cached_blocks..) final in every layer whose
  // sum is not known yet, read at `block_table` (under mu_).
  void ChecksumFinal(std::span<const uint32_t> block_table);

  kvtransfer::Transport& transport_;
  const PushPlan plan_;
  const PushMode mode_;
  const uint64_t layer_bytes_;

  mutable std::mutex mu_;
  std::vector<uint32_t> pushed_;  // [prompt blocks] leading layers posted per block
  std::vector<uint64_t> sums_;    // [prompt blocks] XXH3-64 (plan_.checksum)
  std::vector<bool> summed_;      // [prompt blocks] sums_[b] is known
  std::optional<uint32_t> attempt_;
  bool resend_all_ = false;       // an earlier post may hold stale bytes: the final one re-sends
  std::set<kvtransfer::XferId> inflight_;
  uint32_t outstanding_ = 0;      // posted or being posted, not yet terminal
  std::optional<Pending> pending_;
  bool final_posted_ = false;
  DoneFn done_;
  bool aborted_ = false;
  std::vector<std::function<void()>> abort_waiters_;
  kvtransfer::XferStatus failure_ = kvtransfer::XferStatus::kSuccess;
  Status failure_detail_;
  bool ended_ = false;            // done_ ran (or is running)
  uint64_t bytes_posted_ = 0;
  uint32_t transfers_posted_ = 0;
  bool slices_started_ = false;                 // sliced: every rank's part was started
  std::vector<kvtransfer::XferId> slice_xfers_;  // sliced: rank 0's writes (for Abort)

  // Sealing (transport.encrypt): set by EnableSealing.
  static constexpr uint32_t kUnsealed = ~0u;
  KvSealer* sealer_ = nullptr;
  std::optional<kvtransfer::KvCipher> cipher_;  // the engine thread's (OnProgress, SealRest)
  std::vector<uint32_t> sealed_to_;  // guarded by mu_: [prompt blocks] staging block or kUnsealed
  std::string tags_;                 // guarded by mu_: kKvTagBytes per block past cached_blocks
  std::vector<uint32_t> staging_;    // guarded by mu_: held staging blocks (KvSealer indices)
};

}  // namespace tandem::prefiller
