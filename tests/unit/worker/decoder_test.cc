// The decoder core without gRPC: reservations, leases, notices, cancel.
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using decoder::Decoder;
using decoder::DecoderOptions;
using decoder::DecodeSpec;
using decoder::KvNoticeInfo;

class DecoderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = Node::Make("decode-unit", 32);
    ASSERT_NE(node_, nullptr);
  }
  void MakeDecoder(double lease_seconds = 30) {
    DecoderOptions o;
    o.lease_seconds = lease_seconds;
    decoder_ = std::make_unique<Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
  }
  std::shared_ptr<RecordingSink> Register(const std::string& id, const std::vector<uint32_t>& prompt,
                                          uint32_t max_tokens = 4) {
    auto sink = std::make_shared<RecordingSink>();
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = prompt;
    s.sampling = Greedy(max_tokens);
    EXPECT_TRUE(decoder_->Register(s, sink).ok());
    return sink;
  }
  KvNoticeInfo Notice(const decoder::KvTargetInfo& t, uint32_t first_token) {
    KvNoticeInfo n;
    n.request_id = t.request_id;
    n.reservation_id = t.reservation_id;
    n.generation = t.generation;
    n.first_token_id = first_token;
    n.capability = t.capability;
    return n;
  }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }

  std::unique_ptr<Node> node_;
  std::unique_ptr<Decoder> decoder_;
};

TEST_F(DecoderTest, ReserveGivesSlotsForEveryPromptBlockAndTheTransportIdentity) {
  MakeDecoder();
  const auto prompt = Prompt(40, 1);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->slots.size(), 3u);
  EXPECT_EQ(t->cached_blocks, 0u);
  EXPECT_EQ(t->generation, node_->transport->generation());
  EXPECT_EQ(t->transport_descriptor, node_->transport->LocalDescriptor());
  EXPECT_GT(t->lease_expiry, std::chrono::system_clock::now() + 20s);
  EXPECT_EQ(FreeBlocks(), 29u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  // Unknown request or another prompt: refused, nothing held.
  EXPECT_EQ(decoder_->Reserve("nope", "p", prompt).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(decoder_->Reserve("a", "p", Prompt(40, 2)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FreeBlocks(), 29u);
}

TEST_F(DecoderTest, NoRoomIsResourceExhaustedAndHoldsNothing) {
  MakeDecoder();
  const auto big = Prompt(300, 3);  // 19 blocks
  Register("a", big);
  Register("b", Prompt(300, 4));
  ASSERT_TRUE(decoder_->Reserve("a", "p", big).ok());
  const uint32_t free_before = FreeBlocks();
  auto r = decoder_->Reserve("b", "p", Prompt(300, 4));
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(FreeBlocks(), free_before);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  EXPECT_EQ(decoder_->counts().reservations_refused, 1u);
}

TEST_F(DecoderTest, CancelledReservationWaitsForThePrefillersNotice) {
  MakeDecoder();
  const auto prompt = Prompt(40, 5);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  decoder_->Cancel("a");
  // The prefiller may still be writing: the slots stay held.
  EXPECT_EQ(decoder_->counts().registered, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  EXPECT_EQ(FreeBlocks(), 29u);
  KvNoticeInfo n = Notice(*t, 7);
  n.error = CancelledError("gave up");
  decoder_->OnKvNotice(n);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
  EXPECT_FALSE(sink->Ended());  // a cancelled stream hears nothing
}

TEST_F(DecoderTest, EachReservationHasItsOwnRandomCapabilityAndId) {
  MakeDecoder();
  const auto pa = Prompt(20, 30), pb = Prompt(20, 31);
  Register("a", pa);
  Register("b", pb);
  auto a = decoder_->Reserve("a", "p", pa);
  auto b = decoder_->Reserve("b", "p", pb);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->capability.size(), 16u);
  EXPECT_EQ(b->capability.size(), 16u);
  EXPECT_NE(a->capability, b->capability);
  EXPECT_NE(a->capability, std::string(16, '\0'));
  // Not a counter: neither id follows from the other.
  EXPECT_NE(b->reservation_id, a->reservation_id + 1);
  EXPECT_NE(a->reservation_id, 0u);
}

TEST_F(DecoderTest, NoticeWithTheWrongCapabilityIsRefusedCountedAndChangesNothing) {
  MakeDecoder();
  const auto prompt = Prompt(20, 32);
  auto sink = Register("a", prompt, 3);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  // Wrong bytes, no capability, a truncated one, and an error notice that
  // would free the reservation if it were believed.
  KvNoticeInfo wrong = Notice(*t, 9);
  wrong.capability[0] = static_cast<char>(wrong.capability[0] ^ 1);
  decoder_->OnKvNotice(wrong);
  KvNoticeInfo none = Notice(*t, 9);
  none.capability.clear();
  decoder_->OnKvNotice(none);
  KvNoticeInfo shorter = Notice(*t, 9);
  shorter.capability.pop_back();
  decoder_->OnKvNotice(shorter);
  KvNoticeInfo forged_error = wrong;
  forged_error.error = CancelledError("forged");
  decoder_->OnKvNotice(forged_error);
  EXPECT_EQ(decoder_->counts().notices_refused_capability, 4u);
  EXPECT_EQ(decoder_->counts().stale_notices, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  EXPECT_EQ(FreeBlocks(), 32u - 2u);
  EXPECT_FALSE(sink->Ended());
  // The genuine notice still works.
  decoder_->OnKvNotice(Notice(*t, 9));
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->finished);
  ASSERT_EQ(sink->tokens.size(), 3u);
  EXPECT_EQ(sink->tokens[0], 9u);
}

TEST_F(DecoderTest, StaleOrUnknownNoticesAreIgnoredAndCounted) {
  MakeDecoder();
  const auto prompt = Prompt(20, 6);
  auto sink = Register("a", prompt, 3);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  KvNoticeInfo stale = Notice(*t, 9);
  stale.generation += 1;
  decoder_->OnKvNotice(stale);
  KvNoticeInfo unknown = Notice(*t, 9);
  unknown.reservation_id += 100;
  decoder_->OnKvNotice(unknown);
  EXPECT_EQ(decoder_->counts().stale_notices, 2u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  EXPECT_FALSE(sink->Ended());
  // The right notice starts decoding; the first token is index 0.
  decoder_->OnKvNotice(Notice(*t, 9));
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->finished);
  ASSERT_EQ(sink->tokens.size(), 3u);
  EXPECT_EQ(sink->tokens[0], 9u);
  EXPECT_FALSE(sink->out_of_order);
  EXPECT_EQ(sink->result.completion_tokens, 3u);
  EXPECT_EQ(sink->result.finish_reason, engine::FinishReason::kLength);
  // A duplicate of it is stale now.
  decoder_->OnKvNotice(Notice(*t, 9));
  EXPECT_EQ(decoder_->counts().stale_notices, 3u);
  ASSERT_TRUE(WaitFor([&] { return FreeBlocks() == 32u; }));
}

TEST_F(DecoderTest, ErrorNoticeReturnsTheRequestToRegisteredForARetry) {
  MakeDecoder();
  const auto prompt = Prompt(20, 7);
  auto sink = Register("a", prompt, 2);
  auto t1 = decoder_->Reserve("a", "p1", prompt);
  ASSERT_TRUE(t1.ok());
  KvNoticeInfo n = Notice(*t1, 0);
  n.error = UnavailableError("prefiller failed");
  decoder_->OnKvNotice(n);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(decoder_->counts().registered, 1u);
  auto t2 = decoder_->Reserve("a", "p2", prompt);
  ASSERT_TRUE(t2.ok());
  decoder_->OnKvNotice(Notice(*t2, 11));
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->finished);
  EXPECT_EQ(sink->tokens.front(), 11u);
}

TEST_F(DecoderTest, LeaseExpiryFreesTheBlocksAndEndsTheStream) {
  MakeDecoder(/*lease_seconds=*/0.2);
  const auto prompt = Prompt(40, 8);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->errored);
  EXPECT_EQ(sink->error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(decoder_->counts().leases_expired, 1u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
  // The late writer's notice is stale now.
  decoder_->OnKvNotice(Notice(*t, 5));
  EXPECT_EQ(decoder_->counts().stale_notices, 1u);
}

TEST_F(DecoderTest, ANewStreamSupersedesOneStillWaitingForItsKv) {
  MakeDecoder();
  const auto prompt = Prompt(20, 9);
  auto first = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  auto second = Register("a", prompt);
  EXPECT_TRUE(first->errored);
  EXPECT_EQ(first->error.code(), StatusCode::kAborted);
  // The old stream's late cancel does not touch the new registration.
  decoder_->Cancel("a", first.get());
  EXPECT_EQ(decoder_->counts().registered, 1u);
  // The old reservation waits for its writer.
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  KvNoticeInfo n = Notice(*t, 3);
  decoder_->OnKvNotice(n);  // the old writer finished: released, not used
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_FALSE(second->Ended());
}

TEST_F(DecoderTest, DrainingRefusesNewStreams) {
  MakeDecoder();
  decoder_->SetDraining();
  DecodeSpec s;
  s.request_id = "x";
  s.prompt_ids = Prompt(5, 1);
  s.sampling = Greedy(2);
  EXPECT_EQ(decoder_->Register(s, std::make_shared<RecordingSink>()).code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tandem::worker_test
