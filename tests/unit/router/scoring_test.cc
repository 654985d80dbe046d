#include "router/scoring.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace tandem::router {
namespace {

constexpr WorkerRole P = WorkerRole::kPrefill, D = WorkerRole::kDecode, B = WorkerRole::kBoth;

struct W {
  WorkerId id;
  WorkerRole role;
  uint32_t overlap = 0;
  int64_t queued_tokens = 0;
  int64_t active_blocks = 0;
  int64_t free_blocks = 1000;
  int64_t running = 0;
  uint32_t node = 0;
  uint32_t zone = 0;
  double fill = 0;
};

std::vector<Candidate> Make(const std::vector<W>& ws, uint64_t block_bytes = 0) {
  std::vector<Candidate> out;
  for (const W& w : ws) {
    Candidate c;
    c.id = w.id;
    c.role = w.role;
    c.node_id = w.node;
    c.zone_id = w.zone;
    c.block_bytes = block_bytes;
    c.overlap_blocks = w.overlap;
    c.load = {w.queued_tokens, w.active_blocks, w.free_blocks, w.running, true};
    c.cache_fill = w.fill;
    out.push_back(c);
  }
  return out;
}

struct Fixture {
  RouterOptions options;
  ScoringParams params;
  PolicyState state{42};
  Fixture() { params.options = &options; }
};

// kv_aware with a 160-token (10-block) prompt, prefill_weight 1 unless set.
TEST(ScoringTest, KvAwareCostsAndTieBreaks) {
  const struct {
    const char* name;
    std::vector<W> workers;
    double prefill_weight;
    WorkerId want_p, want_d;
    bool want_local;
    double want_cost;
  } kCases[] = {
      {"cache wins", {{0, P, 8}, {1, P, 0}, {2, D}}, 1, 0, 2, false, 2 + 10},
      {"queue outweighs cache", {{0, P, 8, 160}, {1, P, 0}, {2, D}}, 1, 1, 2, false, 10 + 10},
      {"weight 2 makes the cache worth more", {{0, P, 8, 160}, {1, P, 0}, {2, D}}, 2, 0, 2, false, 14 + 10},
      {"decoder's own cache counts", {{0, P}, {2, D, 0}, {3, D, 8, 0, 5}}, 1, 0, 3, false, 10 + 7},
      {"decoder without room is rejected", {{0, P}, {2, D, 0, 0, 0, 5}, {3, D, 0, 0, 100, 100}}, 1, 0, 3, false,
       10 + 110},
      {"room counts the decoder's cache", {{0, P}, {2, D, 8, 0, 50, 2}, {3, D, 0, 0, 100, 100}}, 1, 0, 2, false,
       10 + 52},
      {"tie: fewer running wins", {{0, P, 0, 0, 0, 1000, 3}, {1, P, 0, 0, 0, 1000, 1}, {2, D}}, 1, 1, 2, false, 20},
      {"tie: lowest ids win", {{4, P}, {1, P}, {7, D}, {3, D}}, 1, 1, 3, false, 20},
      {"tie: emptier caches win",
       {{0, P, 0, 0, 0, 1000, 0, 0, 0, 0.5}, {1, P, 0, 0, 0, 1000, 0, 0, 0, 0.1},
        {2, D, 0, 0, 0, 1000, 0, 0, 0, 0.3}, {3, D, 0, 0, 0, 1000, 0, 0, 0, 0.2}},
       1, 1, 3, false, 20},
      {"tie: running before cache fill", {{0, P, 0, 0, 0, 1000, 0, 0, 0, 0.9}, {1, P, 0, 0, 0, 1000, 2}, {2, D}},
       1, 0, 2, false, 20},
      {"cache fill never outweighs cost", {{0, P, 1, 0, 0, 1000, 0, 0, 0, 0.9}, {1, P}, {2, D}}, 1, 0, 2, false,
       9 + 10},
      {"aggregated: one both worker keeps the request", {{0, B, 0}, {1, B, 8}}, 1, 1, 1, true, 2 + 2},
      {"prefill worker may feed a both worker", {{0, P, 8}, {1, B, 0, 0, 30}}, 1, 0, 1, false, 2 + 40},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    f.params.prefill_weight = c.prefill_weight;
    RouteDecision d;
    const std::vector<Candidate> ws = Make(c.workers);
    ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
    EXPECT_EQ(d.prefill, c.want_p);
    EXPECT_EQ(d.decode, c.want_d);
    EXPECT_EQ(d.local_prefill, c.want_local);
    EXPECT_DOUBLE_EQ(d.cost, c.want_cost);
    EXPECT_EQ(d.prompt_blocks, 10u);
    EXPECT_EQ(d.transfer_blocks, c.want_local ? 0u : 10 - d.decode_overlap_blocks);
  }
}

TEST(ScoringTest, ErrorsWhenNoWorkerCanServe) {
  const struct {
    const char* name;
    std::vector<W> workers;
    StatusCode want;
  } kCases[] = {
      {"no prefiller", {{0, D}}, StatusCode::kUnavailable},
      {"no decoder", {{0, P}}, StatusCode::kUnavailable},
      {"no decoder has room", {{0, P}, {1, D, 0, 0, 0, 9}, {2, D, 2, 0, 0, 7}}, StatusCode::kResourceExhausted},
      {"both worker full", {{0, B, 0, 0, 0, 3}}, StatusCode::kResourceExhausted},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    RouteDecision d;
    const std::vector<Candidate> ws = Make(c.workers);
    EXPECT_EQ(Score(ws, 160, f.params, &f.state, &d).code(), c.want);
  }
}

// A 200-block prompt fully cached on worker 0, whose prefill queue is
// `hot_queue_blocks`; workers 1-3 have 10 queued blocks each.
TEST(ScoringTest, HotPrefixGuard) {
  const struct {
    const char* name;
    int64_t hot_queue_blocks;
    double threshold;
    double min_load_blocks;
    bool want_guard;
    WorkerId want_p;
  } kCases[] = {
      {"cold cache owner keeps it", 20, 1.0, 64, false, 0},
      {"over 2x the mean: load wins", 100, 1.0, 64, true, 1},
      {"over 2x the mean but under the floor", 60, 1.0, 64, false, 0},
      {"higher threshold tolerates it", 100, 3.0, 64, false, 0},
      {"zero floor, zero threshold", 11, 0.0, 0, true, 1},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    f.options.hot_prefix_threshold = c.threshold;
    f.options.hot_prefix_min_load_blocks = c.min_load_blocks;
    const std::vector<Candidate> ws = Make({{0, P, 200, c.hot_queue_blocks * 16},
                                            {1, P, 0, 160},
                                            {2, P, 0, 160},
                                            {3, P, 0, 160},
                                            {4, D, 0, 0, 0, 100000}});
    RouteDecision d;
    ASSERT_TRUE(Score(ws, 200 * 16, f.params, &f.state, &d).ok());
    EXPECT_EQ(d.hot_prefix_prefill, c.want_guard);
    EXPECT_EQ(d.prefill, c.want_p);
    EXPECT_EQ(d.prefill_overlap_blocks, c.want_p == 0 ? 200u : 0u);
  }
}

// Prompt of 160 tokens; the decoder caches `decoder_overlap` blocks.
TEST(ScoringTest, ConditionalDisaggregation) {
  const struct {
    const char* name;
    uint32_t threshold_tokens;
    uint32_t decoder_overlap;
    bool want_local;
  } kCases[] = {
      {"off", 0, 9, false},
      {"short uncached tail", 64, 8, true},  // 32 tokens uncached
      {"tail at the threshold", 64, 6, false},  // 64 tokens uncached
      {"nothing cached, short prompt threshold", 200, 0, true},
      {"nothing cached", 64, 0, false},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    f.params.local_prefill_threshold_tokens = c.threshold_tokens;
    const std::vector<Candidate> ws = Make({{0, P, 0}, {1, D, c.decoder_overlap}});
    RouteDecision d;
    ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
    EXPECT_EQ(d.decode, 1u);
    EXPECT_EQ(d.local_prefill, c.want_local);
    EXPECT_EQ(d.conditional_local, c.want_local);
    EXPECT_EQ(d.prefill, c.want_local ? 1u : 0u);
    EXPECT_EQ(d.transfer_blocks, c.want_local ? 0u : 10 - c.decoder_overlap);
    EXPECT_EQ(d.transfer_cost, 0.0);
  }
}

// Prefiller 0 is idle on node 0; prefiller 1 has 5 queued blocks on node 1
// with the decoder. 10 blocks of 2 MiB move to the decoder.
TEST(ScoringTest, TopologyPrefersSameNodeWhenTheLinkIsSlow) {
  const double kBytes = 10.0 * 2 * 1024 * 1024;
  const struct {
    const char* name;
    double cross_node_bw;
    double cross_zone_bw;
    uint32_t p0_zone;
    WorkerId want_p;
  } kCases[] = {
      {"slow inter-node link: same node wins", 1.25e9, 0.5e9, 0, 1},
      {"fast inter-node link: idle remote wins", 50e9, 0.5e9, 0, 0},
      {"fast link but other zone: same node wins", 50e9, 0.5e9, 1, 1},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    f.options.cross_node_bandwidth_bytes_per_s = c.cross_node_bw;
    f.options.cross_zone_bandwidth_bytes_per_s = c.cross_zone_bw;
    const std::vector<Candidate> ws =
        Make({{0, P, 0, 0, 0, 1000, 0, 0, c.p0_zone}, {1, P, 0, 80, 0, 1000, 0, 1, 0}, {2, D, 0, 0, 0, 1000, 0, 1, 0}},
             2 * 1024 * 1024);
    RouteDecision d;
    ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
    EXPECT_EQ(d.prefill, c.want_p);
    const double bw = c.want_p == 1 ? f.options.same_node_bandwidth_bytes_per_s
                                    : (c.p0_zone == 0 ? c.cross_node_bw : c.cross_zone_bw);
    EXPECT_NEAR(d.transfer_cost, kBytes / bw * 1e3, 1e-9);
  }
}

// With temperature T the pair is drawn with probability ~ exp(-cost/T).
TEST(ScoringTest, TemperatureSamplesSoftmaxOfCosts) {
  const struct {
    const char* name;
    double temperature;
    std::vector<int64_t> queued_blocks;  // prefillers 0..n-1; the decoder is id 9
  } kCases[] = {
      {"two, T=2", 2.0, {0, 2}},
      {"three, T=1", 1.0, {0, 1, 3}},
      {"three, T=100 is near uniform", 100.0, {0, 1, 3}},
  };
  constexpr int kDraws = 4000;
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    f.params.temperature = c.temperature;
    std::vector<W> ws;
    for (size_t i = 0; i < c.queued_blocks.size(); ++i) ws.push_back({WorkerId(i), P, 0, c.queued_blocks[i] * 16});
    ws.push_back({9, D});
    const std::vector<Candidate> cands = Make(ws);
    std::vector<int> counts(c.queued_blocks.size(), 0);
    RouteDecision d;
    for (int i = 0; i < kDraws; ++i) {
      ASSERT_TRUE(Score(cands, 160, f.params, &f.state, &d).ok());
      ASSERT_LT(d.prefill, counts.size());
      ++counts[d.prefill];
    }
    double z = 0;
    for (int64_t q : c.queued_blocks) z += std::exp(-static_cast<double>(q) / c.temperature);
    for (size_t i = 0; i < counts.size(); ++i) {
      const double p = std::exp(-static_cast<double>(c.queued_blocks[i]) / c.temperature) / z;
      const double sigma = std::sqrt(kDraws * p * (1 - p));
      EXPECT_NEAR(counts[i], kDraws * p, 5 * sigma + 1) << "prefiller " << i;
    }
  }
  // Seeded: the same seed draws the same sequence.
  Fixture a, b;
  a.params.temperature = b.params.temperature = 1.0;
  const std::vector<Candidate> cands = Make({{0, P}, {1, P, 0, 16}, {2, D}});
  RouteDecision da, db;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(Score(cands, 160, a.params, &a.state, &da).ok());
    ASSERT_TRUE(Score(cands, 160, b.params, &b.state, &db).ok());
    ASSERT_EQ(da.prefill, db.prefill);
  }
}

TEST(ScoringTest, ComparisonPolicies) {
  const std::vector<Candidate> ws =
      Make({{0, P, 9, 64}, {1, P, 0, 32}, {2, P, 0, 48}, {3, D, 0, 0, 40}, {4, D, 9, 0, 20}, {5, D, 0, 0, 0, 1}});
  {
    Fixture f;
    f.params.policy = Policy::kLeastLoaded;
    RouteDecision d;
    ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
    EXPECT_EQ(d.prefill, 1u);  // shortest queue, cache ignored
    EXPECT_EQ(d.decode, 4u);   // fewest active blocks among those with room
  }
  {
    Fixture f;
    f.params.policy = Policy::kRoundRobin;
    const WorkerId kWantP[] = {0, 1, 2, 0, 1, 2}, kWantD[] = {3, 4, 3, 4, 3, 4};
    for (int i = 0; i < 6; ++i) {
      RouteDecision d;
      ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
      EXPECT_EQ(d.prefill, kWantP[i]) << i;
      EXPECT_EQ(d.decode, kWantD[i]) << i;  // 5 has no room
    }
  }
  {
    Fixture f;
    f.params.policy = Policy::kRandom;
    std::vector<int> pc(6, 0), dc(6, 0);
    for (int i = 0; i < 600; ++i) {
      RouteDecision d;
      ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
      ++pc[d.prefill];
      ++dc[d.decode];
    }
    for (int p : {0, 1, 2}) EXPECT_GT(pc[p], 120) << p;
    for (int d : {3, 4}) EXPECT_GT(dc[d], 200) << d;
    EXPECT_EQ(dc[5], 0);
  }
}

// Decode seats (docs/router.md): a decoder in a higher seat round is left
// out while one in the lowest has room, whatever its KV cost; a decoder no
// prefiller can serve (an incompatible rank layout) sets no round; seats 0
// (unknown) is round 0.
TEST(ScoringTest, DecodersInAHigherSeatRoundAreLeftOut) {
  Fixture f;
  auto seats = [](std::vector<Candidate> ws, std::vector<std::pair<uint32_t, int64_t>> seats_demand) {
    for (size_t i = 0; i < ws.size(); ++i) {
      ws[i].decode_seats = seats_demand[i].first;
      ws[i].load.seat_demand = seats_demand[i].second;
    }
    return ws;
  };
  RouteDecision d;
  // d2 caches 8 of the 10 blocks, but its 8 seats are spoken for.
  auto ws = seats(Make({{0, P}, {2, D, 8}, {3, D}}), {{0, 0}, {8, 8}, {128, 127}});
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 3u);
  EXPECT_EQ(d.seat_deferred, 1u);
  EXPECT_TRUE(d.decode_scores[0].no_room);  // by id: 2 first
  // Both past their seats: the lower round wins (16/8 = 2 against 130/128 = 1).
  ws = seats(Make({{0, P}, {2, D, 8}, {3, D}}), {{0, 0}, {8, 16}, {128, 130}});
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 3u);
  // Same round: cost decides (the cache).
  ws = seats(Make({{0, P}, {2, D, 8}, {3, D}}), {{0, 0}, {8, 9}, {128, 200}});
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 2u);
  EXPECT_EQ(d.seat_deferred, 0u);
  // Seats unknown on d2: round 0, so d3 (round 1) is left out.
  ws = seats(Make({{0, P}, {2, D}, {3, D}}), {{0, 0}, {0, 500}, {128, 128}});
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 2u);
  // d2 has a free seat but no prefiller's layout reaches it: it does not
  // leave d3 out, and the request is routed rather than refused.
  ws = seats(Make({{0, P}, {2, D}, {3, D}}), {{0, 0}, {8, 0}, {8, 8}});
  ws[1].layout_id = 1;  // layout 0 (p, d3) reaches only layout 0
  const uint64_t compat[2] = {0b01, 0b10};
  f.params.layout_compat = compat;
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 3u);
  EXPECT_EQ(d.seat_deferred, 0u);
  // Other policies ignore seats.
  f.params.layout_compat = nullptr;
  f.params.policy = Policy::kLeastLoaded;
  ws = seats(Make({{0, P}, {2, D}, {3, D, 0, 0, 50}}), {{0, 0}, {8, 8}, {128, 0}});
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  EXPECT_EQ(d.decode, 2u);
  EXPECT_EQ(d.seat_deferred, 0u);
}

TEST(ScoringTest, DecisionRecordsEveryCandidate) {
  Fixture f;
  const std::vector<Candidate> ws = Make({{0, P, 4}, {1, P, 0}, {2, D, 0, 0, 0, 1}, {3, D, 2, 0, 7}});
  RouteDecision d;
  ASSERT_TRUE(Score(ws, 160, f.params, &f.state, &d).ok());
  ASSERT_EQ(d.prefill_scores.size(), 2u);
  ASSERT_EQ(d.decode_scores.size(), 2u);
  EXPECT_EQ(d.prefill_scores[0].worker, 0u);
  EXPECT_DOUBLE_EQ(d.prefill_scores[0].cost, 6);
  EXPECT_EQ(d.prefill_scores[0].overlap_blocks, 4u);
  EXPECT_DOUBLE_EQ(d.prefill_scores[1].cost, 10);
  EXPECT_TRUE(d.decode_scores[0].no_room);
  EXPECT_DOUBLE_EQ(d.decode_scores[1].cost, 15);
  const std::string s = d.DebugString();
  EXPECT_NE(s.find("policy=kv_aware p=0 d=3 local=0"), std::string::npos) << s;
  EXPECT_NE(s.find("|P 0:6.00/4 1:10.00/0 |D 2:full/0 3:15.00/2"), std::string::npos) << s;
  EXPECT_EQ(s.find('\n'), std::string::npos);
}

}  // namespace
}  // namespace tandem::router
