#include "worker/worker_runtime.h"

#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "common/config.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/net.h"
#include "common/rpc_server.h"
#include "common/tracing_otlp.h"
#include "decoder/decoder.h"
#include "decoder/decode_mux_tcp.h"
#include "decoder/decoder_service.h"
#include "decoder/reserve_tcp.h"
#include "engine/engine.h"
#include "engine/llama_forward.h"
#include "engine/parallel_backend.h"
#include "engine/sim_backend.h"
#include "kvtransfer/slice_push_ranks.h"
#include "kvtransfer/transport.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/follower.h"
#include "parallel/step_plan.h"
#include "prefiller/prefill_tcp.h"
#include "prefiller/prefiller.h"
#include "prefiller/prefiller_service.h"
#include "prefiller/reserve_tcp_link.h"
#include "worker/advertise.h"
#include "worker/kv_transport_setup.h"
#include "worker/proxy_registrar.h"
#include "worker/rank_kv.h"
#include "worker/rank_layout.h"
#include "worker/rank_process.h"
#include "worker/role_capabilities.h"
#include "worker/worker_metrics.h"
#include "worker/watch_tcp.h"
#include "worker/worker_service.h"

namespace tandem::worker {

namespace {

// The engine's KV pool is the transport's (UCX-allocated) memory.
class TransportPoolAllocator final : public engine::KvPoolAllocator {
 public:
  explicit TransportPoolAllocator(kvtransfer::Transport& t) : transport_(t) {}
  Result<std::span<std::byte>> Allocate(size_t bytes) override {
    if (bytes != transport_.pool_bytes()) {
      return InternalError(fmt::format("the engine wants a {}-byte KV pool; the transport has {}",
                                       bytes, transport_.pool_bytes()));
    }
    if (reinterpret_cast<uintptr_t>(transport_.pool()) % 64 != 0) {
      return InternalError("the transport's KV pool is not 64-byte aligned");
    }
    return std::span<std::byte>(transport_.pool(), bytes);
  }

 private:
  kvtransfer::Transport& transport_;
};

uint64_t RandomEpoch() {
  std::random_device rd;
  uint64_t e = 0;
  while (e == 0) e = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return e;
}

// Everything one worker process runs, in construction order (destroyed in
// reverse: servers before services before the engine before the transport,
// whose memory the engine's pool is).
struct Worker {
  FleetConfig fleet;
  RpcCredentials credentials;  // the internal plane's
  model::ModelConfig model_config;
  engine::SimSetup sim;  // backend sim only
  std::unique_ptr<kvtransfer::Transport> transport;
  std::unique_ptr<TransportPoolAllocator> allocator;
  std::unique_ptr<MetricsRegistry> registry;
  std::unique_ptr<WorkerMetrics> metrics;
  std::unique_ptr<engine::Engine> engine;
  engine::ParallelBackend* group = nullptr;  // rank 0 of a rank group (issue 18); in `engine`
  std::unique_ptr<decoder::Decoder> decoder;
  std::unique_ptr<prefiller::DecoderLink> link;
  std::unique_ptr<prefiller::Prefiller> prefiller;
  std::unique_ptr<grpc::Service> decoder_service;
  std::unique_ptr<grpc::Service> prefiller_service;
  std::unique_ptr<WorkerService> worker_service;
  // Wakes the Watch monitor's idle load sampling when work arrives (the
  // engine's steps, the decoder's first reservation; issue 23).
  std::shared_ptr<IdleWake> idle_wake = std::make_shared<IdleWake>();
  std::unique_ptr<RpcServer> server;
  // The decode stream over framed TCP (issue 23, decode.mux_listen).
  std::unique_ptr<FrameServer> mux_server;
  // The Watch stream over framed TCP (issue 23, <role>.watch_listen).
  std::unique_ptr<FrameServer> watch_server;
  // Prefill over framed TCP (issue 23, prefill.frame_listen).
  std::unique_ptr<FrameServer> prefill_frame_server;
  // Reserve over framed TCP (issue 23, decode.reserve_listen).
  std::unique_ptr<FrameServer> reserve_server;
  // Keeps it registered with every proxy (--join, --join-dns); stopped
  // first when draining.
  std::unique_ptr<ProxyRegistrar> registrar;
  // Failure-handling counters (docs/failure-handling.md), fed from the
  // prefiller's totals on every metrics tick.
  prometheus::Counter* dropped_target_lost = nullptr;
  prometheus::Counter* dropped_lease_expired = nullptr;
  mutable std::mutex dropped_mu;
  mutable uint64_t dropped_target_lost_seen = 0;    // guarded by dropped_mu
  mutable uint64_t dropped_lease_expired_seen = 0;  // guarded by dropped_mu

  // The engine, decoder and prefiller go before the registry (and its
  // exposer thread): the scrape hook that reads them goes first.
  ~Worker() {
    if (registry) registry->OnScrape({});
  }

  LoadSample Load() const {
    const engine::EngineStats st = engine->stats();
    LoadSample s;
    s.free_blocks = st.free_blocks;
    s.active_decode_blocks = st.num_blocks - st.free_blocks;
    s.running_requests = st.num_running;
    s.waiting_requests = st.num_waiting;
    s.kv_usage_ratio = st.kv_usage_ratio;
    s.num_parked_prefills = st.num_parked;
    s.prefill_tokens_total = st.prefill_step_tokens;
    s.prefill_seconds_total = st.prefill_step_seconds;
    s.prefill_attention_pairs_total = st.prefill_step_pairs;
    s.prefill_pair_cost = st.prefill_pair_cost;
    if (decoder) {
      const decoder::DecoderCounts c = decoder->counts();
      s.num_reservations = c.reservations;
      s.kv_growth_reserve_blocks = st.growth_reserve_blocks;
      s.kv_growth_ratio = static_cast<float>(st.growth_ratio);
      s.registered_requests = c.registered;
      s.seats_released_total = c.seats_released;
      s.seat_seconds_total = c.seat_seconds;
      s.leases_expired = c.leases_expired;
      s.stale_notices = c.stale_notices;
    }
    if (prefiller) {
      const prefiller::PrefillerCounts c = prefiller->counts();
      s.queued_prefill_requests = c.queued;
      s.queued_prefill_tokens = c.queued_prompt_tokens;
    }
    return s;
  }

  void UpdateMetrics() const {
    MetricsSample m;
    m.engine = engine->stats();
    if (decoder) m.decoder = decoder->counts();
    m.fair_share_deficit_tokens = m.engine.fair_share_deficit_tokens;
    if (prefiller) {
      const prefiller::PrefillerCounts pc = prefiller->counts();
      m.queued_prefills = pc.queued;
      m.prefill_seat_waits = pc.reserve_seat_waits;
      for (const auto& [tenant, tokens] : pc.fair_share_deficit_tokens) {
        m.fair_share_deficit_tokens[tenant] += tokens;
      }
    }
    metrics->Update(m);
    if (prefiller && dropped_target_lost) {
      const prefiller::PrefillerCounts c = prefiller->counts();
      std::lock_guard lock(dropped_mu);
      dropped_target_lost->Increment(static_cast<double>(c.dropped_target_lost - dropped_target_lost_seen));
      dropped_lease_expired->Increment(
          static_cast<double>(c.dropped_lease_expired - dropped_lease_expired_seen));
      dropped_target_lost_seen = c.dropped_target_lost;
      dropped_lease_expired_seen = c.dropped_lease_expired;
    }
  }

  size_t Inflight() const {
    size_t n = 0;
    if (decoder) {
      const auto c = decoder->counts();
      n += c.registered + c.reservations;
    }
    if (prefiller) {
      const auto c = prefiller->counts();
      n += c.queued + c.inflight;
    }
    return n;
  }
};

// Where a framed TCP listener binds: its setting, `auto` = the gRPC
// address's host on a port the kernel picks.
Result<std::string> FrameListenAddress(const Worker& w, const std::string& setting) {
  if (setting != "auto") return setting;
  TANDEM_ASSIGN_OR_RETURN(HostPort grpc, ParseHostPort(w.server->address()));
  return HostPort{grpc.host, 0}.ToString();
}

// What such a listener bound at `bound` advertises (--advertise's host).
Result<std::string> AdvertisedFrameAddress(const std::string& bound, const WorkerCommand& cmd) {
  if (cmd.advertise.empty()) return bound;
  TANDEM_ASSIGN_OR_RETURN(HostPort adv, ParseAdvertise(cmd.advertise));
  return Advertised(bound, adv, false);
}

// One framed TCP listener (issue 23): on the gRPC address's host unless its
// setting `key` says otherwise, with the internal plane's mutual TLS
// identity; its authenticated connections counted in `metric`. `serve`
// starts it from its options; the result is the address to advertise, ""
// when the setting is off.
template <typename Options, typename Serve>
Result<std::string> StartFramed(Worker& w, const WorkerCommand& cmd, const std::string& setting,
                                const char* key, const char* metric, const char* help,
                                Options o, Serve serve, std::unique_ptr<FrameServer>& out) {
  if (setting == "off") return std::string();
  TANDEM_ASSIGN_OR_RETURN(const std::string listen, FrameListenAddress(w, setting));
  auto tls = InternalFrameTls(w.credentials);
  if (!tls.ok()) return tls.status().WithContext(key);
  prometheus::Counter* connections = &w.registry->Counter(metric, help);
  o.address = listen;
  o.tls = std::move(tls).value();
  o.on_connection = [connections] { connections->Increment(); };
  auto server = serve(std::move(o));
  if (!server.ok()) return server.status().WithContext(key);
  out = std::move(server).value();
  return AdvertisedFrameAddress(out->address(), cmd);
}

// The framed TCP listeners of this worker's role, each advertised in its
// WorkerInfo field: the decode stream (docs/decode-stream.md "Transport")
// and Reserve (docs/serving-workers.md "Reserve transport") of a decoder,
// Prefill of a prefiller ("Prefill transport"), every worker's Watch
// ("Watch transport").
Status StartFrameListeners(Worker& w, const RoleConfig& rc, const WorkerCommand& cmd,
                           bool decodes, bool prefills) {
  std::string a;
  if (decodes) {
    TANDEM_ASSIGN_OR_RETURN(
        a, StartFramed(w, cmd, rc.mux_listen, "decode.mux_listen",
                       "tandem_decode_mux_tcp_connections_total",
                       "Authenticated framed TCP decode stream connections accepted (issue 23; one "
                       "per proxy connection)",
                       decoder::DecodeMuxTcpOptions{},
                       [&w](auto o) { return decoder::ServeDecodeMuxTcp(*w.decoder, std::move(o)); },
                       w.mux_server));
    w.worker_service->SetDecodeMuxAddress(a);
    TANDEM_ASSIGN_OR_RETURN(
        a, StartFramed(w, cmd, rc.reserve_listen, "decode.reserve_listen",
                       "tandem_reserve_tcp_connections_total",
                       "Authenticated framed TCP Reserve connections accepted (issue 23; one per "
                       "prefiller connection)",
                       decoder::ReserveTcpOptions{},
                       [&w](auto o) { return decoder::ServeReserveTcp(*w.decoder, std::move(o)); },
                       w.reserve_server));
    w.worker_service->SetReserveAddress(a);
  }
  if (prefills) {
    prefiller::PrefillTcpOptions po;
    po.on_closed = [](const std::string& peer, const Status& why) {
      spdlog::debug("prefill connection from {} ended: {}", peer, why.message());
    };
    TANDEM_ASSIGN_OR_RETURN(
        a, StartFramed(w, cmd, rc.frame_listen, "prefill.frame_listen",
                       "tandem_prefill_tcp_connections_total",
                       "Authenticated framed TCP Prefill connections accepted (issue 23; one per "
                       "proxy connection)",
                       std::move(po),
                       [&w](auto o) { return prefiller::ServePrefillTcp(*w.prefiller, std::move(o)); },
                       w.prefill_frame_server));
    w.worker_service->SetPrefillFrameAddress(a);
  }
  TANDEM_ASSIGN_OR_RETURN(
      a, StartFramed(w, cmd, rc.watch_listen, "watch_listen", "tandem_watch_tcp_connections_total",
                     "Authenticated framed TCP Watch connections accepted (issue 23; one per proxy "
                     "watch)",
                     WatchTcpOptions{},
                     [&w](auto o) { return ServeWatchTcp(*w.worker_service, std::move(o)); },
                     w.watch_server));
  w.worker_service->SetWatchAddress(a);
  return Status::Ok();
}

Status Build(const WorkerCommand& cmd, const std::string& name, const RoleConfig& rc, Worker& w) {
  const bool decodes = cmd.role == "decode" || cmd.role == "both";
  const bool prefills = cmd.role == "prefill" || cmd.role == "both";
  TANDEM_ASSIGN_OR_RETURN(w.model_config, model::LoadModelConfig(w.fleet.model.path));
  const bool simulated = w.fleet.model.backend == "sim";
  model::ModelWeights weights;  // as loaded; the engine makes its own copy
  if (simulated) {
    // No weights: a timing model stands in for the GPU; model.path gives
    // the tokenizer's vocabulary (docs/sim.md).
    TANDEM_ASSIGN_OR_RETURN(w.sim, engine::PrepareSim(w.fleet.sim, w.model_config,
                                                      w.fleet.cache.block_size,
                                                      rc.tensor_parallel, rc.pipeline_parallel));
    w.model_config = w.sim.storage_config;
  } else {
    // cuda: matrices straight to bf16 (half the host memory; docs/cuda.md).
    const auto format = w.fleet.model.backend == "cuda" ? model::WeightFormat::kBf16
                                                        : model::WeightFormat::kF32;
    TANDEM_ASSIGN_OR_RETURN(weights,
                            model::LoadWeights(w.fleet.model.path, w.model_config, format));
  }

  engine::EngineOptions eo = engine::EngineOptions::FromFleetConfig(w.fleet);
  if (simulated) {
    eo.num_blocks = w.sim.num_blocks;  // from the simulated device's memory
    eo.sim_timing = w.sim.timing.get();
    eo.sim_host_bytes_per_s = w.fleet.sim.pcie_gbps * 1e9 / 8;
    eo.sim_disk_bytes_per_s = w.fleet.sim.nvme_gbps * 1e9 / 8;
    eo.sim_kv_scale = w.sim.kv_scale;
    eo.sim_eos_probability = w.fleet.sim.eos_probability;
  }
  if (rc.num_blocks != 0) eo.num_blocks = rc.num_blocks;
  // One disk-tier directory per worker (its name is stable across restarts).
  if (!eo.disk_tier_path.empty()) eo.disk_tier_path = (std::filesystem::path(eo.disk_tier_path) / name).string();
  eo.epoch = RandomEpoch();
  engine::KvLayout layout;
  layout.num_layers = w.model_config.num_hidden_layers;
  layout.num_kv_heads = w.model_config.num_key_value_heads;
  layout.head_dim = w.model_config.head_dim;
  layout.block_size = eo.block_size;
  // Issue 18 (docs/parallelism.md "Rank processes"): rank 0 of a group of
  // ranks (the layout was checked against the model: CheckRankFlags). Its
  // engine runs ParallelBackend, which waits for the followers to join; its
  // pool and transport hold rank 0's slice of every block.
  const parallel::ParallelLayout pl =
      simulated ? parallel::ParallelLayout{} : parallel::ParallelLayout{rc.tensor_parallel, rc.pipeline_parallel};
  const uint64_t model_block_bytes = layout.block_bytes();  // the whole block, every rank's slice
  if (pl.world() > 1) {
    TANDEM_RETURN_IF_ERROR(CheckTransportForLayout(cmd.role, pl, w.fleet.transport));
    eo.parallel = pl;
    eo.parallel_group = cmd.group;
    eo.parallel_join_timeout_ms = kRankJoinTimeoutMs;
    layout = engine::ShardKvLayout(w.model_config, engine::ShardSpec{pl, 0}, eo.block_size);
  }

  // The transport first: it allocates the pool, and nothing may touch UCX before it.
  kvtransfer::TransportOptions to;
  to.backend = w.fleet.transport.backend;
  to.agent_name = name;
  to.block_bytes = layout.block_bytes();
  to.num_blocks = eo.num_blocks;
  to.peer_timeout_s = w.fleet.transport.peer_timeout_seconds;
  // transport.encrypt: a prefiller seals outgoing blocks into a staging copy.
  if (w.fleet.transport.encrypt && prefills) to.staging_blocks = eo.num_blocks;
  if (simulated && w.fleet.sim.link_gbps > 0) {  // the simulated network link
    to.pace_bits_per_s = w.fleet.sim.link_gbps * 1e9;
    to.pace_byte_scale = w.sim.kv_scale;
    to.pace_latency_s = w.fleet.sim.link_latency_us * 1e-6;
  }
  // transport.encrypt seals and opens blocks with the CPU: a device pool
  // (backend cuda) cannot, so refuse before allocating anything.
  if (w.fleet.transport.encrypt && w.fleet.model.backend == "cuda") {
    return FailedPreconditionError(
        "transport.encrypt: the KV pool of backend cuda is in device memory, which this build "
        "cannot seal or open; turn transport.encrypt off for GPU pools");
  }
  // cuda: the transport's pool is the device KV pool (kv_transport_setup.h).
  const uint64_t bf16_block_bytes = layout.block_floats() * 2;
  TANDEM_ASSIGN_OR_RETURN(WorkerTransport wt,
                          CreateWorkerTransport(w.fleet.model.backend, to, bf16_block_bytes,
                                                w.fleet.transport.device_path, decodes));
  w.transport = std::move(wt.transport);
  if (wt.device_kv_pool != nullptr) {
    eo.device_kv_pool = wt.device_kv_pool;
    eo.device_kv_pool_bytes = wt.device_kv_pool_bytes;
  } else {
    w.allocator = std::make_unique<TransportPoolAllocator>(*w.transport);
    eo.allocator = w.allocator.get();
  }
  if (w.fleet.transport.encrypt && w.transport->capabilities().device_memory) {
    return FailedPreconditionError(
        "transport.encrypt: the KV pool is in device memory, which this build cannot seal or "
        "open; turn transport.encrypt off for GPU pools");
  }
  spdlog::info("{}: KV transfer path: {}{}", name, wt.detail,
               w.fleet.transport.encrypt ? " (transport.encrypt: AES-256-GCM)" : "");

  w.registry = std::make_unique<MetricsRegistry>(MetricLabels{w.fleet.model.name, cmd.role, name});
  w.metrics = std::make_unique<WorkerMetrics>(*w.registry);
  // The cadence this worker's Watch loop samples its load at while busy,
  // from its role's load_interval_ms (docs/serving-workers.md "Load reports").
  w.registry
      ->Gauge("tandem_worker_load_interval_seconds",
              "how often this worker samples its load for its Watch streams while busy (its "
              "role's load_interval_ms)")
      .Set(rc.load_interval_ms / 1000.0);
  if (simulated) {
    w.registry
        ->Gauge("tandem_simulated_info",
                "1 on a worker whose GPU is simulated (model.backend sim); labels name the "
                "hardware profile, the model shape and the KV scale",
                {{"profile", w.sim.timing->params().hardware.name},
                 {"model_shape", w.sim.timing->params().shape.name},
                 {"kv_scale", fmt::format("{:.0f}", w.sim.kv_scale)}})
        .Set(1);
    spdlog::info("{}: {}", name, w.sim.summary);
  }
  WorkerMetrics* metrics = w.metrics.get();
  eo.on_onboard = [metrics](double seconds) { metrics->ObserveOnboard(seconds); };
  // The prefiller's dispatcher sleeps until the engine schedules or ends a
  // request (issue 23; prefiller.h, EngineProgress).
  std::shared_ptr<prefiller::EngineProgress> engine_progress =
      prefills ? std::make_shared<prefiller::EngineProgress>(/*shared=*/decodes) : nullptr;
  eo.on_queue_time = [metrics, engine_progress](int32_t priority, const std::string& tenant,
                                                double seconds) {
    metrics->ObserveQueueTime(priority, tenant, seconds);
    if (engine_progress) engine_progress->Scheduled();
  };
  eo.on_step = [metrics, idle = w.idle_wake, engine_progress](const engine::StepStats& st) {
    idle->Notify();
    if (engine_progress) engine_progress->StepEnded();
    if (st.num_prefill_tokens == 0 && st.num_decode_tokens > 0) metrics->ObserveDecodeStep(st.seconds);
  };
  // The backend makes its own copy (the cpu backend's packed weights, freeing
  // each loaded tensor once copied; the cuda backend's device buffers): the
  // loaded one would keep the model's size resident a second time.
  const uint64_t loaded = model::HostBytes(weights);
  TANDEM_ASSIGN_OR_RETURN(w.engine, engine::Engine::Create(w.model_config, std::move(weights), eo));
  model::ReleaseHostWeights(weights);  // what the backend did not free (cuda: all of it)
  if (loaded > 0) {
    spdlog::info("{}: freed the loaded weights ({:.1f} MiB); the {} backend keeps its own copy",
                 name, loaded / 1048576.0, w.fleet.model.backend);
  }
  // No silent fallback: a backend whose KV the transport cannot move is refused here.
  TANDEM_RETURN_IF_ERROR(
      CheckRoleCapabilities(w.engine->backend(), cmd.role, w.transport->capabilities()));
  // A prompt as long as the context must fit its KV notice (a checksum per
  // block, read from host pools only, and transport.encrypt's tags), or
  // every such request would fail at its push.
  TANDEM_RETURN_IF_ERROR(CheckKvNoticeFits(
      cmd.role, w.engine->max_model_len(), w.fleet.cache.block_size,
      w.fleet.transport.checksum && !w.transport->capabilities().device_memory,
      w.fleet.transport.encrypt, w.transport->capabilities()));
  // Issue 18: every follower has joined (Engine::Create waited); before the
  // first step plan, rank 0 collects every rank's KV transport descriptor
  // (the followers send theirs right after joining).
  engine::ParallelBackend* group = nullptr;
  std::vector<std::string> rank_descriptors;
  if (pl.world() > 1) {
    group = dynamic_cast<engine::ParallelBackend*>(&w.engine->backend());
    if (group == nullptr) return InternalError("a rank group's engine has no ParallelBackend");
    TANDEM_ASSIGN_OR_RETURN(rank_descriptors, kvtransfer::ExchangeRankDescriptors(
                                                  group->world(), w.transport->LocalDescriptor()));
    spdlog::info("{}: rank 0 of {} ({}), every rank joined group {}", name, pl.world(),
                 parallel::ToString(pl), cmd.group);
    w.group = group;
  }
  w.engine->Start();

  // End-to-end KV checksums read the pools from the host.
  const bool checksum = w.fleet.transport.checksum && !w.transport->capabilities().device_memory;
  if (w.fleet.transport.checksum && !checksum) {
    spdlog::warn("{}: transport.checksum: the KV pool is in device memory; KV checksums are not "
                 "computed or verified on this worker",
                 name);
  }
  std::vector<grpc::Service*> services;
  if (decodes) {
    decoder::DecoderOptions dopt;
    dopt.lease_seconds = w.fleet.transport.lease_seconds;
    dopt.encrypt = w.fleet.transport.encrypt;
    dopt.verify_checksums = checksum;
    dopt.on_local_prefill_seconds = [metrics](double s) { metrics->ObservePrefill(s); };
    dopt.on_pending_work = [idle = w.idle_wake] { idle->Notify(); };
    dopt.layout = pl;  // issue 18: the decode ranks' descriptors go in every KvTarget
    if (pl.world() > 1) dopt.rank_descriptors = rank_descriptors;
    // Decode seats (docs/serving-workers.md): no more requests reserved or
    // decoding than the running batch takes; a Reserve past it waits.
    dopt.max_seats = w.fleet.scheduler.max_num_seqs;
    dopt.inter_token_latency = &metrics->decoder_itl();
    dopt.reserve_wait = &metrics->reserve_wait();
    w.decoder = std::make_unique<decoder::Decoder>(*w.engine, *w.transport, dopt);
    w.decoder->Start();
    w.decoder_service = decoder::MakeDecoderService(*w.decoder, *w.transport);
    services.push_back(w.decoder_service.get());
  }
  if (prefills) {
    // Reserve (issue 23, docs/serving-workers.md "Reserve transport"): over a
    // decoder's framed listener unless <role>.reserve_transport is grpc.
    w.link = prefiller::MakeGrpcDecoderLink(w.credentials, w.transport->LocalDescriptor());
    if (rc.reserve_transport == "tcp") {
      auto tls = InternalFrameTls(w.credentials);
      if (!tls.ok()) return tls.status().WithContext("reserve_transport");
      w.link = prefiller::MakeTcpDecoderLink(std::move(w.link), std::move(tls).value(),
                                             w.transport->LocalDescriptor());
    }
    prefiller::PrefillerOptions popt;
    popt.name = name;
    popt.max_queue = w.fleet.scheduler.max_waiting;
    popt.max_num_seqs = w.fleet.scheduler.max_num_seqs;
    popt.max_batched_tokens = w.fleet.scheduler.max_batched_tokens;
    popt.lease_seconds = w.fleet.transport.lease_seconds;
    popt.encrypt = w.fleet.transport.encrypt;
    popt.checksum = checksum;
    popt.push_mode = w.fleet.transport.push == "after_prefill" ? prefiller::PushMode::kAfterPrefill
                                                               : prefiller::PushMode::kStreaming;
    popt.layout = pl;  // issue 18: pushes are sliced when either side has several ranks
    popt.engine_progress = engine_progress;
    if (pl.world() > 1) {
      popt.kv_dims = KvDimsOf(w.model_config, eo.block_size);
      // The other prefill ranks' parts of a sliced push: a push_kv step plan
      // and their reports, on the engine thread (where a push's Finish runs).
      popt.follower_push = [group](const kvtransfer::SlicePushSpec& spec,
                                   kvtransfer::RankSlicePusher::Done done) {
        auto send_plan = [group](std::string spec_bytes) {
          parallel::StepPlan plan;
          plan.kind = parallel::StepKind::kPushKv;
          const auto* b = reinterpret_cast<const std::byte*>(spec_bytes.data());
          plan.extensions.push_back(
              {kvtransfer::kPushKvSpecTag, std::vector<std::byte>(b, b + spec_bytes.size())});
          return group->BroadcastPlan(std::move(plan));
        };
        done(kvtransfer::PushThroughFollowers(spec, send_plan, group->world()));
      };
    }
    const char* help = "Prefills dropped with their blocks freed and nothing written, by reason "
                       "(target_lost: the decoder or the push failed; lease_expired: the KV was "
                       "ready too late for the decoder's lease)";
    w.dropped_target_lost =
        &w.registry->Counter("tandem_prefill_dropped_total", help, {{"reason", "target_lost"}});
    w.dropped_lease_expired =
        &w.registry->Counter("tandem_prefill_dropped_total", help, {{"reason", "lease_expired"}});
    popt.on_complete = [metrics](const prefiller::PrefillResult& r) {
      metrics->ObservePrefill(r.prefill_seconds);
      metrics->ObserveTransfer(r.transferred_bytes, r.transfer_seconds, r.prefill_seconds);
    };
    w.prefiller = std::make_unique<prefiller::Prefiller>(*w.engine, *w.transport, *w.link, popt);
    w.prefiller->Start();
    w.prefiller_service = prefiller::MakePrefillerService(*w.prefiller);
    services.push_back(w.prefiller_service.get());
  }

  WorkerIdentity id;
  id.name = name;
  id.role = cmd.role;
  id.model = w.fleet.model.name;
  id.revision = w.fleet.model.revision;
  id.block_size = eo.block_size;
  id.kv_dtype = eo.hash_context.kv_dtype;
  id.fleet_salt_fingerprint = FleetSaltFingerprint(eo.hash_context.fleet_salt);
  id.hash_root = w.engine->root_hash();
  // The whole model's (a rank group's pool holds a slice; issue 18).
  id.num_layers = w.model_config.num_hidden_layers;
  id.num_kv_heads = w.model_config.num_key_value_heads;
  id.head_dim = layout.head_dim;
  id.block_bytes = w.transport->block_bytes();  // what travels: bf16 blocks on cuda
  // A rank group's transport holds rank 0's slice; the fleet compares whole blocks.
  if (pl.world() > 1) id.block_bytes = model_block_bytes;
  id.num_blocks = eo.num_blocks;
  if (cmd.role != "prefill") id.decode_seats = w.fleet.scheduler.max_num_seqs;
  id.epoch = w.engine->events().epoch();
  id.transport_backend = w.transport->capabilities().backend;
  // Issue 18: the rank layout whose KV slices a transfer moves. A sim
  // worker models its ranks inside one process and one KV pool: 1 x 1.
  if (!simulated) {
    id.tensor_parallel = rc.tensor_parallel;
    id.pipeline_parallel = rc.pipeline_parallel;
  }
  // Router labels: the command line's, else the role section's; unset ones
  // are not sent (the proxy then applies its own fleet file's).
  if (const std::string& node = cmd.node.empty() ? rc.node : cmd.node; !node.empty()) id.labels["node"] = node;
  if (const std::string& zone = cmd.zone.empty() ? rc.zone : cmd.zone; !zone.empty()) id.labels["zone"] = zone;
  Worker* self = &w;
  w.worker_service = std::make_unique<WorkerService>(
      id, *w.engine, [self] { return self->Load(); }, [self] { self->UpdateMetrics(); },
      std::chrono::milliseconds(rc.load_interval_ms), w.idle_wake);
  services.push_back(w.worker_service->service());
  w.UpdateMetrics();  // every series exists (at zero) before anyone scrapes
  // And every scrape samples afresh: it includes what happened just before
  // it, whether a proxy watches this worker or not (docs/metrics.md).
  w.registry->OnScrape([self] { self->UpdateMetrics(); });

  const std::string grpc_addr = cmd.grpc.empty() ? rc.grpc : cmd.grpc;
  const std::string metrics_addr = cmd.metrics.empty() ? rc.metrics : cmd.metrics;
  TANDEM_ASSIGN_OR_RETURN(w.server, RpcServer::Start(grpc_addr, services, w.credentials));
  // Readiness (gRPC health; docs/kubernetes.md): a joining worker is
  // SERVING only once the proxy has registered it.
  if (!cmd.join.empty() || !cmd.join_dns.empty()) w.server->SetServing(false);
  TANDEM_RETURN_IF_ERROR(w.registry->Serve(metrics_addr));
  if (cmd.advertise.empty()) {
    w.worker_service->SetAddresses(w.server->address(), w.registry->bound_address());
  } else {
    TANDEM_ASSIGN_OR_RETURN(HostPort adv, ParseAdvertise(cmd.advertise));
    w.worker_service->SetAddresses(Advertised(w.server->address(), adv, true),
                                   Advertised(w.registry->bound_address(), adv, false));
  }
  TANDEM_RETURN_IF_ERROR(StartFrameListeners(w, rc, cmd, decodes, prefills));
  w.worker_service->Start();
  return Status::Ok();
}

// Waits for SIGINT/SIGTERM (blocked in every thread); returns the signal.
// Rank 0 of a rank group also watches the group: 0 once a rank is lost
// (`group` failed; issue 18).
int WaitForStopSignal(const sigset_t& set, const engine::ParallelBackend* group) {
  while (true) {
    if (group == nullptr) {
      int sig = 0;
      if (sigwait(&set, &sig) == 0) return sig;
      continue;
    }
    const timespec tick{0, 200'000'000};
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig > 0) return sig;
    if (!group->failure().ok()) return 0;
  }
}

void Drain(Worker& w, double drain_seconds) {
  if (w.server) w.server->SetServing(false);
  // Out of routing first: the proxy sends nothing new while in-flight work ends.
  if (w.worker_service) w.worker_service->SetOnWatchCancelled({});
  if (w.registrar) w.registrar->Stop();  // no registration after this
  if (w.worker_service) w.worker_service->Leave();
  if (w.decoder) w.decoder->SetDraining();
  if (w.prefiller) w.prefiller->SetDraining();
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(drain_seconds));
  while (w.engine && w.Inflight() > 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (w.engine && w.Inflight() > 0) {
    spdlog::warn("{} requests still in flight after {} s; stopping anyway", w.Inflight(), drain_seconds);
  }
  spdlog::debug("drain: in-flight work done; stopping Watch streams");
  if (w.worker_service) w.worker_service->Stop();
  if (w.watch_server) w.watch_server->Stop();  // after the streams' graceful end
  spdlog::debug("drain: shutting the gRPC server down");
  if (w.server) w.server->Shutdown(1000);
  if (w.mux_server) w.mux_server->Stop();  // ends the TCP decode streams, as Shutdown the gRPC ones
  if (w.prefill_frame_server) w.prefill_frame_server->Stop();  // and cancels the TCP Prefill calls
  if (w.reserve_server) w.reserve_server->Stop();  // as the gRPC server's Reserve
  spdlog::debug("drain: stopping the prefiller, decoder and engine");
  if (w.prefiller) w.prefiller->Stop();
  if (w.decoder) w.decoder->Stop();
  if (w.engine) w.engine->Stop();
  spdlog::debug("drain: done");
}

}  // namespace

int RunWorker(const WorkerCommand& cmd) {
  sigset_t stop_set;
  sigemptyset(&stop_set);
  sigaddset(&stop_set, SIGINT);
  sigaddset(&stop_set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_set, nullptr);

  for (const auto& [flag, value] : {std::pair{"--node", &cmd.node}, std::pair{"--zone", &cmd.zone}}) {
    if (Status s = CheckRouterLabel(flag, *value); !s.ok()) {
      std::cerr << fmt::format("tandem {}: {}\n", cmd.role, s.message());
      return 1;
    }
  }
  if (!cmd.advertise.empty()) {
    if (auto adv = ParseAdvertise(cmd.advertise); !adv.ok()) {
      std::cerr << fmt::format("tandem {}: {}\n", cmd.role, adv.status().message());
      return 1;
    }
  }
  auto w = std::make_unique<Worker>();
  auto fleet = LoadFleetConfig(cmd.config_path);
  if (!fleet.ok()) {
    std::cerr << fleet.status().message() << "\n";
    return 1;
  }
  w->fleet = std::move(fleet).value();
  RoleConfig& rc = cmd.role == "prefill" ? w->fleet.prefill
                   : cmd.role == "decode" ? w->fleet.decode
                                          : w->fleet.both;
  // Issue 18: the command line's layout replaces the role section's.
  if (cmd.tensor_parallel != 0) rc.tensor_parallel = cmd.tensor_parallel;
  if (cmd.pipeline_parallel != 0) rc.pipeline_parallel = cmd.pipeline_parallel;
  if (Status s = CheckRankFlags(cmd, w->fleet, rc); !s.ok()) {
    std::cerr << fmt::format("tandem {}: {}\n", cmd.role, s.message());
    return 1;
  }
  std::string name = cmd.name;
  if (name.empty()) {
    auto hp = ParseHostPort(cmd.grpc.empty() ? rc.grpc : cmd.grpc);
    name = hp.ok() && hp->port != 0 ? fmt::format("{}-{}", cmd.role, hp->port)
                                    : fmt::format("{}-{}", cmd.role, getpid());
  }
  const std::string level = cmd.log_level.empty() ? w->fleet.logging.level : cmd.log_level;
  const std::string format = cmd.log_format.empty() ? w->fleet.logging.format : cmd.log_format;
  if (Status s = SetupLogging(cmd.rank > 0 ? fmt::format("{}-rank{}", name, cmd.rank) : name,
                              level, format);
      !s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  if (cmd.rank > 0) {
    // A follower ends with its group: SIGTERM/SIGINT stop it at once (rank
    // 0 is the one that drains).
    pthread_sigmask(SIG_UNBLOCK, &stop_set, nullptr);
    return RunFollower(cmd, w->fleet, rc, name);
  }

  {
    const std::string service = cmd.role == "prefill" ? "tandem-prefill"
                                : cmd.role == "decode" ? "tandem-decode"
                                                       : "tandem-both";
    if (Status s = tracing::StartTracing(w->fleet.observability, service, name); !s.ok()) {
      std::cerr << fmt::format("tandem {}: {}\n", cmd.role, s.message());
      return 1;
    }
  }
  if (auto creds = InternalCredentials(w->fleet.security, {cmd.tls_ca, cmd.tls_cert, cmd.tls_key});
      creds.ok()) {
    w->credentials = std::move(creds).value();
  } else {
    spdlog::error("{} did not start: {}", name, creds.status().message());
    std::cerr << fmt::format("tandem {}: {}\n", cmd.role, creds.status().message());
    return 1;
  }
  if (Status s = Build(cmd, name, rc, *w); !s.ok()) {
    spdlog::error("{} did not start: {}", name, s.message());
    std::cerr << fmt::format("tandem {}: {}\n", cmd.role, s.message());
    Drain(*w, 0);
    return 1;
  }
  if (!cmd.join.empty() || !cmd.join_dns.empty()) {
    RegistrarOptions ro;
    ro.join_dns = cmd.join_dns;
    ro.discovery_interval = std::chrono::milliseconds(cmd.discovery_interval_ms);
    // One kept connection per proxy for the refresh every interval.
    auto channels = std::make_shared<ProxyChannels>(
        w->credentials, w->fleet.proxy.register_transport == "tcp");  // grpc-idle: framed Register
    auto register_fn = [&w = *w, channels](const std::string& address,
                                           std::chrono::milliseconds retry_for) {
      std::chrono::milliseconds heartbeat{0};
      Status s = channels->Register(address, w.worker_service->identity(), retry_for, &heartbeat);
      if (s.ok()) w.worker_service->SetKeepalive(address, heartbeat);
      return s;
    };
    Status s = Status::Ok();
    if (auto list = ParseJoinList(cmd.join, "--join"); !list.ok()) {
      s = list.status();
    } else {
      ro.join = *list;
      auto reg = ProxyRegistrar::Create(ro, register_fn);
      if (!reg.ok()) {
        s = reg.status();
      } else {
        w->registrar = std::move(reg).value();
        s = w->registrar->RegisterInitial(std::chrono::seconds(30));
      }
    }
    if (!s.ok()) {
      spdlog::error("{}", s.message());
      std::cerr << fmt::format("tandem {}: {}\n", cmd.role, s.message());
      Drain(*w, 0);
      return 1;
    }
    // A proxy that cancels its Watch stream (it restarted, went away or
    // dropped this worker) gets the registration again at once.
    w->worker_service->SetOnWatchCancelled([r = w->registrar.get()] { r->Kick(); });
    w->registrar->Start();
    w->server->SetServing(true);
  }
  if (!cmd.advertise.empty()) {
    spdlog::info("{} advertises gRPC {} metrics {}", name, w->worker_service->identity().grpc_address,
                 w->worker_service->identity().metrics_address);
  }
  spdlog::info("{} serving: gRPC {} metrics {} (model {}, {} KV blocks of {} bytes, transport {})",
               name, w->server->address(), w->registry->bound_address(), w->fleet.model.name,
               w->transport->num_blocks(), w->transport->block_bytes(),
               w->transport->capabilities().backend);
  WriteReady(cmd.ready_fd, w->server->address(), w->registry->bound_address());

  const int sig = WaitForStopSignal(stop_set, w->group);
  if (sig == 0) {
    // A rank is gone: the group cannot compute any more. Out of routing
    // at once (the proxy migrates or retries what was here) and exit 1.
    spdlog::error("{}: {}; leaving routing and exiting (the worker cannot compute without every "
                  "rank)",
                  name, w->group->failure().message());
    Drain(*w, 0);
    w.reset();
    tracing::Tracer::Get().Stop();
    return 1;
  }
  spdlog::info("{} received signal {}: draining (up to {} s)", name, sig, cmd.drain_seconds);
  Drain(*w, cmd.drain_seconds);
  w.reset();  // then the metrics exposer, the transport (UCX) and the model
  tracing::Tracer::Get().Stop();  // exports the spans still queued
  spdlog::info("{} stopped", name);
  return 0;
}

}  // namespace tandem::worker
