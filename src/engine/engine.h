// The engine every prefiller, decoder and `tandem generate` runs: a paged KV
// pool, block manager with prefix cache and KV events, a continuous-batching
// scheduler, a compute backend and sampling.
//
// Threads:
// - Start() launches the engine thread, which owns compute: it schedules,
//   runs the backend and samples. Without Start(), a single caller drives
//   the engine with Step()/RunUntilIdle() (tests, benchmarks) — never both.
// - Every other public method is thread-safe and may be called from any
//   thread, including from inside an OutputCallback. The engine lock is
//   never held across a forward pass or a callback.
// - Callbacks run on the engine thread (or on the thread calling Abort,
//   Stop, AddPrefilled, when the request finishes right there).
//
// Serving-path calls:
// - prefill-only requests (GenerateRequest::prefill_only): stop after the
//   first sampled token; the finishing output carries the pinned blocks and
//   the prefix-cache hit count; ReleasePrefill() unpins.
// - Reserve() on a decoder: blocks for a prompt whose KV will be written
//   externally, reusing the decoder's own cached prefix; ReleaseReservation()
//   gives them back; AddPrefilled() turns the reservation into a decoding
//   sequence given the first token (no compute for the prompt).
// - Abort(request_id) frees every block of the request in any stage
//   (waiting, running, parked prefill, reservation).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "common/block_hash.h"
#include "common/config.h"
#include "common/status.h"
#include "engine/backend.h"
#include "engine/block_manager.h"
#include "engine/kv_events.h"
#include "engine/kv_pool.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "parallel/parallel_layout.h"
#include "sim/timing_model.h"

namespace tandem::engine {

struct StepStats {
  double seconds = 0;  // schedule + forward + sampling
  uint32_t num_seqs = 0;
  uint32_t num_prefill_tokens = 0;
  uint32_t num_decode_tokens = 0;
};

struct EngineOptions {
  std::string backend = "cpu";
  uint32_t block_size = 16;
  uint32_t num_blocks = 1024;
  SchedulerLimits scheduler;
  uint32_t threads = 1;        // compute threads
  uint32_t max_model_len = 0;  // 0: the model's max_position_embeddings
  // model.batch_invariant: the cuda backend's invariant mode; the cpu
  // backend is invariant either way (docs/cuda.md).
  bool batch_invariant = true;
  // Root of the block hash chain; block_size is taken from above.
  HashContext hash_context;
  uint64_t epoch = 0;  // KV event epoch; 0: derived from the clock
  // Borrowed; must outlive the engine. Null: plain aligned memory.
  KvPoolAllocator* allocator = nullptr;
  // cache.prefault: make the whole KV pool resident in Engine::Create
  // (PrefaultMemory), not page by page as blocks are first written.
  bool prefault_kv_pool = true;
  // Model parallelism (issue 18, docs/parallelism.md): with parallel.world()
  // > 1 this engine is rank 0 of the group; its pool holds rank 0's shard
  // (engine::ShardKvLayout) and the backend is ParallelBackend, which waits
  // (up to parallel_join_timeout_ms) for the follower ranks (`tandem rank
  // --group <parallel_group>`, parallel/follower.h) to join. cpu only.
  parallel::ParallelLayout parallel;
  std::string parallel_group;
  int64_t parallel_join_timeout_ms = 60000;
  // Borrowed; enables stop strings and RequestOutput::text. May be null.
  const model::Tokenizer* tokenizer = nullptr;
  // Called on the engine thread after every step (for metrics histograms).
  std::function<void(const StepStats&)> on_step;
  // Backend "sim" only: the simulated GPU (borrowed; must outlive the
  // engine). See engine/sim_backend.h.
  const sim::TimingModel* sim_timing = nullptr;
  // Backend "cuda" only: the device KV pool the KV transport owns (borrowed;
  // null: the backend allocates one). See CudaBackendOptions::kv_pool.
  void* device_kv_pool = nullptr;
  size_t device_kv_pool_bytes = 0;
  // Requests with an on_kv_progress callback hear about their KV after
  // each of this many layer groups of a chunk (backends that report layer
  // progress; others once per chunk). >= 1.
  uint32_t kv_progress_layer_groups = 4;
  // Backend "sim" only: lower-tier onboarding links (sim.pcie_gbps,
  // sim.nvme_gbps, in bytes/s) and the real/stored KV size ratio.
  double sim_host_bytes_per_s = 0;
  double sim_disk_bytes_per_s = 0;
  double sim_kv_scale = 1;
  double sim_eos_probability = 0;  // sim.eos_probability

  // Lower KV tiers (docs/engine.md, "KV tiers"): cache.host_tier_blocks and
  // cache.disk_tier. The disk tier's files go straight under
  // disk_tier_path (a fleet worker passes <cache.disk_tier.path>/<name>).
  uint32_t host_tier_blocks = 0;
  std::string disk_tier_path;    // empty: no disk tier
  double disk_tier_max_gib = 0;
  // Borrowed; the host tier's memory (pinned host memory on cuda). Null:
  // an anonymous mapping, touched as it fills.
  KvPoolAllocator* host_tier_allocator = nullptr;
  // Called (under the engine lock; be quick) with the wall seconds of each
  // onboarding from a lower tier.
  std::function<void(double)> on_onboard;
  // Called (on the engine thread, under the engine lock; be quick) once per
  // request, at its first scheduled step, with the seconds it waited
  // (GenerateRequest::queued_since on) and its priority and tenant.
  std::function<void(int32_t priority, const std::string& tenant, double seconds)> on_queue_time;
  // Tests only: called on the engine thread as each step's forward starts,
  // the engine's lock released (what other threads do then meets a step in
  // flight: an Abort is finished after the step). Null in every server.
  std::function<void()> on_forward_for_tests;

  // The fleet file's model/cache/scheduler sections.
  static EngineOptions FromFleetConfig(const FleetConfig& fleet);
};

struct EngineStats {
  uint32_t num_blocks = 0;
  uint32_t free_blocks = 0;   // reference count zero (free or evictable)
  uint32_t cached_blocks = 0; // committed blocks in the prefix cache
  double kv_usage_ratio = 0;  // 1 - free / total
  uint32_t num_running = 0;
  uint32_t num_waiting = 0;
  uint32_t num_parked = 0;        // prefill-only requests holding blocks
  uint32_t num_reservations = 0;
  uint64_t prefix_query_tokens = 0;
  uint64_t prefix_hit_tokens = 0;
  uint64_t preemptions = 0;
  // The growth reserve's ratio now (Scheduler::growth_ratio; 0 when off),
  // and the blocks it keeps free now for the requests holding blocks (a
  // reservation is granted only with these free beyond its own).
  double growth_ratio = 0;
  uint32_t growth_reserve_blocks = 0;
  double growth_floor = 0;  // what the ratio falls to (Scheduler::growth_floor)
  uint64_t steps = 0;
  double prefill_step_seconds = 0;  // total over steps with prefill tokens
  uint64_t prefill_step_tokens = 0;  // prefill tokens of those steps, total
  // Their causal-attention (query, key) pairs, total (SchedulerOutput::
  // num_prefill_pairs), and what one pair costs in prefill tokens of
  // linear-layer compute (sim::ModelShape::prefill_pair_cost of the model,
  // or of the simulated shape on the sim backend): the TTFT prediction's
  // attention term.
  uint64_t prefill_step_pairs = 0;
  double prefill_pair_cost = 0;
  double decode_step_seconds = 0;   // total over decode-only steps
  uint64_t generated_tokens = 0;
  // By tier (engine/kv_tier.h: device, host, disk). Usage: blocks holding
  // KV / capacity (0 for a tier that is off).
  std::array<double, kNumKvTiers> tier_usage_ratio{};
  std::array<uint64_t, kNumKvTiers> tier_hit_tokens{};   // prefix hits, totals
  std::array<uint64_t, kNumKvTiers> tier_evictions{};    // blocks evicted from the tier, totals
  // Scheduler::FairShareDeficits (docs/scheduling.md).
  std::map<std::string, double> fair_share_deficit_tokens;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const model::ModelConfig& config,
                                                const model::ModelWeights& weights,
                                                EngineOptions options);
  // The same, freeing `weights`' tensors as the backend copies them (the
  // cpu backend packs a layer, then frees it): a load peaks near one copy
  // of the model instead of two. `weights` is left empty or partly freed;
  // model::ReleaseHostWeights frees what remains (the cuda backend's).
  static Result<std::unique_ptr<Engine>> Create(const model::ModelConfig& config,
                                                model::ModelWeights&& weights,
                                                EngineOptions options);
  ~Engine();  // Stop()s a started engine
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Engine thread; see the header comment.
  void Start();
  // Stops the engine thread; requests still inside finish with kAbort
  // (UNAVAILABLE) and reservations are released.
  void Stop();
  // Manual driving (no engine thread): one step; false when there was nothing to do.
  bool Step();
  // Steps until no request is waiting or running (parked ones stay).
  void RunUntilIdle();

  // Validates and queues a request. INVALID_ARGUMENT for bad input
  // (messages give the numbers), RESOURCE_EXHAUSTED when the waiting queue
  // is full, ALREADY_EXISTS for a live request id.
  Status Submit(GenerateRequest request);
  // Any stage; NOT_FOUND when the id is unknown. The callback gets kAbort.
  Status Abort(const std::string& request_id);
  // Unpins a finished prefill-only request's blocks; its prompt's stored
  // events, quiet until now, wake the Watch loop at once (so does an Abort
  // of it; docs/engine.md "KV events").
  Status ReleasePrefill(const std::string& request_id);

  // Decoder side, see the header comment. RESOURCE_EXHAUSTED when the
  // blocks are not there (nothing is held then).
  // `cache_salt` as in GenerateRequest: the reused prefix must have been
  // cached under the same salt. `max_tokens`: the request's, for the
  // growth reserve (docs/engine.md "Growth reserve"): while other requests
  // hold blocks, the reservation is granted only if the blocks left free
  // cover the scheduler's growth ratio x the tokens the holders (this one
  // included) may still write past their blocks.
  Result<Reservation> Reserve(const std::string& request_id, std::span<const uint32_t> prompt_ids,
                              const std::string& cache_salt = "", uint32_t max_tokens = 1);
  Status ReleaseReservation(uint64_t reservation_id);
  // The reservation will not decode (a decoder keeps its blocks only until
  // no write into them can land: its request was cancelled or taken over,
  // or its lease expired): it stops counting its growth in the growth
  // reserve. NOT_FOUND when there is none.
  Status EndReservationGrowth(uint64_t reservation_id);
  // `request.prompt_ids` must equal the reserved prompt (or be empty: the
  // reserved one is used). The first token is delivered to the callback.
  // On an error the reservation stays (release it); on success it is gone.
  Status AddPrefilled(uint64_t reservation_id, GenerateRequest request, uint32_t first_token);

  // Drops every cached block no request holds (publishes `cleared`); for
  // weight reloads and operators.
  void ResetPrefixCache();

  // The checks Submit makes on a prompt and its sampling parameters
  // (INVALID_ARGUMENT naming the numbers), for callers that want to refuse
  // bad input before they commit resources. Any thread.
  Status CheckPrompt(std::span<const uint32_t> prompt_ids, const SamplingParams& sampling,
                     bool prefill_only) const;
  // CheckPrompt's checks that need only the prompt's length (everything but
  // the token ids' range): for a decoder that has the prompt by reference
  // until the prefiller's Reserve brings its tokens (session 39).
  Status CheckPromptLength(uint64_t prompt_tokens, const SamplingParams& sampling,
                           bool prefill_only) const;

  EngineStats stats() const;
  KvEventPublisher& events() { return *events_; }
  KvSnapshot SnapshotKv() const;
  const KvPool& pool() const { return *pool_; }
  const model::ModelConfig& model_config() const { return config_; }
  const ComputeBackend& backend() const { return *backend_; }
  // Non-const: a rank group's ParallelBackend is driven between steps by
  // the worker (KV pushes on the engine thread; issue 18).
  ComputeBackend& backend() { return *backend_; }
  uint32_t max_model_len() const { return max_model_len_; }
  // The chain root of requests without a cache salt, and of `cache_salt`.
  uint64_t root_hash() const { return root_hash_; }
  uint64_t RootHashFor(const std::string& cache_salt) const;
  uint32_t block_size() const { return options_.block_size; }
  // Output blocks filled by decode steps join the prefix cache in runs of
  // this many, and the rest when the sequence ends (docs/engine.md; issue
  // 23: a stored event, and a wake-up of the worker's Watch loop, per
  // filled block per sequence was most of a sim decoder's CPU). Prompt
  // blocks: at once.
  static constexpr uint32_t kDecodeCommitBlocks = 8;

 private:
  static Result<std::unique_ptr<Engine>> CreateImpl(const model::ModelConfig& config,
                                                    const model::ModelWeights& weights,
                                                    EngineOptions options,
                                                    model::ModelWeights* consume);
  struct ReservationState {
    std::string request_id;
    std::vector<uint32_t> prompt;
    std::vector<uint64_t> hashes;
    std::vector<uint32_t> blocks;
    uint32_t num_cached_blocks = 0;
    uint64_t kv_end = 0;  // prompt + max_tokens - 1: where its KV will end (growth reserve)
  };
  // Blocks the growth reserve keeps free for a reservation whose own
  // growth is `own_tokens` (0 when off or nothing else holds blocks).
  uint32_t GrowthKeepLocked(uint64_t own_tokens) const;
  // What the reservations may still write past their blocks, in tokens.
  uint64_t ReservedGrowthLocked() const;
  // A step's outputs, in order, for the caller to run without the lock.
  // The slots (and their strings' and vectors' buffers) are kept from one
  // batch to the next: queuing an output copies into them instead of
  // allocating an id string and a token vector per request per step
  // (issue 23).
  class Deliveries {
   public:
    // The next slot, reset (buffers kept), for `callback`'s output.
    RequestOutput& Add(std::shared_ptr<const OutputCallback> callback);
    // Runs every queued callback in order, then empties the batch (each
    // callback reference is dropped; the outputs' buffers stay).
    void Run();
    bool empty() const { return size_ == 0; }

   private:
    std::vector<std::pair<std::shared_ptr<const OutputCallback>, RequestOutput>> slots_;
    size_t size_ = 0;
  };

  Engine(const model::ModelConfig& config, EngineOptions options);
  void Loop(std::stop_token stop);
  // One step; deliveries collected for the caller to run without the lock.
  bool StepLocked(std::unique_lock<std::mutex>& lock, Deliveries& out);
  Status ValidateRequest(const GenerateRequest& request) const;
  // Creates the lower KV tiers the options ask for (Create).
  Status AttachTiers();
  std::unique_ptr<Sequence> NewSequence(GenerateRequest request);
  // Appends a sampled token; checks stop conditions; queues the delivery.
  // Returns true when the sequence finished.
  bool AppendToken(Sequence& seq, uint32_t token, Deliveries& out);
  void Finish(Sequence& seq, FinishReason reason, Status status, Deliveries& out);
  // Fills `o` (a reset Deliveries slot) with the sequence's undelivered
  // tokens and text and its usage.
  void FillOutput(const Sequence& seq, RequestOutput& o) const;
  // Registers the sequence's full blocks past num_committed in the prefix
  // cache (stored events), when at least `min_new` are waiting. `quiet`:
  // the events wake no Watch loop (KvEventPublisher, "quiet").
  void CommitFullBlocks(Sequence& seq, uint32_t min_new = 1, bool quiet = false);

  void DropExpired(Deliveries& out);
  static void Deliver(Deliveries& deliveries);
  // Runs the step's deliveries, then options_.on_step with the stats the
  // step left (the stepping thread; after the outputs, outside the lock).
  void DeliverStep(Deliveries& deliveries);
  // Wakes the engine thread when it waits for blocks or work (mu_ held,
  // or after a change made under it).
  void Poke();

  model::ModelConfig config_;
  EngineOptions options_;
  uint32_t max_model_len_ = 0;
  uint64_t root_hash_ = 0;
  HashContext hash_context_;  // options_.hash_context with the block size
  std::unique_ptr<AlignedKvPoolAllocator> own_allocator_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<KvEventPublisher> events_;
  Sampler sampler_;                 // engine thread only
  std::vector<float> logits_;       // engine thread only: [rows][vocab]
  std::vector<SeqChunk> chunks_;    // engine thread only
  // Engine thread only: a step's deliveries, reused (a vector grown from
  // empty every step was a large malloc per step, issue 23).
  Deliveries step_out_;
  // Engine thread / the Step() caller: the last step's stats for on_step,
  // valid when step_stats_ready_.
  StepStats step_stats_;
  bool step_stats_ready_ = false;
  // Engine thread only: this step's chunks whose requests want KvProgress.
  struct ProgressChunk {
    const KvProgressCallback* callback = nullptr;  // the sequence's; stable during the forward
    KvProgress progress;
  };
  std::vector<ProgressChunk> progress_;
  void ReportKvProgress(uint32_t layers_done);
  // The stepping thread holds events_' wake-ups (kv_events.h) while it
  // steps and flushes them once per step, as the step's forward starts
  // (FlushEvents: release and hold again), and releases them before it
  // waits for work, so that the Watch loop wakes at most once per step
  // (issue 23).
  void HoldEvents();
  void FlushEvents();
  void ReleaseEvents();
  bool events_held_ = false;  // the stepping thread only

  mutable std::mutex mu_;
  std::condition_variable_any cv_;
  std::unique_ptr<BlockManager> blocks_;    // guarded by mu_
  std::unique_ptr<Scheduler> scheduler_;    // guarded by mu_
  std::map<std::string, std::unique_ptr<Sequence>> seqs_;  // guarded by mu_
  std::map<uint64_t, ReservationState> reservations_;     // guarded by mu_
  // guarded by mu_: bumped by every change that may let blocked work run
  // (blocks released, work queued, a request aborted); the engine thread
  // waits for it to move instead of polling (issue 23).
  uint64_t changes_ = 0;
  // An unseeded request's sampling seed: SplitMix64's stream from a base
  // the OS drew once per engine (session 29: a std::random_device per
  // request cost 15 us of CPU on these VMs, a tenth of a backlogged decode
  // step's scheduling).
  const uint64_t seed_base_;
  std::atomic<uint64_t> seeds_drawn_{0};
  EngineStats counters_;                    // guarded by mu_ (steps, seconds, tokens)
  std::jthread thread_;
};

}  // namespace tandem::engine
