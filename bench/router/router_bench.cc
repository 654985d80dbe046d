// Router benchmarks (issue 7 targets: p99 < 20 us per route for 8k-token
// prompts with 64 workers and 1M indexed blocks; > 5M block events/s on
// one core).
//
// Fleet: 32 prefillers + 32 decoders (or 64 'both' workers). Index: 2048
// documents of 512 blocks (1,048,576 distinct block hashes); each document
// is cached by one prefiller and one decoder (2M (block, worker) entries).
// Prompts are 8192 tokens = 512 blocks of 16:
//   hit        a whole cached document (two holders, no drop-out point
//              inside: the search reads 17 blocks; the block-by-block walk
//              would read all 512)
//   half       the first 256 blocks of a document, then 256 new ones (one
//              drop-out point: about 33 blocks read)
//   miss       512 blocks nobody holds (block 0 decides)
//   staggered  one of 16 extra documents that every one of the 64 workers
//              holds a different prefix of (8w+1 .. 8w+8 blocks): 64 drop-out
//              points, the search's worst case here (about 320 blocks read)
// Each route is timed on its own, twice: wall clock (steady_clock) and this
// thread's CPU time (CLOCK_THREAD_CPUTIME_ID, which leaves out the time the
// thread was preempted: the 2-core machine these run on is shared). p50,
// p99 and max of each go out as counters, in ns.
// BM_RandomLines is the physical yardstick of the same run: 512 prefetched
// reads of random cache lines in a 64 MiB buffer (what reading every block
// of a cached 8k prompt costs at least; BM_Overlap compares the search with
// that block-by-block walk in the same run).
#include <benchmark/benchmark.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "router/load_tracker.h"
#include "router/router.h"

namespace tandem::router {
namespace {

constexpr uint32_t kBlocksPerPrompt = 512;
constexpr uint32_t kDocs = 2048;
constexpr uint32_t kWorkers = 64;
constexpr uint32_t kStaggeredDocs = 16;  // documents kDocs .. kDocs+15

uint64_t Mix(uint64_t x) {  // splitmix64: stands in for XXH3 outputs
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<uint64_t> Doc(uint64_t doc, uint32_t n = kBlocksPerPrompt) {
  std::vector<uint64_t> h(n);
  for (uint32_t i = 0; i < n; ++i) h[i] = Mix(doc * kBlocksPerPrompt + i);
  return h;
}

// GCC 12 warns (-Wrestrict, a false positive) on "literal" + std::string.
std::string Name(const char* prefix, uint64_t i) {
  std::string s(prefix);
  s += std::to_string(i);
  return s;
}

struct BenchFleet {
  std::unique_ptr<Router> router;
  std::vector<WorkerId> ids;

  BenchFleet(bool aggregated, Policy policy, uint32_t docs = kDocs) {
    RouterConfig config;
    config.policy = std::string(PolicyName(policy));
    router = Router::Create(config).value();
    for (uint32_t i = 0; i < kWorkers; ++i) {
      WorkerInfo info;
      info.name = Name("w", i);
      info.role = aggregated ? WorkerRole::kBoth : (i % 2 == 0 ? WorkerRole::kPrefill : WorkerRole::kDecode);
      info.node = Name("node", i / 8);
      info.zone = Name("zone", i / 32);
      info.epoch = 1;
      info.num_blocks = 1 << 20;
      info.block_bytes = 2 << 20;
      ids.push_back(router->AddWorker(info).value());
    }
    std::vector<uint64_t> next_id(kWorkers, 1);
    for (uint32_t d = 0; d < docs; ++d) {
      const std::vector<uint64_t> h = Doc(d);
      for (WorkerId w : {ids[(2 * d) % kWorkers], ids[(2 * d + 1 + 2 * (d / kWorkers)) % kWorkers]}) {
        (void)router->ApplyEvent(w, {KvEventKind::kStored, 1, next_id[w]++, 0, h}).value();
      }
    }
    if (docs != kDocs) return;
    for (uint32_t s = 0; s < kStaggeredDocs; ++s) {
      const std::vector<uint64_t> h = Doc(kDocs + s);
      for (uint32_t i = 0; i < kWorkers; ++i) {
        const uint32_t held = 8 * i + 1 + s % 8;
        (void)router->ApplyEvent(ids[i], {KvEventKind::kStored, 1, next_id[ids[i]]++, 0,
                                          std::span(h).first(held)}).value();
      }
    }
  }

  void Report(uint32_t salt) {
    for (WorkerId w : ids) {
      LoadReport r;
      r.queued_prefill_tokens = (Mix(w + salt) % 64) * 16;
      r.active_decode_blocks = static_cast<uint32_t>(Mix(w * 7 + salt) % 4096);
      r.free_blocks = (1 << 20) - r.active_decode_blocks;
      r.running_requests = static_cast<uint32_t>(Mix(w * 13 + salt) % 32);
      (void)router->ApplyLoadReport(w, r).ok();
    }
  }
};

void SetPercentiles(benchmark::State& state, const char* prefix, std::vector<double>& ns) {
  if (ns.empty()) return;
  std::sort(ns.begin(), ns.end());
  auto at = [&](double q) { return ns[std::min(ns.size() - 1, static_cast<size_t>(q * ns.size()))]; };
  const std::string p(prefix);
  state.counters[p + "p50_ns"] = at(0.50);
  state.counters[p + "p99_ns"] = at(0.99);
  state.counters[p + "max_ns"] = ns.back();
}

int64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

enum Kind : int64_t { kHit = 0, kHalf = 1, kMiss = 2, kStaggered = 3 };

// 256 prompts of a kind (routed in turn).
std::vector<std::vector<uint64_t>> Prompts(Kind kind, uint32_t docs) {
  std::vector<std::vector<uint64_t>> prompts;
  for (uint32_t i = 0; i < 256; ++i) {
    const uint64_t doc = Mix(i) % docs;
    std::vector<uint64_t> h = Doc(doc);
    if (kind == kHalf) {
      const std::vector<uint64_t> fresh = Doc(1'000'000 + i);
      std::copy(fresh.begin() + kBlocksPerPrompt / 2, fresh.end(), h.begin() + kBlocksPerPrompt / 2);
    } else if (kind == kMiss) {
      h = Doc(2'000'000 + i);
    } else if (kind == kStaggered) {
      h = Doc(kDocs + i % kStaggeredDocs);
    }
    prompts.push_back(std::move(h));
  }
  return prompts;
}

// Args: prompt kind, aggregated (0/1), policy.
void BM_Route(benchmark::State& state) {
  const Kind kind = static_cast<Kind>(state.range(0));
  const bool aggregated = state.range(1) != 0;
  const Policy policy = static_cast<Policy>(state.range(2));
  static std::unique_ptr<BenchFleet> fleets[2][kNumPolicies];
  auto& fleet = fleets[aggregated][static_cast<int>(policy)];
  if (!fleet) fleet = std::make_unique<BenchFleet>(aggregated, policy);

  const std::vector<std::vector<uint64_t>> prompts = Prompts(kind, kDocs);
  std::vector<double> ns, cpu_ns;
  ns.reserve(1 << 20);
  cpu_ns.reserve(1 << 20);
  RouteDecision decision;
  uint64_t i = 0;
  uint64_t overlap_sum = 0;
  // As the proxy does, each route's prefill is ended (EndPrefill) once it
  // is over, then its attempt (EndAttempt): here 64 routes later, so that
  // about 64 prefills are open at any time. Timed apart ("end_").
  std::array<PrefillTicket, 64> in_flight{};
  std::vector<double> end_ns;
  end_ns.reserve(1 << 20);
  for (auto _ : state) {
    if (i % 512 == 0) {
      state.PauseTiming();
      fleet->Report(static_cast<uint32_t>(i));
      state.ResumeTiming();
    }
    const std::vector<uint64_t>& h = prompts[i++ % prompts.size()];
    const int64_t c0 = ThreadCpuNs();
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = fleet->router->Route({h, kBlocksPerPrompt * 16}, &decision);
    const auto t1 = std::chrono::steady_clock::now();
    const int64_t c1 = ThreadCpuNs();
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
    overlap_sum += decision.prefill_overlap_blocks;
    PrefillTicket& slot = in_flight[i % in_flight.size()];
    const auto e0 = std::chrono::steady_clock::now();
    fleet->router->EndPrefill(slot);
    fleet->router->EndAttempt(slot, /*prefill_ended=*/true);
    const auto e1 = std::chrono::steady_clock::now();
    slot = decision.prefill_ticket;
    if (ns.size() < ns.capacity()) {
      ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
      cpu_ns.push_back(static_cast<double>(c1 - c0));
      end_ns.push_back(std::chrono::duration<double, std::nano>(e1 - e0).count());
    }
  }
  for (const PrefillTicket& t : in_flight) fleet->router->EndAttempt(t);
  SetPercentiles(state, "", ns);
  SetPercentiles(state, "cpu_", cpu_ns);
  SetPercentiles(state, "end_", end_ns);
  state.counters["mean_prefill_overlap_blocks"] = i ? static_cast<double>(overlap_sum) / i : 0;
  state.counters["indexed_hashes"] = static_cast<double>(fleet->router->index().size());
}
BENCHMARK(BM_Route)
    ->ArgNames({"prompt", "both", "policy"})
    ->Args({kHit, 0, static_cast<int64_t>(Policy::kKvAware)})
    ->Args({kHalf, 0, static_cast<int64_t>(Policy::kKvAware)})
    ->Args({kMiss, 0, static_cast<int64_t>(Policy::kKvAware)})
    ->Args({kStaggered, 0, static_cast<int64_t>(Policy::kKvAware)})
    ->Args({kHit, 1, static_cast<int64_t>(Policy::kKvAware)})
    ->Args({kHit, 0, static_cast<int64_t>(Policy::kLeastLoaded)})
    ->Args({kHit, 0, static_cast<int64_t>(Policy::kRoundRobin)})
    ->Unit(benchmark::kMicrosecond);

// Overlap lookup alone (the index part of a route) for 512-block prompts,
// with the full index (2048 documents, 64 MiB of table) or one that fits in
// L2 (32 documents). Args: documents, prompt kind (hit or staggered),
// method (0: Overlap's search, 1: OverlapEveryBlock, reading block by block
// until every holder missed). Items = the prompt's 512 blocks.
void BM_Overlap(benchmark::State& state) {
  const uint32_t docs = static_cast<uint32_t>(state.range(0));
  const Kind kind = static_cast<Kind>(state.range(1));
  const bool every_block = state.range(2) != 0;
  BenchFleet fleet(false, Policy::kKvAware, docs);
  const std::vector<std::vector<uint64_t>> prompts = Prompts(kind, docs);
  OverlapBlocks out;
  uint64_t i = 0;
  for (auto _ : state) {
    const std::vector<uint64_t>& h = prompts[i++ % prompts.size()];
    if (every_block) {
      fleet.router->index().OverlapEveryBlock(h, &out);
    } else {
      fleet.router->index().Overlap(h, &out);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kBlocksPerPrompt);
}
BENCHMARK(BM_Overlap)
    ->ArgNames({"docs", "prompt", "every_block"})
    ->Args({2048, kHit, 0})->Args({2048, kHit, 1})
    ->Args({2048, kStaggered, 0})->Args({2048, kStaggered, 1})
    ->Args({32, kHit, 0})->Args({32, kHit, 1})
    ->Unit(benchmark::kMicrosecond);

// Yardstick: 512 prefetched reads of random lines of a 64 MiB buffer on
// huge pages, the memory floor of a block-by-block 512-block lookup.
void BM_RandomLines(benchmark::State& state) {
  constexpr size_t kBytes = size_t{64} << 20;
  char* buf = static_cast<char*>(std::aligned_alloc(size_t{2} << 20, kBytes));
  madvise(buf, kBytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < kBytes; i += 64) buf[i] = static_cast<char>(i);
  std::vector<uint64_t> idx(kBlocksPerPrompt * 64);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = (Mix(i) % (kBytes / 64)) * 64;
  uint64_t sum = 0, round = 0;
  for (auto _ : state) {
    const uint64_t* v = idx.data() + (round++ % 64) * kBlocksPerPrompt;
    for (uint32_t i = 0; i < kBlocksPerPrompt; ++i) __builtin_prefetch(buf + v[i]);
    for (uint32_t i = 0; i < kBlocksPerPrompt; ++i) sum += static_cast<unsigned char>(buf[v[i]]);
  }
  benchmark::DoNotOptimize(sum);
  std::free(buf);
}
BENCHMARK(BM_RandomLines)->Unit(benchmark::kMicrosecond);

// Steady event churn, one event per iteration: stored events of
// `per_event` new blocks for a rotating worker, each removed again 256
// events later. apply(worker, kind, hashes) applies one event. Returns the
// blocks stored or removed.
template <typename Apply>
uint64_t RunChurn(benchmark::State& state, uint32_t per_event, uint64_t seed, Apply&& apply) {
  constexpr uint32_t kLag = 256;
  std::vector<uint64_t> hashes(size_t{kLag} * per_event * 4);
  for (size_t i = 0; i < hashes.size(); ++i) hashes[i] = Mix(seed + i);
  const auto event = [&](uint64_t e) {
    return std::span<const uint64_t>(hashes).subspan((e * per_event) % hashes.size(), per_event);
  };
  uint64_t e = 0, blocks = 0;
  for (auto _ : state) {
    apply(static_cast<WorkerId>(e % kWorkers), KvEventKind::kStored, event(e));
    blocks += per_event;
    if (e >= kLag) {
      const uint64_t old = e - kLag;
      apply(static_cast<WorkerId>(old % kWorkers), KvEventKind::kRemoved, event(old));
      blocks += per_event;
    }
    ++e;
  }
  return blocks;
}

// Event application on one thread against an index already holding 1M
// blocks: stored events of range(0) blocks for a rotating worker, each
// removed again 256 events later (steady state). Items = blocks stored or
// removed.
void BM_ApplyEvents(benchmark::State& state) {
  const uint32_t per_event = static_cast<uint32_t>(state.range(0));
  PrefixIndex index;
  for (WorkerId w = 0; w < kWorkers; ++w) (void)index.AddWorker(w, 1);
  std::vector<uint64_t> next_id(kWorkers, 1);
  for (uint32_t d = 0; d < kDocs; ++d) {
    const WorkerId w = d % kWorkers;
    (void)index.Apply(w, {KvEventKind::kStored, 1, next_id[w]++, 0, Doc(d)}).value();
  }
  const uint64_t blocks = RunChurn(state, per_event, 10'000'000'000ull,
                                   [&](WorkerId w, KvEventKind kind, std::span<const uint64_t> h) {
                                     (void)index.Apply(w, {kind, 1, next_id[w]++, 0, h});
                                   });
  state.SetItemsProcessed(static_cast<int64_t>(blocks));
  state.counters["indexed_hashes"] = static_cast<double>(index.size());
}
BENCHMARK(BM_ApplyEvents)->ArgName("blocks_per_event")->Arg(1)->Arg(16)->Arg(64);

// The proxy's case in the sim 1P1D bench (issue 23, `prompt`): two workers
// (a prefiller and a decoder) of range(0) blocks each, the tables reserved
// for both pools as the router does at AddWorker (PrefixIndex::Reserve);
// every 8k prompt stores 500 new blocks on both, and once a worker is full
// the oldest prompt's 500 are removed from both. 26,624 blocks is the sim
// fleet's pool (configs/sim-1p1d.yaml: 53,248 reserved, 131,072 slots);
// 131,072 fills the largest reservation (kReserveMaxHashes: ~262k hashes
// indexed at most, 1M slots). Between events the caches are cold (the
// proxy's frame loop sleeps while the workers run): 32 MiB of other memory
// is touched outside the timing. One iteration = one prompt's events on
// one worker (its store, and its share of the removals once full); the
// time is this thread's CPU time inside Apply only. Counters: CPU ns per
// stored and per removed hash (means, every rehash included) and the
// rehashes over the timed events.
void BM_ApplyColdEvents(benchmark::State& state) {
  constexpr uint32_t kPerEvent = 500;
  constexpr size_t kThrash = size_t{32} << 20;
  const uint32_t capacity = static_cast<uint32_t>(state.range(0));
  PrefixIndex index;
  for (WorkerId w = 0; w < 2; ++w) (void)index.AddWorker(w, 1);
  index.Reserve(2 * uint64_t{capacity});
  std::vector<uint64_t> next_id(2, 1);
  std::vector<char> thrash(kThrash, 1);
  uint64_t doc = 0, oldest = 0, sink = 0;
  // [0]: stored, [1]: removed; CPU ns and hashes over the timed events.
  std::array<int64_t, 2> cpu_ns{};
  std::array<uint64_t, 2> hashes{};
  int64_t step_ns = 0;
  bool timed = false;
  const auto apply = [&](WorkerId w, KvEventKind kind, uint64_t d) {
    const std::vector<uint64_t> h = Doc(50'000'000 + d, kPerEvent);
    const int64_t c0 = ThreadCpuNs();
    (void)index.Apply(w, {kind, 1, next_id[w]++, 0, h});
    const int64_t ns = ThreadCpuNs() - c0;
    if (!timed) return;
    const size_t k = kind == KvEventKind::kStored ? 0 : 1;
    cpu_ns[k] += ns;
    hashes[k] += kPerEvent;
    step_ns += ns;
  };
  const auto step = [&] {
    const WorkerId w = static_cast<WorkerId>(doc % 2);
    apply(w, KvEventKind::kStored, doc / 2);
    if (w == 1 && index.HeldBlocks(1) > capacity) {
      apply(0, KvEventKind::kRemoved, oldest);
      apply(1, KvEventKind::kRemoved, oldest);
      ++oldest;
    }
    ++doc;
  };
  // Untimed: the pools fill and churn for a while (tombstones, if any,
  // accumulate as in a running proxy).
  while (oldest < 64) step();
  const uint64_t rehashes = index.Rehashes();
  timed = true;
  for (auto _ : state) {
    for (size_t i = 0; i < kThrash; i += 64) sink += static_cast<unsigned char>(thrash[i]++);
    step_ns = 0;
    step();
    state.SetIterationTime(static_cast<double>(step_ns) * 1e-9);
  }
  benchmark::DoNotOptimize(sink);
  state.SetItemsProcessed(static_cast<int64_t>(hashes[0] + hashes[1]));
  state.counters["store_ns_per_hash"] = hashes[0] ? static_cast<double>(cpu_ns[0]) / hashes[0] : 0;
  state.counters["remove_ns_per_hash"] = hashes[1] ? static_cast<double>(cpu_ns[1]) / hashes[1] : 0;
  state.counters["rehashes"] = static_cast<double>(index.Rehashes() - rehashes);
  state.counters["indexed_hashes"] = static_cast<double>(index.size());
  state.counters["table_slots"] = static_cast<double>(index.TableSlots());
}
BENCHMARK(BM_ApplyColdEvents)
    ->ArgName("pool_blocks")
    ->Arg(26'624)
    ->Arg(131'072)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->Iterations(1200);

// The same stream through Router::ApplyEvent (index + the prefill-completion
// check), on a 32P32D router with 64 documents indexed. Args: blocks per
// event; keyed predictions pending on every prefiller (0: the check is one
// atomic load; 8: every event to a prefiller takes the router mutex and
// compares its hashes with the 8 keys, none of which it completes: the
// worst steady state of the check, since a completion would end one).
void BM_RouterApplyEvents(benchmark::State& state) {
  const uint32_t per_event = static_cast<uint32_t>(state.range(0));
  const uint32_t pending = static_cast<uint32_t>(state.range(1));
  BenchFleet fleet(false, Policy::kRoundRobin, 64);
  // Round robin over 32 prefillers: `pending` distinct 2-block prompts each.
  for (uint32_t i = 0; i < 32 * pending; ++i) {
    const std::vector<uint64_t> h = {Mix(20'000'000'000ull + 2 * i), Mix(20'000'000'001ull + 2 * i)};
    (void)fleet.router->Route({h, 40}).value();
  }
  // Event ids continue each worker's stream (BenchFleet's stored documents).
  std::vector<uint64_t> last(kWorkers, 0);
  for (uint32_t d = 0; d < 64; ++d) {
    for (WorkerId w : {fleet.ids[(2 * d) % kWorkers], fleet.ids[(2 * d + 1 + 2 * (d / kWorkers)) % kWorkers]}) {
      ++last[w];
    }
  }
  const uint64_t blocks = RunChurn(state, per_event, 30'000'000'000ull,
                                   [&](WorkerId w, KvEventKind kind, std::span<const uint64_t> h) {
                                     (void)fleet.router->ApplyEvent(w, {kind, 1, ++last[w], 0, h});
                                   });
  state.SetItemsProcessed(static_cast<int64_t>(blocks));
  const RouterCounters c = fleet.router->counters();
  state.counters["events_ignored"] = static_cast<double>(c.events_ignored);
  state.counters["prefills_completed"] = static_cast<double>(c.prefills_completed);
}
BENCHMARK(BM_RouterApplyEvents)
    ->ArgNames({"blocks_per_event", "pending"})
    ->Args({1, 0})->Args({1, 8})->Args({16, 0})->Args({16, 8})->Args({64, 8});

// LoadTracker::Complete alone: one prefiller with `open` prefills queued
// (each keyed by its prompt's last full block), and stored events of 85
// hashes (a sim prefiller's usual chunk event) that end none of them,
// which is what every chunk but a prompt's last does. Per event.
void BM_LoadTrackerComplete(benchmark::State& state) {
  const uint32_t open = static_cast<uint32_t>(state.range(0));
  LoadTracker t(5'000'000, INT64_MAX / 4);
  t.Reset(0, 10'000);
  for (uint32_t i = 0; i < open; ++i) {
    t.AddPrefill(0, {.ticket = i + 1, .key = Mix(40'000'000'000ull + i), .tokens = 8000}, 0);
  }
  std::vector<std::vector<uint64_t>> events(64, std::vector<uint64_t>(85));
  for (size_t e = 0; e < events.size(); ++e) {
    for (size_t i = 0; i < 85; ++i) events[e][i] = Mix(50'000'000'000ull + e * 85 + i);
  }
  size_t e = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(t.Complete(0, events[e]));
    e = (e + 1) % events.size();
  }
  state.counters["keyed"] = t.keyed_predictions(0);
}
BENCHMARK(BM_LoadTrackerComplete)->ArgName("open")->Arg(16)->Arg(256)->Arg(1024);

}  // namespace
}  // namespace tandem::router

BENCHMARK_MAIN();
