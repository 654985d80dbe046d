// RPC adapter: Registry.Register and the Worker.Watch client streams.
#include "proxy/registry_service.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>

#include "common/rpc_server.h"
#include "common/tls.h"
#include "common/wire_ids.h"
#include "proxy/watch_batch.h"
#include "proxy/watch_tcp_client.h"

namespace tandem::proxy {

namespace pb = ::tandem::v1;

class WorkerWatch final : public grpc::ClientReadReactor<pb::WorkerUpdate> {
 public:
  // `tcp_address` non-empty: over the worker's framed TCP listener
  // (proxy/watch_tcp_client.h) instead of the gRPC Worker.Watch.
  WorkerWatch(RegistryService* owner, std::string name, std::string address, uint64_t epoch,
              std::optional<WorkerRecord> rejoin, std::string tcp_address)
      : owner_(owner), name_(std::move(name)), address_(std::move(address)), epoch_(epoch),
        rejoin_(std::move(rejoin)), tcp_address_(std::move(tcp_address)) {
    if (tcp_address_.empty()) stub_ = pb::Worker::NewStub(owner_->channels_->Channel(address_));
    Touch();  // its liveness deadline counts from now (housekeeping may look before Begin)
  }

  void Begin(std::shared_ptr<WorkerWatch> self) {
    self_ = std::move(self);
    req_.set_after_event_id(0);  // start with a snapshot
    req_.set_epoch(epoch_);
    req_.set_batched(true);  // one update per round of the worker's watch loop (issue 23)
    // Hashes as fixed64 (common/wire_ids.h); an older worker still sends
    // block_hashes, read as before.
    req_.set_fixed64_hashes(true);
    Touch();
    if (!tcp_address_.empty()) {
      auto tcp = WatchTcpClient::Create(tcp_address_, owner_->watch_tls_, req_);
      {
        std::lock_guard lock(mu_);
        tcp_ = tcp;
      }
      tcp->Start({[this](const pb::WorkerUpdate& u) { OnUpdate(u); },
                  [this](bool graceful, const Status& why) { Ended(graceful, why.message()); },
                  [this](const WatchBatch& b) { OnBatch(b); }});
      if (stopping_.load()) tcp->Stop(CancelledError("watch stopped"));  // before tcp_ was set
      return;
    }
    stub_->async()->Watch(&ctx_, &req_, this);
    StartRead(&update_);
    StartCall();
  }

  void Stop(std::string why) {
    std::shared_ptr<WatchTcpClient> tcp;
    {
      std::lock_guard lock(mu_);
      if (why_.empty()) why_ = std::move(why);
      tcp = tcp_;
    }
    stopping_.store(true);
    if (tcp) {
      tcp->Stop(CancelledError("watch stopped"));
    } else if (tcp_address_.empty()) {
      ctx_.TryCancel();
    }
  }

  // Stop() was called: its end is on the way (housekeeping skips it).
  bool stopping() const { return stopping_.load(); }

  std::chrono::steady_clock::time_point last_seen() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_seen_.load()));
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (OnUpdate(update_)) StartRead(&update_);
  }

  void OnDone(const grpc::Status& s) override { Ended(s.ok(), s.error_message()); }

 private:
  void Touch() {
    last_seen_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  }

  // An update (either transport; updates are serialized). False: stop
  // reading (a probe that is no longer current).
  bool OnUpdate(const pb::WorkerUpdate& update) {
    std::optional<router::WorkerId> id;
    if (!Received(update.epoch(), &id)) return false;
    if (id) Apply(owner_->fleet_->router(), *id, update);
    return true;
  }

  // A batch read without protobuf (framed TCP, watch_batch.h): as the
  // same update through OnUpdate.
  void OnBatch(const WatchBatch& b) {
    std::optional<router::WorkerId> id;
    if (!Received(b.epoch, &id) || !id) return;
    auto& router = owner_->fleet_->router();
    for (const router::KvEventView& e : b.events) {
      if (!ApplyEvent(router, *id, e)) break;
    }
    if (b.has_load) ApplyLoad(router, *id, b.load);
  }

  // What every update does first: the liveness stamp, a probe's rejoin;
  // `id`: the worker's router id, if it has one now. False: stop reading
  // (a probe that is no longer current).
  bool Received(uint64_t epoch, std::optional<router::WorkerId>* id) {
    Touch();
    if (rejoin_ && !rejoined_) {
      // A probe: the worker answers again. Back into the fleet first, so
      // that its snapshot lands in the router.
      rejoined_ = true;
      if (!owner_->Rejoin(name_, this, *rejoin_, epoch)) {
        Stop("probe no longer current");
        return false;
      }
    }
    // The router's answer is kept while its membership does not change.
    const router::Router& router = owner_->fleet_->router();
    const uint64_t generation = router.membership_generation();
    if (generation != id_generation_) {
      id_ = router.FindWorker(name_);
      id_generation_ = generation;
    }
    *id = id_;
    return true;
  }

  // The stream is over (either transport, once): `ended_ok` = the worker
  // ended it (OK status, watch_ended).
  void Ended(bool ended_ok, const std::string& message) {
    std::string why;
    bool graceful;
    {
      std::lock_guard lock(mu_);
      graceful = ended_ok && why_.empty();
      why = why_.empty() ? fmt::format("watch stream ended: {}",
                                       ended_ok ? "closed by the worker" : message)
                         : why_;
    }
    owner_->WatchEnded(name_, this, why, resync_.load(), graceful, address_, epoch_,
                       rejoined_ ? std::nullopt : rejoin_);
    std::shared_ptr<WorkerWatch> self = std::move(self_);  // may delete this
  }

  void Apply(router::Router& router, router::WorkerId id, const pb::WorkerUpdate& u) {
    switch (u.kind_case()) {
      case pb::WorkerUpdate::kSnapshot: {
        const auto span = [](const google::protobuf::RepeatedField<uint64_t>& f) {
          return std::span<const uint64_t>(f.data(), static_cast<size_t>(f.size()));
        };
        const auto hashes = BlockHashesOf(u.snapshot());
        const auto host = span(u.snapshot_host_hashes());
        const auto disk = span(u.snapshot_disk_hashes());
        if (router.ApplySnapshot(id, u.epoch(), u.snapshot_event_id(), hashes, host,
                                 disk)
                .ok()) {
          owner_->SnapshotApplied(name_);
        }
        break;
      }
      case pb::WorkerUpdate::kEvent:
        ApplyEvent(router, id, u.event());
        break;
      case pb::WorkerUpdate::kLoad:
        ApplyLoad(router, id, u.load());
        break;
      case pb::WorkerUpdate::KIND_NOT_SET:
        // A batch (WatchRequest.batched): events in id order, then the
        // round's load report. After a gap the rest of the batch is moot.
        for (const pb::KvEvent& e : u.events()) {
          if (!ApplyEvent(router, id, e)) break;
        }
        if (u.has_batched_load()) ApplyLoad(router, id, u.batched_load());
        break;
      default:
        break;
    }
  }

  // False when the event asks for a snapshot (the stream is being dropped).
  bool ApplyEvent(router::Router& router, router::WorkerId id, const pb::KvEvent& e) {
    return ApplyEvent(router, id, KvEventViewFromProto(e));
  }
  bool ApplyEvent(router::Router& router, router::WorkerId id, const router::KvEventView& e) {
    auto r = router.ApplyEvent(id, e);
    if (r.ok() && *r == router::EventResult::kNeedsSnapshot) {
      // A gap or a restart: drop the stream; the worker is watched anew
      // (from a snapshot) when it registers again, or now by the owner.
      resync_ = true;
      Stop("KV event gap: resynchronizing from a snapshot");
      return false;
    }
    return true;
  }

  static void ApplyLoad(router::Router& router, router::WorkerId id, const pb::LoadReport& l) {
    router::LoadReport rep;
    rep.queued_prefill_tokens = l.queued_prefill_tokens();
    rep.active_decode_blocks = l.active_decode_blocks();
    rep.free_blocks = l.free_blocks();
    rep.running_requests = l.running_requests();
    rep.registered_requests = l.registered_requests();
    rep.num_reservations = l.num_reservations();
    rep.kv_growth_reserve_blocks = l.kv_growth_reserve_blocks();
    rep.kv_growth_ratio = l.kv_growth_ratio();
    rep.prefill_tokens_total = l.prefill_tokens_total();
    rep.prefill_seconds_total = l.prefill_seconds_total();
    rep.prefill_attention_pairs_total = l.prefill_attention_pairs_total();
    rep.prefill_pair_cost = l.prefill_pair_cost();
    rep.seats_released_total = l.seats_released_total();
    rep.seat_seconds_total = l.seat_seconds_total();
    router.ApplyLoadReport(id, rep).IgnoreError();
  }

  RegistryService* owner_;
  const std::string name_;
  const std::string address_;
  const uint64_t epoch_;
  const std::optional<WorkerRecord> rejoin_;
  bool rejoined_ = false;  // read callbacks are serialized
  // Received's cache of FindWorker(name_), as of the router's membership
  // generation (read callbacks are serialized).
  std::optional<router::WorkerId> id_;
  uint64_t id_generation_ = UINT64_MAX;
  std::atomic<bool> resync_{false};
  std::atomic<bool> stopping_{false};
  const std::string tcp_address_;
  std::unique_ptr<pb::Worker::Stub> stub_;
  std::shared_ptr<WatchTcpClient> tcp_;  // guarded by mu_ (set once, in Begin)
  grpc::ClientContext ctx_;
  pb::WatchRequest req_;
  pb::WorkerUpdate update_;
  std::atomic<int64_t> last_seen_{0};
  std::mutex mu_;
  std::string why_;  // guarded by mu_
  std::shared_ptr<WorkerWatch> self_;
};

namespace {

router::WorkerRole RoleFromProto(pb::WorkerRole r) {
  switch (r) {
    case pb::WORKER_ROLE_PREFILL: return router::WorkerRole::kPrefill;
    case pb::WORKER_ROLE_DECODE: return router::WorkerRole::kDecode;
    default: return router::WorkerRole::kBoth;
  }
}

}  // namespace

RegistryService::RegistryService(Fleet* fleet, GrpcWorkerClient* channels,
                                 std::chrono::milliseconds liveness_timeout, bool watch_tcp,
                                 const RpcCredentials& credentials)
    : fleet_(fleet), channels_(channels), liveness_timeout_(liveness_timeout) {
  if (watch_tcp) {
    auto tls = InternalFrameTls(credentials);
    if (tls.ok()) {
      watch_tcp_ = true;
      watch_tls_ = std::move(tls).value();
    } else {
      spdlog::warn("proxy.watch_transport tcp: {}; Watch streams use gRPC", tls.status().message());
    }
  }
  housekeeping_ = std::jthread([this](std::stop_token st) { Housekeeping(st); });
}

RegistryService::~RegistryService() { Shutdown(); }

void RegistryService::Shutdown() {
  housekeeping_.request_stop();
  housekeeping_cv_.notify_all();
  if (housekeeping_.joinable()) housekeeping_.join();
  std::map<std::string, std::shared_ptr<WorkerWatch>> watches;
  {
    std::lock_guard lock(mu_);
    shut_down_ = true;
    watches = watches_;
  }
  for (auto& [_, w] : watches) w->Stop("proxy shutting down");
  // Wait (bounded) for the streams to end: their reactors point at us.
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard lock(mu_);
      if (watches_.empty()) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

grpc::ServerUnaryReactor* RegistryService::Register(grpc::CallbackServerContext* ctx,
                                                    const pb::RegisterRequest* request,
                                                    pb::RegisterResponse* response) {
  // The verified certificate identity of the caller ("" over plaintext).
  HandleRegister(*request, PeerIdentity(*ctx), response);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void RegistryService::HandleRegister(const pb::RegisterRequest& request,
                                     const std::string& identity,
                                     pb::RegisterResponse* response) {
  const auto& w = request.worker();
  WorkerRecord rec;
  rec.name = w.name();
  rec.role = RoleFromProto(w.role());
  rec.grpc_address = w.grpc_address();
  rec.reserve_address = w.reserve_address();
  rec.reserve_waits_for_registration = w.reserve_waits_for_registration();
  rec.takes_prompt_from_reserve = w.takes_prompt_from_reserve();
  rec.metrics_address = w.metrics_address();
  rec.protocol_version = w.protocol_version();
  rec.model = w.model();
  rec.revision = w.revision();
  rec.block_size = w.block_size();
  rec.kv_dtype = w.kv_dtype();
  rec.fleet_salt_fingerprint = w.fleet_salt_fingerprint();
  rec.hash_root = w.hash_root();
  rec.block_bytes = w.block_bytes();
  rec.num_blocks = w.num_blocks();
  rec.decode_seats = w.decode_seats();
  rec.epoch = w.epoch();
  rec.tensor_parallel = std::max(1u, w.tensor_parallel());
  rec.pipeline_parallel = std::max(1u, w.pipeline_parallel());
  rec.num_layers = w.num_layers();
  rec.num_kv_heads = w.num_kv_heads();
  if (auto it = w.labels().find("node"); it != w.labels().end()) rec.node = it->second;
  if (auto it = w.labels().find("zone"); it != w.labels().end()) rec.zone = it->second;

  Status st = Status::Ok();
  bool refresh = false;
  bool was_lost = false;
  {
    std::lock_guard lock(mu_);
    auto bound = identities_.find(rec.name);
    if (shut_down_) {
      st = UnavailableError("the proxy is shutting down");
    } else if (bound != identities_.end() && bound->second != identity) {
      st = PermissionDeniedError(fmt::format(
          "worker name '{}' belongs to the certificate identity '{}' that first registered it; "
          "this registration presents '{}' (names are bound to identities: pick another name)",
          rec.name, bound->second, identity));
    } else if (auto known = fleet_->Find(rec.name);
               known && bound != identities_.end() && known->epoch == rec.epoch &&
               known->grpc_address == rec.grpc_address && watches_.count(rec.name) > 0) {
      refresh = true;  // already watched: the worker's periodic re-registration
    } else {
      st = fleet_->Register(rec);
      if (st.ok()) {
        identities_.emplace(rec.name, identity);
        // Issue 23: where its Watch goes over framed TCP (none: gRPC).
        if (watch_tcp_ && !w.watch_address().empty()) {
          watch_addresses_[rec.grpc_address] = w.watch_address();
        } else {
          watch_addresses_.erase(rec.grpc_address);
        }
        // A worker out of routing may come back through its periodic
        // re-registration before the proxy's probe reaches it.
        was_lost = lost_.erase(rec.name) > 0;
      }
    }
  }
  // Issue 23: requests to this decoder go over its multiplexed stream.
  if (st.ok()) {
    channels_->Reachable(rec.grpc_address);  // it registered: calls to it are made again
    channels_->SetDecodeStream(rec.grpc_address, w.decode_stream());
    channels_->SetDecodeMuxAddress(rec.grpc_address, w.decode_mux_address());  // framed TCP
    channels_->SetPrefillFrameAddress(rec.grpc_address, w.prefill_frame_address());  // framed TCP
    channels_->SetPromptFixed32(rec.grpc_address, w.reads_fixed32_prompt());
  }
  if (!st.ok()) {
    spdlog::warn("{}", st.message());
    response->mutable_error()->set_code(static_cast<int>(st.code()));
    response->mutable_error()->set_message(st.message());
  } else {
    // The keep-alive this proxy needs on the Watch stream: a quarter of its
    // liveness timeout (an idle worker sends nothing else; issue 23).
    response->set_heartbeat_interval_ms(
        static_cast<uint64_t>(std::max<int64_t>(10, liveness_timeout_.count() / 4)));
    if (was_lost) spdlog::info("worker {} answers again: back in routing", rec.name);
    if (!refresh) StartWatch(rec.name, rec.grpc_address, rec.epoch);
  }
}

void RegistryService::SnapshotApplied(const std::string& name) {
  fleet_->MarkIndexed(name);
  {
    std::lock_guard lock(mu_);
    if (!snapshotted_.insert(name).second) return;
  }
  snapshot_cv_.notify_all();
}

size_t RegistryService::WaitForSnapshots(size_t n, std::chrono::milliseconds limit) {
  std::unique_lock lock(mu_);
  snapshot_cv_.wait_for(lock, limit, [&] { return snapshotted_.size() >= n || shut_down_; });
  return snapshotted_.size();
}

void RegistryService::StartWatch(const std::string& name, const std::string& address,
                                 uint64_t epoch, std::optional<WorkerRecord> rejoin) {
  std::string tcp_address;
  {
    std::lock_guard lock(mu_);
    if (auto it = watch_addresses_.find(address); it != watch_addresses_.end()) {
      tcp_address = it->second;
    }
  }
  auto watch = std::make_shared<WorkerWatch>(this, name, address, epoch, std::move(rejoin),
                                             std::move(tcp_address));
  std::shared_ptr<WorkerWatch> old;
  {
    std::lock_guard lock(mu_);
    old = watches_[name];
    watches_[name] = watch;
    housekeeping_kick_ = true;  // a new liveness deadline
  }
  housekeeping_cv_.notify_all();
  if (old) old->Stop("replaced by a new registration");
  watch->Begin(watch);
}

void RegistryService::WatchEnded(const std::string& name, WorkerWatch* watch,
                                 const std::string& why, bool resync, bool graceful,
                                 const std::string& address, uint64_t epoch,
                                 const std::optional<WorkerRecord>& probe_of) {
  bool abandon = false, restart = false;
  {
    std::lock_guard lock(mu_);
    auto it = watches_.find(name);
    if (it == watches_.end() || it->second.get() != watch) return;  // replaced meanwhile
    watches_.erase(it);
    const auto now = std::chrono::steady_clock::now();
    if (probe_of) {
      // A probe that got no answer: try again later (or give up).
      auto l = lost_.find(name);
      if (l != lost_.end()) {
        if (graceful || shut_down_ || now - l->second.since > kForgetAfter) {
          spdlog::info("worker {}: no longer probed ({})", name, why);
          lost_.erase(l);
        } else {
          l->second.next_probe = now + kProbeInterval;
          housekeeping_kick_ = true;
          spdlog::debug("worker {}: probe failed: {}", name, why);
        }
      }
      housekeeping_cv_.notify_all();
      return;
    }
    if (!resync || shut_down_) {
      // A worker that left in order, or this proxy stopping: not an alarm.
      const bool expected = graceful || shut_down_;
      spdlog::log(expected ? spdlog::level::info : spdlog::level::warn,
                  "worker {} out of routing: {}", name, why);
      auto rec = fleet_->Find(name);
      fleet_->Remove(name, expected);
      if (rec && !graceful && !shut_down_) {
        lost_[name] = Lost{*rec, now, now + kProbeInterval};
        housekeeping_kick_ = true;  // a new probe deadline
        abandon = true;
      } else {
        lost_.erase(name);
      }
    } else {
      restart = true;
    }
  }
  if (abandon) housekeeping_cv_.notify_all();
  if (abandon) {
    // Calls in flight to a worker that stopped answering would wait for
    // their deadlines (a paused process keeps its connections open): end
    // them, so the requests are retried or migrated now.
    const size_t n = channels_->AbandonCalls(
        address, fmt::format("worker '{}' stopped answering ({})", name, why));
    if (n > 0) spdlog::warn("worker {}: {} calls in flight ended; their requests move on", name, n);
    return;
  }
  if (!restart) return;
  spdlog::info("worker {}: {}", name, why);
  StartWatch(name, address, epoch);
}

bool RegistryService::Rejoin(const std::string& name, WorkerWatch* watch, WorkerRecord rec,
                             uint64_t epoch) {
  {
    std::lock_guard lock(mu_);
    auto it = watches_.find(name);
    if (shut_down_ || it == watches_.end() || it->second.get() != watch) return false;
    lost_.erase(name);
    if (epoch != 0) rec.epoch = epoch;
    Status st = fleet_->Register(rec);
    if (!st.ok()) {
      spdlog::warn("worker {} answers again but cannot rejoin: {}", name, st.message());
      return false;
    }
  }
  // Calls to it were given up with it (AbandonCalls); they are made again.
  channels_->Reachable(rec.grpc_address);
  spdlog::info("worker {} answers again: back in routing", name);
  return true;
}

void RegistryService::Housekeeping(std::stop_token stop) {
  // Sleeps until the next deadline — a watched worker's liveness (its last
  // update + liveness_timeout) or a lost worker's next probe — or until a
  // new watch or probe deadline is set (issue 23: it polled every 100 ms).
  using Clock = std::chrono::steady_clock;
  std::unique_lock lock(mu_);
  while (!stop.stop_requested()) {
    std::vector<std::shared_ptr<WorkerWatch>> silent;
    std::vector<Lost> probe;
    auto next = Clock::time_point::max();
    const auto now = Clock::now();
    for (auto& [_, w] : watches_) {
      if (w->stopping()) continue;  // its end (WatchEnded) is on the way
      const auto deadline = w->last_seen() + liveness_timeout_;
      if (now > deadline) {
        silent.push_back(w);
      } else {
        next = std::min(next, deadline + std::chrono::milliseconds(1));
      }
    }
    for (auto& [name, l] : lost_) {
      if (watches_.count(name) > 0) continue;
      if (l.next_probe <= now) {
        l.next_probe = now + kForgetAfter;  // until this probe ends
        probe.push_back(l);
      } else {
        next = std::min(next, l.next_probe);
      }
    }
    if (!silent.empty() || !probe.empty()) {
      lock.unlock();
      for (auto& w : silent) {
        w->Stop(fmt::format("no update for {} ms", liveness_timeout_.count()));
      }
      for (auto& l : probe) {
        StartWatch(l.record.name, l.record.grpc_address, l.record.epoch, l.record);
      }
      lock.lock();
      continue;
    }
    housekeeping_kick_ = false;
    housekeeping_cv_.wait_until(lock, stop, next, [this] { return housekeeping_kick_; });
  }
}

}  // namespace tandem::proxy
