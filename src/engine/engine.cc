// Engine: creation, validation and the thread-safe request API. The step
// itself (schedule, forward, sample) is in engine_step.cc.
#include "engine/engine.h"
#include "common/delivery_scope.h"
#include "common/splitmix.h"
#include "engine/parallel_backend.h"
#include "engine/sim_backend.h"
#include "engine/stage_runner.h"

#include <fmt/format.h>

#include <sched.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#ifdef TANDEM_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif

namespace tandem::engine {

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kDeadline: return "deadline";
    case FinishReason::kError: return "error";
    case FinishReason::kPrefillDone: return "prefill_done";
  }
  return "unknown";
}

uint32_t Reservation::num_cached_tokens() const { return num_cached_blocks * block_size; }

namespace {

// Reservation ids are random (docs/security.md, "KV plane"): a peer that
// learns one cannot guess another.
Result<uint64_t> RandomReservationId() {
  uint64_t v = 0;
  while (v == 0) {
    const ssize_t got = getrandom(&v, sizeof(v), 0);
    if (got == static_cast<ssize_t>(sizeof(v))) continue;
    if (got < 0 && errno != EINTR) {
      return InternalError(fmt::format("getrandom failed: {}", std::strerror(errno)));
    }
    v = 0;
  }
  return v;
}

// A real model's pair cost (sim::ModelShape's formula over its sizes).
double PrefillPairCost(const model::ModelConfig& config) {
  sim::ModelShape shape;
  shape.hidden_size = config.hidden_size;
  shape.intermediate_size = config.intermediate_size;
  shape.num_layers = config.num_hidden_layers;
  shape.num_heads = config.num_attention_heads;
  shape.num_kv_heads = config.num_key_value_heads;
  shape.head_dim = config.head_dim;
  return shape.prefill_pair_cost();
}

}  // namespace

namespace {
// scheduler.threads: 0 (the default): the CPUs this process may run on (its
// affinity mask) divided among the worker processes the fleet file lists
// (prefill + decode + both replicas, each of tensor_parallel x
// pipeline_parallel rank processes — issue 18 — which `tandem launch`
// starts on one host), at least 1. Measured in bench/results/cpu_vs_llamacpp.md: one worker computes
// fastest with every core; more compute threads than cores only make the
// workers wait for each other.
uint32_t AutoComputeThreads(const FleetConfig& fleet) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const uint32_t cpus =
      sched_getaffinity(0, sizeof(set), &set) == 0 ? static_cast<uint32_t>(CPU_COUNT(&set)) : 1;
  const bool sim = fleet.model.backend == "sim";  // one process per worker, whatever the layout
  auto processes = [sim](const RoleConfig& r) {
    return r.replicas * (sim ? 1u : r.tensor_parallel * r.pipeline_parallel);
  };
  const uint32_t workers =
      std::max(1u, processes(fleet.prefill) + processes(fleet.decode) + processes(fleet.both));
  return std::max(1u, cpus / workers);
}
}  // namespace

EngineOptions EngineOptions::FromFleetConfig(const FleetConfig& fleet) {
  EngineOptions o;
  o.backend = fleet.model.backend;
  o.block_size = fleet.cache.block_size;
  o.num_blocks = fleet.cache.num_blocks;
  o.scheduler.max_num_seqs = fleet.scheduler.max_num_seqs;
  o.scheduler.max_batched_tokens = fleet.scheduler.max_batched_tokens;
  o.scheduler.max_waiting = fleet.scheduler.max_waiting;
  o.scheduler.schedule_conservativeness = fleet.scheduler.schedule_conservativeness;
  o.threads = fleet.scheduler.threads != 0 ? fleet.scheduler.threads : AutoComputeThreads(fleet);
  o.max_model_len = fleet.model.max_model_len;
  o.batch_invariant = fleet.model.batch_invariant;
  o.hash_context = HashContextFromFleet(fleet);  // the one builder (common/block_hash.h)
  o.host_tier_blocks = fleet.cache.host_tier_blocks;
  o.disk_tier_path = fleet.cache.disk_tier_path;
  o.disk_tier_max_gib = fleet.cache.disk_tier_max_gib;
  o.prefault_kv_pool = fleet.cache.prefault;
  return o;
}

Engine::Engine(const model::ModelConfig& config, EngineOptions options)
    : config_(config), options_(std::move(options)), seed_base_([] {
        std::random_device rd;
        return (static_cast<uint64_t>(rd()) << 32) ^ rd();
      }()) {}

Engine::~Engine() {
  if (thread_.joinable()) Stop();
}

Result<std::unique_ptr<Engine>> Engine::Create(const model::ModelConfig& config,
                                               const model::ModelWeights& weights,
                                               EngineOptions options) {
  return CreateImpl(config, weights, std::move(options), nullptr);
}

Result<std::unique_ptr<Engine>> Engine::Create(const model::ModelConfig& config,
                                               model::ModelWeights&& weights,
                                               EngineOptions options) {
  return CreateImpl(config, weights, std::move(options), &weights);
}

Result<std::unique_ptr<Engine>> Engine::CreateImpl(const model::ModelConfig& config,
                                                   const model::ModelWeights& weights,
                                                   EngineOptions options,
                                                   model::ModelWeights* consume) {
  if (options.block_size == 0 || options.num_blocks == 0) {
    return InvalidArgumentError(fmt::format("block_size ({}) and num_blocks ({}) must be > 0",
                                            options.block_size, options.num_blocks));
  }
  if (options.scheduler.max_num_seqs == 0 || options.scheduler.max_batched_tokens == 0) {
    return InvalidArgumentError("max_num_seqs and max_batched_tokens must be > 0");
  }
  std::unique_ptr<Engine> e(new Engine(config, std::move(options)));
  EngineOptions& o = e->options_;
  uint32_t len = config.max_position_embeddings;
  if (o.max_model_len != 0) len = len == 0 ? o.max_model_len : std::min(len, o.max_model_len);
  if (len == 0) return InvalidArgumentError("the model's context length is unknown (max_position_embeddings)");
  e->max_model_len_ = len;

  KvLayout layout;
  layout.num_layers = config.num_hidden_layers;
  layout.num_kv_heads = config.num_key_value_heads;
  layout.head_dim = config.head_dim;
  layout.block_size = o.block_size;
  const bool is_parallel = o.parallel.world() > 1;
  if (is_parallel) {
    if (o.backend != "cpu") {
      return UnimplementedError(fmt::format(
          "tensor_parallel {} x pipeline_parallel {}: backend '{}' has no rank group runtime "
          "(only cpu ranks are built)",
          o.parallel.tp, o.parallel.pp, o.backend));
    }
    TANDEM_RETURN_IF_ERROR(parallel::CheckLayout(o.parallel, DimsOf(config)));
    if (o.host_tier_blocks > 0 || !o.disk_tier_path.empty()) {
      // A tier block would hold rank 0's shard of the KV only. Refused here,
      // before the backend waits for the follower ranks to join.
      return UnimplementedError(fmt::format(
          "cache.host_tier_blocks / cache.disk_tier: not built for a rank group ({}); turn the "
          "tiers off or run tensor_parallel = pipeline_parallel = 1",
          parallel::ToString(o.parallel)));
    }
    layout = ShardKvLayout(config, ShardSpec{o.parallel, 0}, o.block_size);
  }
  KvPoolAllocator* allocator = o.allocator;
  if (allocator == nullptr) {
    e->own_allocator_ = std::make_unique<AlignedKvPoolAllocator>();
    allocator = e->own_allocator_.get();
  }
  TANDEM_ASSIGN_OR_RETURN(e->pool_, KvPool::Create(layout, o.num_blocks, *allocator));
  if (o.backend == "sim") {
    if (o.sim_timing == nullptr) {
      return InvalidArgumentError(
          "model.backend 'sim' runs in fleet workers only (tandem launch, tandem "
          "prefill|decode|both); this command does not set up a simulated GPU "
          "(EngineOptions::sim_timing, see engine/sim_backend.h)");
    }
    auto sim = std::make_unique<SimBackend>(config, *o.sim_timing, e->pool_.get());
    sim->set_tier_links(o.sim_host_bytes_per_s, o.sim_disk_bytes_per_s,
                        static_cast<double>(layout.block_bytes()) * o.sim_kv_scale);
    TANDEM_RETURN_IF_ERROR(sim->set_eos_probability(o.sim_eos_probability));
    e->backend_ = std::move(sim);
  } else if (o.backend == "cuda") {
#ifdef TANDEM_HAVE_CUDA
    // No device: FAILED_PRECONDITION naming the runtime's reason (docs/cuda.md).
    CudaBackendOptions cuda;
    cuda.batch_invariant = o.batch_invariant;
    cuda.kv_pool = o.device_kv_pool;
    cuda.kv_pool_bytes = o.device_kv_pool_bytes;
    TANDEM_ASSIGN_OR_RETURN(e->backend_, CreateCudaBackend(config, weights, e->pool_.get(), cuda));
#else
    return UnimplementedError(
        "backend cuda: this build has no CUDA kernels (configure with -DTANDEM_CUDA=ON where "
        "nvcc is installed)");
#endif
  } else if (is_parallel) {
    ParallelBackendOptions po;
    po.layout = o.parallel;
    po.group = o.parallel_group;
    po.threads = static_cast<int>(o.threads);
    po.join_timeout_ms = o.parallel_join_timeout_ms;
    TANDEM_ASSIGN_OR_RETURN(e->backend_,
                            CreateParallelBackend(config, weights, e->pool_.get(), po, consume));
  } else {
    TANDEM_ASSIGN_OR_RETURN(e->backend_, CreateBackend(o.backend, config, weights, e->pool_.get(),
                                                       static_cast<int>(o.threads), consume));
  }
  // Only a pool the backend computes in: the cuda backend keeps its KV in
  // device memory and reads this host pool's geometry only.
  if (o.prefault_kv_pool && e->backend_->Supports(BackendFeature::kHostKvPool)) {
    TANDEM_RETURN_IF_ERROR(PrefaultMemory(
        {reinterpret_cast<std::byte*>(e->pool_->base()), e->pool_->size_bytes()}));
  }
  uint64_t epoch = o.epoch;
  if (epoch == 0) {
    epoch = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::system_clock::now().time_since_epoch()).count());
  }
  e->events_ = std::make_unique<KvEventPublisher>(epoch);
  e->blocks_ = std::make_unique<BlockManager>(o.num_blocks, o.block_size, e->events_.get());
  HashContext ctx = o.hash_context;
  ctx.block_size = o.block_size;
  e->root_hash_ = RootHash(ctx);
  e->hash_context_ = std::move(ctx);
  TANDEM_RETURN_IF_ERROR(e->AttachTiers());
  e->scheduler_ = std::make_unique<Scheduler>(o.scheduler, e->blocks_.get());
  e->scheduler_->set_outside_growth([raw = e.get()] { return raw->ReservedGrowthLocked(); });
  e->counters_.num_blocks = o.num_blocks;
  e->counters_.prefill_pair_cost = o.sim_timing != nullptr
                                       ? o.sim_timing->params().shape.prefill_pair_cost()
                                       : PrefillPairCost(config);
  return e;
}

Status Engine::AttachTiers() {
  const EngineOptions& o = options_;
  if (o.host_tier_blocks == 0 && o.disk_tier_path.empty()) return Status::Ok();
  if (!backend_->Supports(BackendFeature::kHostKvPool)) {
    return UnimplementedError(fmt::format(
        "cache.host_tier_blocks / cache.disk_tier: backend {} keeps its KV pool in device memory; "
        "onboarding into it (pinned host memory, a copy stream) is not built yet — use the cpu "
        "or sim backend, or turn the tiers off",
        backend_->name()));
  }
  const size_t block_bytes = pool_->layout().block_bytes();
  std::unique_ptr<HostKvTier> host;
  if (o.host_tier_blocks > 0) {
    auto h = HostKvTier::Create(o.host_tier_blocks, block_bytes, o.block_size, o.host_tier_allocator);
    if (!h.ok()) return h.status().WithContext("cache.host_tier_blocks");
    host = std::move(h).value();
  }
  std::unique_ptr<DiskKvTier> disk;
  if (!o.disk_tier_path.empty()) {
    DiskTierOptions d;
    d.path = o.disk_tier_path;
    d.max_bytes = static_cast<uint64_t>(o.disk_tier_max_gib * 1024.0 * 1024.0 * 1024.0);
    d.block_size = o.block_size;
    d.block_bytes = block_bytes;
    d.fingerprint = DiskTierFingerprint(root_hash_, block_bytes, o.block_size);
    auto t = DiskKvTier::Open(d);
    if (!t.ok()) return t.status().WithContext("cache.disk_tier");
    disk = std::move(t).value();
  }
  blocks_->AttachTiers(std::make_unique<TieredKvStore>(std::move(host), std::move(disk), events_.get()),
                       pool_.get(), o.on_onboard);
  return Status::Ok();
}

Status Engine::ValidateRequest(const GenerateRequest& r) const {
  if (r.request_id.empty()) return InvalidArgumentError("request_id is empty");
  return CheckPrompt(r.prompt_ids, r.sampling, r.prefill_only);
}

Status Engine::CheckPrompt(std::span<const uint32_t> prompt_ids, const SamplingParams& sampling,
                           bool prefill_only) const {
  if (prompt_ids.empty()) return InvalidArgumentError("the prompt has no tokens");
  for (uint32_t id : prompt_ids) {
    if (id >= config_.vocab_size) {
      return InvalidArgumentError(fmt::format(
          "prompt token id {} is out of range; the vocabulary has {} tokens", id, config_.vocab_size));
    }
  }
  return CheckPromptLength(prompt_ids.size(), sampling, prefill_only);
}

Status Engine::CheckPromptLength(uint64_t prompt, const SamplingParams& sampling,
                                 bool prefill_only) const {
  if (prompt == 0) return InvalidArgumentError("the prompt has no tokens");
  TANDEM_RETURN_IF_ERROR(ValidateSamplingParams(sampling));
  if (!sampling.stop.empty() && options_.tokenizer == nullptr) {
    return InvalidArgumentError("stop strings need a tokenizer, and this engine has none");
  }
  if (prompt > max_model_len_) {
    return InvalidArgumentError(fmt::format("prompt has {} tokens; this model accepts at most {}",
                                            prompt, max_model_len_));
  }
  const uint64_t total = prompt + sampling.max_tokens;
  if (total > max_model_len_) {
    return InvalidArgumentError(fmt::format(
        "prompt has {} tokens and max_tokens is {}: {} tokens exceed this model's context of {}",
        prompt, sampling.max_tokens, total, max_model_len_));
  }
  const uint64_t need = prefill_only ? prompt + 1 : total;
  const uint64_t blocks = (need + options_.block_size - 1) / options_.block_size;
  if (blocks > options_.num_blocks) {
    return InvalidArgumentError(fmt::format(
        "{} tokens need {} KV blocks; this worker has {} blocks of {} tokens", need, blocks,
        options_.num_blocks, options_.block_size));
  }
  return Status::Ok();
}

std::unique_ptr<Sequence> Engine::NewSequence(GenerateRequest request) {
  auto seq = std::make_unique<Sequence>();
  seq->req = std::move(request);
  seq->on_output = std::make_shared<const OutputCallback>(std::move(seq->req.on_output));
  seq->req.on_output = nullptr;
  if (seq->req.sampling.seed) {
    seq->seed = *seq->req.sampling.seed;
  } else {
    const uint64_t n = seeds_drawn_.fetch_add(1, std::memory_order_relaxed);
    seq->seed = SplitMix64(seed_base_ + n * kSplitMix64Gamma);
  }
  seq->root_hash = RootHashFor(seq->req.cache_salt);
  seq->tokens = seq->req.prompt_ids;
  seq->prompt_len = static_cast<uint32_t>(seq->tokens.size());
  if (options_.tokenizer != nullptr) {
    seq->detok = std::make_unique<model::IncrementalDetokenizer>(options_.tokenizer);
    if (!seq->req.sampling.stop.empty()) {
      seq->stop_matcher = std::make_unique<model::StopStringMatcher>(seq->req.sampling.stop);
    }
  }
  return seq;
}

Status Engine::Submit(GenerateRequest request) {
  TANDEM_RETURN_IF_ERROR(ValidateRequest(request));
  auto seq = NewSequence(std::move(request));
  {
    std::lock_guard lock(mu_);
    if (seqs_.count(seq->req.request_id) != 0) {
      return AlreadyExistsError(fmt::format("request '{}' is already in the engine", seq->req.request_id));
    }
    if (scheduler_->waiting_full()) {
      return ResourceExhaustedError(fmt::format("waiting queue is full ({} requests)",
                                                scheduler_->limits().max_waiting));
    }
    Sequence* raw = seq.get();
    seqs_.emplace(raw->req.request_id, std::move(seq));
    scheduler_->AddWaiting(raw);
    Poke();
  }
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::Abort(const std::string& request_id) {
  Deliveries out;
  bool found = false;
  {
    std::lock_guard lock(mu_);
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      if (it->second.request_id == request_id) {
        blocks_->Release(it->second.blocks);
        it = reservations_.erase(it);
        events_->WakeIfQuiet();  // its quiet evictions (Reserve) leave now
        found = true;
      } else {
        ++it;
      }
    }
    if (auto it = seqs_.find(request_id); it != seqs_.end()) {
      found = true;
      Sequence& seq = *it->second;
      if (seq.state == SeqState::kParked) {  // already delivered its last output
        blocks_->Release(seq.blocks);
        seqs_.erase(it);
        events_->WakeNow();  // its prompt's quiet blocks (engine_step.cc) leave now
      } else if (seq.in_flight) {
        seq.abort_requested = true;  // the engine thread finishes it after the step
      } else {
        Finish(seq, FinishReason::kAbort, CancelledError("request aborted"), out);
        seqs_.erase(it);
      }
    }
    if (found) Poke();
  }
  cv_.notify_all();
  Deliver(out);
  return found ? Status::Ok() : NotFoundError(fmt::format("no request '{}'", request_id));
}

Status Engine::ReleasePrefill(const std::string& request_id) {
  {
    std::lock_guard lock(mu_);
    auto it = seqs_.find(request_id);
    if (it == seqs_.end() || it->second->state != SeqState::kParked) {
      return NotFoundError(fmt::format("no finished prefill-only request '{}'", request_id));
    }
    blocks_->Release(it->second->blocks);
    seqs_.erase(it);
    // Its prompt's blocks were committed quietly (engine_step.cc): they
    // leave now, as the prefiller replies, not at the next step boundary
    // of the prompt computing meanwhile (the engine's hold).
    events_->WakeNow();
    Poke();
  }
  cv_.notify_all();
  return Status::Ok();
}

uint64_t Engine::RootHashFor(const std::string& cache_salt) const {
  if (cache_salt.empty()) return root_hash_;
  HashContext ctx = hash_context_;
  ctx.tenant_salt = cache_salt;
  return RootHash(ctx);
}

Result<Reservation> Engine::Reserve(const std::string& request_id,
                                    std::span<const uint32_t> prompt_ids,
                                    const std::string& cache_salt, uint32_t max_tokens) {
  if (prompt_ids.empty()) return InvalidArgumentError("the prompt has no tokens");
  if (prompt_ids.size() >= max_model_len_) {
    return InvalidArgumentError(fmt::format(
        "prompt has {} tokens; this model accepts at most {} (with room for one generated token)",
        prompt_ids.size(), max_model_len_ - 1));
  }
  for (uint32_t id : prompt_ids) {
    if (id >= config_.vocab_size) {
      return InvalidArgumentError(fmt::format(
          "prompt token id {} is out of range; the vocabulary has {} tokens", id, config_.vocab_size));
    }
  }
  const uint32_t bs = options_.block_size;
  std::vector<uint32_t> prompt(prompt_ids.begin(), prompt_ids.end());
  std::vector<uint64_t> hashes = HashBlocks(RootHashFor(cache_salt), prompt, bs);
  const uint32_t total = static_cast<uint32_t>((prompt.size() + bs - 1) / bs);
  TANDEM_ASSIGN_OR_RETURN(uint64_t reservation_id, RandomReservationId());
  std::lock_guard lock(mu_);
  while (reservation_id == 0 || reservations_.count(reservation_id) != 0) ++reservation_id;  // 2^-64 odds
  PrefixHit hit;
  std::vector<uint32_t> blocks =
      blocks_->AcquireCachedPrefix(hashes, prompt, static_cast<uint32_t>(hashes.size()), &hit);
  const uint32_t cached = static_cast<uint32_t>(blocks.size());
  if (total > blocks_->num_blocks()) {
    blocks_->Release(blocks);
    return ResourceExhaustedError(fmt::format(
        "a {}-token prompt needs {} KV blocks of {} tokens; this worker's whole pool has {} "
        "(cache.num_blocks, or its role's num_blocks)",
        prompt.size(), total, bs, blocks_->num_blocks()));
  }
  // First come, first served, as vLLM's waiting queue: requests preempted
  // here wait for blocks ahead of a new reservation (else the blocks each
  // ending request frees could go to reservations while they starve).
  if (const size_t preempted = scheduler_->num_preempted_waiting(); preempted > 0) {
    blocks_->Release(blocks);
    return ResourceExhaustedError(fmt::format(
        "cannot reserve {} KV blocks for a {}-token prompt: {} preempted requests wait for blocks "
        "first ({} of {} blocks free)",
        total - cached, prompt.size(), preempted, blocks_->num_free_blocks(), blocks_->num_blocks()));
  }
  const uint64_t kv_end = prompt.size() + std::max<uint32_t>(max_tokens, 1) - 1;
  if (const uint32_t keep = GrowthKeepLocked(GrowthTokensPast(kv_end, total, bs));
      keep > 0 && blocks_->num_free_blocks() < total - cached + keep) {
    blocks_->Release(blocks);
    return ResourceExhaustedError(fmt::format(
        "cannot reserve {} KV blocks for a {}-token prompt: {} more are kept free for the growth of "
        "the requests holding blocks (growth ratio {:.2f}, scheduler.schedule_conservativeness; {} "
        "of {} blocks free)",
        total - cached, prompt.size(), keep, scheduler_->growth_ratio(),
        blocks_->num_free_blocks(), blocks_->num_blocks()));
  }
  // The evictions that make the reservation's room are quiet: they leave
  // with the prompt's blocks when its KV has landed (AddPrefilled), or when
  // the reservation ends without it, or with the Watch loop's next load
  // sample (kv_events.h): one update per pushed prompt instead of two.
  auto fresh = blocks_->Allocate(total - cached, /*quiet_evictions=*/true);
  if (!fresh.ok()) {
    blocks_->Release(blocks);
    return ResourceExhaustedError(fmt::format(
        "cannot reserve {} KV blocks for a {}-token prompt: {} of {} blocks free", total - cached,
        prompt.size(), blocks_->num_free_blocks(), blocks_->num_blocks()));
  }
  blocks.insert(blocks.end(), fresh->begin(), fresh->end());
  scheduler_->CountPrefixQuery(prompt.size(), uint64_t{cached} * bs);
  blocks_->CountHit(hit);
  Reservation r;
  r.reservation_id = reservation_id;
  r.block_ids = blocks;
  r.num_cached_blocks = cached;
  r.block_size = bs;
  ReservationState st;
  st.request_id = request_id;
  st.prompt = std::move(prompt);
  st.hashes = std::move(hashes);
  st.blocks = std::move(blocks);
  st.num_cached_blocks = cached;
  st.kv_end = kv_end;
  reservations_.emplace(r.reservation_id, std::move(st));
  return r;
}

uint32_t Engine::GrowthKeepLocked(uint64_t own_tokens) const {
  if (scheduler_->growth_ratio() <= 0 || (reservations_.empty() && !scheduler_->AnyHolder())) {
    return 0;
  }
  Growth g = scheduler_->HolderGrowth();  // the reservations' included
  g.output += own_tokens;
  return scheduler_->KeepFor(g);
}

uint64_t Engine::ReservedGrowthLocked() const {
  uint64_t tokens = 0;
  for (const auto& [id, r] : reservations_) {
    tokens += GrowthTokensPast(r.kv_end, r.blocks.size(), options_.block_size);
  }
  return tokens;
}

Status Engine::ReleaseReservation(uint64_t reservation_id) {
  {
    std::lock_guard lock(mu_);
    auto it = reservations_.find(reservation_id);
    if (it == reservations_.end()) {
      return NotFoundError(fmt::format("no reservation {}", reservation_id));
    }
    blocks_->Release(it->second.blocks);
    reservations_.erase(it);
    events_->WakeIfQuiet();  // its quiet evictions (Reserve) leave now
    Poke();
  }
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::EndReservationGrowth(uint64_t reservation_id) {
  {
    std::lock_guard lock(mu_);
    auto it = reservations_.find(reservation_id);
    if (it == reservations_.end()) {
      return NotFoundError(fmt::format("no reservation {}", reservation_id));
    }
    it->second.kv_end = 0;  // GrowthTokensPast: nothing past its blocks
    Poke();                 // a local prefill the reserve held may fit now
  }
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::AddPrefilled(uint64_t reservation_id, GenerateRequest request,
                            uint32_t first_token) {
  if (first_token >= config_.vocab_size) {
    return InvalidArgumentError(fmt::format("first token {} is out of range; the vocabulary has {}",
                                            first_token, config_.vocab_size));
  }
  Deliveries out;
  {
    std::unique_lock lock(mu_);
    auto it = reservations_.find(reservation_id);
    if (it == reservations_.end()) {
      return NotFoundError(fmt::format("no reservation {}", reservation_id));
    }
    if (request.prompt_ids.empty()) request.prompt_ids = it->second.prompt;
    if (request.prompt_ids != it->second.prompt) {
      return InvalidArgumentError(fmt::format(
          "request '{}': prompt differs from the one reserved ({} vs {} tokens)",
          request.request_id, request.prompt_ids.size(), it->second.prompt.size()));
    }
    request.prefill_only = false;
    TANDEM_RETURN_IF_ERROR(ValidateRequest(request));
    if (seqs_.count(request.request_id) != 0) {
      return AlreadyExistsError(fmt::format("request '{}' is already in the engine", request.request_id));
    }
    ReservationState res = std::move(it->second);
    reservations_.erase(it);
    auto seq = NewSequence(std::move(request));
    seq->blocks = std::move(res.blocks);
    seq->hashes = std::move(res.hashes);
    seq->num_computed = seq->prompt_len;
    seq->num_committed = res.num_cached_blocks;
    seq->cached_prompt_tokens = std::min(res.num_cached_blocks * options_.block_size, seq->prompt_len);
    seq->admitted_once = true;
    // The prompt's blocks (a stored event for the run's first block, then
    // one for the rest) and the reservation's quiet evictions wake the
    // Watch loop once, together (the evictions alone when every full block
    // was cached and nothing is stored).
    events_->Hold();
    CommitFullBlocks(*seq);
    events_->WakeIfQuiet();
    events_->Release();
    Sequence* raw = seq.get();
    auto [pos, inserted] = seqs_.emplace(raw->req.request_id, std::move(seq));
    if (AppendToken(*raw, first_token, out)) {
      seqs_.erase(pos);
    } else {
      scheduler_->AddWaiting(raw);
    }
    Poke();
  }
  cv_.notify_all();
  Deliver(out);
  return Status::Ok();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s = counters_;
  s.num_blocks = blocks_->num_blocks();
  s.free_blocks = blocks_->num_free_blocks();
  s.cached_blocks = blocks_->num_cached_blocks();
  s.kv_usage_ratio = 1.0 - static_cast<double>(s.free_blocks) / s.num_blocks;
  s.num_running = static_cast<uint32_t>(scheduler_->num_running());
  s.num_waiting = static_cast<uint32_t>(scheduler_->num_waiting());
  s.num_parked = 0;
  for (const auto& [id, seq] : seqs_) s.num_parked += seq->state == SeqState::kParked;
  s.num_reservations = static_cast<uint32_t>(reservations_.size());
  s.prefix_query_tokens = scheduler_->prefix_query_tokens();
  s.prefix_hit_tokens = scheduler_->prefix_hit_tokens();
  s.preemptions = scheduler_->preemptions();
  s.growth_ratio = scheduler_->growth_ratio();
  s.growth_floor = scheduler_->growth_floor();
  s.growth_reserve_blocks = GrowthKeepLocked(0);
  s.fair_share_deficit_tokens = scheduler_->FairShareDeficits();
  s.tier_usage_ratio[0] =
      1.0 - static_cast<double>(blocks_->num_empty_blocks()) / s.num_blocks;
  for (uint32_t t = 0; t < kNumKvTiers; ++t) {
    const auto tier = static_cast<KvTier>(t);
    if (t > 0 && blocks_->tiers() != nullptr) s.tier_usage_ratio[t] = blocks_->tiers()->usage_ratio(tier);
    s.tier_hit_tokens[t] = blocks_->hit_tokens(tier);
    s.tier_evictions[t] = blocks_->evictions(tier);
  }
  return s;
}

void Engine::ResetPrefixCache() {
  std::lock_guard lock(mu_);
  // Blocks still held lose their registration too (the subscribers forget
  // everything on `cleared`); their holders keep using them privately.
  blocks_->ClearCache();
}

KvSnapshot Engine::SnapshotKv() const {
  std::lock_guard lock(mu_);
  return blocks_->Snapshot();
}

RequestOutput& Engine::Deliveries::Add(std::shared_ptr<const OutputCallback> callback) {
  if (size_ == slots_.size()) slots_.emplace_back();
  auto& [cb, o] = slots_[size_++];
  cb = std::move(callback);
  // Reset, keeping the buffers (assigned by the caller).
  o.finished = false;
  o.finish_reason = FinishReason::kNone;
  if (!o.status.ok()) o.status = Status::Ok();
  o.prompt_tokens = 0;
  o.completion_tokens = 0;
  o.cached_prompt_tokens = 0;
  o.block_ids.clear();
  return o;
}

void Engine::Deliveries::Run() {
  // One batch: consumers may send it as one message (common/delivery_scope.h).
  DeliveryScope scope;
  for (size_t i = 0; i < size_; ++i) {
    auto& [cb, output] = slots_[i];
    if (cb && *cb) (*cb)(output);
    cb.reset();
  }
  size_ = 0;
}

void Engine::Deliver(Deliveries& deliveries) { deliveries.Run(); }

void Engine::DeliverStep(Deliveries& deliveries) {
  deliveries.Run();
  if (step_stats_ready_) {
    step_stats_ready_ = false;
    options_.on_step(step_stats_);
  }
}

}  // namespace tandem::engine
