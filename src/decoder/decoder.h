// The decoder side of DESIGN.md section 2, without gRPC: registered
// requests, reservations with leases, KV notices, and the engine requests
// that stream the completion.
//
// Lifecycle of one request:
//   Register (the Decode stream opens)            -> kRegistered
//   Reserve (a prefiller scheduled it)            -> kReserved (lease starts)
//   KV notice, success                            -> kRunning (AddPrefilled)
//   engine finishes                               -> gone (sink told)
// prefill_locally requests go straight to kRunning through Engine::Submit.
// A request in kReserved or kRunning holds a decode seat; with
// DecoderOptions::max_seats a Reserve past them waits for one
// (ReserveOrWait, decode_seats.cc) or is refused (Reserve). Likewise a
// Reserve that finds too few free KV blocks for its prompt waits for them,
// or is refused.
//
// Safety of one-sided writes (acknowledge-or-dead, docs/failure-handling.md
// "Quarantine"): a reservation whose prefiller may still be writing is
// released only when that prefiller's notice (success or error: it comes
// after the data, or once no byte of an aborted push can land) arrives, or
// when the transport declares that prefiller dead (its keepalive, an
// endpoint error, or a newer generation of the same agent reserving). Until
// then it stays held — also when the request was cancelled or re-reserved
// (the old reservation is "orphaned") and when its lease expired (the
// reservation is then "quarantined": the request fails over, the blocks
// stay out of the free list, tandem_kv_quarantined_blocks).
//
// Checksums (transport.checksum): a success notice carries XXH3-64 of every
// pushed block; they are verified before the request is added to the
// engine. A mismatch fails the request with UNAVAILABLE (the proxy prefills
// it again elsewhere) and is counted; bad KV is never decoded.
// Engine reservations are made under an internal id ("<request>@r<n>") so
// that Engine::Abort(request) never frees a reservation early.
//
// Threads: every public method may be called from any thread (gRPC
// callbacks, the transport's progress thread for OnKvNotice). Sinks are
// called on the engine thread, the progress thread or the lease thread,
// never under the decoder's lock. The lease thread is started by Start().
//
// Stop (docs/failure-handling.md "Leave"): after a drain, what is still
// open is cut. Every request's stream ends UNAVAILABLE "this decoder is
// shutting down", the engine's requests are aborted and every reservation
// is released (quarantined ones too: nothing will decode here again). The
// callbacks the decoder hands to the engine and the transport, and its
// entry points (Register, Reserve, OnKvNotice), run through a Lifeline
// (common/lifeline.h) that Stop ends: none runs decoder code after Stop,
// also when the engine or the transport delivers later (they outlive the
// decoder). A running request's per-step output touches only its stream's
// emitter, which Stop has ended: no guard per token (issue 23).
#pragma once

#include <atomic>
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
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/lifeline.h"
#include "common/status.h"
#include "engine/engine.h"
#include "kvtransfer/transport.h"
#include "parallel/parallel_layout.h"

namespace tandem {
class HeldHistogram;  // common/metrics.h
}  // namespace tandem

namespace tandem::decoder {

struct DecodeSpec {
  std::string request_id;
  std::vector<uint32_t> prompt_ids;
  // Session 39 (docs/decode-stream.md, "The prompt goes once"): the prompt by
  // reference instead of prompt_ids (DecodeRequest.prompt_length and
  // prompt_digest): its tokens come with the prefiller's Reserve, which
  // must match both. Never with prefill_locally.
  struct PromptRef {
    uint32_t length = 0;
    uint64_t digest = 0;  // PromptDigest (common/block_hash.h)
  };
  std::optional<PromptRef> prompt_ref;
  engine::SamplingParams sampling;
  std::optional<std::chrono::system_clock::time_point> deadline;
  bool prefill_locally = false;
  uint32_t first_sample_index = 0;  // migration: output tokens produced elsewhere
  std::string cache_salt;  // the tenant's (engine::GenerateRequest::cache_salt)
  // Scheduling (docs/scheduling.md): engine::GenerateRequest's fields.
  int32_t priority = 0;
  std::string tenant;
  double tenant_weight = 1.0;
};

struct DecodeResult {
  engine::FinishReason finish_reason = engine::FinishReason::kNone;  // kStop | kLength
  uint32_t completion_tokens = 0;
  uint32_t cached_prompt_tokens = 0;  // decoder-side: not transferred / prefix hits
  uint32_t prefill_cached_prompt_tokens = 0;  // the prefiller's hits, from its KV notice
};

// Where one request's stream goes. Calls never overlap for one request and
// come in order: OnTokens*, then exactly one of OnFinished / OnError.
// They must not block.
class DecodeSink {
 public:
  virtual ~DecodeSink() = default;
  // `first_index`: index in the completion of token_ids[0] (first token: 0).
  // `token_ids` is valid during the call only (the engine's output, not a
  // copy per token: issue 23).
  virtual void OnTokens(uint32_t first_index, std::span<const uint32_t> token_ids) = 0;
  virtual void OnFinished(const DecodeResult& result) = 0;
  virtual void OnError(const Status& status) = 0;
};

// What a prefiller needs to write a request's KV (KvTarget in worker.proto).
struct KvTargetInfo {
  std::string request_id;
  uint64_t reservation_id = 0;
  uint64_t generation = 0;
  std::string transport_descriptor;  // binary, Transport::LocalDescriptor()
  std::vector<uint32_t> slots;       // [prompt blocks]
  uint32_t cached_blocks = 0;
  std::chrono::system_clock::time_point lease_expiry;
  std::string capability;  // kvtransfer::kCapabilityBytes random bytes; the notice must carry them
  std::string kv_key;      // transport.encrypt: the AES-256-GCM key of this reservation; else empty
  // Issue 18: this decoder's rank layout and, with more than one rank,
  // every rank's transport descriptor by rank (KvTarget fields 190-192).
  parallel::ParallelLayout layout;
  std::vector<std::string> rank_descriptors;
};

// A decoded KvNotice (worker.proto).
struct KvNoticeInfo {
  std::string request_id;
  uint64_t reservation_id = 0;
  uint64_t generation = 0;
  uint32_t first_token_id = 0;
  uint32_t prefill_cached_prompt_tokens = 0;  // the prefiller's prefix-cache hits
  Status error;  // non-OK: the prefiller gave up on the request
  // Not from a prefiller: the decoder's own release of a reservation whose
  // Reserve reply never reached it (ReleaseUnreceivedTarget; `error` says
  // why). Counted in unreceived_replies_released.
  bool unreceived_reply = false;
  std::string capability;  // must equal the reservation's (KvTargetInfo::capability)
  std::string kv_tags;     // transport.encrypt: kKvTagBytes per pushed block, prompt order
  // XXH3-64 of each pushed block (slots cached_blocks.. of the reservation).
  std::vector<uint64_t> block_checksums;
};

struct DecoderOptions {
  double lease_seconds = 30.0;
  // transport.encrypt (docs/security.md): every reservation gets a key; a
  // success notice must carry a valid tag for every pushed block, checked
  // (and the block decrypted in place) before the request may use them.
  bool encrypt = false;
  // transport.checksum: verify the KV notice's block checksums (a notice
  // without them, for blocks that were pushed, fails closed).
  bool verify_checksums = true;
  // Called on the engine thread with a local prefill's compute time
  // (submit to first token); may be empty.
  std::function<void(double)> on_local_prefill_seconds;
  // Called (mu_ held: must not call into the decoder) when a reservation or
  // a KV-waiting deadline comes sooner than anything pending, e.g. the first
  // one of an idle decoder; may be empty (issue 23: the worker's load
  // sampling leaves its idle pace, worker/worker_service.h IdleWake).
  std::function<void()> on_pending_work;
  // Issue 18 (docs/parallelism.md, "KV transfer between different
  // layouts"): this decoder's rank layout and, with more than one rank,
  // every rank's KV transport descriptor by rank (entry 0: this process's
  // transport), learnt from the follower ranks at start-up. Sent in every
  // KvTarget; a prefiller pushes each rank its slices.
  parallel::ParallelLayout layout;
  std::vector<std::string> rank_descriptors;
  // Decode seats (docs/serving-workers.md "Decode seats"): at most this
  // many requests reserved or decoding at once (the engine's running
  // batch, scheduler.max_num_seqs), so that a request waits for its seat
  // before its prefill (in TTFT) rather than between its first and second
  // token. Past it ReserveOrWait waits for a seat and Reserve is refused
  // (RESOURCE_EXHAUSTED). 0: no limit.
  uint32_t max_seats = 0;
  // tandem_decoder_inter_token_latency_seconds (docs/metrics.md): every gap
  // between consecutive hand-offs of one request's tokens to its sink, as
  // the proxy and the client count theirs (k tokens handed off together: a
  // gap and k-1 zeros), stamped with the delivery batch's time. Borrowed,
  // must outlive the decoder; null: not observed.
  HeldHistogram* inter_token_latency = nullptr;
  // tandem_decode_reserve_wait_seconds (docs/metrics.md): how long each
  // Reserve call that got its reservation waited here for a decode seat or
  // KV blocks (0 for one reserved at once). Borrowed, must outlive the
  // decoder; null: not observed.
  HeldHistogram* reserve_wait = nullptr;
};

struct DecoderCounts {
  uint32_t registered = 0;    // open requests (any stage)
  uint32_t reservations = 0;  // held, incl. orphaned ones
  uint64_t leases_expired = 0;
  uint64_t stale_notices = 0;
  uint64_t reservations_refused = 0;
  // KV notices refused (never acted on), by reason (docs/security.md):
  uint64_t notices_refused_capability = 0;  // a known reservation, the wrong capability
  uint64_t notices_refused_unreadable = 0;  // not a KvNotice at all
  uint64_t notices_refused_decrypt = 0;     // encrypt: a pushed block failed authentication
  // Acknowledge-or-dead: expired reservations whose prefiller has neither
  // confirmed that no write is outstanding nor been declared dead.
  uint32_t quarantined_reservations = 0;
  uint32_t quarantined_blocks = 0;  // their pushed (not prefix-cached) blocks
  uint64_t quarantine_released_ack = 0;   // by the prefiller's notice
  uint64_t quarantine_released_dead = 0;  // by the prefiller's death
  uint64_t checksum_failures = 0;  // requests whose KV failed verification
  // Reservations released because their Reserve reply never reached the
  // prefiller (a gRPC call that ended first, a framed reply not sent).
  uint64_t unreceived_replies_released = 0;
  // Decoder.DecodeStream (issue 23): messages sent (one per delivery
  // batch) and the per-request items they carried, totals.
  uint64_t stream_messages = 0;
  uint64_t stream_items = 0;
  // Decode seats (DecoderOptions::max_seats): requests reserved or decoding
  // now, Reserve calls waiting for a seat or for KV blocks now, calls that
  // waited for a seat (total), calls that waited for KV blocks to free
  // (total; one that waited for both counts in both), and the waits that
  // ran out (total; answered RESOURCE_EXHAUSTED).
  uint32_t seats_taken = 0;
  uint32_t reserves_waiting = 0;
  uint64_t reserve_waits = 0;
  uint64_t kv_waits = 0;
  uint64_t reserve_waits_expired = 0;
  // Reserve calls that came before their request's registration and
  // waited for it (total; the proxy sends the Prefill with the decode
  // start, so its prefiller may ask first: docs/decode-stream.md "Prefill
  // with the start"), and those waiting for it now.
  uint64_t registration_waits = 0;
  uint32_t reserves_awaiting_registration = 0;
  // Seat turnover (the router's seat-wait prediction, docs/router.md
  // "Seat waits in the TTFT prediction"): seats given back (total), and
  // the integral of seats_taken over time in seat-seconds (total). Their
  // deltas over a window are Little's law: the mean time a request holds a
  // seat = seat-seconds / seats given back.
  uint64_t seats_released = 0;
  double seat_seconds = 0;
};

// Decoder.DecodeStream's totals (issue 23): messages sent (one per delivery
// batch) and the per-request items they carried. Shared with the streams,
// which may flush a batch after the decoder is gone. Any thread.
class StreamTally {
 public:
  void Count(size_t items) {
    messages_.fetch_add(1, std::memory_order_relaxed);
    items_.fetch_add(items, std::memory_order_relaxed);
  }
  uint64_t messages() const { return messages_.load(std::memory_order_relaxed); }
  uint64_t items() const { return items_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> messages_{0};
  std::atomic<uint64_t> items_{0};
};

class Decoder {
 public:
  // `engine` and `transport` are borrowed and must outlive the decoder.
  Decoder(engine::Engine& engine, kvtransfer::Transport& transport, DecoderOptions options);
  ~Decoder();  // Stop()
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  void Start();  // lease thread
  // Joins the lease thread and ends the Lifeline (waits for the entry
  // points and callbacks running); then ends every open stream with
  // UNAVAILABLE, aborts the engine's requests and releases every
  // reservation. Idempotent. Not from a sink or an engine callback.
  void Stop();

  // Registers a request whose KV will come from a prefiller (or, with
  // prefill_locally, submits it to the engine). UNAVAILABLE while draining,
  // INVALID_ARGUMENT for bad input. A new stream for an id whose KV has not
  // arrived yet supersedes the old one (the proxy retrying before its
  // cancel landed): the old stream ends with ABORTED and its reservation is
  // orphaned. ALREADY_EXISTS when that request is already decoding.
  Status Register(DecodeSpec spec, std::shared_ptr<DecodeSink> sink);

  // Reserves blocks for a registered request. RESOURCE_EXHAUSTED when there
  // is no room or no free decode seat (nothing held then), NOT_FOUND when
  // the request is not registered (cancelled, finished or unknown).
  // `prefiller_descriptor` (binary, may be empty): the prefiller's own
  // transport descriptor; the decoder connects to it to learn of its death.
  // `prefill_layout`: the prefiller's rank layout (issue 18); when it or
  // this decoder has more than one rank, FAILED_PRECONDITION while
  // transport.encrypt or transport.checksum is on here (a sliced push is
  // neither sealed nor checksummed; docs/parallelism.md).
  Result<KvTargetInfo> Reserve(const std::string& request_id, const std::string& prefiller,
                               std::span<const uint32_t> prompt_ids,
                               std::string_view prefiller_descriptor = {},
                               parallel::ParallelLayout prefill_layout = {});

  // Reserve's answer when it came after the call (ReserveOrWait).
  using ReserveDone = std::function<void(const Result<KvTargetInfo>& target)>;
  // Reserve, except that when every decode seat is taken (max_seats), or
  // too few KV blocks are free for the prompt, the call waits for them, in
  // arrival order, until `wait_until`, and is then answered
  // RESOURCE_EXHAUSTED. `done` runs exactly once: inline (then 0 is
  // returned), or later on the decoder's lease thread (a ticket for
  // AbandonReserve is returned), never under the decoder's lock; it must
  // not block. A waiting call is answered CANCELLED when its request is
  // cancelled and UNAVAILABLE by Stop.
  // A call for a request not registered here (yet) waits for its
  // registration, until `wait_until` but at most kRegistrationWait (then
  // NOT_FOUND), unless the request ended here within kEndedMemory (NOT_FOUND
  // at once, as Reserve answers); `for_registration` (may be null) is set
  // when the call waits for that rather than for a seat or blocks. A
  // registration refused answers its waiting calls with the refusal.
  uint64_t ReserveOrWait(const std::string& request_id, const std::string& prefiller,
                         std::span<const uint32_t> prompt_ids,
                         std::string_view prefiller_descriptor,
                         parallel::ParallelLayout prefill_layout,
                         std::chrono::steady_clock::time_point wait_until, ReserveDone done,
                         bool* for_registration = nullptr);
  // How long a Reserve call may wait for its request's registration, and
  // how long an ended request is remembered so that a late call for it is
  // refused at once.
  static constexpr std::chrono::seconds kRegistrationWait{5};
  static constexpr std::chrono::seconds kEndedMemory{60};
  static constexpr size_t kEndedKept = 65536;  // and at most this many
  // The caller of a waiting ReserveOrWait went away: it is answered
  // CANCELLED now (nothing was reserved). No-op once answered.
  void AbandonReserve(uint64_t ticket);

  // A KV notice from a prefiller (after its data). One for an unknown or
  // stale reservation is counted in stale_notices; one whose capability is
  // not the reservation's is refused (notices_refused_capability): the
  // reservation stays as it was, the request is not started.
  void OnKvNotice(const KvNoticeInfo& notice);
  // A notice that could not be parsed: counted, nothing else.
  void OnUnreadableNotice(const std::string& sender, size_t bytes);

  // The request's stream went away: frees it at any stage (its reservation
  // when the prefiller can no longer write into it). The sink is not called.
  // With `sink`, only the registration that uses that sink is cancelled (a
  // superseded stream's late cancel leaves its successor alone).
  void Cancel(const std::string& request_id, const DecodeSink* sink = nullptr);

  // The transport declared the prefiller `agent` (this generation and every
  // older one) dead: its quarantined reservations are released, later
  // expiring ones of it are released at expiry. Any thread.
  void OnPrefillerLost(const std::string& agent, uint64_t generation);
  // The same, reported by the decoder's own KV endpoint to that prefiller
  // (an endpoint error, a keep-alive failure): it may be a false loss (a
  // partition that healed, a stopped process, the prefiller closing a lost
  // endpoint of its own). A later Reserve from that very generation proves
  // it alive: it is watched again through a new endpoint and no longer
  // counts as dead (docs/failure-handling.md). Any thread.
  void OnPrefillerEndpointFailed(const std::string& agent, uint64_t generation);

  // New registrations fail with UNAVAILABLE; Reserve for registered ones
  // still works so that in-flight requests finish.
  void SetDraining();

  DecoderCounts counts() const;
  // Where the DecodeStream messages that leave are counted (decode_mux.cc).
  std::shared_ptr<StreamTally> stream_tally() const { return stream_tally_; }

 private:
  enum class Stage { kRegistered, kReserved, kRunning };
  // Puts one request's deliveries back in completion order before they
  // reach its sink: the engine may deliver AddPrefilled's first token (on
  // the caller's thread) after the engine thread delivered the next one.
  class Emitter;
  struct Entry {
    DecodeSpec spec;
    std::shared_ptr<Emitter> emitter;
    Stage stage = Stage::kRegistered;
    uint64_t reservation_id = 0;  // the active one (kReserved)
    std::chrono::steady_clock::time_point submitted;  // prefill_locally: for the prefill time
    bool first_token_seen = false;
    uint32_t prefill_cached_prompt_tokens = 0;  // from the KV notice
  };
  struct Held {
    std::string request_id;
    std::string prefiller;
    std::chrono::steady_clock::time_point lease_expiry;
    bool orphaned = false;  // its request was cancelled or re-reserved
    std::string capability;  // what the KvTarget carried
    std::string kv_key;      // encrypt: the reservation's key
    std::vector<uint32_t> slots;  // [prompt blocks]
    uint32_t cached_blocks = 0;
    bool quarantined = false;  // the lease expired: waits for the notice or the writer's death
    std::string writer_agent;  // from the prefiller's descriptor ("" when unknown)
    uint64_t writer_generation = 0;
  };
  // One Reserve call's arguments (borrowed).
  struct ReserveArgs {
    const std::string& request_id;
    const std::string& prefiller;
    std::span<const uint32_t> prompt_ids;
    std::string_view prefiller_descriptor;
    parallel::ParallelLayout prefill_layout;
  };
  // A Reserve call waiting for a seat or for KV blocks (its arguments
  // copied).
  struct Waiter {
    uint64_t ticket = 0;
    std::string request_id;
    std::string prefiller;
    std::vector<uint32_t> prompt_ids;
    std::string prefiller_descriptor;
    parallel::ParallelLayout prefill_layout;
    std::chrono::steady_clock::time_point wait_until;
    std::chrono::steady_clock::time_point arrived;  // when it was queued
    ReserveDone done;
    // Set when the engine had too few free KV blocks the last time the call
    // was tried (its words), at blocks_freed_ == kv_epoch; empty while the
    // call waits for a seat.
    std::string kv_why;
    uint64_t kv_epoch = 0;
    bool short_of_blocks() const { return !kv_why.empty(); }
    ReserveArgs args() const {
      return {request_id, prefiller, prompt_ids, prefiller_descriptor, prefill_layout};
    }
  };
  // How a call that finds no free seat or too few KV blocks may wait
  // (ReserveOrWait).
  struct Park {
    std::chrono::steady_clock::time_point wait_until;
    ReserveDone* done;  // moved into the queued Waiter
    uint64_t* ticket;   // set to the Waiter's ticket
    bool* for_registration = nullptr;  // set when it waits for its registration
  };
  // Register's checks of the prompt: all of the engine's on its tokens, or
  // those its length allows on a reference (DecodeSpec::prompt_ref).
  Status CheckRegisteredPrompt(const DecodeSpec& spec) const;
  // A Reserve's prompt is the registered request's: its tokens, or the
  // reference's length and digest. INVALID_ARGUMENT naming both otherwise.
  static Status SamePrompt(const DecodeSpec& spec, std::span<const uint32_t> prompt_ids);
  // Reserve's body; the caller holds a Lifeline pass (or is the lease
  // thread). With `park`, a call that finds no free seat, or too few free
  // KV blocks, is queued (its arguments copied) and nullopt is returned;
  // without, it is refused. `seated`: a seat was claimed for this call
  // already (ServeWaiting); it is taken or given back here. `kv_short`
  // (ServeWaiting, no `park`): set when the engine refused for want of free
  // blocks; the refusal is then not counted.
  std::optional<Result<KvTargetInfo>> ReserveIn(const ReserveArgs& a, const Park* park,
                                                bool seated, bool* kv_short = nullptr);
  // Queues a call (mu_ held); `kv_why`: the engine's refusal when it waits
  // for KV blocks (counted in kv_waits), empty when it waits for a seat or
  // in line behind calls that wait.
  void ParkLocked(const ReserveArgs& a, const Park& park, std::string kv_why);
  // The queued form of a call (mu_ held): its arguments copied, `park`'s
  // answer moved in, its ticket numbered and handed out.
  std::unique_ptr<Waiter> NewWaiterLocked(const ReserveArgs& a, const Park& park);
  // Queues a call whose request is not registered (yet) in unregistered_
  // (mu_ held), until its registration or its wait's end.
  void ParkUnregisteredLocked(const ReserveArgs& a, const Park& park);
  // `id` registered (mu_ held): its calls in unregistered_ join waiting_ in
  // arrival order and the lease thread serves them.
  void AdmitUnregisteredLocked(const std::string& id);
  // `id`'s registration was refused: its waiting calls are answered so.
  void RefuseUnregistered(const std::string& id, const Status& why);
  // An entry left requests_ (mu_ held): remembered for kEndedMemory.
  void NoteEndedLocked(const std::string& id);
  bool EndedRecentlyLocked(const std::string& id) const;
  // Register's body (Register refuses the waiting calls on its error).
  Status RegisterIn(DecodeSpec spec, std::shared_ptr<DecodeSink> sink);
  // Seats (mu_ held): a request holds one while reserved or decoding.
  static bool Seated(Stage s) { return s != Stage::kRegistered; }
  // Before seats_taken_ changes: the seat-seconds so far are added up.
  void TakeSeatLocked();
  void GiveSeatBackLocked();
  void SetStageLocked(Entry& e, Stage stage);
  std::map<std::string, Entry>::iterator EraseLocked(std::map<std::string, Entry>::iterator it);
  // A seat may have come free: the lease thread serves the waiting calls.
  void SeatFreedLocked();
  // KV blocks came free (mu_ held): blocks_freed_ moves on and the waiting
  // calls are served. Engine releases that the decoder makes go through
  // ReleaseInEngine / AbortInEngine (which call it after the engine freed
  // the blocks); a request the engine ends frees its blocks before its
  // output reaches the decoder, whose seat release calls it.
  void BlocksFreedLocked();
  // (mu_ held) The reservation will not decode here (its request was
  // cancelled or taken over, or its lease expired): `orphaned` or
  // `quarantined` is set by the caller; its blocks stay held until no write
  // can land, but its growth leaves the engine's growth reserve at once,
  // and the waiting Reserve calls try again.
  void EndGrowthLocked(uint64_t reservation_id);
  // (mu_ held) Its request was cancelled, taken over or timed out: the
  // reservation (if still held) is orphaned, and EndGrowthLocked.
  void OrphanLocked(uint64_t reservation_id);
  void ReleaseInEngine(uint64_t reservation_id);
  void AbortInEngine(const std::string& request_id);
  // Lease thread: answers waiting calls, in arrival order, while seats are
  // free and the engine has the first one's KV blocks (one short of blocks
  // is tried again once blocks came free); then those whose wait ran out
  // by `now` (RESOURCE_EXHAUSTED).
  void ServeWaiting();
  void ExpireWaiting(std::chrono::steady_clock::time_point now);
  // Why a call that waited for KV blocks is refused.
  static std::string NoBlocksCameFree(const Waiter& w);
  // options_.reserve_wait, when set: a call that got its reservation.
  void ObserveReserveWait(double seconds);
  // Answers (outside mu_) the waiting calls taken out of the queue.
  static void Answer(std::vector<std::unique_ptr<Waiter>>& calls, const Status& status);

  // encrypt: checks and decrypts the pushed blocks of a reservation in
  // place; DATA_LOSS (the request must not use them) on any failure.
  Status OpenPushedBlocks(uint64_t reservation_id, const Held& held, const std::string& tags);

  engine::GenerateRequest MakeEngineRequest(const DecodeSpec& spec, std::shared_ptr<Emitter> emitter);
  // An output that is not a running request's plain step (the first
  // token, the end); through the Lifeline.
  void OnOutput(const std::string& request_id, Emitter& emitter, const engine::RequestOutput& out);
  void LeaseLoop(std::stop_token stop);
  // Wakes LeaseLoop when `due` is sooner than the time it sleeps to (mu_ held).
  void WakeLeaseLoopLocked(std::chrono::steady_clock::time_point due);
  // Whether the writer of `h` is known dead (mu_ held).
  bool WriterDeadLocked(const Held& h) const;
  // Connects to a prefiller's transport so that its death is reported
  // (once per descriptor; failures are logged).
  void WatchPrefiller(std::string_view descriptor, std::string* agent, uint64_t* generation);
  // A Reserve came from `agent` at `generation`: if only its endpoint's
  // failure made it dead, it is alive after all (takes mu_). True if so.
  bool ReviveWriter(const std::string& agent, uint64_t generation);
  // Verifies the pushed blocks of reservation `h` against `checksums`;
  // the error names the first bad block.
  Status VerifyChecksums(const Held& h, const std::vector<uint64_t>& checksums) const;
  // VerifyChecksums for a success notice, counted and logged on failure;
  // the error (UNAVAILABLE) is what the request's stream ends with.
  Status CheckPushedBlocks(const KvNoticeInfo& n, const Held& held);
  // Ends a request's stream with an error (outside the lock).
  static void Fail(const std::shared_ptr<Emitter>& emitter, const Status& status);

  engine::Engine& engine_;
  kvtransfer::Transport& transport_;
  const DecoderOptions options_;
  const std::string descriptor_;  // the transport's, computed once

  mutable std::mutex mu_;
  std::map<std::string, Entry> requests_;   // guarded by mu_
  std::map<uint64_t, Held> reservations_;   // guarded by mu_; key: engine reservation id
  uint64_t next_tag_ = 1;                   // guarded by mu_
  bool draining_ = false;                   // guarded by mu_
  DecoderCounts counts_;                    // guarded by mu_ (totals)
  // Decode seats, guarded by mu_: requests in kReserved or kRunning, seats
  // claimed by Reserve calls under way, and the calls waiting for one
  // (arrival order). serve_kick_: a seat came free while calls wait.
  uint32_t seats_taken_ = 0;
  uint32_t seats_claimed_ = 0;
  // Waiting calls ServeWaiting took off waiting_ to try (mu_): they count
  // as waiting until answered or put back.
  uint32_t waiters_trying_ = 0;
  // Seat-seconds up to seats_changed_ (DecoderCounts::seat_seconds), mu_.
  double seat_seconds_ = 0;
  std::chrono::steady_clock::time_point seats_changed_ = std::chrono::steady_clock::now();
  std::deque<std::unique_ptr<Waiter>> waiting_;
  // Calls that came before their request's registration (mu_), and the
  // requests that ended here lately: id -> when (mu_), oldest first in
  // ended_order_ (an id ended again has a later entry; only the map's time
  // is current).
  std::vector<std::unique_ptr<Waiter>> unregistered_;
  std::unordered_map<std::string, std::chrono::steady_clock::time_point> ended_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> ended_order_;
  uint64_t next_ticket_ = 1;
  bool serve_kick_ = false;
  uint64_t blocks_freed_ = 0;  // mu_: times KV blocks may have come free (BlocksFreedLocked)
  std::map<std::string, uint64_t> dead_writers_;  // guarded by mu_: agent -> newest dead generation
  // guarded by mu_: agent -> the generation its endpoint's failure declared
  // dead (OnPrefillerEndpointFailed), until a Reserve of it revives it.
  std::map<std::string, uint64_t> endpoint_failed_;
  std::mutex watch_mu_;
  std::map<std::string, kvtransfer::PeerId> watched_;  // guarded by watch_mu_: descriptor -> peer
  std::condition_variable_any lease_cv_;
  // guarded by mu_: when LeaseLoop wakes next (min(): it is awake), and
  // whether a sooner deadline came meanwhile.
  std::chrono::steady_clock::time_point lease_wake_at_ = std::chrono::steady_clock::time_point::min();
  bool lease_kick_ = false;
  std::jthread lease_thread_;
  const std::shared_ptr<StreamTally> stream_tally_ = std::make_shared<StreamTally>();
  // Ended by Stop: the engine's output callbacks, the transport's
  // peer-failure callback and the entry points run through it.
  Lifeline lifeline_;
};

}  // namespace tandem::decoder
