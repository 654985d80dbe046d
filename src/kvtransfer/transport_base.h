// TransportBase: what every backend shares — the request and peer tables,
// stale-generation checks, notification delivery and the progress thread.
// A backend supplies the data path through the hooks below.
//
// Threads: public Transport methods run on any thread and only touch the
// tables under mu_. Everything else — backend objects (UCX worker, endpoints,
// keys), the active list and the per-request progress fields — belongs to
// the progress thread. Commands (import/release peer, post) reach it through
// a queue plus Wake(). Hooks marked [progress] run on the progress thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvtransfer/callback_slot.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer::detail {

// Backend state of one imported peer (endpoint, remote key). [progress]
struct PeerState {
  virtual ~PeerState() = default;
};

struct PeerEntry {
  PeerId id = 0;
  PeerDescriptor desc;
  std::unique_ptr<PeerState> state;  // [progress]
  bool failed = false;               // guarded by mu_
  Status failure;                    // guarded by mu_
  bool releasing = false;            // guarded by mu_
  bool failed_seen = false;          // [progress] mirror of `failed`
  std::promise<Status> released;     // fulfilled when the backend state is gone
  std::chrono::steady_clock::time_point release_deadline;
};

enum class Phase { kPut, kFlush, kFlushed, kNotice, kDone };

struct Xfer {
  XferId id = 0;
  PeerId peer = 0;
  std::vector<Segment> segments;  // [n_segments], validated against both pools
  std::optional<std::string> notice;
  uint64_t total_bytes = 0;

  // Guarded by TransportBase::mu_.
  XferStatus status = XferStatus::kPrepared;
  Status detail;
  XferCallback on_done;
  bool released = false;
  bool in_active = false;  // owned by the progress thread's active list

  std::atomic<bool> abort{false};
  std::atomic<uint64_t> bytes_done{0};

  // [progress] only.
  Phase phase = Phase::kPut;
  size_t next_segment = 0;
  uint64_t segment_offset_bytes = 0;  // within segments[next_segment]
  uint32_t outstanding = 0;           // backend operations not yet completed
  bool stopping = false;              // abort seen: issue nothing new
  bool finished = false;              // [progress] mirror of IsTerminal(status)
  Status op_error;                    // first failed operation
  std::string notice_wire;            // encoded notice, alive until sent
  bool notice_sent = false;

  // Fault injection (KvFaultOptions), decided at Post. Backends flip the
  // byte at `flip_remote_offset` of the peer's pool to `flip_value` once the
  // data landed and before the notice (only when not stopping).
  bool fault_fail = false;
  // lose_peer_at: this write makes the transport declare its peer lost.
  bool fault_lose_peer = false;
  // Delayed by the hook: the write is "on the wire" and an abort takes
  // effect only once all its data landed (no notice then).
  bool fault_in_flight = false;
  std::optional<uint64_t> flip_remote_offset;
  std::byte flip_value{};  // stays alive for the backend's put
  bool flip_done = false;  // [progress]
};

// Notice wire format (inside one message): u64 target_generation |
// u64 sender_generation | u32 name_len | name | payload.
std::string EncodeNotice(uint64_t target_generation, uint64_t sender_generation,
                         std::string_view sender, std::string_view payload);
struct DecodedNotice {
  uint64_t target_generation = 0;
  Notification notification;
};
Result<DecodedNotice> DecodeNotice(std::string_view wire);

class TransportBase : public Transport {
 public:
  ~TransportBase() override;

  Result<PeerId> ImportPeer(std::string_view descriptor) override;
  Status ReleasePeer(PeerId peer) override;
  Result<std::string> TransportsInUse(PeerId peer) override;
  Result<XferId> PrepareWrite(PeerId peer, std::vector<Segment> segments,
                              std::optional<std::string> notice) override;
  Status Post(XferId xfer, XferCallback on_done) override;
  XferStatus Poll(XferId xfer, Status* detail) override;
  uint64_t BytesDone(XferId xfer) override;
  Status Abort(XferId xfer) override;
  Status Release(XferId xfer) override;
  std::vector<Notification> TakeNotifications() override;
  void SetNotificationCallback(NotificationCallback cb) override;
  void SetPeerFailureCallback(PeerFailureCallback cb) override;
  TransportStats stats() const override;

  // [any thread] A received notice: checks its generation, then queues it
  // or hands it to the callback (on the calling thread).
  void DeliverNotice(std::string_view wire);

 protected:
  TransportBase(const TransportOptions& options);

  // Starts the progress thread; the backend calls it at the end of its
  // constructor, once its state exists.
  void StartProgressThread();
  // Releases every peer and joins the progress thread; the backend calls it
  // first thing in its destructor, while its state still exists.
  void Shutdown();

  // ---- hooks ----
  // [progress] Connects to a peer (descriptor already checked).
  virtual Result<std::unique_ptr<PeerState>> ConnectPeer(PeerId id, const PeerDescriptor& desc) = 0;
  // [progress] Frees a peer's endpoint and key. No operation of it is outstanding.
  virtual void DisconnectPeer(PeerState& peer) = 0;
  // [progress] Issues the next operations of `x` (puts, flush, notice) and
  // calls Finish when it is done. Called again after every progress round.
  virtual void Advance(Xfer& x, PeerEntry& peer) = 0;
  // [progress] One round of backend progress; true if anything happened.
  virtual bool ProgressOnce() = 0;
  // [progress] Sleeps until an event or Wake(), at most `timeout_ms` (< 0:
  // no limit).
  virtual void WaitForEvents(int timeout_ms) = 0;
  // [any thread] Interrupts WaitForEvents.
  virtual void Wake() = 0;
  // [progress]
  virtual Result<std::string> DescribePeerTransports(PeerState& peer) = 0;
  // [any thread] The generation notices must name to be accepted.
  virtual uint64_t CurrentGeneration() const { return generation(); }

  // ---- helpers for backends ----
  // [progress] Makes `x` terminal (first call wins) and runs its callback.
  void Finish(Xfer& x, XferStatus status, Status detail);
  // [progress] Marks the peer failed and fails its unfinished transfers.
  void OnPeerFailed(PeerId peer, const Status& why);
  // [not progress] Runs `fn` on the progress thread and waits for its result.
  Status RunOnProgressThread(std::function<Status()> fn);

  const TransportOptions& options() const { return options_; }
  Status CheckNotForked() const;

  std::atomic<uint64_t> live_remote_keys_{0};
  std::atomic<uint64_t> puts_posted_{0};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> notifications_sent_{0};
  std::atomic<uint64_t> faults_injected_{0};
  std::atomic<uint64_t> handshakes_waiting_on_live_peers_{0};

 private:
  void ProgressLoop(std::stop_token stop);
  // How long an idle progress thread may sleep (-1: until woken).
  int IdleWaitMs() const;
  void RunCommands();
  void SweepActive();
  void SweepReleasingPeers();
  Status CheckPeerUsable(const PeerEntry& p) const;  // mu_ held

  TransportOptions options_;
  pid_t creator_pid_;

  mutable std::mutex mu_;
  std::unordered_map<XferId, std::unique_ptr<Xfer>> xfers_;
  std::unordered_map<PeerId, std::unique_ptr<PeerEntry>> peers_;
  std::unordered_map<std::string, uint64_t> latest_generation_;  // agent -> newest seen
  XferId next_xfer_id_ = 1;
  PeerId next_peer_id_ = 1;
  std::deque<std::function<void()>> commands_;
  std::deque<Notification> notices_;
  CallbackSlot<NotificationCallback> notice_cb_;
  CallbackSlot<PeerFailureCallback> peer_failure_cb_;
  uint64_t inflight_ = 0;
  uint64_t notifications_received_ = 0;
  uint64_t stale_notifications_dropped_ = 0;

  // Pacing (TransportOptions::pace_*): posted writes wait here until the
  // modelled link would have delivered them.
  void ReleaseDuePaced();
  std::chrono::steady_clock::time_point link_free_at_{};  // guarded by mu_
  std::vector<std::pair<std::chrono::steady_clock::time_point, Xfer*>> paced_;  // [progress]

  // Fault injection: decides what happens to a data write being posted
  // (mu_ held); returns the extra delay before its bytes move.
  std::chrono::milliseconds InjectFaults(Xfer& x, const PeerEntry& peer);
  uint64_t fault_writes_ = 0;  // guarded by mu_: data writes posted
  uint64_t fault_blocks_ = 0;  // guarded by mu_: remote blocks they touched
  uint64_t fault_imports_ = 0;  // guarded by mu_: imports that made a new endpoint

  // Rounds of the progress thread with nothing in flight: spent polling
  // after a notice, or asleep waiting for events (TransportStats).
  std::atomic<uint64_t> idle_polls_{0};
  std::atomic<uint64_t> idle_sleeps_{0};

  std::vector<Xfer*> active_;  // [progress]
  std::jthread progress_thread_;
  bool shut_down_ = false;
};

}  // namespace tandem::kvtransfer::detail
