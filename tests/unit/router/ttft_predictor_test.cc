// TTFT prediction (router/ttft_predictor.h) and its use in the router's
// choice: measured prefill rates, the formula, the SLO filter.
#include "router/ttft_predictor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <vector>

#include "router/router.h"

namespace tandem::router {
namespace {

TEST(PrefillRateTest, MeasuresDeltasBetweenReports) {
  PrefillRate r;
  EXPECT_EQ(r.tokens_per_s(), 0);  // unknown until two reports with prefill work between
  r.Update(5000, 1.0);             // the first report is the base only
  EXPECT_EQ(r.tokens_per_s(), 0);
  r.Update(6000, 1.1);  // 1000 tokens in 0.1 s of prefill steps
  EXPECT_NEAR(r.tokens_per_s(), 10000, 1e-6);
  r.Update(6100, 1.105);  // under kMinWindowSeconds: waits for a longer window
  EXPECT_NEAR(r.tokens_per_s(), 10000, 1e-6);
  r.Update(8000, 1.2);  // 2000 tokens in 0.1 s since the base (6000, 1.1)
  const double avg = (1 - PrefillRate::kAlpha) * 10000 + PrefillRate::kAlpha * 20000;
  EXPECT_NEAR(r.tokens_per_s(), avg, 1e-6);
  r.Update(8000, 1.2);  // idle: no prefill seconds, nothing changes
  EXPECT_NEAR(r.tokens_per_s(), avg, 1e-6);
  r.Update(10, 0.001);  // totals went back: a restarted worker, measured anew
  EXPECT_EQ(r.tokens_per_s(), 0);
  r.Update(2010, 0.201);
  EXPECT_NEAR(r.tokens_per_s(), 10000, 1e-6);
}

// A worker that reports its attention pairs and their cost: the work rate
// (tokens + cost x pairs per second) is measured beside the tokens' rate.
TEST(PrefillRateTest, AttentionPairsGiveTheWorkRate) {
  PrefillRate r;
  r.Update(5000, 1.0, 2'000'000, 1e-3);  // base
  EXPECT_EQ(r.speed().work_per_s, 0);
  r.Update(6000, 1.1, 2'500'000, 1e-3);  // 1000 tokens, 500k pairs in 0.1 s
  const PrefillSpeed s = r.speed();
  EXPECT_NEAR(s.tokens_per_s, 10000, 1e-6);
  EXPECT_NEAR(s.work_per_s, (1000 + 1e-3 * 500'000) / 0.1, 1e-6);
  EXPECT_EQ(s.pair_cost, 1e-3);
  // An older worker reports no cost: tokens only.
  PrefillRate old;
  old.Update(5000, 1.0);
  old.Update(6000, 1.1);
  EXPECT_NEAR(old.speed().tokens_per_s, 10000, 1e-6);
  EXPECT_EQ(old.speed().work_per_s, 0);
  EXPECT_EQ(old.speed().pair_cost, 0);
}

TEST(SeatTurnoverTest, LittlesLawOverTheWindowsBetweenReports) {
  SeatTurnover t;
  EXPECT_EQ(t.hold_seconds(), 0);  // unknown until a window with releases
  t.Update(10, 5.0);               // the first report is the base only
  EXPECT_EQ(t.hold_seconds(), 0);
  t.Update(12, 7.0);  // 2 releases: under kMinReleases, the window grows
  EXPECT_EQ(t.hold_seconds(), 0);
  t.Update(18, 17.0);  // 8 releases over 12 seat-seconds since (10, 5.0)
  EXPECT_NEAR(t.hold_seconds(), 1.5, 1e-9);
  t.Update(18, 20.0);  // seats held, none given back: the window grows
  EXPECT_NEAR(t.hold_seconds(), 1.5, 1e-9);
  t.Update(22, 22.0);  // 4 releases over 5 seat-seconds since (18, 17.0)
  EXPECT_NEAR(t.hold_seconds(), (1 - SeatTurnover::kAlpha) * 1.5 + SeatTurnover::kAlpha * 1.25, 1e-9);
  t.Update(3, 0.5);  // totals went back: a restarted decoder, measured anew
  EXPECT_EQ(t.hold_seconds(), 0);
  t.Update(7, 2.5);
  EXPECT_NEAR(t.hold_seconds(), 0.5, 1e-9);
}

Candidate Prefiller(WorkerId id, int64_t queued_tokens, uint32_t overlap = 0) {
  Candidate c;
  c.id = id;
  c.role = WorkerRole::kPrefill;
  c.load.queued_prefill_tokens = queued_tokens;
  c.overlap_blocks = overlap;
  return c;
}

// A long prompt's own prefill counts its attention (the pairs of its
// uncached tokens, at the work rate); the queue ahead stays at tokens/s.
TEST(TtftPredictorTest, ALongPromptsAttentionCountsAtTheWorkRate) {
  PrefillSpeed speed(10000);
  speed.work_per_s = 15000;
  speed.pair_cost = 1e-4;
  const TtftInputs in{4096, 256, 16};
  const Candidate p = Prefiller(0, 3000);
  const double pairs = 4096.0 * 4097 / 2;
  ASSERT_TRUE(PrefillSideMs(p, speed, in).has_value());
  EXPECT_NEAR(*PrefillSideMs(p, speed, in), 3000.0 / 10000 * 1e3 + (4096 + 1e-4 * pairs) / 15000 * 1e3,
              1e-9);
  // Half of it cached: only the pairs of tokens 2048..4095.
  const Candidate half = Prefiller(0, 0, 128);
  const double rest = (4096.0 * 4097 - 2048.0 * 2049) / 2;
  EXPECT_NEAR(*PrefillSideMs(half, speed, in), (2048 + 1e-4 * rest) / 15000 * 1e3, 1e-9);
  // The cost reported but the work rate not measured yet: tokens only.
  PrefillSpeed early(10000);
  early.pair_cost = 1e-4;
  EXPECT_NEAR(*PrefillSideMs(p, early, in), (3000.0 + 4096) / 10000 * 1e3, 1e-9);
  // An older worker (no cost): as before, tokens over tokens/s.
  EXPECT_NEAR(*PrefillSideMs(p, PrefillSpeed(10000), in), (3000.0 + 4096) / 10000 * 1e3, 1e-9);
}

TEST(TtftPredictorTest, QueueAheadPlusOwnUncachedTokensOverTheRate) {
  const TtftInputs in{1000, 63, 16};
  // 3000 tokens ahead, 16 of its 63 blocks cached: 1000 - 256 = 744 of its own.
  Candidate p = Prefiller(0, 3000, 16);
  ASSERT_TRUE(PrefillSideMs(p, 10000, in).has_value());
  EXPECT_DOUBLE_EQ(*PrefillSideMs(p, 10000, in), (3000.0 + 744.0) / 10000 * 1e3);
  EXPECT_FALSE(PrefillSideMs(p, 0, in).has_value());  // rate not measured: unknown
  // 4 more blocks in the host tier at onboarding cost 0.1: 4 x 0.1 blocks of work.
  p.tier_blocks = 4;
  p.tier_credit_blocks = 4 * 0.9;
  EXPECT_NEAR(*PrefillSideMs(p, 10000, in), (3000.0 + (1000 - 20 * 16) + 0.4 * 16) / 10000 * 1e3, 1e-9);
}

TEST(TtftPredictorTest, TransferOfTheBlocksTheDecoderLacksOverTheLink) {
  RouterOptions o;
  o.same_node_bandwidth_bytes_per_s = 1e9;
  o.cross_node_bandwidth_bytes_per_s = 1e8;
  const TtftInputs in{1000, 63, 16};
  Candidate p = Prefiller(0, 0);
  Candidate d;
  d.id = 1;
  d.role = WorkerRole::kDecode;
  d.block_bytes = 1 << 20;
  d.overlap_blocks = 3;  // 60 blocks to move
  EXPECT_DOUBLE_EQ(TransferMs(p, d, in, o), 60.0 * (1 << 20) / 1e9 * 1e3);
  d.node_id = 1;  // another node
  EXPECT_DOUBLE_EQ(TransferMs(p, d, in, o), 60.0 * (1 << 20) / 1e8 * 1e3);
  EXPECT_EQ(TransferMs(d, d, in, o), 0);  // local prefill: nothing moves
}

TEST(TtftPredictorTest, PerPrefillerTakesTheFastestLinkAndSkipsUnknownRates) {
  RouterOptions o;
  o.same_node_bandwidth_bytes_per_s = 1e9;
  o.cross_node_bandwidth_bytes_per_s = 1e8;
  const TtftInputs in{160, 10, 16};
  std::vector<Candidate> c = {Prefiller(0, 0), Prefiller(1, 1600), Prefiller(2, 0)};
  Candidate d;
  d.id = 3;
  d.role = WorkerRole::kDecode;
  d.block_bytes = 1000000;
  d.node_id = 1;  // only worker 1 shares its node
  c[1].node_id = 1;
  c.push_back(d);
  std::vector<PrefillSpeed> rates = {1600, 1600, 0, 0};
  std::vector<std::optional<double>> ms(c.size());
  PredictPerPrefiller(c, rates, {}, in, o, ms);
  ASSERT_TRUE(ms[0] && ms[1]);
  EXPECT_DOUBLE_EQ(*ms[0], 100 + 10 * 1e6 / 1e8 * 1e3);         // 160 tokens at 1600/s + cross-node
  EXPECT_DOUBLE_EQ(*ms[1], 1000 + 100 + 10 * 1e6 / 1e9 * 1e3);  // 1600 ahead + same node
  EXPECT_FALSE(ms[2]);  // no rate yet
  EXPECT_FALSE(ms[3]);  // a decoder does not prefill
}

// Issue 18: a decoder whose rank layout the prefiller cannot reach is no
// pair, however fast its link.
TEST(TtftPredictorTest, PerPrefillerSkipsDecodersOfIncompatibleLayouts) {
  RouterOptions o;
  o.same_node_bandwidth_bytes_per_s = 1e9;
  o.cross_node_bandwidth_bytes_per_s = 1e8;
  const TtftInputs in{160, 10, 16};
  std::vector<Candidate> c = {Prefiller(0, 0)};
  for (WorkerId id : {1u, 2u}) {
    Candidate d;
    d.id = id;
    d.role = WorkerRole::kDecode;
    d.block_bytes = 1000000;
    c.push_back(d);
  }
  c[1].layout_id = 1;  // same node as the prefiller, layout 1: unreachable
  c[2].node_id = 1;    // another node, layout 0
  const uint64_t compat[2] = {0b01, 0b10};  // each layout reaches only itself
  std::vector<PrefillSpeed> rates = {1600, 0, 0};
  std::vector<std::optional<double>> ms(c.size());
  PredictPerPrefiller(c, rates, {}, in, o, ms, compat);
  ASSERT_TRUE(ms[0]);
  EXPECT_DOUBLE_EQ(*ms[0], 100 + 10 * 1e6 / 1e8 * 1e3);  // the cross-node decoder's link
  PredictPerPrefiller(c, rates, {}, in, o, ms);           // no table: every pair
  EXPECT_DOUBLE_EQ(*ms[0], 100 + 10 * 1e6 / 1e9 * 1e3);
}

Candidate Decoder(WorkerId id, uint32_t seats, int64_t seat_demand) {
  Candidate d;
  d.id = id;
  d.role = WorkerRole::kDecode;
  d.decode_seats = seats;
  d.load.seat_demand = seat_demand;
  return d;
}

TEST(TtftPredictorTest, SeatWaitIsTheReleasesAheadOverTheTurnover) {
  // 8 seats, each held 2 s on average: a seat frees every 0.25 s when full.
  EXPECT_EQ(SeatWaitMs(Decoder(1, 8, 7), 2.0), 0);  // a seat is free
  EXPECT_DOUBLE_EQ(SeatWaitMs(Decoder(1, 8, 8), 2.0), 250);   // first in line
  EXPECT_DOUBLE_EQ(SeatWaitMs(Decoder(1, 8, 19), 2.0), 3000);  // 12th in line
  EXPECT_EQ(SeatWaitMs(Decoder(1, 8, 19), 0), 0);  // turnover not measured: admitted as if free
  EXPECT_EQ(SeatWaitMs(Decoder(1, 0, 19), 2.0), 0);  // seats unknown (an older decoder)
}

// A decoder holding `in_use` blocks for `running` requests, `free` free.
Candidate FullDecoder(int64_t free, int64_t in_use, int64_t running) {
  Candidate d = Decoder(1, 0, running);
  d.load.free_known = true;
  d.load.free_blocks = free;
  d.load.active_decode_blocks = in_use;
  d.load.running_requests = running;
  return d;
}

TEST(TtftPredictorTest, KvWaitIsTheRequestEndsThatFreeTheBlocksOverTheTurnover) {
  // 4 requests hold 80 blocks (20 each) and 2 s each: one ends every 0.5 s.
  const TtftInputs in{640, 40, 16};  // 40 blocks
  EXPECT_EQ(KvWaitMs(FullDecoder(40, 80, 4), 2.0, in), 0);    // they are free
  EXPECT_DOUBLE_EQ(KvWaitMs(FullDecoder(39, 80, 4), 2.0, in), 500);  // 1 short: one end
  EXPECT_DOUBLE_EQ(KvWaitMs(FullDecoder(0, 80, 4), 2.0, in), 1000);  // 40 short: two ends
  EXPECT_DOUBLE_EQ(KvWaitMs(FullDecoder(-5, 80, 4), 2.0, in), 1500);  // routes since the report took 5 more
  // Blocks the decoder caches are not allocated again: 30 to find, 10 free.
  Candidate cached = FullDecoder(10, 80, 4);
  cached.overlap_blocks = 10;
  EXPECT_DOUBLE_EQ(KvWaitMs(cached, 2.0, in), 500);
  // Reservations hold blocks as running requests do: 8 holders of 10
  // blocks, one ending every 0.25 s; 30 short: three ends.
  Candidate reserved = FullDecoder(10, 80, 4);
  reserved.load.reservations = 4;
  EXPECT_DOUBLE_EQ(KvWaitMs(reserved, 2.0, in), 750);
  // Two requests registered that hold nothing yet go first: 40 blocks
  // more to free (20 each), 30 + 40 short: four ends.
  Candidate line = FullDecoder(10, 80, 4);
  line.load.pending_reserves = 2;
  EXPECT_DOUBLE_EQ(KvWaitMs(line, 2.0, in), 2000);
  // ... and make a request wait that the free blocks alone would hold.
  Candidate roomy = FullDecoder(50, 80, 4);
  roomy.load.pending_reserves = 1;
  EXPECT_DOUBLE_EQ(KvWaitMs(roomy, 2.0, in), 500);  // 40 + 20 - 50 = 10 short
  // The decoder's growth reserve keeps blocks free that the prompt cannot
  // take (docs/engine.md, "Growth reserve"): 40 free hold the prompt, but
  // with 25 kept free 25 are short: two ends.
  Candidate growing = FullDecoder(40, 80, 4);
  growing.load.growth_reserve_blocks = 25;
  EXPECT_DOUBLE_EQ(KvWaitMs(growing, 2.0, in), 1000);
  growing.load.growth_reserve_blocks = 0;
  EXPECT_EQ(KvWaitMs(growing, 2.0, in), 0);
  // ... and the request's own share (session 27): at the decoder's ratio
  // 0.5, a request that may generate 385 tokens keeps ceil(0.5 x 384 / 16)
  // = 12 more free (its KV ends at 640 + 384 tokens, its prompt fills 40
  // blocks): 12 short, one end. Its max_tokens unknown or the reserve off: none.
  growing.load.growth_ratio = 0.5;
  const TtftInputs generating{640, 40, 16, 385};
  EXPECT_EQ(OwnGrowthBlocks(0.5, 640, 385, 16), 12);
  EXPECT_DOUBLE_EQ(KvWaitMs(growing, 2.0, generating), 500);
  EXPECT_EQ(KvWaitMs(growing, 2.0, in), 0);
  growing.load.growth_ratio = 0;
  EXPECT_EQ(KvWaitMs(growing, 2.0, generating), 0);
  EXPECT_EQ(KvWaitMs(FullDecoder(0, 80, 4), 0, in), 0);  // turnover not measured: admitted as if free
  Candidate unknown = FullDecoder(0, 80, 4);
  unknown.load.free_known = false;  // no report and no pool size
  EXPECT_EQ(KvWaitMs(unknown, 2.0, in), 0);
}

TEST(TtftPredictorTest, APairWaitsForTheLongerOfItsQueueAndItsSeat) {
  RouterOptions o;
  o.same_node_bandwidth_bytes_per_s = 1e9;
  const TtftInputs in{160, 10, 16};
  Candidate p = Prefiller(0, 800);  // 500 ms ahead at 1600 tokens/s, its own 100 ms
  Candidate d = Decoder(1, 4, 5);   // 2nd in line, holds of 0.4 s: 200 ms
  d.block_bytes = 1000000;
  const double move = 10 * 1e6 / 1e9 * 1e3;
  ASSERT_TRUE(PairTtftMs(p, d, 1600, 0.4, in, o).has_value());
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, d, 1600, 0.4, in, o), 500 + 100 + move);  // the queue is longer
  d.load.seat_demand = 13;  // 10th in line: 1000 ms
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, d, 1600, 0.4, in, o), 1000 + 100 + move);
  EXPECT_FALSE(PairTtftMs(p, d, 0, 0.4, in, o).has_value());  // p's rate unknown

  // Per prefiller, the pair with the shortest total: a free seat across
  // nodes beats a saturated decoder on the prefiller's own node.
  Candidate far = Decoder(2, 4, 3);
  far.block_bytes = 1000000;
  far.node_id = 1;
  o.cross_node_bandwidth_bytes_per_s = 1e8;
  std::vector<Candidate> c = {p, d, far};
  std::vector<PrefillSpeed> rates = {1600, 0, 0};
  std::vector<double> holds = {0, 0.4, 0.4};
  std::vector<std::optional<double>> ms(c.size());
  PredictPerPrefiller(c, rates, holds, in, o, ms);
  ASSERT_TRUE(ms[0]);
  EXPECT_DOUBLE_EQ(*ms[0], 500 + 100 + 10 * 1e6 / 1e8 * 1e3);
  // Without the turnover measured, the saturated near one looks free.
  PredictPerPrefiller(c, rates, {}, in, o, ms);
  EXPECT_DOUBLE_EQ(*ms[0], 500 + 100 + move);

  // Seats free but KV blocks short: 2 requests hold 40 blocks for 0.4 s
  // each, 2 free; the prompt's 10 blocks need one to end (every 0.2 s),
  // under the queue's 500 ms. Two ends: 0.4 s; with 6 waiting for a
  // seat too, the longer wait (its seat: 1000 ms) counts, not both.
  Candidate full = Decoder(1, 4, 2);
  full.block_bytes = 1000000;
  full.load.free_known = true;
  full.load.free_blocks = 2;
  full.load.active_decode_blocks = 40;
  full.load.running_requests = 2;
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, full, 1600, 0.4, in, o), 500 + 100 + move);
  p.load.queued_prefill_tokens = 0;
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, full, 1600, 0.4, in, o), 200 + 100 + move);
  full.load.free_blocks = -12;  // 22 short: two ends
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, full, 1600, 0.4, in, o), 400 + 100 + move);
  full.load.seat_demand = 13;
  EXPECT_DOUBLE_EQ(*PairTtftMs(p, full, 1600, 0.4, in, o), 1000 + 100 + move);
  // A local prefill waits for nothing on the decoder side (its own pool
  // is the prefill's).
  full.role = WorkerRole::kBoth;
  full.id = 0;
  EXPECT_DOUBLE_EQ(*PairTtftMs(full, full, 1600, 0.4, in, o), 100);
}

// A router on a fake clock with measured rates.
struct SloFleet {
  std::shared_ptr<std::atomic<int64_t>> now = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  std::unique_ptr<Router> router;
  SloFleet() {
    RouterOptions o;
    o.clock = [clock = now] { return clock->load(); };
    router = Router::Create({}, std::move(o)).value();
  }
  WorkerId Add(const std::string& name, WorkerRole role) {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.epoch = 1;
    info.num_blocks = 100000;
    return router->AddWorker(info).value();
  }
  // A decoder of `num_blocks` KV blocks and `seats` decode seats.
  WorkerId AddDecoder(const std::string& name, uint32_t num_blocks, uint32_t seats) {
    WorkerInfo info;
    info.name = name;
    info.role = WorkerRole::kDecode;
    info.epoch = 1;
    info.num_blocks = num_blocks;
    info.decode_seats = seats;
    return router->AddWorker(info).value();
  }
  // Two reports 0.1 s of prefill apart: `tokens_per_s` measured.
  void Measure(WorkerId w, double tokens_per_s) {
    LoadReport r;
    r.free_blocks = 100000;
    ASSERT_TRUE(router->ApplyLoadReport(w, r).ok());
    r.prefill_tokens_total = static_cast<uint64_t>(tokens_per_s / 10);
    r.prefill_seconds_total = 0.1;
    ASSERT_TRUE(router->ApplyLoadReport(w, r).ok());
    ASSERT_NEAR(router->prefill_rate(w), tokens_per_s, 1e-6 * tokens_per_s);
  }
};

std::vector<uint64_t> Chain(uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = (i + 1) * 0x9E3779B97F4A7C15ull;
  return v;
}

TEST(TtftRoutingTest, SloSteersAwayFromACachedButSlowPrefiller) {
  SloFleet f;
  const WorkerId slow = f.Add("p-slow", WorkerRole::kPrefill);
  const WorkerId fast = f.Add("p-fast", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  f.Measure(slow, 1000);
  f.Measure(fast, 100000);
  const std::vector<uint64_t> h = Chain(64);  // 1024 tokens
  ASSERT_TRUE(f.router->ApplyEvent(slow, {KvEventKind::kStored, 1, 1, 0, std::span(h).first(32)}).ok());

  // Without an SLO the cache wins: half the prompt is cached on the slow one.
  RouteDecision d;
  ASSERT_TRUE(f.router->Route({h, 1024}, &d).ok());
  EXPECT_EQ(d.prefill, slow);
  EXPECT_DOUBLE_EQ(d.predicted_ttft_ms, 512.0 / 1000 * 1e3);
  EXPECT_EQ(d.slo_excluded, 0u);
  f.router->EndPrefill(d.prefill_ticket);

  // With a 100 ms SLO the slow one (512 ms predicted) is left out.
  RouteRequest req{h, 1024, 100.0};
  ASSERT_TRUE(f.router->Route(req, &d).ok());
  EXPECT_EQ(d.prefill, fast);
  EXPECT_NEAR(d.predicted_ttft_ms, 1024.0 / 100000 * 1e3, 1e-9);
  EXPECT_EQ(d.slo_excluded, 1u);
  EXPECT_EQ(f.router->counters().slo_steered, 1u);
  f.router->EndPrefill(d.prefill_ticket);

  // An SLO nobody meets changes nothing in the choice (admission decides).
  req.ttft_slo_ms = 1;
  ASSERT_TRUE(f.router->Route(req, &d).ok());
  EXPECT_EQ(d.prefill, slow);
  EXPECT_EQ(d.slo_excluded, 0u);
}

TEST(TtftRoutingTest, PredictionCountsTheRoutedQueueAndIsUnknownUntilMeasured) {
  SloFleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const std::vector<uint64_t> h = Chain(10);
  EXPECT_FALSE(f.router->PredictTtftMs({h, 160}).has_value());  // no rate yet
  f.Measure(p, 1600);
  ASSERT_TRUE(f.router->PredictTtftMs({h, 160}).has_value());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);
  // Three requests routed and not finished: 480 tokens ahead of the next.
  std::vector<RouteDecision> routed(3);
  for (int i = 0; i < 3; ++i) {
    const std::vector<uint64_t> other = {uint64_t(1000 + i)};
    ASSERT_TRUE(f.router->Route({other, 160}, &routed[i]).ok());
  }
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 400);
  f.router->EndPrefill(routed[0].prefill_ticket);  // one prefill done: it leaves the queue
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 300);
  // A second prefiller not measured yet: it may be fast, so no prediction.
  f.Add("p2", WorkerRole::kPrefill);
  EXPECT_FALSE(f.router->PredictTtftMs({h, 160}).has_value());
}

// The seat wait reaches the router's prediction (and so SLO admission)
// from the decoder's load reports: its seats, the requests registered
// there and its measured seat turnover.
TEST(TtftRoutingTest, ASaturatedDecoderAddsItsSeatWaitToThePrediction) {
  SloFleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  const WorkerId d = f.AddDecoder("d", 100000, 4);
  f.Measure(p, 1600);
  const std::vector<uint64_t> h = Chain(10);
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);  // 160 tokens, nothing ahead
  // Saturated: 9 requests registered on 4 seats, turnover not measured yet.
  LoadReport r;
  r.free_blocks = 100000;
  r.registered_requests = 9;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);
  // Measured: 8 seats given back over 4 seat-seconds, a hold of 0.5 s.
  r.seats_released_total = 8;
  r.seat_seconds_total = 4.0;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  // 6th in line (9 - 4 + 1), a seat every 0.125 s: 750 ms, then its prefill.
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 750 + 100);
  // The route counts on the decoder at once: the next request is 7th.
  RouteDecision dec;
  const std::vector<uint64_t> other = {77};
  ASSERT_TRUE(f.router->Route({other, 160}, &dec).ok());
  EXPECT_EQ(dec.decode, d);
  EXPECT_DOUBLE_EQ(dec.predicted_ttft_ms, 750 + 100);  // its own prediction, made before it counted
  EXPECT_NE(dec.DebugString().find(" ttft=850.0ms"), std::string::npos) << dec.DebugString();
  // (The routed prompt is 100 ms ahead on the prefiller: less than the seat.)
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 875 + 100);
}

// A decoder whose turnover is not measured yet (it joined, or restarted,
// and has given back fewer than four seats) is predicted at the mean hold
// of the decoders that are measured, not as if its seats were free.
TEST(TtftRoutingTest, AnUnmeasuredDecoderTakesTheFleetsMeanHold) {
  SloFleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  const WorkerId old_one = f.AddDecoder("d-old", 100000, 4);
  const WorkerId new_one = f.AddDecoder("d-new", 100000, 4);
  f.Measure(p, 1600);
  const std::vector<uint64_t> h = Chain(10);  // 160 tokens: 100 ms of prefill
  // d-old: a hold of 0.5 s measured, 40 registered on 4 seats (37th in line).
  LoadReport r;
  r.free_blocks = 100000;
  r.registered_requests = 40;
  ASSERT_TRUE(f.router->ApplyLoadReport(old_one, r).ok());
  r.seats_released_total = 8;
  r.seat_seconds_total = 4.0;
  ASSERT_TRUE(f.router->ApplyLoadReport(old_one, r).ok());
  // d-new: 9 registered on its 4 seats, nothing given back yet: 6th in line
  // at d-old's hold, 750 ms (before: as if free, 100 ms in all).
  LoadReport fresh;
  fresh.free_blocks = 100000;
  fresh.registered_requests = 9;
  ASSERT_TRUE(f.router->ApplyLoadReport(new_one, fresh).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 750 + 100);
  RouteDecision dec;
  ASSERT_TRUE(f.router->Route({h, 160}, &dec).ok());
  EXPECT_DOUBLE_EQ(dec.predicted_ttft_ms, 750 + 100);
  EXPECT_EQ(dec.decode, new_one);
  // Measured itself (a hold of 0.1 s): its own counts. 7th in line now
  // (the route above counts until a report does): 175 ms.
  fresh.seats_released_total = 10;
  fresh.seat_seconds_total = 1.0;
  ASSERT_TRUE(f.router->ApplyLoadReport(new_one, fresh).ok());
  f.router->EndPrefill(dec.prefill_ticket);
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 175 + 100);
}

// The KV-block wait reaches the prediction from the decoder's load reports
// (free and used blocks, requests running, reservations, requests
// registered) and its seat turnover; the router's own routes since the
// report count at once.
TEST(TtftRoutingTest, ADecoderShortOfKvBlocksAddsItsBlockWaitToThePrediction) {
  SloFleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  const WorkerId d = f.AddDecoder("d", 100, 64);  // seats are not what it runs short of
  f.Measure(p, 1600);
  const std::vector<uint64_t> h = Chain(10);  // 160 tokens, 10 blocks
  // 4 requests running with 23 blocks each, one reservation with 8: 8 free.
  LoadReport r;
  r.free_blocks = 8;
  r.active_decode_blocks = 92;
  r.running_requests = 4;
  r.num_reservations = 1;
  r.registered_requests = 5;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);  // turnover not measured yet
  r.seats_released_total = 8;
  r.seat_seconds_total = 4.0;  // a hold of 0.5 s: with 5 holders one ends every 0.1 s
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  // 2 blocks short of 10, 18.4 blocks per holder: one end, 100 ms.
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100 + 100);
  // Two more registered that hold nothing yet: 36.8 more to free, 3 ends.
  r.registered_requests = 7;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 300 + 100);
  r.registered_requests = 5;
  r.free_blocks = 12;  // room for it: no wait
  r.active_decode_blocks = 88;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);
  // Unless its growth reserve keeps 4 of them free (docs/engine.md,
  // "Growth reserve"): 2 short, one end.
  r.kv_growth_reserve_blocks = 4;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100 + 100);
  r.kv_growth_reserve_blocks = 0;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  // Nor the share it keeps for the request's own growth at its ratio
  // (session 27): 0.5 x the 96 tokens a request with max_tokens 97 may
  // write past its 10 blocks = 3 blocks, 1 short: one end. Without its
  // max_tokens, or the ratio not reported, no share.
  r.kv_growth_ratio = 0.5f;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160, 0, nullptr, 97}), 100 + 100);
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160, 0, nullptr, 65}), 100);  // 2: none short
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160}), 100);
  r.kv_growth_ratio = 0;
  ASSERT_TRUE(f.router->ApplyLoadReport(d, r).ok());
  EXPECT_DOUBLE_EQ(*f.router->PredictTtftMs({h, 160, 0, nullptr, 97}), 100);
  // A route to it takes 10 of the 12 at once, before a report says so (its
  // prefill done, so that the prefiller's queue is empty again): 8 short,
  // 98 blocks over 6 holders, one end, one every 0.5 / 6 s.
  RouteDecision dec;
  const std::vector<uint64_t> other = {77, 78, 79, 80, 81, 82, 83, 84, 85, 86};
  ASSERT_TRUE(f.router->Route({other, 160}, &dec).ok());
  EXPECT_EQ(dec.decode, d);
  f.router->EndPrefill(dec.prefill_ticket);
  EXPECT_NEAR(*f.router->PredictTtftMs({h, 160}), 500.0 / 6 + 100, 1e-9);
}

}  // namespace
}  // namespace tandem::router
