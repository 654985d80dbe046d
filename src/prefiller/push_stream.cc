#include "prefiller/push_stream.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/kv_checksum.h"

namespace tandem::prefiller {

namespace kv = kvtransfer;

namespace {

// How a write the transport refused ends the stream: a peer it declared
// lost (UNAVAILABLE) or released (being released: CANCELLED; gone:
// NOT_FOUND) as kErrRemoteDisconnect, so that the prefiller treats it as
// the loss it is; a restarted one as stale.
kv::XferStatus RefusedAs(const Status& s, kv::XferStatus otherwise) {
  switch (s.code()) {
    case StatusCode::kUnavailable:
    case StatusCode::kCancelled:
    case StatusCode::kNotFound:
      return kv::XferStatus::kErrRemoteDisconnect;
    case StatusCode::kFailedPrecondition:
      return kv::XferStatus::kErrStaleDescriptor;
    default:
      return otherwise;
  }
}

}  // namespace

std::shared_ptr<PushStream> PushStream::Create(kv::Transport& transport, PushPlan plan,
                                               PushMode mode) {
  return std::shared_ptr<PushStream>(new PushStream(transport, std::move(plan), mode));
}

PushStream::PushStream(kv::Transport& transport, PushPlan plan, PushMode mode)
    : transport_(transport),
      plan_(std::move(plan)),
      mode_(plan_.sliced ? PushMode::kAfterPrefill : mode),
      layer_bytes_(plan_.num_layers == 0 ? plan_.block_bytes : plan_.block_bytes / plan_.num_layers),
      pushed_(plan_.slots.size(), 0),
      sums_(plan_.slots.size(), 0),
      summed_(plan_.slots.size(), false) {}

void PushStream::ChecksumFinal(std::span<const uint32_t> block_table) {
  if (!plan_.checksum) return;
  const uint32_t n = static_cast<uint32_t>(std::min(block_table.size(), pushed_.size()));
  for (uint32_t b = plan_.cached_blocks; b < n; ++b) {
    if (summed_[b] || pushed_[b] < plan_.num_layers) continue;
    sums_[b] = KvChecksum(transport_.block(block_table[b]), plan_.block_bytes);
    summed_[b] = true;
  }
}

uint64_t PushStream::bytes_posted() const {
  std::lock_guard lock(mu_);
  return bytes_posted_;
}

uint32_t PushStream::transfers_posted() const {
  std::lock_guard lock(mu_);
  return transfers_posted_;
}

std::vector<kv::Segment> PushStream::TakeFinal(std::span<const uint32_t> block_table,
                                               const std::vector<uint32_t>& final_layers) {
  std::vector<kv::Segment> segs;
  const uint32_t n = static_cast<uint32_t>(std::min(block_table.size(), pushed_.size()));
  for (uint32_t b = plan_.cached_blocks; b < n; ++b) {
    const uint32_t from = pushed_[b], to = final_layers[b];
    if (to <= from) continue;
    kv::Segment s;
    // Sealing: the block's ciphertext in its staging block (whole blocks only).
    const uint32_t local = sealer_ != nullptr ? sealed_to_[b] : block_table[b];
    s.local_offset_bytes = uint64_t{local} * plan_.block_bytes + from * layer_bytes_;
    s.remote_offset_bytes = uint64_t{plan_.slots[b]} * plan_.block_bytes + from * layer_bytes_;
    s.length_bytes = uint64_t{to - from} * layer_bytes_;
    pushed_[b] = to;
    if (!segs.empty()) {
      kv::Segment& prev = segs.back();
      if (prev.local_offset_bytes + prev.length_bytes == s.local_offset_bytes &&
          prev.remote_offset_bytes + prev.length_bytes == s.remote_offset_bytes) {
        prev.length_bytes += s.length_bytes;
        continue;
      }
    }
    segs.push_back(s);
  }
  return segs;
}

void PushStream::OnProgress(const engine::KvProgress& p, bool posting_allowed) {
  if (mode_ != PushMode::kStreaming) return;
  std::unique_lock lock(mu_);
  if (ended_ || aborted_ || failure_ != kv::XferStatus::kSuccess || pending_) return;
  // Preempted: the blocks were freed while puts may have read them. Sealed
  // blocks were copied when final, so only an unsealed stream re-sends.
  if (attempt_ && *attempt_ != p.attempt && sealer_ == nullptr) resend_all_ = true;
  attempt_ = p.attempt;
  if (resend_all_ || !posting_allowed) return;
  const uint32_t bs = plan_.block_size;
  std::vector<uint32_t> final_layers(pushed_.size(), 0);
  std::vector<uint32_t> to_seal;
  for (uint32_t b = plan_.cached_blocks; b < final_layers.size(); ++b) {
    const uint32_t end = std::min((b + 1) * bs, plan_.prompt_tokens);
    if (end <= p.final_tokens) {
      final_layers[b] = plan_.num_layers;
      if (sealer_ != nullptr && sealed_to_[b] == kUnsealed && b < p.block_table.size()) {
        to_seal.push_back(b);
      }
    } else if (end <= p.chunk_end && sealer_ == nullptr) {
      final_layers[b] = std::min(p.layers_done, plan_.num_layers);
    }
  }
  if (sealer_ != nullptr) {
    // A block that could not be sealed now is left to SealRest, which
    // reports the error.
    if (!to_seal.empty() && !SealBlocks(lock, to_seal, p.block_table).ok()) return;
    if (ended_ || aborted_ || failure_ != kv::XferStatus::kSuccess || pending_) return;
    for (uint32_t b = plan_.cached_blocks; b < final_layers.size(); ++b) {
      if (sealed_to_[b] == kUnsealed) final_layers[b] = 0;
    }
  }
  std::vector<kv::Segment> segs = TakeFinal(p.block_table, final_layers);
  if (segs.empty()) return;
  ChecksumFinal(p.block_table);
  PostLocked(lock, std::move(segs), std::nullopt, /*is_final=*/false);
  Advance(lock);
}

void PushStream::Finish(std::vector<uint32_t> block_ids, std::string notice, DoneFn done) {
  Finish(std::move(block_ids),
         [notice = std::move(notice)](std::vector<uint64_t>) { return notice; }, std::move(done));
}

void PushStream::Finish(std::vector<uint32_t> block_ids, NoticeFn notice, DoneFn done) {
  std::unique_lock lock(mu_);
  if (pending_ || ended_) return;  // Finish twice: the first one stands
  pending_ = Pending{std::move(block_ids), std::move(notice)};
  done_ = std::move(done);
  Advance(lock);
}

void PushStream::Abort(std::function<void()> then) {
  std::vector<kv::XferId> ids;
  {
    std::unique_lock lock(mu_);
    aborted_ = true;
    Fail(kv::XferStatus::kErrCanceled, CancelledError("KV push aborted"));
    if (then) abort_waiters_.push_back(std::move(then));
    ids.assign(inflight_.begin(), inflight_.end());
    // Rank 0's slice writes; the followers' parts end on their own (their
    // writes complete or fail), and `then` waits for their reports.
    ids.insert(ids.end(), slice_xfers_.begin(), slice_xfers_.end());
  }
  for (kv::XferId x : ids) transport_.Abort(x).IgnoreError();  // NOT_FOUND once released
  std::unique_lock lock(mu_);
  Advance(lock);
}

void PushStream::Fail(kv::XferStatus st, Status why) {
  if (failure_ != kv::XferStatus::kSuccess) return;  // the first failure stands
  failure_ = st == kv::XferStatus::kSuccess ? kv::XferStatus::kErrBackend : st;
  failure_detail_ = std::move(why);
}

bool PushStream::PostLocked(std::unique_lock<std::mutex>& lock, std::vector<kv::Segment> segments,
                            std::optional<std::string> notice, bool is_final) {
  uint64_t bytes = 0;
  for (const kv::Segment& s : segments) bytes += s.length_bytes;
  ++outstanding_;
  // Counted before the post: its completion may run before Post returns.
  bytes_posted_ += bytes;
  ++transfers_posted_;
  lock.unlock();
  auto x = transport_.PrepareWrite(plan_.peer, std::move(segments), std::move(notice));
  lock.lock();
  if (!x.ok()) {
    --outstanding_;
    bytes_posted_ -= bytes;
    --transfers_posted_;
    Fail(RefusedAs(x.status(), kv::XferStatus::kErrInvalidArgument),
         x.status().WithContext("preparing the KV push"));
    return false;
  }
  inflight_.insert(*x);
  const bool abort_now = aborted_;
  lock.unlock();
  auto self = shared_from_this();
  Status posted = transport_.Post(*x, [self, is_final](kv::XferId id, kv::XferStatus st,
                                                       const Status& detail) {
    self->OnDone(id, st, detail, is_final);
  });
  if (!posted.ok()) {
    transport_.Release(*x).IgnoreError();
    lock.lock();
    inflight_.erase(*x);
    --outstanding_;
    bytes_posted_ -= bytes;
    --transfers_posted_;
    Fail(RefusedAs(posted, kv::XferStatus::kErrBackend), posted.WithContext("posting the KV push"));
    return false;
  }
  if (abort_now) transport_.Abort(*x).IgnoreError();
  lock.lock();
  return true;
}

void PushStream::OnDone(kv::XferId x, kv::XferStatus st, const Status& detail, bool is_final) {
  transport_.Release(x).IgnoreError();
  std::unique_lock lock(mu_);
  inflight_.erase(x);
  --outstanding_;
  if (st != kv::XferStatus::kSuccess) {
    Fail(st, detail.ok() ? Status(StatusCode::kUnavailable, std::string(kv::XferStatusName(st)))
                         : detail);
  } else if (is_final && !ended_) {
    ended_ = true;
    DoneFn done = std::move(done_);
    lock.unlock();
    if (done) done(kv::XferStatus::kSuccess, Status::Ok());
    lock.lock();
  }
  Advance(lock);
}

void PushStream::Advance(std::unique_lock<std::mutex>& lock) {
  while (outstanding_ == 0) {
    const bool failed = failure_ != kv::XferStatus::kSuccess;
    if (failed) {
      // Nothing of ours can land any more: report, then release abort waiters.
      if (pending_ && !ended_) {
        ended_ = true;
        DoneFn done = std::move(done_);
        const kv::XferStatus st = failure_;
        const Status why = failure_detail_;
        lock.unlock();
        if (done) done(st, why);
        lock.lock();
        continue;
      }
      if (abort_waiters_.empty()) return;
      auto waiters = std::move(abort_waiters_);
      abort_waiters_.clear();
      lock.unlock();
      for (auto& w : waiters) w();
      lock.lock();
      continue;
    }
    if (!pending_ || final_posted_ || ended_) return;
    if (plan_.sliced && !slices_started_) {
      // Every rank's slices first; the notice once all completed.
      StartSlicesLocked(lock);
      continue;
    }
    // Every earlier transfer completed: the rest, then the notice.
    final_posted_ = true;
    if (sealer_ != nullptr &&
        std::any_of(sealed_to_.begin() + plan_.cached_blocks, sealed_to_.end(),
                    [](uint32_t s) { return s == kUnsealed; })) {
      Fail(kv::XferStatus::kErrInvalidArgument,
           InternalError("transport.encrypt: a prompt block was not sealed before the notice"));
      continue;
    }
    std::vector<uint32_t> all(pushed_.size(), plan_.num_layers);
    if (resend_all_) {
      std::fill(pushed_.begin(), pushed_.end(), 0);
      std::fill(summed_.begin(), summed_.end(), false);  // the blocks were computed again
    }
    // Sliced: every byte already landed; the notice goes alone.
    std::vector<kv::Segment> segs;
    if (!plan_.sliced) segs = TakeFinal(pending_->block_ids, all);
    std::vector<uint64_t> sums;
    if (plan_.checksum) {
      ChecksumFinal(pending_->block_ids);
      sums.assign(sums_.begin() + std::min<size_t>(plan_.cached_blocks, sums_.size()), sums_.end());
    }
    PostLocked(lock, std::move(segs), pending_->notice(std::move(sums)), /*is_final=*/true);
    // A failed post leaves failure_ set and outstanding_ at 0: the loop reports it.
  }
}

void PushStream::StartSlicesLocked(std::unique_lock<std::mutex>& lock) {
  slices_started_ = true;
  kv::SlicePushSpec spec = plan_.sliced->spec;
  spec.block_ids.assign(pending_->block_ids.begin(),
                        pending_->block_ids.begin() +
                            std::min(pending_->block_ids.size(), plan_.slots.size()));
  const bool followers = static_cast<bool>(plan_.sliced->followers);
  outstanding_ += followers ? 2 : 1;
  lock.unlock();
  auto self = shared_from_this();
  std::vector<kv::XferId> ids = plan_.sliced->pusher->Push(
      spec, [self](kv::RankSlicePusher::Outcome o) { self->OnSlicesDone(o, "prefill rank 0"); });
  if (followers) {
    plan_.sliced->followers(spec, [self](kv::RankSlicePusher::Outcome o) {
      self->OnSlicesDone(o, "the follower prefill ranks");
    });
  }
  lock.lock();
  slice_xfers_.insert(slice_xfers_.end(), ids.begin(), ids.end());
  if (aborted_) {
    lock.unlock();
    for (kv::XferId x : ids) transport_.Abort(x).IgnoreError();
    lock.lock();
  }
}

void PushStream::OnSlicesDone(const kv::RankSlicePusher::Outcome& o, const char* whose) {
  std::unique_lock lock(mu_);
  --outstanding_;
  bytes_posted_ += o.bytes;
  transfers_posted_ += o.writes;
  if (!o.status.ok()) {
    // kErrBackend, not a disconnect: decode rank 0 may well be alive and
    // must hear (by an error notice) that its reservation is abandoned.
    Fail(o.status.code() == StatusCode::kCancelled ? kv::XferStatus::kErrCanceled
                                                   : kv::XferStatus::kErrBackend,
         o.status.WithContext(fmt::format("KV slices pushed by {}", whose)));
  }
  Advance(lock);
}

Status PushStream::EnableSealing(KvSealer& sealer, std::string_view key, uint64_t reservation_id) {
  TANDEM_ASSIGN_OR_RETURN(kv::KvCipher cipher, kv::KvCipher::Create(key, reservation_id));
  std::lock_guard lock(mu_);
  if (sealer_ != nullptr) return FailedPreconditionError("sealing is already on for this push");
  if (plan_.cached_blocks > plan_.slots.size()) {
    return InvalidArgumentError(fmt::format("{} cached blocks of {}", plan_.cached_blocks,
                                            plan_.slots.size()));
  }
  cipher_.emplace(std::move(cipher));
  sealer_ = &sealer;
  sealed_to_.assign(plan_.slots.size(), kUnsealed);
  tags_.assign((plan_.slots.size() - plan_.cached_blocks) * kv::kKvTagBytes, '\0');
  return Status::Ok();
}

Status PushStream::SealBlocks(std::unique_lock<std::mutex>& lock, const std::vector<uint32_t>& todo,
                              std::span<const uint32_t> block_table) {
  std::vector<uint32_t> local(todo.size());
  for (size_t i = 0; i < todo.size(); ++i) local[i] = block_table[todo[i]];
  lock.unlock();
  auto sealed = sealer_->Seal(*cipher_, todo, local);
  lock.lock();
  if (!sealed.ok()) return sealed.status();
  for (size_t i = 0; i < todo.size(); ++i) {
    const uint32_t b = todo[i];
    sealed_to_[b] = sealed->blocks[i];
    tags_.replace((b - plan_.cached_blocks) * kv::kKvTagBytes, kv::kKvTagBytes, sealed->tags,
                  i * kv::kKvTagBytes, kv::kKvTagBytes);
  }
  staging_.insert(staging_.end(), sealed->staging.begin(), sealed->staging.end());
  return Status::Ok();
}

Result<std::string> PushStream::SealRest(std::span<const uint32_t> block_ids) {
  std::unique_lock lock(mu_);
  if (sealer_ == nullptr) return FailedPreconditionError("this push does not seal its blocks");
  if (ended_ || aborted_) return CancelledError("KV push aborted");
  if (block_ids.size() < sealed_to_.size()) {
    return InvalidArgumentError(fmt::format("{} blocks for a push of {}", block_ids.size(),
                                            sealed_to_.size()));
  }
  std::vector<uint32_t> todo;
  for (uint32_t b = plan_.cached_blocks; b < sealed_to_.size(); ++b) {
    if (sealed_to_[b] == kUnsealed) todo.push_back(b);
  }
  if (!todo.empty()) TANDEM_RETURN_IF_ERROR(SealBlocks(lock, todo, block_ids));
  return tags_;
}

void PushStream::ReleaseStaging() {
  std::vector<uint32_t> staging;
  {
    std::lock_guard lock(mu_);
    staging.swap(staging_);
  }
  if (sealer_ != nullptr) sealer_->Release(staging);
}

}  // namespace tandem::prefiller
