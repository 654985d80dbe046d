// The tandem.v1.Worker service every worker serves, and registration with
// the proxy (tandem.v1.Registry), behind proto-free interfaces.
//
//   GetInfo: the worker's identity and KV geometry (WorkerInfo).
//   Watch:   a snapshot of every cached block hash (always first: this
//            worker keeps no event history, so a resume is answered with a
//            snapshot too), then each KV event as it happens and a
//            LoadReport: load is sampled every `load_interval` (every
//            keep-alive period while the worker is quiescent and nothing
//            changed, until IdleWake::Notify) and sent
//            when what the router reads of it changed (LoadSample::
//            SameForRouting; or KV events went out since the last report);
//            a round whose KV events go to a batched watcher samples it at
//            once and the report leaves with them (the next sample then an
//            interval later: issue 23, one update per batch, not a batch
//            plus reports),
//            and to a stream that carried nothing for the keep-alive period
//            (the proxies ask for it when the worker registers:
//            RegisterResponse.heartbeat_interval_ms), so an idle worker
//            sends a few reports a second, not one per interval (issue 23).
//            The stream doubles as the liveness signal. Streams end (OK)
//            when the worker stops.
//
// Threads: the monitor thread (Start) drains the engine's KV events, takes
// snapshots, samples load and runs `on_tick`; gRPC callback threads open
// and cancel streams. No lock is held across an engine call or a write.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/tls.h"
#include "engine/engine.h"

namespace tandem::v1 {
class WorkerInfo;
class WorkerUpdate;
}

namespace tandem::worker {

struct WorkerIdentity {
  std::string name;
  std::string role;  // prefill | decode | both
  std::string grpc_address;
  std::string metrics_address;
  std::string model;
  std::string revision;
  uint32_t block_size = 0;
  std::string kv_dtype;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint64_t block_bytes = 0;
  uint32_t num_blocks = 0;
  uint32_t decode_seats = 0;  // decode/both: scheduler.max_num_seqs (WorkerInfo.decode_seats)
  uint64_t epoch = 0;
  std::string transport_backend;
  std::string fleet_salt_fingerprint;  // FleetSaltFingerprint(cache.salt)
  uint64_t hash_root = 0;              // RootHash of the hash context (tenant salt empty)
  std::map<std::string, std::string> labels;
  // Its rank layout (issue 18): tensor_parallel x pipeline_parallel ranks.
  uint32_t tensor_parallel = 1;
  uint32_t pipeline_parallel = 1;
  // Issue 23: the decode stream's framed TCP listener ("" = none).
  std::string decode_mux_address;
  // Issue 23: the Watch stream's framed TCP listener ("" = none).
  std::string watch_address;
  // Issue 23: the Prefill call's framed TCP listener ("" = none).
  std::string prefill_frame_address;
  // Issue 23: the decoder's framed TCP Reserve listener ("" = none).
  std::string reserve_address;
};

// LoadReport of worker.proto as plain numbers.
struct LoadSample {
  uint32_t queued_prefill_tokens = 0;
  uint32_t active_decode_blocks = 0;
  uint32_t free_blocks = 0;
  uint32_t running_requests = 0;
  uint32_t waiting_requests = 0;
  double kv_usage_ratio = 0;
  uint32_t num_reservations = 0;
  uint32_t num_parked_prefills = 0;
  uint32_t queued_prefill_requests = 0;
  uint32_t registered_requests = 0;
  uint64_t leases_expired = 0;
  uint64_t stale_notices = 0;
  uint64_t prefill_tokens_total = 0;   // engine: prefill tokens computed, total
  double prefill_seconds_total = 0;    // engine: seconds of steps with prefill tokens, total
  uint64_t prefill_attention_pairs_total = 0;  // engine: their attention pairs, total
  double prefill_pair_cost = 0;        // engine: one pair's cost in prefill tokens
  uint64_t seats_released_total = 0;   // decoder: decode seats given back, total
  double seat_seconds_total = 0;       // decoder: seats taken x seconds, total
  uint32_t kv_growth_reserve_blocks = 0;  // decoder: blocks its growth reserve keeps free
  float kv_growth_ratio = 0;              // decoder: the reserve's ratio (0: off)
  bool operator==(const LoadSample&) const = default;
  // The fields the proxy's router reads (proxy/registry_service.cc
  // ApplyLoad; router/types.h LoadReport) are equal. A change in the others
  // alone (registered requests, reservations, waiting, parked, queued
  // requests, leases, notices, usage ratio) sends no update of its own: the
  // next update carries it (issue 23).
  bool SameForRouting(const LoadSample& o) const {
    return queued_prefill_tokens == o.queued_prefill_tokens &&
           active_decode_blocks == o.active_decode_blocks && free_blocks == o.free_blocks &&
           running_requests == o.running_requests &&
           prefill_tokens_total == o.prefill_tokens_total &&
           prefill_seconds_total == o.prefill_seconds_total;
  }
  // Nothing queued, waiting, running, reserved or registered.
  bool quiescent() const {
    return queued_prefill_tokens == 0 && running_requests == 0 && waiting_requests == 0 &&
           num_reservations == 0 && num_parked_prefills == 0 && queued_prefill_requests == 0 &&
           registered_requests == 0;
  }
};

// Wakes the Watch monitor of a quiescent worker, which samples its load
// only every keep-alive period while nothing happens (issue 23), as soon as
// work arrives: the engine's steps and the decoder's first reservation call
// Notify. Cheap when the monitor is not idle (one atomic load). Shared: it
// outlives the WorkerService, which detaches itself in Stop().
class IdleWake {
 public:
  void Notify() {
    if (!armed_.load() || !armed_.exchange(false)) return;
    std::lock_guard lock(mu_);
    if (wake_) wake_();
  }

 private:
  friend class WorkerService;
  std::atomic<bool> armed_{false};
  std::mutex mu_;
  std::function<void()> wake_;  // guarded by mu_
};

// A Watch stream's writer on a transport other than gRPC (issue 23,
// worker/watch_tcp.h). The monitor thread calls Write and End; neither
// blocks.
class WatchSink {
 public:
  virtual ~WatchSink() = default;
  // False once the stream is over (it broke, or End was called).
  virtual bool open() const = 0;
  virtual void Write(const tandem::v1::WorkerUpdate& update) = 0;
  // Ends the stream. `graceful`: as a gRPC Watch ends with OK (the worker
  // leaves: drain or stop); otherwise as one that breaks.
  virtual void End(bool graceful) = 0;
};

class WorkerService {
 public:
  // A Watch stream gets a report at least this often until a proxy asks
  // for another period (SetKeepalive): a quarter of the proxy's default
  // liveness timeout (2 s).
  static constexpr std::chrono::milliseconds kDefaultKeepalive{500};

  // `engine` is borrowed. `load` is sampled on the monitor thread;
  // `on_tick` (may be empty) runs there after each sample that is sent
  // (the load changed); scrapes sample on their own.
  // `idle_wake` (may be null): what the runtime notifies when work
  // arrives; without it a quiescent worker keeps sampling every interval.
  WorkerService(WorkerIdentity identity, engine::Engine& engine, std::function<LoadSample()> load,
                std::function<void()> on_tick,
                std::chrono::milliseconds load_interval = std::chrono::milliseconds(150),
                std::shared_ptr<IdleWake> idle_wake = nullptr);
  ~WorkerService();  // Stop()

  grpc::Service* service();
  // The addresses are known only once the servers listen.
  void SetAddresses(const std::string& grpc_address, const std::string& metrics_address);
  // Issue 23: where the decode stream is served over framed TCP (before Start).
  void SetDecodeMuxAddress(const std::string& address);
  // Issue 23: where the Watch stream is served over framed TCP (before Start).
  void SetWatchAddress(const std::string& address);
  // Issue 23: a Watch stream on another transport (worker/watch_tcp.h),
  // served exactly as a gRPC one (WatchRequest.batched = `batched`,
  // .fixed64_hashes = `fixed64_hashes`; a snapshot first). False (nothing
  // kept) when the worker is stopping or has left.
  bool AddWatch(std::shared_ptr<WatchSink> sink, bool batched, bool fixed64_hashes = false);
  // Such a stream broke or its proxy closed it: runs the
  // SetOnWatchCancelled hook, as a cancelled gRPC stream does.
  void WatchBroken();
  // Issue 23: where Prefill is served over framed TCP (before Start).
  void SetPrefillFrameAddress(const std::string& address);
  // Issue 23: where Decoder.Reserve is served over framed TCP (before Start).
  void SetReserveAddress(const std::string& address);
  WorkerIdentity identity() const;

  void Start();
  // Ends every Watch stream (OK) and joins the monitor thread.
  void Stop();
  // Drain: ends every Watch stream with OK, so the proxy takes this worker
  // out of routing at once, and refuses new ones; load sampling and the
  // metrics go on until Stop().
  void Leave();

  // The proxy at `proxy_address` wants a Watch update at least every
  // `every` (RegisterResponse.heartbeat_interval_ms; 0 is ignored). Every
  // stream gets the shortest period any proxy asked for.
  void SetKeepalive(const std::string& proxy_address, std::chrono::milliseconds every);
  // Runs (on a gRPC thread) whenever a Watch stream is cancelled by its
  // proxy or breaks: the proxy went away, restarted, or dropped this worker
  // (ProxyRegistrar::Kick registers again at once).
  void SetOnWatchCancelled(std::function<void()> fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// `id` as the WorkerInfo of GetInfo and registrations (proxy_channels.cc).
void FillWorkerInfo(const WorkerIdentity& id, tandem::v1::WorkerInfo* out);

// Registry.Register on the proxy's internal listener at `proxy_address`
// over `credentials`, retried while the proxy is unreachable (UNAVAILABLE)
// for up to `retry_for`. A refusal comes back as FAILED_PRECONDITION with
// the proxy's reason; a TLS handshake that fails (a certificate of another
// CA, none) is not retried and says so.
// `channel`: the connection to use; null dials a new one for this call.
// `heartbeat`: when set, receives the keep-alive period the proxy asked for
// (0 when it named none).
Status RegisterWithProxy(const std::string& proxy_address, const WorkerIdentity& identity,
                         const RpcCredentials& credentials, std::chrono::milliseconds retry_for,
                         std::shared_ptr<grpc::Channel> channel = nullptr,
                         std::chrono::milliseconds* heartbeat = nullptr);

// Whether a failed registration's `message` says the TLS handshake failed
// (not retried: RegisterWithProxy). The proxy's own address, which the
// message names, is not read: a proxy called `tls-gw` that is not up yet
// is an unreachable proxy, not a TLS failure.
bool IsTlsFailure(std::string_view message, std::string_view proxy_address);

// Registration over kept connections, for the ProxyRegistrar's refresh
// every interval: one channel per proxy address is kept while its calls
// succeed, so a refresh is one small unary call on an open connection, not
// a new TCP connection and mutual-TLS handshake each time (issue 23: those
// handshakes, one per worker per second, were most of an idle proxy's CPU
// and half of its CPU per admitted prompt). A failed registration drops the
// address's channel, so the next one dials afresh (a restarted proxy, a
// rotated certificate), as before.
//
// Thread-safety: Register from any thread.
//
// `tcp` (proxy.register_transport tcp, the default; proxy/register_tcp.h):
// the registrations go as frames over one kept framed connection per proxy
// (mutual TLS as the internal plane), with the same retries, refusals and
// TLS errors as RegisterWithProxy; otherwise Registry.Register over gRPC.
class ProxyChannels {
 public:
  explicit ProxyChannels(RpcCredentials credentials, bool tcp = false);
  ~ProxyChannels();

  // RegisterWithProxy over the address's kept channel (dialed if none).
  Status Register(const std::string& proxy_address, const WorkerIdentity& identity,
                  std::chrono::milliseconds retry_for,
                  std::chrono::milliseconds* heartbeat = nullptr);

  // Channels (or framed connections) dialed so far (tests).
  uint64_t dials() const;

 private:
  struct Framed;  // proxy_channels.cc
  Status RegisterFramed(const std::string& proxy_address, const WorkerIdentity& identity,
                        std::chrono::milliseconds retry_for, std::chrono::milliseconds* heartbeat);

  const RpcCredentials credentials_;
  std::unique_ptr<Framed> framed_;  // null: gRPC
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
  uint64_t dials_ = 0;                                               // guarded by mu_
};

}  // namespace tandem::worker
