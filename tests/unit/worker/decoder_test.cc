// The decoder core without gRPC: reservations, leases, notices, cancel.
#include "common/metrics.h"
#include "kvtransfer/kv_cipher.h"
#include "worker_test_util.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "kvtransfer/loopback/loopback_transport.h"

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
  // Most cases move no KV bytes: checksums are verified only where a case
  // says so.
  void MakeDecoder(double lease_seconds = 30, bool verify_checksums = false, bool encrypt = false,
                   HeldHistogram* itl = nullptr) {
    DecoderOptions o;
    o.lease_seconds = lease_seconds;
    o.verify_checksums = verify_checksums;
    o.encrypt = encrypt;
    o.inter_token_latency = itl;
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
  static KvNoticeInfo Notice(const decoder::KvTargetInfo& t, uint32_t first_token) {
    return SuccessNotice(t, first_token);
  }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }
  // A prefiller's transport the decoder can watch (its descriptor goes with
  // Reserve, as a real prefiller's does).
  std::string WriterDescriptor() {
    if (!writer_) {
      kvtransfer::TransportOptions o;
      o.backend = "loopback";
      o.agent_name = "writer-" + std::to_string(reinterpret_cast<uintptr_t>(this));
      o.block_bytes = TinyLayout().block_bytes();
      o.num_blocks = 2;
      auto t = kvtransfer::CreateTransport(o);
      EXPECT_TRUE(t.ok()) << t.status().ToString();
      writer_ = std::move(t).value();
    }
    return writer_->LocalDescriptor();
  }
  std::unique_ptr<kvtransfer::Transport> writer_;
  // XXH3-64 of the pushed slots of `t`, as a prefiller computes them.
  std::vector<uint64_t> Sums(const decoder::KvTargetInfo& t) {
    std::vector<uint64_t> out;
    for (size_t i = t.cached_blocks; i < t.slots.size(); ++i) {
      out.push_back(XXH3_64bits(node_->transport->block(t.slots[i]), node_->transport->block_bytes()));
    }
    return out;
  }

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

// transport.encrypt: what a prefiller does — seal each pushed block (a
// known pattern) into its slot of this decoder's pool — and the notice
// with the tags. Returns the plaintext of each pushed position.
std::vector<std::vector<std::byte>> SealIntoSlots(kvtransfer::Transport& t,
                                                  const decoder::KvTargetInfo& target,
                                                  std::string& tags) {
  auto cipher = kvtransfer::KvCipher::Create(target.kv_key, target.reservation_id);
  EXPECT_TRUE(cipher.ok()) << cipher.status().ToString();
  std::vector<std::vector<std::byte>> plain;
  tags.clear();
  for (uint32_t pos = target.cached_blocks; pos < target.slots.size(); ++pos) {
    std::vector<std::byte> p(t.block_bytes());
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<std::byte>((i * 7 + pos * 13) & 0xff);
    std::array<std::byte, kvtransfer::kKvTagBytes> tag;
    EXPECT_TRUE(cipher->Seal(pos, p.data(), t.block(target.slots[pos]), p.size(), tag.data()).ok());
    tags.append(reinterpret_cast<const char*>(tag.data()), tag.size());
    plain.push_back(std::move(p));
  }
  return plain;
}

TEST_F(DecoderTest, EncryptedPushIsCheckedAndOpenedInPlaceBeforeDecoding) {
  MakeDecoder(30, /*verify_checksums=*/false, /*encrypt=*/true);
  const auto prompt = Prompt(48, 33);  // three full blocks: decoding writes only a fourth
  auto sink = Register("a", prompt, 3);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  ASSERT_EQ(t->kv_key.size(), kvtransfer::kKvKeyBytes);
  std::string tags;
  const auto plain = SealIntoSlots(*node_->transport, *t, tags);
  ASSERT_EQ(plain.size(), 3u);
  KvNoticeInfo n = Notice(*t, 9);
  n.kv_tags = tags;
  decoder_->OnKvNotice(n);
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->finished) << sink->error.ToString();
  EXPECT_EQ(decoder_->counts().notices_refused_decrypt, 0u);
  // The prompt's slots hold the plaintext again (decrypted where they landed).
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(std::memcmp(node_->transport->block(t->slots[i]), plain[i].data(), plain[i].size()), 0)
        << "block " << i;
  }
}

TEST_F(DecoderTest, TamperedOrUntaggedEncryptedPushIsRefusedFailsClosedAndFreesItsBlocks) {
  MakeDecoder(30, /*verify_checksums=*/false, /*encrypt=*/true);
  // One byte flipped in flight.
  const auto pa = Prompt(40, 34);
  auto sa = Register("a", pa, 3);
  auto ta = decoder_->Reserve("a", "p", pa);
  ASSERT_TRUE(ta.ok());
  std::string tags;
  SealIntoSlots(*node_->transport, *ta, tags);
  node_->transport->block(ta->slots[1])[5] ^= std::byte{0x20};
  KvNoticeInfo na = Notice(*ta, 9);
  na.kv_tags = tags;
  decoder_->OnKvNotice(na);
  ASSERT_TRUE(WaitFor([&] { return sa->Ended(); }));
  EXPECT_TRUE(sa->errored);
  EXPECT_EQ(sa->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(sa->error.message().find("failed authentication"), std::string::npos)
      << sa->error.message();
  EXPECT_TRUE(sa->tokens.empty());  // nothing decoded from tampered KV
  // A notice without the tags (a prefiller that did not encrypt).
  const auto pb = Prompt(20, 35);
  auto sb = Register("b", pb, 3);
  auto tb = decoder_->Reserve("b", "p", pb);
  ASSERT_TRUE(tb.ok());
  decoder_->OnKvNotice(Notice(*tb, 9));
  ASSERT_TRUE(WaitFor([&] { return sb->Ended(); }));
  EXPECT_EQ(sb->error.code(), StatusCode::kDataLoss);
  EXPECT_EQ(decoder_->counts().notices_refused_decrypt, 2u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(decoder_->counts().registered, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
}

// transport.encrypt with transport.checksum: the prefiller hashes its
// plaintext blocks, so the decoder opens the blocks first and verifies the
// checksums over the plaintext; a block failing its tag is a decryption
// refusal (DATA_LOSS), not a checksum failure.
TEST_F(DecoderTest, EncryptedPushWithChecksumsVerifiesThePlaintext) {
  MakeDecoder(30, /*verify_checksums=*/true, /*encrypt=*/true);
  auto sums_of = [](const std::vector<std::vector<std::byte>>& plain) {
    std::vector<uint64_t> sums;
    for (const auto& p : plain) sums.push_back(XXH3_64bits(p.data(), p.size()));
    return sums;
  };
  // Good: tags and plaintext checksums.
  const auto pa = Prompt(48, 36);
  auto sa = Register("a", pa, 3);
  auto ta = decoder_->Reserve("a", "p", pa);
  ASSERT_TRUE(ta.ok());
  std::string tags;
  auto plain = SealIntoSlots(*node_->transport, *ta, tags);
  KvNoticeInfo na = Notice(*ta, 9);
  na.kv_tags = tags;
  na.block_checksums = sums_of(plain);
  decoder_->OnKvNotice(na);
  ASSERT_TRUE(WaitFor([&] { return sa->Ended(); }));
  EXPECT_TRUE(sa->finished) << sa->error.ToString();
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().registered == 0; }));
  const uint32_t free_after_a = FreeBlocks();
  // A checksum that does not match the plaintext: a checksum failure.
  const auto pb = Prompt(48, 37);
  auto sb = Register("b", pb, 3);
  auto tb = decoder_->Reserve("b", "p", pb);
  ASSERT_TRUE(tb.ok());
  plain = SealIntoSlots(*node_->transport, *tb, tags);
  KvNoticeInfo nb = Notice(*tb, 9);
  nb.kv_tags = tags;
  nb.block_checksums = sums_of(plain);
  nb.block_checksums[2] ^= 1;
  decoder_->OnKvNotice(nb);
  ASSERT_TRUE(WaitFor([&] { return sb->Ended(); }));
  EXPECT_EQ(sb->error.code(), StatusCode::kUnavailable) << sb->error.ToString();
  EXPECT_EQ(decoder_->counts().checksum_failures, 1u);
  EXPECT_EQ(decoder_->counts().notices_refused_decrypt, 0u);
  // Tampered ciphertext with the right checksums: refused by its tag.
  const auto pc = Prompt(48, 38);
  auto sc = Register("c", pc, 3);
  auto tc = decoder_->Reserve("c", "p", pc);
  ASSERT_TRUE(tc.ok());
  plain = SealIntoSlots(*node_->transport, *tc, tags);
  node_->transport->block(tc->slots[0])[3] ^= std::byte{0x01};
  KvNoticeInfo nc = Notice(*tc, 9);
  nc.kv_tags = tags;
  nc.block_checksums = sums_of(plain);
  decoder_->OnKvNotice(nc);
  ASSERT_TRUE(WaitFor([&] { return sc->Ended(); }));
  EXPECT_EQ(sc->error.code(), StatusCode::kDataLoss) << sc->error.ToString();
  EXPECT_EQ(decoder_->counts().notices_refused_decrypt, 1u);
  EXPECT_EQ(decoder_->counts().checksum_failures, 1u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == free_after_a; })) << FreeBlocks();
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

// Acknowledge-or-dead: an expired lease ends the stream (the proxy retries)
// but its blocks stay out of the free list until the writer's notice says
// no write is outstanding. A request reserved meanwhile gets other blocks.
TEST_F(DecoderTest, LeaseExpiryQuarantinesTheBlocksUntilTheWriterAcknowledges) {
  MakeDecoder(/*lease_seconds=*/0.2);
  const auto prompt = Prompt(40, 8);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt, WriterDescriptor());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_TRUE(sink->errored);
  EXPECT_EQ(sink->error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(decoder_->counts().leases_expired, 1u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);
  EXPECT_EQ(decoder_->counts().quarantined_reservations, 1u);
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 3u);
  EXPECT_EQ(FreeBlocks(), 29u);
  // Scheduled meanwhile: never one of the quarantined slots.
  const auto other = Prompt(40, 80);
  auto sink_b = Register("b", other);
  auto b = decoder_->Reserve("b", "p", other, WriterDescriptor());
  ASSERT_TRUE(b.ok());
  for (uint32_t slot : b->slots) {
    EXPECT_EQ(std::count(t->slots.begin(), t->slots.end(), slot), 0) << "slot " << slot << " reused";
  }
  // The late writer's notice (its data landed): released, not decoded.
  decoder_->OnKvNotice(Notice(*t, 5));
  EXPECT_EQ(decoder_->counts().quarantine_released_ack, 1u);
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 1u);  // b's
  EXPECT_EQ(decoder_->counts().stale_notices, 0u);
  EXPECT_EQ(FreeBlocks(), 29u);
  decoder_->OnKvNotice(Notice(*b, 5));
  ASSERT_TRUE(WaitFor([&] { return sink_b->Ended(); }));
  EXPECT_TRUE(sink_b->finished);
  ASSERT_TRUE(WaitFor([&] { return FreeBlocks() == 32u; }));
}

// A pool that fits one request: while the first one's blocks wait in
// quarantine, the next is refused (they are not reused); after the
// writer's acknowledgement it fits.
TEST_F(DecoderTest, QuarantinedBlocksAreNotReusedEvenWhenThePoolIsFull) {
  MakeDecoder(/*lease_seconds=*/0.2);
  const auto big = Prompt(300, 3);  // 19 of 32 blocks
  auto sink = Register("a", big);
  auto t = decoder_->Reserve("a", "p", big, WriterDescriptor());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 19u);
  const auto big2 = Prompt(300, 4);
  Register("b", big2);
  EXPECT_EQ(decoder_->Reserve("b", "p", big2).status().code(), StatusCode::kResourceExhausted);
  KvNoticeInfo n = Notice(*t, 0);
  n.error = CancelledError("aborted; no byte of it can land");
  decoder_->OnKvNotice(n);
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
  EXPECT_TRUE(decoder_->Reserve("b", "p", big2).ok());
}

// The writer declared dead (the transport's keepalive, or a newer
// generation of the same agent reserving) ends its quarantine; a notice of
// another agent does not.
// A writer the decoder cannot watch (no descriptor: an older prefiller, a
// test client) would hold its blocks forever: freed at expiry as before.
TEST_F(DecoderTest, UnwatchableWritersBlocksAreFreedAtExpiry) {
  MakeDecoder(/*lease_seconds=*/0.2);
  const auto prompt = Prompt(40, 18);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", "p", prompt);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_EQ(sink->error.code(), StatusCode::kUnavailable);
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reservations == 0; }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().leases_expired, 1u);
  EXPECT_EQ(FreeBlocks(), 32u);
  decoder_->OnKvNotice(Notice(*t, 5));  // a late notice is stale
  EXPECT_EQ(decoder_->counts().stale_notices, 1u);
}

TEST_F(DecoderTest, QuarantineEndsWhenTheWriterIsDeclaredDead) {
  MakeDecoder(/*lease_seconds=*/0.2);
  auto writer = Node::Make("prefill-unit", 4);
  ASSERT_NE(writer, nullptr);
  const std::string agent = writer->transport->agent_name();
  const uint64_t gen1 = writer->transport->generation();
  const auto prompt = Prompt(40, 11);
  auto sink = Register("a", prompt);
  auto t = decoder_->Reserve("a", agent, prompt, writer->transport->LocalDescriptor());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 3u);
  decoder_->OnPrefillerLost("someone-else", gen1 + 100);
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 3u);
  // Restarted writer: the first reservation of its new generation proves
  // the old process gone.
  auto gen2 = kvtransfer::LoopbackRestartPeer(agent);
  ASSERT_TRUE(gen2.ok());
  ASSERT_GT(*gen2, gen1);
  const auto other = Prompt(20, 12);
  auto sink_d = Register("d", other);
  ASSERT_TRUE(decoder_->Reserve("d", agent, other, writer->transport->LocalDescriptor()).ok());
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().quarantine_released_dead, 1u);
  ASSERT_TRUE(WaitFor([&] { return sink_d->Ended(); }));  // d's lease too
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 2u);
  // The transport's report of the writer's death (what its keepalive calls).
  decoder_->OnPrefillerLost(agent, *gen2);
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().quarantine_released_dead, 2u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
  // Known dead: a later expiry of its reservations frees at once.
  auto sink_e = Register("e", other);
  ASSERT_TRUE(decoder_->Reserve("e", agent, other, writer->transport->LocalDescriptor()).ok());
  ASSERT_TRUE(WaitFor([&] { return sink_e->Ended(); }));
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reservations == 0; }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
}

// The decoder's own endpoint to a prefiller failed (what the transport's
// peer-failure callback reports) while the prefiller is alive: e.g. the
// prefiller closed an endpoint its transport had declared lost (peer-lost,
// docs/failure-handling.md). Until it is heard from, it counts as dead; a
// Reserve from that very generation proves it alive, and its expired
// reservations are quarantined again instead of freed under a live writer.
TEST_F(DecoderTest, WriterDeclaredDeadByItsEndpointIsAliveWhenItReservesAgain) {
  MakeDecoder(/*lease_seconds=*/0.2);
  auto writer = Node::Make("prefill-unit", 4);
  ASSERT_NE(writer, nullptr);
  const std::string agent = writer->transport->agent_name();
  const std::string desc = writer->transport->LocalDescriptor();
  const auto prompt = Prompt(40, 21);
  auto sink_a = Register("a", prompt);
  ASSERT_TRUE(decoder_->Reserve("a", agent, prompt, desc).ok());
  decoder_->OnPrefillerEndpointFailed(agent, writer->transport->generation());
  // Dead as far as the decoder knows: a's expired blocks are freed at once.
  ASSERT_TRUE(WaitFor([&] { return sink_a->Ended(); }));
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reservations == 0; }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().quarantine_released_dead, 1u);
  // The same generation reserves again: alive, so b's expired blocks wait
  // in quarantine for its word.
  const auto other = Prompt(40, 22);
  auto sink_b = Register("b", other);
  auto t = decoder_->Reserve("b", agent, other, desc);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return sink_b->Ended(); }));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 3u);
  EXPECT_EQ(decoder_->counts().quarantine_released_dead, 1u);
  // Its notice (the writer is done) releases them.
  decoder_->OnKvNotice(Notice(*t, 0));
  EXPECT_EQ(decoder_->counts().quarantined_blocks, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
}

// End-to-end checksums: verified before the request is added to the
// engine; a flipped byte (or a notice without checksums) fails the request
// closed with UNAVAILABLE, counted, blocks freed, nothing decoded.
TEST_F(DecoderTest, ChecksumMismatchFailsClosedAndNothingIsDecoded) {
  MakeDecoder(/*lease_seconds=*/30, /*verify_checksums=*/true);
  const auto prompt = Prompt(40, 13);
  auto good = Register("good", prompt, 3);
  auto t = decoder_->Reserve("good", "p", prompt);
  ASSERT_TRUE(t.ok());
  for (uint32_t slot : t->slots) std::memset(node_->transport->block(slot), 0, node_->transport->block_bytes());
  KvNoticeInfo n = Notice(*t, 9);
  n.block_checksums = Sums(*t);
  decoder_->OnKvNotice(n);
  ASSERT_TRUE(WaitFor([&] { return good->Ended(); }));
  EXPECT_TRUE(good->finished);
  EXPECT_EQ(good->tokens.size(), 3u);

  auto bad = Register("bad", prompt, 3);
  auto tb = decoder_->Reserve("bad", "p", prompt);
  ASSERT_TRUE(tb.ok());
  ASSERT_LT(tb->cached_blocks, tb->slots.size());  // at least the partial last block moves
  for (uint32_t slot : tb->slots) std::memset(node_->transport->block(slot), 0, node_->transport->block_bytes());
  KvNoticeInfo nb = Notice(*tb, 9);
  nb.block_checksums = Sums(*tb);
  node_->transport->block(tb->slots.back())[100] ^= std::byte{0x40};  // torn on the way
  decoder_->OnKvNotice(nb);
  ASSERT_TRUE(bad->Ended());
  EXPECT_TRUE(bad->errored);
  EXPECT_EQ(bad->error.code(), StatusCode::kUnavailable);
  EXPECT_NE(bad->error.message().find("checksum"), std::string::npos) << bad->error.message();
  EXPECT_TRUE(bad->tokens.empty());
  EXPECT_EQ(decoder_->counts().checksum_failures, 1u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(decoder_->counts().registered, 0u);

  // Without checksums while they are on: fails closed as well.
  auto none = Register("none", Prompt(40, 14), 3);
  auto tn = decoder_->Reserve("none", "p", Prompt(40, 14));
  ASSERT_TRUE(tn.ok());
  decoder_->OnKvNotice(Notice(*tn, 9));
  ASSERT_TRUE(none->Ended());
  EXPECT_TRUE(none->errored);
  EXPECT_EQ(decoder_->counts().checksum_failures, 2u);
  ASSERT_TRUE(WaitFor([&] { return node_->engine->stats().num_running == 0; }));
  EXPECT_EQ(decoder_->counts().reservations, 0u);
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

TEST_F(DecoderTest, EachTokenAfterARequestsFirstCountsOneInterTokenGap) {
  MetricsRegistry registry({"m", "decode", "decode-unit"});
  const std::vector<double> bounds = {0.001, 0.01, 0.1};
  HeldHistogram itl(registry, "tandem_decoder_inter_token_latency_seconds", "itl", bounds);
  MakeDecoder(/*lease_seconds=*/30, /*verify_checksums=*/false, /*encrypt=*/false, &itl);
  auto& series = registry.Histogram("tandem_decoder_inter_token_latency_seconds", "itl", bounds);
  uint64_t expected = 0;
  double sum = 0;
  for (const auto& [id, max_tokens] : {std::pair{"a", 6u}, std::pair{"b", 3u}}) {
    const auto start = std::chrono::steady_clock::now();
    const auto prompt = Prompt(20, max_tokens);
    auto sink = Register(id, prompt, max_tokens);
    auto t = decoder_->Reserve(id, "p", prompt);
    ASSERT_TRUE(t.ok());
    decoder_->OnKvNotice(Notice(*t, 9));
    ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(sink->finished);
    ASSERT_EQ(sink->tokens.size(), max_tokens);
    // The first token handed off has no gap; every other one has one
    // (0 for a token handed off with the one before it).
    expected += max_tokens - 1;
    registry.RunCollectHooks();
    const auto h = series.Collect().histogram;
    EXPECT_EQ(h.sample_count, expected) << id << ": " << sink->hand_offs << " hand-offs";
    // Real durations: together no longer than the request was here. (Not
    // > 0: tokens the engine's thread produced before the notice's thread
    // handed off the first are handed off with it, at one time.)
    EXPECT_GE(h.sample_sum - sum, 0.0) << id;
    EXPECT_LE(h.sample_sum - sum, elapsed) << id;
    sum = h.sample_sum;
  }
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
