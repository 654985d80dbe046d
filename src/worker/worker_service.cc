// The RPC edge of the worker runtime: Worker.GetInfo/Watch and
// Registry.Register (worker.proto).
#include "worker/worker_service.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "common/rpc_server.h"
#include "common/stream_writer.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::worker {

namespace {

namespace pb = ::tandem::v1;
using tandem::StreamWriter;

// Who to tell when a Watch stream is cancelled (WorkerService::SetOnWatchCancelled);
// shared with the streams, which may outlive the service's Impl.
struct CancelHook {
  std::mutex mu;
  std::function<void()> fn;  // guarded by mu
  void Run() {
    std::function<void()> f;
    {
      std::lock_guard lock(mu);
      f = fn;
    }
    if (f) f();
  }
};

// A gRPC Watch stream's writer.
class GrpcWatchSink final : public WatchSink {
 public:
  explicit GrpcWatchSink(std::shared_ptr<StreamWriter<pb::WorkerUpdate>> writer)
      : writer_(std::move(writer)) {}
  bool open() const override { return !writer_->finished(); }
  void Write(const pb::WorkerUpdate& update) override { writer_->Write(update); }
  void End(bool graceful) override {
    writer_->Finish(graceful ? grpc::Status::OK
                             : grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker stopping"));
  }

 private:
  const std::shared_ptr<StreamWriter<pb::WorkerUpdate>> writer_;
};

// What the monitor thread keeps per Watch stream.
struct Watcher {
  std::shared_ptr<WatchSink> writer;
  bool needs_snapshot = true;
  bool needs_load = true;        // its first load report goes at the next sample
  uint64_t last_event_id = 0;    // events up to this one are in what it was sent
  bool batched = false;  // WatchRequest.batched: one update per round (issue 23)
  bool fixed64 = false;  // WatchRequest.fixed64_hashes: hashes in block_hashes_fixed64
  std::chrono::steady_clock::time_point last_write;  // for the keep-alive
};

class WatchStream final : public grpc::ServerWriteReactor<pb::WorkerUpdate> {
 public:
  explicit WatchStream(std::shared_ptr<CancelHook> hook)
      : writer_(std::make_shared<StreamWriter<pb::WorkerUpdate>>(this)), hook_(std::move(hook)) {
    writer_->Open();
  }
  void OnWriteDone(bool ok) override { writer_->OnWriteDone(ok); }
  void OnCancel() override {
    writer_->OnCancel();
    hook_->Run();
  }
  void OnDone() override { delete this; }
  const std::shared_ptr<StreamWriter<pb::WorkerUpdate>>& writer() const { return writer_; }

 private:
  std::shared_ptr<StreamWriter<pb::WorkerUpdate>> writer_;
  std::shared_ptr<CancelHook> hook_;
};

}  // namespace

struct WorkerService::Impl final : public pb::Worker::CallbackService {
  Impl(WorkerIdentity identity, engine::Engine& engine, std::function<LoadSample()> load,
       std::function<void()> on_tick, std::chrono::milliseconds interval,
       std::shared_ptr<IdleWake> idle_wake)
      : identity_(std::move(identity)), engine_(engine), load_(std::move(load)),
        on_tick_(std::move(on_tick)), interval_(interval), idle_wake_(std::move(idle_wake)) {
    if (idle_wake_) {
      std::lock_guard lock(idle_wake_->mu_);
      idle_wake_->wake_ = [this] {
        {
          std::lock_guard l(mu_);
          poked_ = true;
          wake_ = true;
        }
        cv_.notify_all();
      };
    }
  }

  // Detaches from idle_wake_ (no call into this Impl after it returns).
  void DetachIdleWake() {
    if (!idle_wake_) return;
    std::lock_guard lock(idle_wake_->mu_);
    idle_wake_->wake_ = nullptr;
  }

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const pb::GetInfoRequest*,
                                    pb::WorkerInfo* resp) override {
    {
      std::lock_guard lock(mu_);
      FillWorkerInfo(identity_, resp);
    }
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerWriteReactor<pb::WorkerUpdate>* Watch(grpc::CallbackServerContext*,
                                                    const pb::WatchRequest* req) override {
    auto* stream = new WatchStream(cancel_hook_);
    if (!AddWatch(std::make_shared<GrpcWatchSink>(stream->writer()), req->batched(),
                  req->fixed64_hashes())) {
      stream->writer()->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker stopping"));
    }
    return stream;
  }

  bool AddWatch(std::shared_ptr<WatchSink> sink, bool batched, bool fixed64) {
    {
      std::lock_guard lock(mu_);
      if (stopped_) return false;
      Watcher w;
      w.writer = std::move(sink);
      w.last_write = std::chrono::steady_clock::now();
      w.batched = batched;
      w.fixed64 = fixed64;
      watchers_.push_back(std::move(w));
      wake_ = true;
    }
    cv_.notify_all();
    return true;
  }

  // `fixed64` (WatchRequest.fixed64_hashes): the hashes go to
  // block_hashes_fixed64, a copy of their bytes instead of a 10-byte varint
  // each (common/wire_ids.h).
  template <typename Ev>
  static void AddHashes(const std::vector<uint64_t>& hashes, bool fixed64, Ev* ev) {
    auto* out = fixed64 ? ev->mutable_block_hashes_fixed64() : ev->mutable_block_hashes();
    out->Add(hashes.begin(), hashes.end());
  }

  static void FillEvent(const engine::KvEvent& e, bool fixed64, pb::KvEvent* ev) {
    ev->set_event_id(e.event_id);
    ev->set_epoch(e.epoch);
    switch (e.kind) {
      case engine::KvEventKind::kStored: {
        auto* st = ev->mutable_stored();
        st->set_parent_hash(e.parent_hash);
        st->set_tier(static_cast<pb::KvTier>(e.tier));
        AddHashes(e.hashes, fixed64, st);
        break;
      }
      case engine::KvEventKind::kRemoved:
        ev->mutable_removed()->set_tier(static_cast<pb::KvTier>(e.tier));
        AddHashes(e.hashes, fixed64, ev->mutable_removed());
        break;
      case engine::KvEventKind::kCleared: ev->mutable_cleared(); break;
    }
  }

  static pb::WorkerUpdate EventUpdate(const engine::KvEvent& e, bool fixed64) {
    pb::WorkerUpdate u;
    u.set_epoch(e.epoch);
    FillEvent(e, fixed64, u.mutable_event());
    return u;
  }

  pb::WorkerUpdate LoadUpdate(const LoadSample& s) const {
    pb::WorkerUpdate u;
    u.set_epoch(identity_.epoch);
    auto* l = u.mutable_load();
    l->set_queued_prefill_tokens(s.queued_prefill_tokens);
    l->set_active_decode_blocks(s.active_decode_blocks);
    l->set_free_blocks(s.free_blocks);
    l->set_running_requests(s.running_requests);
    l->set_waiting_requests(s.waiting_requests);
    l->set_kv_usage_ratio(s.kv_usage_ratio);
    l->set_num_reservations(s.num_reservations);
    l->set_kv_growth_reserve_blocks(s.kv_growth_reserve_blocks);
    l->set_kv_growth_ratio(s.kv_growth_ratio);
    l->set_num_parked_prefills(s.num_parked_prefills);
    l->set_queued_prefill_requests(s.queued_prefill_requests);
    l->set_registered_requests(s.registered_requests);
    l->set_leases_expired(s.leases_expired);
    l->set_stale_notices(s.stale_notices);
    l->set_prefill_tokens_total(s.prefill_tokens_total);
    l->set_prefill_seconds_total(s.prefill_seconds_total);
    l->set_prefill_attention_pairs_total(s.prefill_attention_pairs_total);
    l->set_prefill_pair_cost(s.prefill_pair_cost);
    l->set_seats_released_total(s.seats_released_total);
    l->set_seat_seconds_total(s.seat_seconds_total);
    return u;
  }

  // The shortest keep-alive any proxy asked for (mu_ held).
  std::chrono::milliseconds KeepaliveLocked() const {
    std::chrono::milliseconds k = kDefaultKeepalive;
    if (!keepalives_.empty()) {
      k = keepalives_.begin()->second;
      for (const auto& [_, v] : keepalives_) k = std::min(k, v);
    }
    return k;
  }

  void Loop(std::stop_token stop) {
    using Clock = std::chrono::steady_clock;
    using Writes =
        std::vector<std::pair<std::shared_ptr<WatchSink>, std::shared_ptr<const pb::WorkerUpdate>>>;
    auto next_load = Clock::now();
    LoadSample last_sent;
    bool sent_any = false;
    bool events_since_load = false;  // KV events went out after the last load report
    // Woken once per batch of events (a step's, kv_events.h), not per event.
    const uint64_t sub = engine_.events().SubscribeWake([this] {
      {
        std::lock_guard lock(mu_);
        wake_ = true;
      }
      cv_.notify_all();
    });
    // Events before the first watcher are in its snapshot.
    const auto initial = engine_.events().Drain();
    uint64_t last_drained = initial.empty() ? 0 : initial.back().event_id;
    while (!stop.stop_requested()) {
      {
        std::unique_lock lock(mu_);
        // The next sample, or a stream's keep-alive when that is sooner
        // (a proxy whose liveness timeout is under 4 sampling intervals).
        auto until = next_load;
        const auto keepalive = KeepaliveLocked();
        for (const auto& w : watchers_) until = std::min(until, w.last_write + keepalive);
        cv_.wait_until(lock, stop, until, [&] { return wake_; });
        wake_ = false;
        if (poked_) {  // work arrived at an idle worker: sample now
          poked_ = false;
          next_load = Clock::now();
        }
      }
      if (stop.stop_requested()) break;
      const std::vector<engine::KvEvent> events = engine_.events().Drain();
      const bool gap = !events.empty() && events.front().event_id != last_drained + 1;
      if (!events.empty()) {
        last_drained = events.back().event_id;
        events_since_load = true;
      }

      std::array<bool, 2> any_snapshot{};  // [fixed64]
      {
        std::lock_guard lock(mu_);
        std::erase_if(watchers_, [](const Watcher& w) { return !w.writer->open(); });
        for (auto& w : watchers_) {
          w.needs_snapshot |= gap;
          any_snapshot[w.fixed64] |= w.needs_snapshot;
        }
      }
      // Taken after the drain, so it covers every drained event; later
      // events are filtered by id. One message per hash encoding asked for.
      std::array<std::shared_ptr<const pb::WorkerUpdate>, 2> snapshot;  // [fixed64]
      uint64_t snapshot_id = 0;
      if (any_snapshot[0] || any_snapshot[1]) {
        const engine::KvSnapshot snap = engine_.SnapshotKv();
        snapshot_id = snap.last_event_id;
        for (const bool fixed64 : {false, true}) {
          if (!any_snapshot[fixed64]) continue;
          auto u = std::make_shared<pb::WorkerUpdate>();
          u->set_epoch(snap.epoch);
          u->set_snapshot_event_id(snap.last_event_id);
          auto* s = u->mutable_snapshot();
          for (const auto& b : snap.blocks) {
            switch (b.tier) {
              case engine::KvTier::kDevice:
                if (fixed64) {
                  s->add_block_hashes_fixed64(b.hash);
                } else {
                  s->add_block_hashes(b.hash);
                }
                break;
              case engine::KvTier::kHost: u->add_snapshot_host_hashes(b.hash); break;
              case engine::KvTier::kDisk: u->add_snapshot_disk_hashes(b.hash); break;
            }
          }
          snapshot[fixed64] = std::move(u);
        }
      }
      // Load: sampled every interval; sent to every stream when it changed
      // (or KV events went out since the last report: a request may have
      // come and gone between two samples), otherwise only to new streams
      // and as the keep-alive of a stream that carried nothing for its period.
      // Issue 23 (load piggyback): a round whose events go to a batched
      // watcher samples the load at once and the report leaves in the same
      // update, and the next sample is an interval after it: the periodic
      // report fires only when nothing left for the interval, so a busy
      // worker sends one update per batch of events instead of a batch plus
      // reports, and the router's view is never older than before.
      bool piggyback = false;
      if (!events.empty()) {
        std::lock_guard lock(mu_);
        piggyback = std::any_of(watchers_.begin(), watchers_.end(),
                                [](const Watcher& w) { return w.batched; });
      }
      std::shared_ptr<const pb::WorkerUpdate> load;
      bool load_changed = false;
      auto now = Clock::now();
      if (now >= next_load || piggyback) {
        // Armed before sampling: work that arrives after this sample wakes
        // the idle pace below (or is in the sample).
        if (idle_wake_) idle_wake_->armed_.store(true);
        const LoadSample sample = load_();
        load_changed = !sent_any || events_since_load || !sample.SameForRouting(last_sent);
        // Unchanged for the router: no update of its own, but the next one
        // (a batch, a keep-alive, a new stream's first) carries these values.
        const bool others_changed = !load_changed && !(sample == last_sent);
        if (load_changed || others_changed) last_sent = sample;
        if (load_changed) {
          sent_any = true;
          events_since_load = false;
        }
        if ((load_changed || others_changed) && on_tick_) on_tick_();
        now = Clock::now();
        // Quiescent and unchanged: the next sample at the keep-alive pace
        // (or at once on IdleWake::Notify); otherwise every interval.
        const bool idle = idle_wake_ && !load_changed && sample.quiescent();
        if (!idle && idle_wake_) idle_wake_->armed_.store(false);
        std::chrono::milliseconds pace = interval_;
        if (idle) {
          std::lock_guard lock(mu_);
          pace = std::max(interval_, KeepaliveLocked());
        }
        next_load = now + pace;
      }
      // Per-event updates only for watchers that did not ask for batches.
      std::array<std::vector<std::shared_ptr<const pb::WorkerUpdate>>, 2> updates;  // [fixed64]
      {
        std::lock_guard lock(mu_);
        for (const bool fixed64 : {false, true}) {
          const bool any_single =
              std::any_of(watchers_.begin(), watchers_.end(), [fixed64](const Watcher& w) {
                return !w.batched && w.fixed64 == fixed64;
              });
          if (!any_single) continue;
          for (const auto& e : events) {
            updates[fixed64].push_back(std::make_shared<pb::WorkerUpdate>(EventUpdate(e, fixed64)));
          }
        }
      }
      // Batched watchers: this round's events (from the first one a watcher
      // lacks) and, when it gets one, the load report in one update, built
      // once per (start, with load, hash encoding).
      std::map<std::tuple<size_t, bool, bool>, std::shared_ptr<const pb::WorkerUpdate>> batches;
      const auto batch_from = [&](size_t first, bool with_load, bool fixed64) {
        auto& b = batches[{first, with_load, fixed64}];
        if (!b) {
          auto u = std::make_shared<pb::WorkerUpdate>();
          u->set_epoch(identity_.epoch);
          for (size_t i = first; i < events.size(); ++i) {
            FillEvent(events[i], fixed64, u->add_events());
          }
          if (with_load) *u->mutable_batched_load() = load->load();
          b = std::move(u);
        }
        return b;
      };

      Writes writes;
      {
        std::lock_guard lock(mu_);
        const auto keepalive = KeepaliveLocked();
        for (auto& w : watchers_) {
          const size_t before = writes.size();
          if (w.needs_snapshot) {
            if (!snapshot[w.fixed64]) continue;  // joined after the snapshot: next round
            w.needs_snapshot = false;
            w.last_event_id = snapshot_id;
            writes.emplace_back(w.writer, snapshot[w.fixed64]);
          }
          size_t first = 0;  // batched: the first event it lacks
          if (w.batched) {
            while (first < events.size() && events[first].event_id <= w.last_event_id) ++first;
            if (first < events.size()) w.last_event_id = events.back().event_id;
          }
          const bool new_events = w.batched ? first < events.size() : [&] {
            bool any = false;
            for (const auto& e : events) any |= e.event_id > w.last_event_id;
            return any;
          }();
          const bool with_load =
              sent_any && (load_changed || w.needs_load ||
                           (writes.size() == before && !new_events &&
                            now - w.last_write >= keepalive));
          if (with_load) {
            // (Between samples, or unchanged: the last report again.)
            if (!load) load = std::make_shared<pb::WorkerUpdate>(LoadUpdate(last_sent));
            w.needs_load = false;
          }
          if (w.batched) {
            if (new_events || with_load) {
              writes.emplace_back(w.writer, batch_from(first, with_load, w.fixed64));
            }
          } else {
            for (size_t i = 0; i < events.size(); ++i) {
              if (events[i].event_id <= w.last_event_id) continue;
              w.last_event_id = events[i].event_id;
              writes.emplace_back(w.writer, updates[w.fixed64][i]);
            }
            if (with_load) writes.emplace_back(w.writer, load);
          }
          if (writes.size() != before) w.last_write = now;
        }
      }
      for (auto& [writer, update] : writes) writer->Write(*update);
    }
    engine_.events().Unsubscribe(sub);
  }

  void FinishAll() {
    std::vector<Watcher> ws;
    {
      std::lock_guard lock(mu_);
      stopped_ = true;
      ws.swap(watchers_);
    }
    for (auto& w : ws) w.writer->End(/*graceful=*/true);
  }

  mutable std::mutex mu_;
  std::condition_variable_any cv_;
  WorkerIdentity identity_;        // guarded by mu_ (addresses change once)
  engine::Engine& engine_;
  std::function<LoadSample()> load_;
  std::function<void()> on_tick_;
  const std::chrono::milliseconds interval_;
  std::vector<Watcher> watchers_;  // guarded by mu_
  std::map<std::string, std::chrono::milliseconds> keepalives_;  // guarded by mu_: proxy -> period
  std::shared_ptr<CancelHook> cancel_hook_ = std::make_shared<CancelHook>();
  bool wake_ = false;              // guarded by mu_
  bool poked_ = false;             // guarded by mu_: IdleWake::Notify came
  const std::shared_ptr<IdleWake> idle_wake_;
  bool stopped_ = false;           // guarded by mu_
  std::jthread thread_;
};

WorkerService::WorkerService(WorkerIdentity identity, engine::Engine& engine,
                             std::function<LoadSample()> load, std::function<void()> on_tick,
                             std::chrono::milliseconds load_interval,
                             std::shared_ptr<IdleWake> idle_wake)
    : impl_(std::make_unique<Impl>(std::move(identity), engine, std::move(load), std::move(on_tick),
                                   load_interval, std::move(idle_wake))) {}

WorkerService::~WorkerService() { Stop(); }

grpc::Service* WorkerService::service() { return impl_.get(); }

void WorkerService::SetAddresses(const std::string& grpc_address, const std::string& metrics_address) {
  std::lock_guard lock(impl_->mu_);
  impl_->identity_.grpc_address = grpc_address;
  impl_->identity_.metrics_address = metrics_address;
}

void WorkerService::SetDecodeMuxAddress(const std::string& address) {
  std::lock_guard lock(impl_->mu_);
  impl_->identity_.decode_mux_address = address;
}

void WorkerService::SetWatchAddress(const std::string& address) {
  std::lock_guard lock(impl_->mu_);
  impl_->identity_.watch_address = address;
}

bool WorkerService::AddWatch(std::shared_ptr<WatchSink> sink, bool batched, bool fixed64_hashes) {
  return impl_->AddWatch(std::move(sink), batched, fixed64_hashes);
}

void WorkerService::WatchBroken() { impl_->cancel_hook_->Run(); }

void WorkerService::SetPrefillFrameAddress(const std::string& address) {
  std::lock_guard lock(impl_->mu_);
  impl_->identity_.prefill_frame_address = address;
}

void WorkerService::SetReserveAddress(const std::string& address) {
  std::lock_guard lock(impl_->mu_);
  impl_->identity_.reserve_address = address;
}

WorkerIdentity WorkerService::identity() const {
  std::lock_guard lock(impl_->mu_);
  return impl_->identity_;
}

void WorkerService::Start() {
  impl_->thread_ = std::jthread([this](std::stop_token stop) { impl_->Loop(stop); });
}

void WorkerService::Stop() {
  impl_->DetachIdleWake();
  if (impl_->thread_.joinable()) {
    impl_->thread_.request_stop();
    impl_->cv_.notify_all();
    impl_->thread_.join();
  }
  impl_->FinishAll();
}

void WorkerService::Leave() { impl_->FinishAll(); }

void WorkerService::SetKeepalive(const std::string& proxy_address, std::chrono::milliseconds every) {
  if (every.count() <= 0) return;
  {
    std::lock_guard lock(impl_->mu_);
    auto& k = impl_->keepalives_[proxy_address];
    if (k == every) return;
    k = every;
    impl_->wake_ = true;  // the monitor recomputes its next wake-up
  }
  impl_->cv_.notify_all();
}

void WorkerService::SetOnWatchCancelled(std::function<void()> fn) {
  std::lock_guard lock(impl_->cancel_hook_->mu);
  impl_->cancel_hook_->fn = std::move(fn);
}

}  // namespace tandem::worker
