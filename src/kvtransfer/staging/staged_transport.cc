#include "kvtransfer/staging/staged_transport.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <tuple>

#include "kvtransfer/staging/staging_notice.h"

namespace tandem::kvtransfer {

using staging::EncodeStagingNotice;
using staging::StagingNotice;

std::string_view StageEventName(StageEvent::Kind kind) {
  switch (kind) {
    case StageEvent::Kind::kCopyStart: return "copy_start";
    case StageEvent::Kind::kCopyDone: return "copy_done";
    case StageEvent::Kind::kPutStart: return "put_start";
    case StageEvent::Kind::kPutDone: return "put_done";
    case StageEvent::Kind::kNoticeSent: return "notice_sent";
    case StageEvent::Kind::kH2dStart: return "h2d_start";
    case StageEvent::Kind::kH2dDone: return "h2d_done";
    case StageEvent::Kind::kNoticeDelivered: return "notice_delivered";
  }
  return "unknown";
}

StagedTransport::StagedTransport(const TransportOptions& options,
                                 std::unique_ptr<CopyEngine> engine, StagedTransportOptions staged)
    : Transport(options.agent_name, options.generation, options.block_bytes, options.num_blocks),
      options_(options),
      staged_(std::move(staged)),
      engine_(std::move(engine)) {}

Status StagedTransport::Init() {
  if (staged_.staging_buffers == 0) return InvalidArgumentError("staging_buffers must be >= 1");
  if (staged_.max_ranges_per_chunk == 0) return InvalidArgumentError("max_ranges_per_chunk must be >= 1");
  const uint64_t bpb = staged_.blocks_per_buffer != 0
                           ? staged_.blocks_per_buffer
                           : std::max<uint64_t>(1, (uint64_t{4} << 20) / options_.block_bytes);
  buffer_bytes_ = bpb * options_.block_bytes;
  const uint64_t mirror_blocks = staged_.receive ? options_.num_blocks : 0;
  const uint64_t inner_blocks = mirror_blocks + bpb * staged_.staging_buffers;
  if (inner_blocks > UINT32_MAX) {
    return InvalidArgumentError(fmt::format("staging: {} blocks plus {} staging blocks exceed 2^32",
                                            options_.num_blocks, bpb * staged_.staging_buffers));
  }
  TransportOptions io = options_;
  io.num_blocks = static_cast<uint32_t>(inner_blocks);
  TANDEM_ASSIGN_OR_RETURN(inner_, CreateTransport(io));
  staging_base_ = mirror_blocks * options_.block_bytes;
  TANDEM_ASSIGN_OR_RETURN(device_pool_, engine_->AllocateDevice(pool_bytes()));
  set_pool(device_pool_);
  if (Status st = engine_->PinHost(inner_->pool(), inner_->pool_bytes()); st.ok()) {
    pinned_ = true;
  } else {
    // Still correct, but every copy is synchronous: said loudly, not hidden.
    spdlog::warn("kvtransfer staging: the {} byte host pool could not be pinned ({}); copies "
                 "will not overlap and the transfer will be slower",
                 inner_->pool_bytes(), st.ToString());
  }
  buffer_free_.assign(staged_.staging_buffers, true);
  counters_.buffers = staged_.staging_buffers;
  counters_.buffer_bytes = buffer_bytes_;
  inner_->SetNotificationCallback([this](Notification n) { OnInnerNotice(std::move(n)); });
  return Status::Ok();
}

StagedTransport::~StagedTransport() {
  std::vector<XferId> inner_ids;
  {
    std::lock_guard lock(mu_);
    shutting_down_ = true;  // nothing new is issued from here on
    for (auto& [_, x] : xfers_) {
      x->stopping = true;
      for (const Chunk& c : x->chunks) {
        if (c.putting) inner_ids.push_back(c.inner);
      }
    }
  }
  if (inner_) {
    for (XferId i : inner_ids) inner_->Abort(i).IgnoreError();
    inner_->SetNotificationCallback({});
  }
  if (engine_) engine_->Drain();  // copy callbacks see shutting_down_: they post nothing
  if (engine_ && inner_ && pinned_) engine_->UnpinHost(inner_->pool());
  // Destroy the host transport while inner_ still points at it: it fails what
  // is left, and those callbacks run now (they see shutting_down_).
  if (inner_) {
    delete inner_.get();
    (void)inner_.release();
  }
  if (engine_) {
    engine_->Drain();
    if (device_pool_ != nullptr) engine_->FreeDevice(device_pool_);
  }
}

// From the host transport's callbacks; while it is being destroyed it frees
// its requests itself.
void StagedTransport::ReleaseInner(XferId inner) {
  if (inner == 0) return;
  {
    std::lock_guard lock(mu_);
    if (shutting_down_) return;
  }
  inner_->Release(inner).IgnoreError();
}

void StagedTransport::Run(Actions& acts) {
  for (auto& a : acts) a();
  acts.clear();
}

void StagedTransport::Trace(StageEvent::Kind kind, XferId x, uint32_t chunk) const {
  if (staged_.trace) staged_.trace(StageEvent{kind, x, chunk});
}

Capabilities StagedTransport::capabilities() const {
  Capabilities c = inner_->capabilities();
  c.backend += "+staging";
  c.device_memory = true;
  c.max_notification_bytes =
      c.max_notification_bytes > staging::kHeaderBytes ? c.max_notification_bytes - staging::kHeaderBytes : 0;
  return c;
}

std::string StagedTransport::LocalDescriptor() const { return inner_->LocalDescriptor(); }
Result<PeerId> StagedTransport::ImportPeer(std::string_view d) { return inner_->ImportPeer(d); }
Status StagedTransport::ReleasePeer(PeerId peer) { return inner_->ReleasePeer(peer); }
Result<std::string> StagedTransport::TransportsInUse(PeerId peer) { return inner_->TransportsInUse(peer); }

Result<XferId> StagedTransport::PrepareWrite(PeerId peer, std::vector<Segment> segments,
                                             std::optional<std::string> notice) {
  if (segments.empty() && !notice) return InvalidArgumentError("a write needs at least one segment or a notice");
  const uint64_t max_notice = capabilities().max_notification_bytes;
  if (notice && notice->size() > max_notice) {
    return InvalidArgumentError(fmt::format("notice has {} bytes; this transport sends at most {}",
                                            notice->size(), max_notice));
  }
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.length_bytes == 0 || s.local_offset_bytes > pool_bytes() ||
        s.length_bytes > pool_bytes() - s.local_offset_bytes) {
      return OutOfRangeError(fmt::format(
          "segment {} (local {} length {}) is empty or outside the device pool of {} bytes", i,
          s.local_offset_bytes, s.length_bytes, pool_bytes()));
    }
  }
  // The host transport checks the peer and the remote bounds, with one
  // byte at each end of every segment read from local offset 0 (a
  // send-only transport's host pool is only the staging buffers).
  if (!segments.empty()) {
    std::vector<Segment> ends;
    ends.reserve(2 * segments.size());
    for (const Segment& s : segments) {
      if (s.remote_offset_bytes > UINT64_MAX - s.length_bytes) {
        return OutOfRangeError(fmt::format("segment remote offset {} + length {} overflows",
                                           s.remote_offset_bytes, s.length_bytes));
      }
      ends.push_back({0, s.remote_offset_bytes, 1});
      ends.push_back({0, s.remote_offset_bytes + s.length_bytes - 1, 1});
    }
    TANDEM_ASSIGN_OR_RETURN(XferId probe, inner_->PrepareWrite(peer, std::move(ends), std::nullopt));
    inner_->Release(probe).IgnoreError();
  }
  auto x = std::make_unique<SXfer>();
  x->peer = peer;
  x->notice = std::move(notice);
  // Chunks: at most one buffer of bytes and max_ranges_per_chunk parts each.
  Chunk cur;
  uint64_t used = 0;
  for (const Segment& s : segments) {
    x->total_bytes += s.length_bytes;
    uint64_t done = 0;
    while (done < s.length_bytes) {
      if (used == buffer_bytes_ || cur.parts.size() == staged_.max_ranges_per_chunk) {
        x->chunks.push_back(std::move(cur));
        cur = Chunk{};
        used = 0;
      }
      const uint64_t n = std::min(s.length_bytes - done, buffer_bytes_ - used);
      cur.parts.push_back({s.local_offset_bytes + done, s.remote_offset_bytes + done, n, used});
      used += n;
      done += n;
    }
  }
  if (!cur.parts.empty()) x->chunks.push_back(std::move(cur));
  std::lock_guard lock(mu_);
  if (shutting_down_) return UnavailableError("transport is shutting down");
  x->id = next_id_++;
  const XferId id = x->id;
  xfers_[id] = std::move(x);
  return id;
}

Status StagedTransport::Post(XferId xfer, XferCallback on_done) {
  Actions acts;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    SXfer& x = *it->second;
    if (x.status != XferStatus::kPrepared) {
      return FailedPreconditionError(
          fmt::format("transfer {} is {}, not prepared", xfer, XferStatusName(x.status)));
    }
    if (shutting_down_) return UnavailableError("transport is shutting down");
    x.status = XferStatus::kInProgress;
    x.on_done = std::move(on_done);
    x.post_seq = next_post_seq_++;
    send_peers_[x.peer].open_posts.insert(x.post_seq);
    if (!x.chunks.empty()) {
      x.waiting = true;
      waiting_.push_back(x.id);
      Pump(acts);
    }
    MaybeComplete(x, acts);
  }
  Run(acts);
  return Status::Ok();
}

// Hands free staging buffers to waiting writes, oldest post first.
void StagedTransport::Pump(Actions& acts) {
  while (!waiting_.empty() && !shutting_down_) {
    auto it = xfers_.find(waiting_.front());
    if (it == xfers_.end() || it->second->stopping ||
        it->second->next_chunk >= it->second->chunks.size()) {
      if (it != xfers_.end()) it->second->waiting = false;
      waiting_.pop_front();
      continue;
    }
    const auto free = std::find(buffer_free_.begin(), buffer_free_.end(), true);
    if (free == buffer_free_.end()) return;  // back-pressure
    SXfer& x = *it->second;
    const int buf = static_cast<int>(free - buffer_free_.begin());
    buffer_free_[buf] = false;
    const uint32_t ci = static_cast<uint32_t>(x.next_chunk++);
    Chunk& c = x.chunks[ci];
    c.buffer = buf;
    ++x.inflight;
    if (x.next_chunk == x.chunks.size()) {
      x.waiting = false;
      waiting_.pop_front();
    }
    std::vector<CopyRange> ranges;
    std::byte* staging = inner_->pool() + staging_base_ + uint64_t(buf) * buffer_bytes_;
    for (const Part& p : c.parts) {
      ranges.push_back({staging + p.staging_offset, device_pool_ + p.device_offset, p.length});
    }
    Trace(StageEvent::Kind::kCopyStart, x.id, ci);
    const XferId id = x.id;
    acts.push_back([this, id, ci, ranges = std::move(ranges)] {
      Status st = engine_->CopyAsync(CopyKind::kDeviceToHost, ranges,
                                     [this, id, ci](const Status& s) { OnCopyDone(id, ci, s); });
      if (!st.ok()) OnCopyDone(id, ci, st);
    });
  }
}

void StagedTransport::OnCopyDone(XferId id, uint32_t ci, const Status& st) {
  Actions acts;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;
    SXfer& x = *it->second;
    Chunk& c = x.chunks[ci];
    Trace(StageEvent::Kind::kCopyDone, id, ci);
    if (st.ok()) ++counters_.chunks_staged;
    if (!st.ok() && !x.stopping) Stop(x, XferStatus::kErrBackend, st, acts);
    if (x.stopping || shutting_down_) {
      buffer_free_[c.buffer] = true;
      c.buffer = -1;
      --x.inflight;
      Pump(acts);
      MaybeComplete(x, acts);
    } else {
      std::vector<Segment> segs;
      StagingNotice m;
      m.kind = StagingNotice::Kind::kManifest;
      const uint64_t base = staging_base_ + uint64_t(c.buffer) * buffer_bytes_;
      for (const Part& p : c.parts) {
        segs.push_back({base + p.staging_offset, p.remote_offset, p.length});
        if (!m.ranges.empty() && m.ranges.back().offset + m.ranges.back().length == p.remote_offset) {
          m.ranges.back().length += p.length;
        } else {
          m.ranges.push_back({p.remote_offset, p.length});
        }
      }
      c.putting = true;
      Trace(StageEvent::Kind::kPutStart, id, ci);
      acts.push_back([this, id, ci, segs = std::move(segs), wire = EncodeStagingNotice(m)]() mutable {
        IssuePut(id, ci, std::move(segs), std::move(wire));
      });
    }
  }
  Run(acts);
}

void StagedTransport::IssuePut(XferId id, uint32_t ci, std::vector<Segment> segs, std::string manifest) {
  PeerId peer = 0;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;
    peer = it->second->peer;
  }
  auto inner = inner_->PrepareWrite(peer, std::move(segs), std::move(manifest));
  if (!inner.ok()) {
    const XferStatus st = inner.status().code() == StatusCode::kFailedPrecondition
                              ? XferStatus::kErrStaleDescriptor
                              : XferStatus::kErrRemoteDisconnect;
    OnPutDone(id, ci, 0, st, inner.status());
    return;
  }
  bool stopping = false;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it != xfers_.end()) {
      it->second->chunks[ci].inner = *inner;
      stopping = it->second->stopping;
    }
  }
  const XferId iid = *inner;
  Status st = inner_->Post(iid, [this, id, ci](XferId i, XferStatus s, const Status& d) {
    OnPutDone(id, ci, i, s, d);
  });
  if (st.ok() && stopping) inner_->Abort(iid).IgnoreError();  // aborted while it was prepared
  if (!st.ok()) {
    Status detail;
    const XferStatus s = inner_->Poll(iid, &detail);
    OnPutDone(id, ci, iid, IsTerminal(s) && s != XferStatus::kSuccess ? s : XferStatus::kErrBackend,
              st);
  }
}

void StagedTransport::OnPutDone(XferId id, uint32_t ci, XferId inner, XferStatus st,
                                const Status& detail) {
  ReleaseInner(inner);
  Actions acts;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;
    SXfer& x = *it->second;
    Chunk& c = x.chunks[ci];
    Trace(StageEvent::Kind::kPutDone, id, ci);
    c.putting = false;
    buffer_free_[c.buffer] = true;
    c.buffer = -1;
    --x.inflight;
    if (st == XferStatus::kSuccess) {
      ++send_peers_[x.peer].manifests_delivered;
      ++x.chunks_done;
      for (const Part& p : c.parts) {
        x.bytes_done += p.length;
        bytes_written_ += p.length;
      }
    } else if (!x.stopping) {
      Stop(x, st, detail.ok() ? InternalError(std::string(XferStatusName(st))) : detail, acts);
    }
    Pump(acts);
    MaybeComplete(x, acts);
  }
  Run(acts);
}

void StagedTransport::Stop(SXfer& x, XferStatus st, Status detail, Actions& acts) {
  x.stopping = true;
  x.stop_status = st;
  x.stop_detail = std::move(detail);
  for (const Chunk& c : x.chunks) {
    if (c.putting && c.inner != 0) {
      const XferId i = c.inner;
      acts.push_back([this, i] { inner_->Abort(i).IgnoreError(); });
    }
  }
  if (x.notice_inner != 0) {
    const XferId i = x.notice_inner;
    acts.push_back([this, i] { inner_->Abort(i).IgnoreError(); });
  }
}

// Makes `x` terminal once nothing of it is in flight, or posts its notice.
void StagedTransport::MaybeComplete(SXfer& x, Actions& acts) {
  if (x.status != XferStatus::kInProgress || x.inflight > 0) return;
  if (!x.stopping && x.chunks_done < x.chunks.size()) return;
  SendPeer& sp = send_peers_[x.peer];
  auto finish = [&](XferStatus st, Status detail) {
    x.status = st;
    x.detail = std::move(detail);
    sp.open_posts.erase(x.post_seq);
    if (x.on_done) {
      acts.push_back([cb = std::move(x.on_done), id = x.id, st, d = x.detail] { cb(id, st, d); });
      x.on_done = nullptr;
    }
    // Writes to this peer that may have waited for this one before their notice.
    std::vector<XferId> others;
    for (auto& [oid, o] : xfers_) {
      if (o.get() != &x && o->peer == x.peer && o->status == XferStatus::kInProgress) others.push_back(oid);
    }
    if (x.released) xfers_.erase(x.id);  // `x` is gone from here on
    for (XferId oid : others) {
      auto it = xfers_.find(oid);
      if (it != xfers_.end()) MaybeComplete(*it->second, acts);
    }
  };
  if (x.stopping) {
    finish(x.stop_status, x.stop_detail.ok() ? CancelledError("transfer aborted") : x.stop_detail);
    return;
  }
  if (!x.notice || x.notice_posted) {
    finish(XferStatus::kSuccess, Status::Ok());
    return;
  }
  // The notice goes only after every earlier write to this peer finished.
  if (!sp.open_posts.empty() && *sp.open_posts.begin() < x.post_seq) return;
  if (shutting_down_) {
    finish(XferStatus::kErrCanceled, UnavailableError("transport is shutting down"));
    return;
  }
  StagingNotice n;
  n.kind = StagingNotice::Kind::kUser;
  n.count = sp.manifests_delivered;
  n.payload = *x.notice;
  x.notice_posted = true;
  ++x.inflight;
  Trace(StageEvent::Kind::kNoticeSent, x.id, static_cast<uint32_t>(x.chunks.size()));
  const XferId id = x.id;
  const PeerId peer = x.peer;
  acts.push_back([this, id, peer, wire = EncodeStagingNotice(n)]() mutable {
    auto inner = inner_->PrepareWrite(peer, {}, std::move(wire));
    if (!inner.ok()) {
      OnNoticeDone(id, 0,
                   inner.status().code() == StatusCode::kFailedPrecondition ? XferStatus::kErrStaleDescriptor
                                                                            : XferStatus::kErrRemoteDisconnect,
                   inner.status());
      return;
    }
    {
      std::lock_guard lock(mu_);
      auto it = xfers_.find(id);
      if (it != xfers_.end()) it->second->notice_inner = *inner;
    }
    const XferId iid = *inner;
    Status st = inner_->Post(iid, [this, id](XferId i, XferStatus s, const Status& d) { OnNoticeDone(id, i, s, d); });
    if (!st.ok()) {
      Status detail;
      const XferStatus s = inner_->Poll(iid, &detail);
      OnNoticeDone(id, iid, IsTerminal(s) && s != XferStatus::kSuccess ? s : XferStatus::kErrBackend, st);
    }
  });
}

void StagedTransport::OnNoticeDone(XferId id, XferId inner, XferStatus st, const Status& detail) {
  ReleaseInner(inner);
  Actions acts;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;
    SXfer& x = *it->second;
    x.notice_inner = 0;
    --x.inflight;
    if (st != XferStatus::kSuccess && !x.stopping) {
      Stop(x, st, detail.ok() ? InternalError(std::string(XferStatusName(st))) : detail, acts);
    }
    MaybeComplete(x, acts);
  }
  Run(acts);
}

XferStatus StagedTransport::Poll(XferId xfer, Status* detail) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  if (it == xfers_.end()) {
    if (detail) *detail = NotFoundError(fmt::format("no transfer {}", xfer));
    return XferStatus::kErrInvalidArgument;
  }
  if (detail) *detail = it->second->detail;
  return it->second->status;
}

uint64_t StagedTransport::BytesDone(XferId xfer) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  return it == xfers_.end() ? 0 : it->second->bytes_done;
}

Status StagedTransport::Abort(XferId xfer) {
  Actions acts;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    SXfer& x = *it->second;
    if (x.status == XferStatus::kPrepared) {
      x.status = XferStatus::kErrCanceled;
      x.detail = CancelledError("transfer aborted before it was posted");
      return Status::Ok();
    }
    if (IsTerminal(x.status) || x.stopping) return Status::Ok();
    Stop(x, XferStatus::kErrCanceled, CancelledError("transfer aborted"), acts);
    Pump(acts);  // drops it from the buffer queue
    MaybeComplete(x, acts);
  }
  Run(acts);
  return Status::Ok();
}

Status StagedTransport::Release(XferId xfer) {
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    if (IsTerminal(it->second->status) || it->second->status == XferStatus::kPrepared) {
      xfers_.erase(it);
      return Status::Ok();
    }
    it->second->released = true;
    it->second->on_done = nullptr;
  }
  return Abort(xfer);
}

TransportStats StagedTransport::stats() const {
  TransportStats s = inner_->stats();
  std::lock_guard lock(mu_);
  s.live_requests = xfers_.size();
  s.inflight_requests = 0;
  for (const auto& [_, x] : xfers_) s.inflight_requests += x->status == XferStatus::kInProgress;
  s.bytes_written = bytes_written_;
  return s;
}

StagingStats StagedTransport::staging_stats() const {
  std::lock_guard lock(mu_);
  StagingStats s = counters_;
  s.free_buffers = static_cast<uint32_t>(std::count(buffer_free_.begin(), buffer_free_.end(), true));
  s.writes_waiting_for_buffer = waiting_.size();
  s.host_pool_pinned = pinned_;
  s.notices_held = 0;
  for (const auto& [_, rp] : recv_peers_) s.notices_held += rp.held.size();
  return s;
}

Result<std::unique_ptr<StagedTransport>> CreateStagedTransport(const TransportOptions& options,
                                                               std::unique_ptr<CopyEngine> engine,
                                                               StagedTransportOptions staged) {
  if (engine == nullptr) return InvalidArgumentError("staging needs a copy engine");
  if (options.block_bytes == 0 || options.num_blocks == 0) {
    return InvalidArgumentError(fmt::format("KV pool of {} blocks of {} bytes is empty",
                                            options.num_blocks, options.block_bytes));
  }
  TransportOptions o = options;
  if (o.generation == 0) o.generation = NewGeneration();
  auto t = std::make_unique<StagedTransport>(o, std::move(engine), std::move(staged));
  TANDEM_RETURN_IF_ERROR(t->Init());
  return t;
}

}  // namespace tandem::kvtransfer
