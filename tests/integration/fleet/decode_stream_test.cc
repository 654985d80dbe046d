// Issue 23: the multiplexed decoder -> proxy stream (Decoder.DecodeStream)
// on a real 1P1D fleet. 32 concurrent streams through one decoder arrive
// token-exact equal to `tandem generate`, a step's tokens travel together
// (fewer messages than items on the decoder's stream), and cancelling one
// request mid-stream neither disturbs the others nor leaves anything held.
// The stream travels over the decoder's framed TCP listener by default and
// over gRPC with proxy.decode_transport grpc, with the same outputs.
// With proxy.decode_stream off the proxy uses one Decode RPC per request
// (the decoder sends nothing on a DecodeStream) and the output is the same.
// Requests of one token end on the prefiller's reply with nothing sent on
// the stream (the quiet end). With 4 decode seats the same 32 streams wait for seats on the
// decoder; with a KV pool that holds a few of them at once, they wait for blocks (with the
// decoder's growth reserve on, the default, and off).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "stream_suite.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 24;

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(500 + i, 8 + (i * 13) % 90, kVocab); }

// 32 streams; stream 7 is cancelled after 3 messages.
const StreamSuite& Suite() {
  static const StreamSuite suite = CancellingSuite(32, kMaxTokens, Prompt, 7, 3);
  return suite;
}

const std::vector<std::vector<uint32_t>>& References() { return Suite().References(); }

double DecoderMetric(const Fleet& fleet, const std::string& name) {
  return RoleMetric(fleet, "decode", name);
}

void RunStreams(const Fleet& fleet, bool cancel_one) { Suite().Run(fleet, cancel_one); }

TEST(DecodeStream, ThirtyTwoStreamsThroughOneDecoderEqualGenerateAndACancelDisturbsNone) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;  // proxy.decode_stream defaults to true
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const double messages0 = DecoderMetric(**fleet, "tandem_decode_stream_messages_total");
  const double items0 = DecoderMetric(**fleet, "tandem_decode_stream_items_total");

  RunStreams(**fleet, /*cancel_one=*/true);

  const double messages = DecoderMetric(**fleet, "tandem_decode_stream_messages_total") - messages0;
  const double items = DecoderMetric(**fleet, "tandem_decode_stream_items_total") - items0;
  // Every request went over the stream (each has at least a `registered`
  // and a final item), and steps of several requests shared messages.
  EXPECT_GE(items, 2.0 * Suite().streams);
  EXPECT_GT(messages, 0);
  EXPECT_LT(messages, items) << "no message carried more than one request's items";
  // ... over the decoder's framed TCP listener (proxy.decode_transport tcp,
  // the default; mutual TLS as every internal connection of the fleet).
  EXPECT_GE(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 1.0);

  // The stream stays usable after the cancel.
  auto again = Generate((*fleet)->proxy_grpc(), [] {
    GenerateArgs a;
    a.prompt_ids = Prompt(3);
    a.max_tokens = kMaxTokens;
    return a;
  }());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->token_ids, References()[3]);

  // The quiet end (session 41, docs/decode-stream.md): requests of one
  // token end on the prefiller's reply and their decoder sends nothing on
  // the stream for them: no message, no item; each answer is the reference's
  // first token, and nothing stays held on the decoder.
  const double quiet_messages0 = DecoderMetric(**fleet, "tandem_decode_stream_messages_total");
  const double quiet_items0 = DecoderMetric(**fleet, "tandem_decode_stream_items_total");
  for (uint32_t i = 0; i < 8; ++i) {
    GenerateArgs a;
    a.prompt_ids = Prompt(100 + i);
    a.max_tokens = 1;
    auto one = Generate((*fleet)->proxy_grpc(), a);
    ASSERT_TRUE(one.ok()) << i << ": " << one.status().ToString();
    auto want = ReferenceGenerate(a.prompt_ids, 1);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    EXPECT_EQ(one->token_ids, *want) << i;
    EXPECT_EQ(one->finish_reason, 2) << i;  // LENGTH
  }
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), quiet_messages0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_stream_items_total"), quiet_items0);
  EXPECT_TRUE(WaitUntil([&] { return DecoderMetric(**fleet, "tandem_decode_seats_taken") == 0; },
                        std::chrono::seconds(30)));
  // Two tokens: the decoder's items come as before, and the stream still works.
  GenerateArgs two;
  two.prompt_ids = Prompt(3);
  two.max_tokens = 2;
  auto second = Generate((*fleet)->proxy_grpc(), two);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->token_ids,
            std::vector<uint32_t>(References()[3].begin(), References()[3].begin() + 2));
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_stream_items_total"), quiet_items0);
}

// Decode seats (docs/serving-workers.md): with 4 seats (max_num_seqs 4)
// the decoder holds the other streams' Reserves until a seat frees; every
// stream still equals `tandem generate`, the cancelled one (possibly while
// its Reserve waits) leaves nothing behind, and no Reserve was refused.
TEST(DecodeStream, ADecoderWithFourSeatsHoldsTheOtherReservesAndEveryStreamEqualsGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.max_num_seqs = 4;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/true);  // ends with the fleet idle
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_seat_waits_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_seats_taken"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_seat_waiting"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_kv_reservations_refused_total"), 0);
}

// KV blocks (docs/serving-workers.md "Decode seats"): the decoder's pool
// of 32 blocks holds a few of the 32 streams at once (1-7 blocks each for
// its prompt), below its 64 seats; the Reserves that find too few blocks
// free wait for them instead of being refused (the only decoder: the
// client would get RESOURCE_EXHAUSTED), and every stream equals
// `tandem generate`. On a loaded host the streams' prefills can arrive
// spread out enough that no Reserve waits (tandem_decode_kv_waits_total 0,
// about one run in ten with three fleets at once on 2 cores): the streams
// then run again, at most 3 rounds in all, until one has.
FleetOptions ShortOfKvBlocks() {
  FleetOptions o;
  o.max_num_seqs = 64;
  o.decode_yaml = "  num_blocks: 32\n";
  return o;
}

// RunStreams until a Reserve has waited for KV blocks (at most 3 rounds).
void RunStreamsUntilAReserveWaited(const Fleet& fleet, bool cancel_one) {
  for (int round = 0; round < 3; ++round) {
    RunStreams(fleet, cancel_one);  // ends with the fleet idle
    if (::testing::Test::HasFatalFailure() ||
        DecoderMetric(fleet, "tandem_decode_kv_waits_total") > 0) {
      return;
    }
  }
}

TEST(DecodeStream, ADecoderShortOfKvBlocksHoldsTheReservesUntilBlocksFree) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  auto fleet = Fleet::Launch(ShortOfKvBlocks());
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreamsUntilAReserveWaited(**fleet, /*cancel_one=*/true);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_kv_waits_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_kv_reservations_refused_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_seat_waiting"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_seats_taken"), 0);
  // The growth reserve is on by default (docs/engine.md "Growth reserve").
  const double ratio = DecoderMetric(**fleet, "tandem_kv_growth_reserve_ratio");
  EXPECT_GT(ratio, 0.0);
  EXPECT_LE(ratio, 1.0);
}

// The same with the growth reserve off (scheduler.schedule_conservativeness
// 0, the behaviour before session 26): the key reaches the decoder's
// engine, the Reserves still wait for blocks and every stream equals
// `tandem generate` (the decoder preempts more: 4-7 per run against 0-1
// with the reserve, docs/engine.md).
TEST(DecodeStream, WithTheGrowthReserveOffTheReservesWaitForBlocksAndEqualGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o = ShortOfKvBlocks();
  o.scheduler_yaml = "  schedule_conservativeness: 0\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreamsUntilAReserveWaited(**fleet, /*cancel_one=*/false);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_kv_waits_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_kv_reservations_refused_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_kv_growth_reserve_ratio"), 0.0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_seats_taken"), 0);
}

TEST(DecodeStream, GrpcTransportCarriesTheSameStreamWithTheSameOutput) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  decode_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/true);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 0);
}

TEST(DecodeStream, ADecoderWithoutATcpListenerGetsTheGrpcStream) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.decode_yaml = "  mux_listen: off\n";  // the proxy asks for tcp; the decoder offers none
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/false);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 0);
}

TEST(DecodeStream, OffUsesOneDecodeCallPerRequestWithTheSameOutput) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  decode_stream: false\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/false);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
}

}  // namespace
}  // namespace tandem::testing
