// The prefiller side of DESIGN.md section 2, without gRPC.
//
// A request waits in a bounded service queue (full: RESOURCE_EXHAUSTED at
// once). The dispatcher moves it on only when the engine can schedule it
// (its waiting queue is empty), and at that moment asks the decoder to
// reserve KV blocks — decoder memory is the scarce resource, so nothing is
// reserved while a request queues here. The dispatcher sleeps until
// something it waits for changes (a request queued, a reservation answered,
// the engine scheduled or ended a request: EngineProgress, a queued
// deadline); no fixed polling (issue 23). Then:
//   engine prefill (prefill_only) -> push the blocks the decoder lacks into
//   its slots (streaming: while the engine computes them; after_prefill:
//   once it is done; see push_stream.h), with a KvNotice sent after all the
//   data -> ReleasePrefill -> reply.
// A refused reservation ends the request with RESOURCE_EXHAUSTED (the proxy
// re-routes). A cancel at any stage stops the work and tells the decoder (a
// KvNotice with an error, so it frees the reservation) once no byte of ours
// can land any more.
//
// Threads: public methods from any thread. The dispatcher thread (Start)
// admits; DecoderLink callbacks (gRPC threads), engine callbacks (engine
// thread) and transfer callbacks (the transport's progress thread) drive the
// rest. No lock is held across an RPC, a transfer or an engine call. Each
// request's `done` runs exactly once, on whichever of those threads ends it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/tracing.h"
#include "engine/engine.h"
#include "engine/fair_share.h"
#include "common/lifeline.h"
#include "kvtransfer/transport.h"
#include "parallel/kv_slices.h"
#include "parallel/parallel_layout.h"
#include "prefiller/kv_sealer.h"
#include "prefiller/push_stream.h"
#include "prefiller/push_targets.h"

namespace tandem::prefiller {

// The longest wait a PrefillJob's `waited` counts (a proxy's claim).
inline constexpr std::chrono::microseconds kMaxWaited = std::chrono::hours(1);

// The service queue's arrival order: the steady clock (ns) at `now` less
// `waited` (at most kMaxWaited), at least 1. Smaller = earlier; requests
// with equal keys keep their submission order.
uint64_t ArrivalKey(std::chrono::steady_clock::time_point now, std::chrono::microseconds waited);

struct PrefillJob {
  std::string request_id;
  std::vector<uint32_t> prompt_ids;
  engine::SamplingParams sampling;
  std::optional<std::chrono::system_clock::time_point> deadline;
  std::string decoder_address;  // gRPC address of the decoder holding the Decode stream
  std::string decoder_name;
  // Where that decoder serves Reserve over framed TCP (issue 23); empty:
  // it does not (the gRPC call then).
  std::string decoder_reserve_address;
  uint32_t first_sample_index = 0;  // migration: output tokens produced elsewhere
  std::string cache_salt;  // the tenant's (engine::GenerateRequest::cache_salt)
  // Scheduling (docs/scheduling.md): engine::GenerateRequest's fields.
  int32_t priority = 0;
  std::string tenant;
  double tenant_weight = 1.0;
  // How long the request had waited since the proxy received it
  // (PrefillRequest.waited_us): the service queue orders it as having
  // arrived that long ago, so a retry keeps its place ahead of requests
  // that came after it. Counted up to kMaxWaited.
  std::chrono::microseconds waited{0};
  // This prefill's span (a child of the proxy's; common/tracing.h). The
  // Reserve call carries it to the decoder. Not sampled: no span.
  tracing::SpanContext trace;
};

struct PrefillResult {
  uint32_t first_token_id = 0;
  uint32_t cached_prompt_tokens = 0;  // prefiller prefix-cache hits
  uint32_t decoder_cached_blocks = 0;
  uint32_t transferred_blocks = 0;
  uint64_t transferred_bytes = 0;
  uint32_t transfers = 0;  // data transfers posted (streaming: per chunk and layer group)
  double prefill_seconds = 0;   // engine submit -> first token
  // The push's part of TTFT that no compute hid: first token -> every byte
  // and the notice sent (after_prefill: the whole push; streaming: what
  // was left when the prefill finished).
  double transfer_seconds = 0;
};

// The decoder's answer to Reserve (KvTarget in worker.proto).
struct ReserveTarget {
  uint64_t reservation_id = 0;
  uint64_t generation = 0;
  std::string transport_descriptor;  // binary
  std::vector<uint32_t> slots;       // [prompt blocks]
  uint32_t cached_blocks = 0;
  // When the decoder frees the slots if our notice has not come (its
  // clock); epoch value: unknown.
  std::chrono::system_clock::time_point lease_expiry{};
  std::string capability;  // the reservation's; every notice for it carries it
  std::string kv_key;      // transport.encrypt: seal every pushed block with it; else empty
  // Issue 18: the decoder's rank layout and, with more than one rank, every
  // rank's transport descriptor by rank (KvTarget fields 190-192).
  parallel::ParallelLayout decode_layout;
  std::vector<std::string> rank_descriptors;
};

// A KvNotice to send through the transport (worker.proto).
struct NoticeSpec {
  std::string request_id;
  uint64_t reservation_id = 0;
  uint64_t generation = 0;
  uint32_t first_token_id = 0;
  uint32_t cached_prompt_tokens = 0;  // this prefiller's prefix-cache hits
  Status error;  // non-OK: this prefiller gave up on the request
  std::string capability;  // ReserveTarget::capability
  std::string kv_tags;     // transport.encrypt: the pushed blocks' GCM tags
  std::vector<uint64_t> block_checksums;  // XXH3-64 of each pushed block (transport.checksum)
  uint32_t ranks_pushed = 0;  // issue 18: prefill ranks whose slices landed (0: one, unsliced)
};

// How the prefiller reaches decoders; the gRPC implementation lives in
// prefiller_service.cc (proto stays at the RPC edge).
class DecoderLink {
 public:
  virtual ~DecoderLink() = default;
  using ReserveDone = std::function<void(Result<ReserveTarget>)>;
  // Asynchronous; `done` runs once, on any thread, never inside this call.
  virtual void Reserve(const PrefillJob& job, const std::string& prefiller_name,
                       ReserveDone done) = 0;
  virtual std::string EncodeNotice(const NoticeSpec& notice) = 0;
  // A decoder's target that arrived after its call had ended here (past
  // its deadline, e.g. read only after this process woke from a stop): the
  // decoder holds a reservation for `request_id` that no one will write
  // into, quarantined once its lease expires until the writer's word or
  // death (docs/failure-handling.md, "Quarantine"). Runs on the link's
  // thread; set before the first Reserve, empty to clear. A link that
  // cannot read a late reply (gRPC drops it at the deadline) ignores this.
  using LateTarget = std::function<void(const std::string& request_id, ReserveTarget target)>;
  virtual void SetLateTargetHandler(LateTarget /*handler*/) {}
  // Decode seats (docs/serving-workers.md): the decoder holds the open
  // Reserve call for `request_id` until one of its seats frees (its reply
  // comes later). At most once per call, before its `done`, on the link's
  // thread; set before the first Reserve, empty to clear. A link that
  // cannot tell (gRPC: one reply per call) never calls it.
  using SeatWait = std::function<void(const std::string& request_id)>;
  virtual void SetSeatWaitHandler(SeatWait /*handler*/) {}
};

class Prefiller;

// How the engine's progress reaches the dispatcher (issue 23). The engine
// exists before the Prefiller, so its owner creates this first, wires
// EngineOptions::on_queue_time to Scheduled() (a request left the waiting
// queue) and on_step to StepEnded() (requests may have finished), and
// passes it in PrefillerOptions::engine_progress. Both may be called under
// the engine's lock (the prefiller never calls the engine with its own
// lock held).
class EngineProgress {
 public:
  // Whether requests other than the prefiller's use the engine (a `both`
  // worker's decodes): their end without a step (an abort while waiting)
  // is not seen, so the dispatcher also looks after every step and at
  // least every Prefiller::kEngineBackstop while it waits for the engine.
  explicit EngineProgress(bool shared = false) : shared_(shared) {}
  void Scheduled();
  void StepEnded();

 private:
  friend class Prefiller;
  const bool shared_;
  std::mutex mu_;
  Prefiller* listener_ = nullptr;  // guarded by mu_; set between Start and Stop
};

struct PrefillerOptions {
  std::string name;            // this worker, for leases and logs
  uint32_t max_queue = 256;    // service queue; past it: RESOURCE_EXHAUSTED
  uint32_t max_num_seqs = 64;  // the engine's: admit only while it has room
  // The engine's token budget per step (scheduler.max_batched_tokens): the
  // requests reserving at once hold at most this many prompt tokens (one
  // request always), so those a step can take together reach the engine
  // together instead of one per step.
  uint32_t max_batched_tokens = 512;
  // The fleet's transport.lease_seconds: a push that could land after the
  // decoder's lease expired (it may have reused the slots) is never posted.
  double lease_seconds = 30.0;
  // transport.encrypt: refuse to push to a decoder that sends no key. (A
  // key from the decoder is honoured either way, if there are staging
  // blocks to seal into.)
  bool encrypt = false;
  // The fleet's transport.push.
  PushMode push_mode = PushMode::kStreaming;
  // transport.checksum: the notice carries XXH3-64 of every pushed block.
  bool checksum = true;
  // Called (on any thread) for every completed prefill with its numbers,
  // before its parked blocks are released (so a worker seen idle has
  // counted it) and before its `done`.
  std::function<void(const PrefillResult&)> on_complete;
  // Issue 18 (docs/parallelism.md, "KV transfer between different
  // layouts"): this prefiller's rank layout and the model's KV dims (zero
  // dims: the engine pool's, valid for a single-rank prefiller). When this
  // prefiller or a decoder has more than one rank, the push is sliced
  // (PushPlan::Sliced); with more than one rank here, `follower_push` runs
  // the other ranks' parts and must be set.
  parallel::ParallelLayout layout;
  parallel::KvDims kv_dims;
  FollowerPushFn follower_push;
  // The engine's progress (see EngineProgress). Null: while the engine has
  // no room, the dispatcher looks again every kEnginePoll.
  std::shared_ptr<EngineProgress> engine_progress;
  // Stop: how long it waits for the requests still in flight to end once
  // aborted (a push's bytes on the wire, a Reserve not answered yet); a
  // request whose end does not come in time is ended UNAVAILABLE and what
  // still arrives for it later is ignored.
  double stop_wait_seconds = 2.0;
};

struct PrefillerCounts {
  uint32_t queued = 0;
  uint32_t inflight = 0;  // admitted, not yet replied
  uint32_t queued_prompt_tokens = 0;
  uint64_t reservations_refused = 0;
  // Reserve calls a decoder held waiting for a decode seat (DecoderLink::SeatWait).
  uint64_t reserve_seat_waits = 0;
  uint64_t expired_in_queue = 0;
  // Requests dropped (blocks freed, nothing written) because the push
  // target vanished (decoder unreachable, push failed) ...
  uint64_t dropped_target_lost = 0;
  // ... or because the decoder's lease ran out before the KV was ready
  // (e.g. this process was paused).
  uint64_t dropped_lease_expired = 0;
  // The service queue's fair-share deficits (engine::Scheduler::FairShareDeficits).
  std::map<std::string, double> fair_share_deficit_tokens;
};

using PrefillDone = std::function<void(Result<PrefillResult>)>;

class Prefiller {
 public:
  // All borrowed; they must outlive the prefiller.
  Prefiller(engine::Engine& engine, kvtransfer::Transport& transport, DecoderLink& link,
            PrefillerOptions options);
  ~Prefiller();  // Stop()
  Prefiller(const Prefiller&) = delete;
  Prefiller& operator=(const Prefiller&) = delete;

  void Start();  // dispatcher thread
  void Stop();   // joins it; queued requests end with UNAVAILABLE

  // Queues a request. Returns non-OK (and never calls `done`) when it is
  // refused at once: RESOURCE_EXHAUSTED (queue full), UNAVAILABLE
  // (draining), ALREADY_EXISTS, INVALID_ARGUMENT, DEADLINE_EXCEEDED.
  Status Submit(PrefillJob job, PrefillDone done);
  // Stops the request at any stage; `done` gets CANCELLED (or its result,
  // if it had already finished).
  void Cancel(const std::string& request_id);
  void SetDraining();

  PrefillerCounts counts() const;

  // Without PrefillerOptions::engine_progress: how often the dispatcher
  // looks at an engine without room. With a shared one (EngineProgress):
  // the backstop for a change that comes without a step.
  static constexpr std::chrono::milliseconds kEnginePoll{2};
  static constexpr std::chrono::milliseconds kEngineBackstop{50};

 private:
  friend class EngineProgress;
  enum class Stage { kQueued, kReserving, kPrefilling, kTransferring, kDone };
  struct Job {
    PrefillJob spec;
    PrefillDone done;
    Stage stage = Stage::kQueued;
    engine::FairTenant* fair_tenant = nullptr;  // in fair_, set when queued
    bool cancelled = false;
    Status cancel_status;  // why, when cancelled (CANCELLED, or UNAVAILABLE at Stop)
    std::optional<std::chrono::steady_clock::time_point> deadline;
    // Known once reserved:
    ReserveTarget target;
    bool have_target = false;
    kvtransfer::PeerId peer = 0;
    bool have_peer = false;
    std::chrono::steady_clock::time_point reserve_sent, lease_deadline;
    // Reserving: whether the job counts in admitting_ (until its reply, or
    // until its decoder says that it waits for a seat), and whether it waits
    // for a seat (counted in seat_waiting_).
    bool admission_held = false;
    bool seat_waiting = false;
    // Engine and transfer:
    bool parked = false;  // prefill done: blocks pinned until ReleasePrefill
    std::shared_ptr<PushStream> push;  // set once the peer is known
    uint32_t ranks_pushed = 0;  // sliced push: the prefill ranks sending (KvNotice.ranks_pushed)
    std::chrono::steady_clock::time_point submitted, transfer_started;
    PrefillResult result;
    uint64_t arrival = 0;  // service-queue order within a tenant: ArrivalKey
    std::chrono::steady_clock::time_point queued_at;  // Submit
  };
  using JobPtr = std::shared_ptr<Job>;

  void DispatchLoop(std::stop_token stop);
  // What the dispatcher waits for when the engine has no room: a waiting
  // request to be scheduled, or a running one to end.
  enum class EngineWait { kNone, kScheduled, kEnded };
  // The engine may have room now (EngineProgress, or a job's engine request
  // ended: its abort may come without a step). Takes mu_.
  void EngineMoved(EngineWait what);
  // With mu_ held: wakes the dispatcher if it sleeps.
  void WakeDispatcherLocked();
  void OnReserved(const JobPtr& job, Result<ReserveTarget> target);
  // DecoderLink::SeatWait: the job's Reserve waits on its decoder for a
  // seat. It leaves the admission budget (so that requests for other
  // decoders are admitted meanwhile), and no other request for that decoder
  // is admitted while one waits there.
  void OnSeatWait(const std::string& request_id);
  // With mu_ held: the job leaves the admission budget and seat_waiting_
  // (each once; either may have been left already).
  void EndAdmissionLocked(Job& job);
  // A target whose Reserve call had already ended (DecoderLink::LateTarget):
  // nothing was or will be written into it, so the decoder is told at once
  // (an error notice) and frees the reservation.
  void OnLateTarget(const std::string& request_id, const ReserveTarget& target);
  void OnOutput(const JobPtr& job, const engine::RequestOutput& out);
  void OnTransferDone(const JobPtr& job, kvtransfer::XferStatus status, const Status& detail);
  // Cancel with `why` as the request's status.
  void CancelJob(const std::string& request_id, Status why);
  // Aborts the job's push; once no byte of it can land, frees the engine's
  // blocks, tells the decoder and completes the job with `why`.
  void GiveUp(const JobPtr& job, Status why, bool release_prefill);
  // Whether a put posted now still lands well inside the decoder's lease.
  bool LeaseAllowsPost(const Job& job) const;
  // Tells the decoder we gave up (when it holds a reservation for us);
  // call only once no data transfer of the job can land any more. When the
  // job's endpoint was declared lost (the decoder may be alive), the notice
  // goes over a fresh one once the lost one is released (PushTargets).
  void SendErrorNotice(const JobPtr& job, const Status& why);
  // The error notice `n` to `peer` (imported from `descriptor`), over a
  // fresh endpoint when that one was declared lost.
  void TellGaveUp(kvtransfer::PeerId peer, const NoticeSpec& n, const std::string& descriptor);
  // Posts `n` to `peer`; on a loss of that endpoint (refused, or the write
  // ended kErrRemoteDisconnect) and `retry_after_loss`, once more over a
  // fresh endpoint for `descriptor`.
  void PostNotice(kvtransfer::PeerId peer, const NoticeSpec& n, const std::string& descriptor,
                  bool retry_after_loss);
  void NoticeAfterLoss(kvtransfer::PeerId lost, const NoticeSpec& n, const std::string& descriptor);
  // With mu_ held, when job.spec.trace is sampled: the prefill's spans
  // (queue, reserve, compute, KV push) as the job ends with `result`.
  void TraceLocked(const Job& job, const Result<PrefillResult>& result) const;
  // Ends the job (first call wins) and runs its `done`.
  void Complete(const JobPtr& job, Result<PrefillResult> result);
  static Status UnknownError();
  // transport.encrypt: turns sealing on for the job's push when the
  // decoder sent a key (PushStream::EnableSealing); refuses a target
  // without one when encryption is on here.
  Status EnableSealing(const JobPtr& job);
  // transport.encrypt: seals what the stream has not sealed yet and puts
  // every pushed block's tag in the notice; a no-op without sealing.
  Status SealPush(const JobPtr& job, std::span<const uint32_t> blocks, NoticeSpec& n);

  // Issue 18: the sliced part of the push plan for `target` (nullopt when
  // both sides are single-rank); FAILED_PRECONDITION for settings a sliced
  // push cannot honour, INVALID_ARGUMENT for layouts it cannot pair.
  Result<std::optional<PushPlan::Sliced>> SlicedPlan(const ReserveTarget& target);

  engine::Engine& engine_;
  kvtransfer::Transport& transport_;
  DecoderLink& link_;
  const PrefillerOptions options_;
  KvSealer sealer_;
  kvtransfer::RankSlicePusher slice_pusher_;  // this rank's (rank 0's) part of sliced pushes

  mutable std::mutex mu_;
  std::condition_variable_any cv_;
  // Served by priority, then fair share between tenants, then arrival
  // (engine/fair_share.h, docs/scheduling.md).
  std::deque<JobPtr> queue_;               // guarded by mu_
  engine::FairShare fair_;                 // guarded by mu_: charged prompt tokens at dispatch
  std::map<std::string, JobPtr> jobs_;     // guarded by mu_: every live job by id
  uint32_t admitting_ = 0;                 // guarded by mu_: reserving, not yet in the engine
  uint64_t admitting_tokens_ = 0;          // guarded by mu_: their prompt tokens
  // Decoder (gRPC address) -> this prefiller's Reserve calls waiting there
  // for a decode seat; queued requests for such a decoder are not admitted.
  std::map<std::string, uint32_t> seat_waiting_;  // guarded by mu_
  // The dispatcher's sleep (guarded by mu_): whether it sleeps, whether it
  // waits for the engine, until when at most, and whether something woke it.
  bool dispatcher_asleep_ = false;
  EngineWait waiting_for_engine_ = EngineWait::kNone;
  bool engine_moved_ = false;  // since the dispatcher last read engine_.stats()
  bool wake_ = false;
  std::chrono::steady_clock::time_point asleep_until_ = std::chrono::steady_clock::time_point::max();
  bool draining_ = false;                  // guarded by mu_
  bool stopping_ = false;                  // guarded by mu_: Stop runs; cv_ hears jobs_ empty
  PrefillerCounts totals_;                 // guarded by mu_ (the totals)

  std::jthread dispatcher_;
  // Every callback handed to the engine, the link or the transport runs
  // through it: after Stop none runs (the transport outlives this object
  // and may complete a write as late as its own shutdown).
  Lifeline lifeline_;
  // Last: destroyed first, running its queued notices while the rest lives.
  PushTargets targets_;
};

}  // namespace tandem::prefiller
