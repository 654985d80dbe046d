// StagedTransport: a Transport whose pool is device memory, for transports
// that cannot read or write device memory themselves (a UCX build without
// CUDA support: Debian's). It decorates a host transport ("ucx" or
// "loopback") and moves data through pinned host memory with a CopyEngine:
//
//   writer:   the segments of a write are cut into chunks of at most one
//             staging buffer (block-granular: a buffer holds a whole number
//             of blocks; sub-block segments are packed). For each chunk:
//             device->host copy into a free staging buffer, then a put of
//             the buffer to the peer's pool at the segments' remote offsets
//             (the same bytes at the same offsets as any transport: the wire
//             format does not change), with a manifest notice naming the
//             ranges. With two buffers the copy of chunk i+1 runs while the
//             put of chunk i is in flight. At most `staging_buffers` chunks
//             are staged at a time, across all writes (back-pressure: a
//             write waits for a buffer, in post order).
//   receiver: the host transport's pool starts with a full-size mirror of
//             the device pool; peers' puts land there. Each manifest queues
//             the host->device copy of its ranges; the caller's notice is
//             handed on only after the copies of every manifest the writer
//             delivered before it completed. The caller therefore never sees
//             a notice before its data is in device memory.
//   notices:  the caller's notice of a write is sent only after every chunk
//             of it, and every earlier write to the same peer, finished
//             (the streaming push posts several writes and puts the notice
//             on the last one).
//
// Pool of the host transport: [num_blocks blocks: mirror][staging_buffers x
// blocks_per_buffer blocks]; without the mirror when send-only
// (StagedTransportOptions::receive false). A peer's descriptor is the host transport's.
// Both ends of a transfer must be staged transports (a plain receiver would
// see the staging notices as payloads); DESIGN: a fleet's workers share one
// backend and therefore one path.
//
// Abort: stops issuing chunks; the write ends kErrCanceled once its copies
// and puts in flight are over, every staging buffer it held is free again,
// and no notice is sent. Errors (a copy failure, a peer lost, a stale
// descriptor) end the write with the host transport's status, after the same
// draining.
//
// Threads: as Transport. Write callbacks and notification callbacks run on
// the host transport's progress thread or on the copy engine's completion
// thread; they must not block.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>

#include "kvtransfer/callback_slot.h"
#include "kvtransfer/staging/copy_engine.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

// One step of the pipeline, for tests of its ordering (recorded under the
// transport's lock, in the order the pipeline took the steps).
struct StageEvent {
  enum class Kind {
    kCopyStart,   // device->host copy of `chunk` queued on the copy engine
    kCopyDone,
    kPutStart,    // put of `chunk` posted on the host transport
    kPutDone,
    kNoticeSent,  // the caller's notice posted (chunk = number of chunks)
    kH2dStart,    // receiver: host->device copy of a manifest queued
    kH2dDone,
    kNoticeDelivered,  // receiver: the caller's notice handed on
  };
  Kind kind;
  XferId xfer = 0;     // writer side
  uint32_t chunk = 0;  // writer side
};
std::string_view StageEventName(StageEvent::Kind kind);

struct StagedTransportOptions {
  uint32_t staging_buffers = 2;    // >= 1; 2 = double buffering
  uint32_t blocks_per_buffer = 0;  // 0: as many blocks as fit in 4 MiB, at least one
  uint32_t max_ranges_per_chunk = 192;  // a manifest must fit in one notice
  // false: a send-only transport (a prefill-only worker, which never
  // receives KV): no host mirror of the device pool — the host pool is the
  // staging buffers only, so its descriptor offers peers no pool to write,
  // and any staging notice that reaches it is dropped as malformed.
  bool receive = true;
  std::function<void(const StageEvent&)> trace;  // tests; must not call the transport
};

struct StagingStats {
  uint32_t buffers = 0;
  uint32_t free_buffers = 0;
  uint64_t buffer_bytes = 0;
  uint64_t writes_waiting_for_buffer = 0;
  uint64_t chunks_staged = 0;       // device->host copies completed
  uint64_t manifests_received = 0;
  uint64_t h2d_copies_done = 0;
  uint64_t h2d_failures = 0;        // the sender's notices are then held (never delivered)
  uint64_t notices_held = 0;        // waiting for their host->device copies now
  uint64_t malformed_notices = 0;
  bool host_pool_pinned = false;   // false: PinHost failed (logged); copies are synchronous
};

class StagedTransport final : public Transport {
 public:
  ~StagedTransport() override;

  Capabilities capabilities() const override;
  std::string LocalDescriptor() const override;
  Result<PeerId> ImportPeer(std::string_view descriptor) override;
  Status ReleasePeer(PeerId peer) override;
  Result<std::string> TransportsInUse(PeerId peer) override;
  Result<XferId> PrepareWrite(PeerId peer, std::vector<Segment> segments,
                              std::optional<std::string> notice) override;
  Status Post(XferId xfer, XferCallback on_done = {}) override;
  XferStatus Poll(XferId xfer, Status* detail = nullptr) override;
  uint64_t BytesDone(XferId xfer) override;
  Status Abort(XferId xfer) override;
  Status Release(XferId xfer) override;
  std::vector<Notification> TakeNotifications() override;
  void SetNotificationCallback(NotificationCallback cb) override;
  void SetPeerFailureCallback(PeerFailureCallback cb) override {
    inner_->SetPeerFailureCallback(std::move(cb));
  }
  TransportStats stats() const override;

  StagingStats staging_stats() const;
  const CopyEngine& copy_engine() const { return *engine_; }
  Transport& host_transport() { return *inner_; }

  // Use CreateStagedTransport.
  StagedTransport(const TransportOptions& options, std::unique_ptr<CopyEngine> engine,
                  StagedTransportOptions staged);
  Status Init();

 private:
  struct Part {
    uint64_t device_offset, remote_offset, length, staging_offset;
  };
  struct Chunk {
    std::vector<Part> parts;
    int buffer = -1;
    XferId inner = 0;
    bool putting = false;
  };
  struct SXfer {
    XferId id = 0;
    PeerId peer = 0;
    std::vector<Chunk> chunks;
    std::optional<std::string> notice;
    uint64_t total_bytes = 0;
    uint64_t bytes_done = 0;
    XferStatus status = XferStatus::kPrepared;
    Status detail;
    XferCallback on_done;
    uint64_t post_seq = 0;
    size_t next_chunk = 0;
    size_t chunks_done = 0;
    uint32_t inflight = 0;  // copies, puts and the notice in flight
    bool waiting = false;   // queued for a staging buffer
    bool stopping = false;
    XferStatus stop_status = XferStatus::kErrCanceled;
    Status stop_detail;
    bool notice_posted = false;
    XferId notice_inner = 0;
    bool released = false;
  };
  struct SendPeer {
    uint64_t manifests_delivered = 0;  // manifest puts that succeeded
    std::set<uint64_t> open_posts;     // post_seq of posted, unfinished writes
  };
  struct RecvKey {
    std::string sender;
    uint64_t generation;
    bool operator<(const RecvKey& o) const {
      return std::tie(sender, generation) < std::tie(o.sender, o.generation);
    }
  };
  struct RecvPeer {
    uint64_t h2d_done = 0;
    bool failed = false;
    std::deque<std::pair<uint64_t, Notification>> held;  // (manifests needed, notice)
  };
  using Actions = std::vector<std::function<void()>>;

  void Trace(StageEvent::Kind kind, XferId x, uint32_t chunk) const;  // mu_ held
  void Pump(Actions& acts);                                           // mu_ held
  void MaybeComplete(SXfer& x, Actions& acts);                        // mu_ held
  void Stop(SXfer& x, XferStatus st, Status detail, Actions& acts);   // mu_ held
  void OnCopyDone(XferId id, uint32_t chunk, const Status& st);
  void OnPutDone(XferId id, uint32_t chunk, XferId inner, XferStatus st, const Status& detail);
  void OnNoticeDone(XferId id, XferId inner, XferStatus st, const Status& detail);
  void IssuePut(XferId id, uint32_t chunk, std::vector<Segment> segs, std::string manifest);
  void OnInnerNotice(Notification n);
  void OnH2dDone(const RecvKey& key, const Status& st);
  void Deliver(std::vector<Notification> ready);
  void ReleaseInner(XferId inner);
  static void Run(Actions& acts);

  const TransportOptions options_;
  const StagedTransportOptions staged_;
  std::unique_ptr<CopyEngine> engine_;
  std::unique_ptr<Transport> inner_;
  std::byte* device_pool_ = nullptr;
  bool pinned_ = false;
  uint64_t buffer_bytes_ = 0;
  uint64_t staging_base_ = 0;  // offset of buffer 0 in the host pool

  mutable std::mutex mu_;
  bool shutting_down_ = false;
  std::vector<bool> buffer_free_;
  std::deque<XferId> waiting_;
  std::unordered_map<XferId, std::unique_ptr<SXfer>> xfers_;
  std::map<PeerId, SendPeer> send_peers_;
  std::map<RecvKey, RecvPeer> recv_peers_;
  XferId next_id_ = 1;
  uint64_t next_post_seq_ = 1;
  uint64_t bytes_written_ = 0;
  StagingStats counters_;
  CallbackSlot<NotificationCallback> user_cb_;
  std::deque<Notification> notices_;
};

// Creates the host transport named in `options.backend` with room for the
// mirror and the staging buffers, allocates the device pool with `engine`
// and pins the host pool. `engine` must outlive nothing else: the transport
// owns it.
Result<std::unique_ptr<StagedTransport>> CreateStagedTransport(const TransportOptions& options,
                                                               std::unique_ptr<CopyEngine> engine,
                                                               StagedTransportOptions staged = {});

}  // namespace tandem::kvtransfer
