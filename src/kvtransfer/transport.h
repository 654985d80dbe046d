// tandem::kvtransfer — moving KV blocks from a prefiller's pool into slots of
// a decoder's pool (DESIGN.md sections 2 and 4).
//
// The shape follows NIXL: a transfer is a lifecycle
//   PrepareWrite → Post → Poll (or a callback) until not in progress → Release
// with status codes where "not finished" is positive, success zero and
// errors negative. Backends ("ucx", "loopback") sit behind one interface and
// answer capability queries.
//
// Memory: the transport *allocates* the KV pool (UCX: ucp_mem_map with
// UCP_MEM_MAP_ALLOCATE, so that on one host the pool lives in a shared
// segment a peer can write at memcpy speed; registered heap memory falls back
// to TCP, ~70x slower). The pool is `num_blocks` blocks of `block_bytes`
// each, block-major: block i is bytes [i * block_bytes, (i + 1) * block_bytes).
// A remote "slot" is a block index in the peer's pool.
//
// Threads: every public method of Transport may be called from any thread.
// Each transport owns one progress thread; completion and notification
// callbacks run on it and must not block (they may call Poll, Post, Release).
// No lock is held while a callback runs.
//
// Fork: create transports only after the process has forked its children
// (`tandem launch` forks and execs workers before any UCX use). A transport
// used from a forked child refuses every call with FAILED_PRECONDITION.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::kvtransfer {

// NIXL-style transfer state: > 0 not finished, 0 success, < 0 failed.
enum class XferStatus : int {
  kPrepared = 2,              // prepared, not yet posted
  kInProgress = 1,            // posted, not finished
  kSuccess = 0,               // every byte is visible at the peer, and the notice was sent after it
  kErrRemoteDisconnect = -1,  // the peer died or became unreachable
  kErrCanceled = -2,          // aborted; no byte of it will land after this is reported
  kErrStaleDescriptor = -3,   // the peer restarted; its old descriptor is no longer valid
  kErrInvalidArgument = -4,
  kErrBackend = -5,  // the transport library failed (detail says how)
};
std::string_view XferStatusName(XferStatus s);
inline bool IsTerminal(XferStatus s) { return static_cast<int>(s) <= 0; }

using XferId = uint64_t;
using PeerId = uint64_t;

// One contiguous copy: local pool bytes [local_offset, +length) to remote
// pool bytes [remote_offset, +length). Offsets and lengths need no alignment.
struct Segment {
  uint64_t local_offset_bytes = 0;
  uint64_t remote_offset_bytes = 0;
  uint64_t length_bytes = 0;
};

// Local block `local_block` goes to the peer's block `remote_slot`.
struct BlockPair {
  uint32_t local_block = 0;
  uint32_t remote_slot = 0;
};

// Turns block pairs into segments, merging runs where both the local block
// and the remote slot advance by one (one put per run). Order is kept.
std::vector<Segment> CoalesceBlocks(std::span<const BlockPair> pairs, uint64_t block_bytes);

// A small message sent after the data of one transfer; the receiver sees it
// only after every byte of that transfer is visible in its pool.
struct Notification {
  std::string sender;  // agent name of the writer
  uint64_t sender_generation = 0;
  std::string payload;  // opaque to the transport
};

// What the UCX and loopback backends send in one notice: room for the KV
// checksums (8 bytes per block) and transport.encrypt's tags (16) of a
// 1M-token prompt in 16-token blocks (65,536 x 24 bytes = 1.5 MiB) and
// more. A worker whose longest prompt's notice would not fit is refused at
// start-up (worker/role_capabilities.h, CheckKvNoticeFits).
inline constexpr uint64_t kTransportNoticeBytes = uint64_t{4} << 20;

struct Capabilities {
  std::string backend;  // "ucx" | "loopback"
  bool one_sided_write = true;
  bool notifications = true;
  bool abort = true;
  bool peer_failure_detection = true;  // peer loss becomes kErrRemoteDisconnect
  bool cross_process = false;          // a peer may live in another process / host
  bool device_memory = false;          // pool in GPU memory (CUDA issue)
  uint64_t max_notification_bytes = 0;
};

// Counters for tests and metrics. `live_*` are resources held right now; all
// return to zero once every request and peer is released.
struct TransportStats {
  uint64_t live_peers = 0;
  uint64_t live_remote_keys = 0;   // unpacked remote memory keys
  uint64_t live_requests = 0;      // prepared and not yet released
  uint64_t inflight_requests = 0;  // posted and not yet terminal
  uint64_t bytes_written = 0;      // payload bytes whose puts completed
  uint64_t puts_posted = 0;        // backend put operations (after coalescing and chunking)
  uint64_t notifications_sent = 0;
  uint64_t notifications_received = 0;
  uint64_t stale_notifications_dropped = 0;  // addressed to an older generation of this agent
  uint64_t faults_injected = 0;  // writes failed, delayed or corrupted by KvFaultOptions
  // Checks that found a peer's connection handshake overdue and its process
  // alive on this host (stopped): the handshake kept waiting
  // (docs/kvtransfer.md, "Connection handshake").
  uint64_t handshakes_waiting_on_live_peers = 0;
  // The progress thread with nothing in flight (docs/kvtransfer.md,
  // "Progress without burning a core"): rounds it polled because a notice
  // had just arrived, and times it went to sleep on the backend's events.
  uint64_t progress_idle_polls = 0;
  uint64_t progress_sleeps = 0;
};

// Fault injection for tests (docs/failure-handling.md, "KV fault
// injection"). Off unless a test sets TransportOptions::fault or the
// process runs with TANDEM_KV_FAULT set (e.g.
// TANDEM_KV_FAULT=fail_every=5,delay_ms=2000,delay_writes=1,flip_block=3,lose_peer_at=7);
// off costs one branch per posted write. Counting is per transport, over
// "data writes" (posted writes with at least one segment) in post order.
struct KvFaultOptions {
  // Every Nth data write ends kErrBackend before any byte of it moves.
  uint32_t fail_every = 0;
  // Data writes start moving bytes only this long after Post (a slow link
  // or a stalled NIC): the stale-writer race. Such a write is "on the
  // wire": an abort meanwhile takes effect only once all its data landed
  // (it then ends ERR_CANCELED, without its notice).
  uint32_t delay_ms = 0;
  // ... only the first N data writes (0: every one).
  uint32_t delay_writes = 0;
  // Once: the Nth block a data write touches (1 = the first; counting every
  // remote block of every data write, in order) gets one byte flipped at the
  // receiver after its data landed and before the write's notice. The
  // sender's pool is not changed.
  uint32_t flip_block = 0;
  // Once: the Nth data write (1 = the first) makes the transport declare its
  // peer lost before any byte of it moves, as an endpoint error from the
  // backend would (the write and every unfinished one to that peer end
  // kErrRemoteDisconnect, the peer-failure callback runs, later writes to
  // that PeerId are refused) while the peer itself is alive: a false
  // keep-alive failure or a partition that heals.
  uint32_t lose_peer_at = 0;
  // Once: the Nth ImportPeer that makes a new endpoint (1 = the first) sends
  // SIGSTOP to the peer's process first — a local one, by the pid in its
  // descriptor — and waits until it is stopped: a peer stopped before it
  // could answer the new endpoint's handshake. The test SIGCONTs it.
  uint32_t stop_peer_at_import = 0;
  // TANDEM_KV_FAULT only: when set, only the transport of this agent (e.g.
  // "prefill-0") takes the faults; others in the fleet ignore the variable.
  std::string agent;
  bool enabled() const {
    return fail_every != 0 || delay_ms != 0 || flip_block != 0 || lose_peer_at != 0 ||
           stop_peer_at_import != 0;
  }
  std::string ToString() const;
};
inline constexpr const char* kKvFaultEnv = "TANDEM_KV_FAULT";
// Parses "key=value,key=value" (keys as the fields above; "" or "off": no
// faults). INVALID_ARGUMENT names the bad key or value.
Result<KvFaultOptions> ParseKvFault(std::string_view spec);

struct TransportOptions {
  std::string backend = "ucx";  // ucx | loopback
  std::string agent_name;       // unique in the fleet, e.g. "decode-0"
  // Changes on every restart so that a peer's old descriptor is rejected.
  // 0: pick one (wall-clock nanoseconds, strictly increasing in a process).
  uint64_t generation = 0;
  uint64_t block_bytes = 0;  // > 0
  uint32_t num_blocks = 0;   // > 0; pool = num_blocks * block_bytes bytes
  // transport.encrypt (docs/security.md): this many more blocks after the
  // pool, in the same registration, for sealed copies of outgoing blocks.
  // Local block indices num_blocks .. num_blocks + staging_blocks - 1 name
  // them in writes; peers only ever see (and may only write) the pool.
  uint32_t staging_blocks = 0;
  // Large segments are split into puts of at most this size; abort takes
  // effect between puts.
  uint64_t max_put_bytes = 4ull << 20;
  // Peer loss surfaces within about this time (UCX: keepalive interval is
  // set to a third of it unless UCX_KEEPALIVE_INTERVAL is set).
  double peer_timeout_s = 3.0;
  // An idle progress thread with a peer wakes every max(this, a quarter of
  // the keep-alive interval) (bounds any missed wakeup, runs the backend's
  // keep-alive); with no peer it sleeps until woken (issue 23).
  uint32_t idle_wait_ms = 100;
  // loopback only, fault injection: sleep before each put.
  uint32_t loopback_delay_per_put_us = 0;
  // Link pacing (simulated fleets, docs/sim.md): a write that carries data
  // starts moving bytes only once a modelled link of `pace_bits_per_s`
  // would have delivered it — its bytes times `pace_byte_scale` (the real
  // KV size the scaled-down bytes stand for) at that rate, queued behind
  // this transport's earlier paced writes (one outgoing link), plus
  // `pace_latency_s`. Notice-only writes are not paced. 0: off.
  double pace_bits_per_s = 0;
  double pace_byte_scale = 1.0;
  double pace_latency_s = 0;
  // Fault injection (tests only; see KvFaultOptions). CreateTransport
  // replaces it with TANDEM_KV_FAULT when that is set.
  KvFaultOptions fault;
  // ucx only, transport.device_path direct (docs/cuda.md): the pool is this
  // caller-allocated memory of `pool_memory` (CUDA device memory), registered
  // with ucp_mem_map instead of allocated; staging_blocks must be 0.
  // `external_pool_owner` keeps it alive until the transport has unmapped it.
  enum class PoolMemory { kHost, kCuda };
  std::byte* external_pool = nullptr;
  PoolMemory pool_memory = PoolMemory::kHost;
  std::shared_ptr<void> external_pool_owner;
};

using XferCallback = std::function<void(XferId, XferStatus, const Status& detail)>;
using NotificationCallback = std::function<void(Notification)>;
// A peer this transport imported was declared lost (endpoint error, the
// keepalive): its agent name and generation.
using PeerFailureCallback =
    std::function<void(const std::string& agent, uint64_t generation, const Status& why)>;

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  virtual Capabilities capabilities() const = 0;
  const std::string& agent_name() const { return agent_name_; }
  uint64_t generation() const { return generation_; }

  // The pool: [num_blocks][block_bytes] bytes, owned by the transport and
  // valid for its lifetime.
  std::byte* pool() const { return pool_; }
  uint64_t block_bytes() const { return block_bytes_; }
  uint32_t num_blocks() const { return num_blocks_; }
  uint64_t pool_bytes() const { return block_bytes_ * num_blocks_; }
  std::byte* block(uint32_t i) const { return pool_ + uint64_t{i} * block_bytes_; }
  // Staging blocks (TransportOptions::staging_blocks) follow the pool:
  // block(num_blocks() + k) is staging block k.
  uint32_t staging_blocks() const { return staging_blocks_; }
  // What local segment offsets may address: the pool and the staging blocks.
  uint64_t local_bytes() const { return block_bytes_ * (uint64_t{num_blocks_} + staging_blocks_); }

  // Serialised endpoint + memory descriptor (binary bytes) that a peer passes
  // to ImportPeer. Use ToHex/FromHex (descriptor.h) to carry it as text.
  virtual std::string LocalDescriptor() const = 0;

  // Connects to the peer a descriptor describes. A descriptor older than one
  // already imported for the same agent is rejected (FAILED_PRECONDITION,
  // "stale"); a newer one makes the older PeerId stale.
  virtual Result<PeerId> ImportPeer(std::string_view descriptor) = 0;
  // Fails the peer's unfinished transfers (kErrCanceled) and frees its
  // endpoint and remote key.
  virtual Status ReleasePeer(PeerId peer) = 0;
  // Transports UCX chose for this peer, e.g. "posix/memory sysv/memory tcp/lo".
  virtual Result<std::string> TransportsInUse(PeerId peer) = 0;

  // Validates bounds and returns a prepared request. `notice` (at most
  // capabilities().max_notification_bytes) is sent after the data.
  virtual Result<XferId> PrepareWrite(PeerId peer, std::vector<Segment> segments,
                                      std::optional<std::string> notice) = 0;
  Result<XferId> PrepareBlockWrite(PeerId peer, std::span<const BlockPair> blocks,
                                   std::optional<std::string> notice);
  // Starts a prepared request. `on_done` (optional) runs once, on the
  // progress thread, when the request becomes terminal.
  virtual Status Post(XferId xfer, XferCallback on_done = {}) = 0;
  // Current state; `detail` (optional) receives the error, if any.
  virtual XferStatus Poll(XferId xfer, Status* detail = nullptr) = 0;
  // Payload bytes of `xfer` whose puts completed so far.
  virtual uint64_t BytesDone(XferId xfer) = 0;
  // Asks an in-flight request to stop; it ends as kErrCanceled (or kSuccess
  // if it had already finished). Returns NOT_FOUND for unknown ids.
  virtual Status Abort(XferId xfer) = 0;
  // Frees the request (aborting it first if still in flight; its resources
  // go once it is terminal). The id is invalid afterwards.
  virtual Status Release(XferId xfer) = 0;

  // Notifications received and not yet taken, oldest first.
  virtual std::vector<Notification> TakeNotifications() = 0;
  // When set, notifications go to `cb` (on the progress thread) instead of
  // the queue TakeNotifications reads. Returns once no call of the callback
  // it replaces is running (unless called from inside one), so a component
  // that unsets its callback in its Stop is not called afterwards.
  virtual void SetNotificationCallback(NotificationCallback cb) = 0;

  // When set, `cb` runs (on the progress thread, must not block nor call
  // ReleasePeer) once for each imported peer declared lost. Default: no
  // failure reports (a transport without peer-failure detection). Returns
  // as SetNotificationCallback does.
  virtual void SetPeerFailureCallback(PeerFailureCallback cb) { (void)cb; }

  virtual TransportStats stats() const = 0;

 protected:
  Transport(std::string agent_name, uint64_t generation, uint64_t block_bytes, uint32_t num_blocks,
            uint32_t staging_blocks = 0)
      : agent_name_(std::move(agent_name)),
        generation_(generation),
        block_bytes_(block_bytes),
        num_blocks_(num_blocks),
        staging_blocks_(staging_blocks) {}
  void set_pool(std::byte* pool) { pool_ = pool; }

 private:
  std::string agent_name_;
  uint64_t generation_;
  uint64_t block_bytes_;
  uint32_t num_blocks_;
  uint32_t staging_blocks_;
  std::byte* pool_ = nullptr;  // [local_bytes()], owned by the backend
};

// Creates the backend named in `options.backend` and allocates its pool.
Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

// A fresh generation number: wall-clock nanoseconds, strictly increasing
// within a process.
uint64_t NewGeneration();

}  // namespace tandem::kvtransfer
