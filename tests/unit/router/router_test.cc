#include "router/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace tandem::router {
namespace {

uint64_t H(uint64_t i) { return (i + 1) * 0x9E3779B97F4A7C15ull; }
std::vector<uint64_t> Chain(uint64_t first, uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = H(first + i);
  return v;
}

// GCC 12 warns (-Wrestrict, a false positive) on "literal" + std::string.
std::string Name(const char* prefix, uint64_t i) {
  std::string s(prefix);
  s += std::to_string(i);
  return s;
}

// A router on a fake clock.
struct Fleet {
  std::shared_ptr<std::atomic<int64_t>> now = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  std::unique_ptr<Router> router;

  explicit Fleet(RouterConfig config = {}, RouterOptions options = {}) {
    options.clock = [clock = now] { return clock->load(); };
    router = Router::Create(config, std::move(options)).value();
  }
  WorkerId Add(const std::string& name, WorkerRole role, uint32_t num_blocks = 100000, std::string node = "") {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.node = std::move(node);
    info.epoch = 1;
    info.num_blocks = num_blocks;
    return router->AddWorker(info).value();
  }
  void Store(WorkerId w, uint64_t event_id, std::span<const uint64_t> hashes) {
    auto r = router->ApplyEvent(w, {KvEventKind::kStored, 1, event_id, 0, hashes});
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(*r, EventResult::kApplied);
  }
  RouteDecision Route(std::span<const uint64_t> hashes, uint32_t tokens) {
    RouteDecision d;
    Status st = router->Route({hashes, tokens}, &d);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return d;
  }
  void Advance(int64_t ns) { *now += ns; }
};

TEST(RouterTest, CreateRejectsBadConfig) {
  const struct {
    const char* name;
    RouterConfig config;
    RouterOptions options;
  } kCases[] = {
      {"unknown policy", {.policy = "fastest"}, {}},
      {"negative temperature", {.temperature = -1}, {}},
      {"negative weight", {.prefill_weight = -0.5}, {}},
      {"zero block size", {}, {.block_size_tokens = 0}},
      {"zero bandwidth", {}, {.cross_node_bandwidth_bytes_per_s = 0}},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(Router::Create(c.config, c.options).status().code(), StatusCode::kInvalidArgument);
  }
  for (const char* p : {"kv_aware", "least_loaded", "round_robin", "random"}) {
    auto r = Router::Create({.policy = p});
    ASSERT_TRUE(r.ok()) << p;
    EXPECT_EQ(PolicyName((*r)->policy()), p);
  }
}

// The membership generation changes with every add and removal (a Watch
// keeps FindWorker's answer while it does not), and only then.
TEST(RouterTest, Membership) {
  Fleet f;
  uint64_t gen = f.router->membership_generation();
  const auto changed = [&] {
    const uint64_t now = f.router->membership_generation();
    const bool c = now != gen;
    gen = now;
    return c;
  };
  EXPECT_EQ(f.Add("a", WorkerRole::kPrefill), 0u);
  EXPECT_TRUE(changed());
  EXPECT_EQ(f.Add("b", WorkerRole::kDecode), 1u);
  EXPECT_TRUE(changed());
  WorkerInfo dup;
  dup.name = "a";
  EXPECT_EQ(f.router->AddWorker(dup).status().code(), StatusCode::kAlreadyExists);
  EXPECT_FALSE(changed());
  ASSERT_TRUE(f.router->RemoveWorker(0).ok());
  EXPECT_TRUE(changed());
  EXPECT_FALSE(f.router->FindWorker("a").has_value());
  EXPECT_EQ(f.Add("c", WorkerRole::kPrefill), 0u);  // lowest free id is reused
  EXPECT_TRUE(changed());
  for (uint32_t i = 2; i < kMaxWorkers; ++i) f.Add(Name("w", i), WorkerRole::kDecode);
  WorkerInfo extra;
  extra.name = "one-too-many";
  EXPECT_EQ(f.router->AddWorker(extra).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(f.router->num_workers(), kMaxWorkers);
}

TEST(RouterTest, RejectsMalformedRequests) {
  Fleet f;
  f.Add("p", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const std::vector<uint64_t> h = Chain(0, 3);
  RouteDecision d;
  EXPECT_EQ(f.router->Route({h, 47}, &d).code(), StatusCode::kInvalidArgument);  // 3 hashes, 2 full blocks
  EXPECT_EQ(f.router->Route({{}, 0}, &d).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(f.router->Route({h, 48}, &d).ok());
  EXPECT_TRUE(f.router->Route({h, 50}, &d).ok());
  EXPECT_EQ(d.prompt_blocks, 4u);
}

// 100 requests at one instant, before any load report: the predictions
// alone must spread them.
TEST(RouterTest, BurstSpreadsAcrossWorkers) {
  const struct {
    const char* name;
    Policy policy;
    uint32_t shared_blocks;  // cached on prefiller 0 and shared by every prompt
    int min_each, max_each;
  } kCases[] = {
      {"kv_aware, nothing cached", Policy::kKvAware, 0, 25, 25},
      // The cache owner takes more (58: its cost grows by 8 blocks a request,
      // the others by 32) but not all.
      {"kv_aware, shared document on one prefiller", Policy::kKvAware, 24, 10, 70},
      {"least_loaded", Policy::kLeastLoaded, 0, 25, 25},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fleet f;
    f.router->SetPolicy(c.policy);
    std::vector<WorkerId> ps, ds;
    for (int i = 0; i < 4; ++i) ps.push_back(f.Add(Name("p", i), WorkerRole::kPrefill));
    for (int i = 0; i < 4; ++i) ds.push_back(f.Add(Name("d", i), WorkerRole::kDecode));
    const std::vector<uint64_t> doc = Chain(1'000'000, c.shared_blocks);
    if (c.shared_blocks) f.Store(ps[0], 1, doc);
    std::vector<int> per_worker(8, 0);
    for (int r = 0; r < 100; ++r) {
      std::vector<uint64_t> h = doc;
      const std::vector<uint64_t> own = Chain(uint64_t(r) * 1000, 32 - c.shared_blocks);
      h.insert(h.end(), own.begin(), own.end());
      const RouteDecision d = f.Route(h, 32 * 16);
      ++per_worker[d.prefill];
      ++per_worker[d.decode];
      f.Advance(10'000);  // 100 requests in 1 ms
    }
    for (WorkerId w : ps) {
      EXPECT_GE(per_worker[w], c.min_each) << "prefiller " << w;
      EXPECT_LE(per_worker[w], c.max_each) << "prefiller " << w;
    }
    for (WorkerId w : ds) EXPECT_EQ(per_worker[w], 25) << "decoder " << w;
  }
}

// Decode blocks and running requests: a report received report_lag after
// the routing replaces the predictions. Prefill work: the router's own
// counts until it ends; a report adds what it counts beyond it (work this
// router did not send, e.g. from before a proxy restart).
TEST(RouterTest, LoadReportsReplaceTimedPredictionsAndAddOnlyForeignPrefills) {
  Fleet f(RouterConfig{}, RouterOptions{.report_lag_ns = 5'000'000});
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  const WorkerId d = f.Add("d", WorkerRole::kDecode, 100);
  std::vector<PrefillTicket> tickets;
  for (int i = 0; i < 3; ++i) tickets.push_back(f.Route(Chain(i * 100, 10), 160).prefill_ticket);
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 480);
  EXPECT_EQ(f.router->load(p)->running_requests, 3);
  EXPECT_EQ(f.router->load(d)->active_decode_blocks, 30);
  EXPECT_EQ(f.router->load(d)->free_blocks, 70);
  // 1 ms later: one of ours waits, one runs. Nothing beyond ours.
  f.Advance(1'000'000);
  ASSERT_TRUE(f.router->ApplyLoadReport(p, {.queued_prefill_tokens = 160, .running_requests = 1}).ok());
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 480);
  EXPECT_EQ(f.router->load(p)->running_requests, 3);
  // 10 ms: the prefiller also holds 800 tokens and a request of someone else's.
  f.Advance(9'000'000);
  ASSERT_TRUE(f.router->ApplyLoadReport(p, {.queued_prefill_tokens = 480 + 800, .running_requests = 3 + 1}).ok());
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 480 + 800);
  EXPECT_EQ(f.router->load(p)->running_requests, 3 + 1);
  // The decoder's report covers the three routings: it replaces them.
  ASSERT_TRUE(f.router->ApplyLoadReport(d, {.active_decode_blocks = 30, .free_blocks = 70, .running_requests = 3})
                  .ok());
  EXPECT_EQ(f.router->load(d)->active_decode_blocks, 30);
  EXPECT_EQ(f.router->load(d)->free_blocks, 70);
  EXPECT_EQ(f.router->load(d)->running_requests, 3);
  // Our prefills end: only the foreign work stays, until a report says otherwise.
  for (const PrefillTicket& t : tickets) f.router->EndPrefill(t);
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 800);
  EXPECT_EQ(f.router->load(p)->running_requests, 1);
  // The first report after they ended may have been sampled before: it is
  // taken as counting them (the foreign part looks smaller for one report).
  f.Advance(150'000'000);
  ASSERT_TRUE(f.router->ApplyLoadReport(p, {.queued_prefill_tokens = 800, .running_requests = 1}).ok());
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 800 - 480);
  EXPECT_EQ(f.router->load(p)->running_requests, 0);
  f.Advance(150'000'000);
  ASSERT_TRUE(f.router->ApplyLoadReport(p, {.queued_prefill_tokens = 800, .running_requests = 1}).ok());
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 800);
  EXPECT_EQ(f.router->load(p)->running_requests, 1);
  ASSERT_TRUE(f.router->ApplyLoadReport(p, {}).ok());
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 0);
  EXPECT_EQ(f.router->load(p)->running_requests, 0);
  EXPECT_EQ(f.router->counters().prefills_ended, 3u);
  EXPECT_EQ(f.router->ApplyLoadReport(7, {}).code(), StatusCode::kNotFound);
}

// Decode seats (docs/router.md, "Decode seats"): a burst fills decoders in
// proportion to their seats (scheduler.max_num_seqs), not 50/50 by KV
// blocks, and a decoder whose seats are all taken (by its report) gets no
// request while another has one free, even with the prompt cached there.
TEST(RouterTest, DecodersFillInProportionToTheirSeats) {
  for (const bool seats_known : {true, false}) {
    SCOPED_TRACE(seats_known ? "seats advertised" : "seats unknown (0)");
    Fleet f(RouterConfig{}, RouterOptions{.report_lag_ns = 5'000'000});
    f.Add("p", WorkerRole::kPrefill);
    auto add_decoder = [&](const std::string& name, uint32_t seats) {
      WorkerInfo info;
      info.name = name;
      info.role = WorkerRole::kDecode;
      info.epoch = 1;
      info.num_blocks = 100000;
      info.decode_seats = seats_known ? seats : 0;
      return f.router->AddWorker(info).value();
    };
    const WorkerId small = add_decoder("d-small", 8);
    const WorkerId big = add_decoder("d-big", 128);
    std::vector<int> routed(2, 0);
    for (int r = 0; r < 272; ++r) {
      const RouteDecision d = f.Route(Chain(uint64_t(r) * 1000, 1), 16);
      ASSERT_TRUE(d.decode == small || d.decode == big);
      ++routed[d.decode == small ? 0 : 1];
      f.Advance(1'000);
    }
    if (seats_known) {
      EXPECT_EQ(routed[0], 16);   // two rounds of 8
      EXPECT_EQ(routed[1], 256);  // two rounds of 128
    } else {
      EXPECT_EQ(routed[0], 136);  // by KV blocks alone: half each
      EXPECT_EQ(routed[1], 136);
    }
    // Reports replace the predictions: the small decoder holds 8 requests
    // (all its seats), the big one 100 of its 128. The small one caches the
    // next prompt, and loses it to a free seat when seats are known.
    f.Advance(10'000'000);
    ASSERT_TRUE(f.router->ApplyLoadReport(small, {.active_decode_blocks = 8, .free_blocks = 99992,
                                                  .running_requests = 8, .registered_requests = 8})
                    .ok());
    ASSERT_TRUE(f.router->ApplyLoadReport(big, {.active_decode_blocks = 100, .free_blocks = 99900,
                                                .running_requests = 100, .registered_requests = 100})
                    .ok());
    EXPECT_EQ(f.router->load(small)->seat_demand, 8);
    EXPECT_EQ(f.router->load(big)->seat_demand, 100);
    const std::vector<uint64_t> cached = Chain(9'000'000, 4);
    f.Store(small, 1, cached);
    const RouteDecision d = f.Route(cached, 64);
    EXPECT_EQ(d.decode, seats_known ? big : small) << d.DebugString();
    EXPECT_EQ(d.seat_deferred, seats_known ? 1u : 0u);
  }
}

TEST(RouterTest, PredictionsExpireWithoutReports) {
  Fleet f(RouterConfig{}, RouterOptions{.max_prediction_age_ns = 2'000'000'000});
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  f.Route(Chain(0, 10), 160);
  f.Advance(3'000'000'000);
  f.Route(Chain(100, 5), 80);
  EXPECT_EQ(f.router->load(p)->queued_prefill_tokens, 80);
}

// Three warm prefillers hold the document and carry 50 queued blocks each;
// a worker that just joined holds nothing and carries nothing.
TEST(RouterTest, ColdWorkerGetsItsShare) {
  Fleet f;
  std::vector<WorkerId> warm;
  const std::vector<uint64_t> doc = Chain(0, 20);
  for (int i = 0; i < 3; ++i) {
    warm.push_back(f.Add(Name("warm", i), WorkerRole::kPrefill));
    f.Store(warm.back(), 1, doc);
    ASSERT_TRUE(f.router->ApplyLoadReport(warm.back(), {.queued_prefill_tokens = 800}).ok());
  }
  f.Add("d", WorkerRole::kDecode);
  const WorkerId cold = f.Add("cold", WorkerRole::kPrefill);
  std::vector<int> count(8, 0);
  for (int r = 0; r < 20; ++r) {
    std::vector<uint64_t> h = doc;
    const std::vector<uint64_t> q = Chain(1000 + r * 10, 4);  // a short question after the document
    h.insert(h.end(), q.begin(), q.end());
    const RouteDecision d = f.Route(h, 24 * 16);
    if (r == 0) {
      EXPECT_EQ(d.prefill, cold) << d.DebugString();
      EXPECT_EQ(d.prefill_overlap_blocks, 0u);
    }
    ++count[d.prefill];
  }
  EXPECT_GE(count[cold], 2);
  for (WorkerId w : warm) EXPECT_GE(count[w], 1) << w;
}

// Issue 17: prefixes nobody holds go to the emptier caches (equal load),
// one at a time, and later questions follow their document.
TEST(RouterTest, ColdPrefixesSpreadByCacheFillAndKeepAffinity) {
  Fleet f;
  const WorkerId p0 = f.Add("p0", WorkerRole::kPrefill, 1000);
  const WorkerId p1 = f.Add("p1", WorkerRole::kPrefill, 1000);
  const WorkerId d2 = f.Add("d2", WorkerRole::kDecode, 1000);
  const WorkerId d3 = f.Add("d3", WorkerRole::kDecode, 1000);
  std::vector<uint64_t> event(8, 0);  // next event id per worker
  std::vector<WorkerId> doc_prefill;
  for (uint64_t doc = 0; doc < 5; ++doc) {
    const std::vector<uint64_t> h = Chain(doc * 100, 12);
    const RouteDecision d = f.Route(h, 12 * 16 + 5);
    EXPECT_EQ(d.prefill_overlap_blocks, 0u) << d.DebugString();
    doc_prefill.push_back(d.prefill);
    // The prefill and the decode store the document (as their events would).
    f.Store(d.prefill, ++event[d.prefill], h);
    f.Store(d.decode, ++event[d.decode], h);
    f.router->EndPrefill(d.prefill_ticket);
  }
  // p0, p1, p0, p1, p0: the emptier cache each time (ties on equal fill: lower id).
  EXPECT_EQ(doc_prefill, (std::vector<WorkerId>{p0, p1, p0, p1, p0}));
  // A question on a cached document goes where the document is.
  for (uint64_t doc = 0; doc < 5; ++doc) {
    std::vector<uint64_t> h = Chain(doc * 100, 12);
    const std::vector<uint64_t> q = Chain(5000 + doc, 1);
    h.insert(h.end(), q.begin(), q.end());
    const RouteDecision d = f.Route(h, 13 * 16 + 2);
    EXPECT_EQ(d.prefill, doc_prefill[doc]) << d.DebugString();
    EXPECT_EQ(d.prefill_overlap_blocks, 12u);
    EXPECT_TRUE(d.decode == d2 || d.decode == d3);
    f.router->EndPrefill(d.prefill_ticket);
  }
}

TEST(RouterTest, MultiTurnPrefersTheDecoderHoldingTheConversation) {
  Fleet f;
  const WorkerId p0 = f.Add("p0", WorkerRole::kPrefill);
  f.Add("p1", WorkerRole::kPrefill);
  f.Add("d2", WorkerRole::kDecode);
  const WorkerId d3 = f.Add("d3", WorkerRole::kDecode);
  const std::vector<uint64_t> turn2 = Chain(0, 15);
  const std::span<const uint64_t> turn1 = std::span(turn2).first(10);
  f.Store(p0, 1, turn1);
  f.Store(d3, 1, turn1);
  const RouteDecision d = f.Route(turn2, 15 * 16 + 3);
  EXPECT_EQ(d.prefill, p0);
  EXPECT_EQ(d.decode, d3);
  EXPECT_EQ(d.prefill_overlap_blocks, 10u);
  EXPECT_EQ(d.decode_overlap_blocks, 10u);
  EXPECT_EQ(d.transfer_blocks, 6u);  // 5 new full blocks and the partial one
}

TEST(RouterTest, ConditionalDisaggregationThroughTheRouter) {
  Fleet f(RouterConfig{.local_prefill_threshold_tokens = 64});
  f.Add("p", WorkerRole::kPrefill);
  const WorkerId d = f.Add("d", WorkerRole::kDecode);
  const std::vector<uint64_t> turn2 = Chain(0, 12);
  f.Store(d, 1, std::span(turn2).first(10));
  const RouteDecision r = f.Route(turn2, 12 * 16);
  EXPECT_TRUE(r.local_prefill);
  EXPECT_TRUE(r.conditional_local);
  EXPECT_EQ(r.prefill, d);
  EXPECT_EQ(f.router->load(d)->queued_prefill_tokens, 32);  // the uncached tail, prefilled locally
  EXPECT_EQ(f.router->load(d)->active_decode_blocks, 2);
  const RouterCounters c = f.router->counters();
  EXPECT_EQ(c.conditional_local, 1u);
  EXPECT_EQ(c.local_prefills, 1u);
  EXPECT_EQ(c.workers[d].local_routes, 1u);
}

TEST(RouterTest, TopologyPrefersSameNodePairs) {
  RouterOptions o;
  o.cross_node_bandwidth_bytes_per_s = 1e9;
  Fleet f({}, o);
  WorkerInfo info;
  const char* kNodes[] = {"a", "b", "a", "b"};
  const WorkerRole kRoles[] = {WorkerRole::kPrefill, WorkerRole::kPrefill, WorkerRole::kDecode, WorkerRole::kDecode};
  for (int i = 0; i < 4; ++i) {
    info.name = Name("w", i);
    info.role = kRoles[i];
    info.node = kNodes[i];
    info.block_bytes = 2 << 20;
    ASSERT_TRUE(f.router->AddWorker(info).ok());
  }
  for (int r = 0; r < 40; ++r) {
    const RouteDecision d = f.Route(Chain(r * 100, 32), 512);
    EXPECT_EQ(d.prefill % 2, d.decode % 2) << d.DebugString();  // same node
  }
}

TEST(RouterTest, RemovedWorkerIsNeverChosen) {
  Fleet f;
  const WorkerId p0 = f.Add("p0", WorkerRole::kPrefill);
  const WorkerId p1 = f.Add("p1", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const std::vector<uint64_t> h = Chain(0, 16);
  f.Store(p0, 1, h);
  EXPECT_EQ(f.Route(h, 256).prefill, p0);
  ASSERT_TRUE(f.router->RemoveWorker(p0).ok());
  EXPECT_EQ(f.router->index().BlocksOf(p0), 0u);
  EXPECT_EQ(f.router->ApplyEvent(p0, {KvEventKind::kStored, 1, 2, 0, h}).status().code(), StatusCode::kNotFound);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(f.Route(h, 256).prefill, p1);
  const RouterCounters c = f.router->counters();
  ASSERT_EQ(c.workers.size(), 2u);
  EXPECT_EQ(c.workers[0].name, "p1");
  EXPECT_EQ(c.workers[0].prefill_routes, 5u);
}

TEST(RouterTest, EventCountersAndResync) {
  Fleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const std::vector<uint64_t> h = Chain(0, 8);
  f.Store(p, 1, std::span(h).first(2));
  EXPECT_EQ(*f.router->ApplyEvent(p, {KvEventKind::kStored, 1, 3, 0, h}), EventResult::kNeedsSnapshot);
  EXPECT_EQ(*f.router->ApplyEvent(p, {KvEventKind::kStored, 1, 4, 0, h}), EventResult::kAwaitingSnapshot);
  EXPECT_EQ(*f.router->ApplySnapshot(p, 1, 4, h), EventResult::kApplied);
  EXPECT_EQ(f.Route(h, 128).prefill_overlap_blocks, 8u);
  const RouterCounters c = f.router->counters();
  EXPECT_EQ(c.events_applied, 1u);
  EXPECT_EQ(c.snapshots_requested, 1u);
  EXPECT_EQ(c.events_ignored, 1u);
  EXPECT_EQ(c.snapshots_applied, 1u);
  EXPECT_EQ(c.workers[p].predicted_hit_blocks, 8u);
}

TEST(RouterTest, CountsDecisionsPerPolicyAndWorker) {
  Fleet f;
  f.Add("b0", WorkerRole::kBoth, 50);
  f.Add("b1", WorkerRole::kBoth, 50);
  const Policy kOrder[] = {Policy::kKvAware, Policy::kRoundRobin, Policy::kRoundRobin, Policy::kRandom,
                           Policy::kLeastLoaded};
  for (Policy p : kOrder) {
    f.router->SetPolicy(p);
    const RouteDecision d = f.Route(Chain(0, 2), 32);
    EXPECT_EQ(d.policy, p);
    EXPECT_TRUE(d.local_prefill);  // aggregated fleet: one worker per request
    EXPECT_EQ(d.prefill, d.decode);
  }
  RouteDecision d;
  f.router->SetPolicy(Policy::kKvAware);
  EXPECT_EQ(f.router->Route({{}, 51 * 16}, &d).code(), StatusCode::kResourceExhausted);
  const RouterCounters c = f.router->counters();
  EXPECT_EQ(c.routes[static_cast<size_t>(Policy::kKvAware)], 1u);
  EXPECT_EQ(c.routes[static_cast<size_t>(Policy::kRoundRobin)], 2u);
  EXPECT_EQ(c.routes[static_cast<size_t>(Policy::kRandom)], 1u);
  EXPECT_EQ(c.routes[static_cast<size_t>(Policy::kLeastLoaded)], 1u);
  EXPECT_EQ(c.route_errors[static_cast<size_t>(Policy::kKvAware)], 1u);
  EXPECT_EQ(c.local_prefills, 5u);
  EXPECT_EQ(c.workers[0].local_routes + c.workers[1].local_routes, 5u);
  EXPECT_EQ(c.workers[0].prefill_routes + c.workers[0].decode_routes, 0u);
}

// Routing, KV events, load reports and membership changes from several
// threads at once (bounded): every route succeeds and picks a worker that
// can serve it, and every decision is counted.
TEST(RouterTest, ConcurrentRoutesEventsAndReports) {
  Fleet f;
  const WorkerId p0 = f.Add("p0", WorkerRole::kPrefill);
  f.Add("p1", WorkerRole::kPrefill);
  f.Add("d0", WorkerRole::kDecode);
  f.Add("d1", WorkerRole::kDecode);
  constexpr int kRoutesPerThread = 2000;
  std::atomic<bool> failed{false};
  std::atomic<int> routers_left{2};
  std::vector<std::jthread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      RouteDecision d;
      for (int i = 0; i < kRoutesPerThread; ++i) {
        const std::vector<uint64_t> h = Chain(uint64_t(i % 50) * 100, 8);
        if (!f.router->Route({h, 8 * 16}, &d).ok() || d.prefill == kNoWorker || d.decode == kNoWorker ||
            d.prefill == d.decode) {
          failed = true;
        }
        if (t == 0 && i % 100 == 0) (void)d.DebugString();
      }
      --routers_left;
    });
  }
  threads.emplace_back([&] {  // KV events of p0
    for (uint64_t id = 1; routers_left > 0 && id < 100000; ++id) {
      const std::vector<uint64_t> h = Chain((id % 50) * 100, 8);
      const KvEventKind kind = id % 3 == 0 ? KvEventKind::kRemoved : KvEventKind::kStored;
      auto r = f.router->ApplyEvent(p0, {kind, 1, id, 0, h});
      if (!r.ok() || *r != EventResult::kApplied) failed = true;
    }
  });
  threads.emplace_back([&] {  // load reports and a decoder that comes and goes
    for (int i = 0; routers_left > 0 && i < 100000; ++i) {
      (void)f.router->ApplyLoadReport(p0, {.queued_prefill_tokens = uint32_t(i % 300)}).ok();
      WorkerInfo info;
      info.name = "extra";
      info.role = WorkerRole::kDecode;
      auto id = f.router->AddWorker(info);
      if (!id.ok() || !f.router->RemoveWorker(*id).ok()) failed = true;
    }
  });
  threads.clear();
  EXPECT_FALSE(failed);
  const RouterCounters c = f.router->counters();
  EXPECT_EQ(c.routes[static_cast<size_t>(Policy::kKvAware)], 2u * kRoutesPerThread);
  uint64_t prefills = 0;
  for (const auto& w : c.workers) prefills += w.prefill_routes;
  EXPECT_EQ(prefills, 2u * kRoutesPerThread);
}

}  // namespace
}  // namespace tandem::router
