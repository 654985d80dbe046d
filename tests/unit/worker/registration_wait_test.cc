// Prefill with the start (docs/decode-stream.md): the proxy sends a
// request's Prefill right after its decode start, so the prefiller's
// Reserve may reach the decoder before the start does. The decoder holds
// such a call until the registration comes (then serves it in line), and
// refuses it when the registration is refused, never comes within the
// call's wait, or belongs to a request that already ended here; nothing is
// reserved for a call that is refused. A start that asks for it
// (registered_with_first_item) gets `registered` with the request's first
// item instead of an item of its own. Real engine, loopback transport and
// the decode stream's session; the wire paths run in reserve_tcp_test and
// the fleet tests.
#include <fmt/format.h>

#include <mutex>
#include <optional>

#include "decoder/decode_mux.h"
#include "tandem/v1/worker.pb.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using decoder::Decoder;
using decoder::DecoderOptions;
using decoder::DecodeSpec;
using decoder::KvTargetInfo;

// A decode stream's output written at once; keeps every batch.
class Batches final : public decoder::MuxOutput {
 public:
  bool Write(const v1::DecodeStreamResponse& batch) override {
    std::lock_guard lock(mu_);
    batches_.push_back(batch);
    return true;
  }
  void EndStream() override {}
  std::vector<v1::DecodeStreamResponse> batches() {
    std::lock_guard lock(mu_);
    return batches_;
  }
  std::vector<v1::DecodeStreamItem> items() {
    std::lock_guard lock(mu_);
    std::vector<v1::DecodeStreamItem> out;
    for (const auto& b : batches_) out.insert(out.end(), b.items().begin(), b.items().end());
    return out;
  }
  bool Ended(uint64_t handle) {
    for (const auto& item : items()) {
      if (item.handle() == handle && (item.has_finished() || item.has_error())) return true;
    }
    return false;
  }

 private:
  std::mutex mu_;
  std::vector<v1::DecodeStreamResponse> batches_;
};

class RegistrationWaitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = Node::Make("registration-wait", 32);
    ASSERT_NE(node_, nullptr);
  }
  void TearDown() override {
    if (decoder_) decoder_->Stop();
  }
  void MakeDecoder(uint32_t max_seats = 0) {
    DecoderOptions o;
    o.verify_checksums = false;
    o.max_seats = max_seats;
    decoder_ = std::make_unique<Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
  }
  static std::vector<uint32_t> PromptOf(const std::string& id) {
    return Prompt(20, static_cast<uint32_t>(std::hash<std::string>{}(id) % 1000));
  }
  Status Register(const std::string& id, std::shared_ptr<RecordingSink> sink = nullptr) {
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = PromptOf(id);
    s.sampling = Greedy(3);
    return decoder_->Register(s, sink ? sink : std::make_shared<RecordingSink>());
  }
  uint64_t ReserveOrWait(const std::string& id, Answer& answer, bool* for_registration,
                         std::chrono::milliseconds wait = 10s) {
    const auto prompt = PromptOf(id);
    return decoder_->ReserveOrWait(id, "p", prompt, {}, {}, std::chrono::steady_clock::now() + wait,
                                   answer.Done(), for_registration);
  }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }

  std::unique_ptr<Node> node_;
  std::unique_ptr<Decoder> decoder_;
};

TEST_F(RegistrationWaitTest, AReserveBeforeItsRegistrationWaitsForItAndIsServedWhenItComes) {
  MakeDecoder();
  Answer a;
  bool for_registration = false;
  EXPECT_NE(ReserveOrWait("a", a, &for_registration), 0u);
  EXPECT_TRUE(for_registration);
  EXPECT_FALSE(a.Has());
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_awaiting_registration, 1u);
  EXPECT_EQ(counts.registration_waits, 1u);
  EXPECT_EQ(counts.reserves_waiting, 0u);  // not in the seat line
  EXPECT_EQ(counts.reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);

  ASSERT_TRUE(Register("a").ok());
  ASSERT_TRUE(WaitFor([&] { return a.Has(); }));
  const auto t = a.Get();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->request_id, "a");
  EXPECT_EQ(t->slots.size(), 2u);
  counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_awaiting_registration, 0u);
  EXPECT_EQ(counts.reservations, 1u);
  EXPECT_EQ(counts.seats_taken, 1u);
  EXPECT_EQ(a.calls(), 1);

  // The pushed KV's notice starts it: the request decodes as any other.
  auto sink = std::make_shared<RecordingSink>();
  Answer b;
  EXPECT_NE(ReserveOrWait("b", b, nullptr), 0u);
  ASSERT_TRUE(Register("b", sink).ok());
  ASSERT_TRUE(WaitFor([&] { return b.Has(); }));
  ASSERT_TRUE(b.Get().ok()) << b.Get().status().ToString();
  decoder_->OnKvNotice(SuccessNotice(*b.Get(), 7));
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(sink->mu_);
    return sink->finished || sink->errored;
  }));
  std::lock_guard lock(sink->mu_);
  EXPECT_TRUE(sink->finished) << sink->error.ToString();
  ASSERT_FALSE(sink->tokens.empty());
  EXPECT_EQ(sink->tokens[0], 7u);  // the prefiller's first token
  EXPECT_EQ(sink->tokens.size(), 3u);
}

TEST_F(RegistrationWaitTest, ACallThatCameFirstWaitsInLineForASeatOnceRegistered) {
  MakeDecoder(/*max_seats=*/1);
  ASSERT_TRUE(Register("a").ok());
  Answer a, b;
  EXPECT_EQ(ReserveOrWait("a", a, nullptr), 0u);
  ASSERT_TRUE(a.Get().ok());
  bool for_registration = false;
  EXPECT_NE(ReserveOrWait("b", b, &for_registration), 0u);
  EXPECT_TRUE(for_registration);
  ASSERT_TRUE(Register("b").ok());
  // Registered, but the one seat is a's: b waits in the seat line now.
  ASSERT_TRUE(WaitFor([&] {
    const auto c = decoder_->counts();
    return c.reserves_awaiting_registration == 0 && c.reserves_waiting == 1;
  }));
  EXPECT_FALSE(b.Has());
  decoder_->Cancel("a");
  ASSERT_TRUE(WaitFor([&] { return b.Has(); }));
  EXPECT_TRUE(b.Get().ok()) << b.Get().status().ToString();
  EXPECT_EQ(decoder_->counts().seats_taken, 1u);
}

TEST_F(RegistrationWaitTest, ARefusedRegistrationAnswersItsWaitingCallWithTheRefusal) {
  MakeDecoder();
  Answer a;
  bool for_registration = false;
  ASSERT_NE(ReserveOrWait("a", a, &for_registration), 0u);
  // The start arrives while the decoder drains: refused, and so is the call.
  decoder_->SetDraining();
  const Status s = Register("a");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  ASSERT_TRUE(a.Has()) << "the refusal answers the waiting call at once";
  EXPECT_EQ(a.Get().status().code(), StatusCode::kUnavailable);
  EXPECT_NE(a.Get().status().message().find("request 'a': its registration on this decoder was "
                                            "refused: this decoder is shutting down"),
            std::string::npos)
      << a.Get().status().message();
  EXPECT_EQ(decoder_->counts().reserves_awaiting_registration, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
  // While draining nothing waits for a registration: refused at once.
  Answer late;
  EXPECT_EQ(ReserveOrWait("b", late, nullptr), 0u);
  EXPECT_EQ(late.Get().status().code(), StatusCode::kNotFound);
}

TEST_F(RegistrationWaitTest, AnInvalidStartAnswersItsWaitingCallInvalidArgument) {
  MakeDecoder();
  Answer a;
  ASSERT_NE(ReserveOrWait("a", a, nullptr), 0u);
  DecodeSpec s;
  s.request_id = "a";
  s.prompt_ids = PromptOf("a");
  s.sampling = Greedy(1'000'000);  // more than the pool holds
  const Status st = decoder_->Register(s, std::make_shared<RecordingSink>());
  ASSERT_FALSE(st.ok());
  ASSERT_TRUE(a.Has());
  EXPECT_EQ(a.Get().status().code(), st.code()) << a.Get().status().ToString();
  EXPECT_NE(a.Get().status().message().find(st.message()), std::string::npos);
  EXPECT_EQ(FreeBlocks(), 32u);
}

TEST_F(RegistrationWaitTest, ACallForARequestThatEndedHereIsRefusedAtOnce) {
  MakeDecoder();
  ASSERT_TRUE(Register("a").ok());
  decoder_->Cancel("a");
  Answer a;
  bool for_registration = false;
  EXPECT_EQ(ReserveOrWait("a", a, &for_registration), 0u);
  EXPECT_FALSE(for_registration);
  ASSERT_TRUE(a.Has());
  EXPECT_EQ(a.Get().status().code(), StatusCode::kNotFound);
  EXPECT_EQ(decoder_->counts().registration_waits, 0u);
  // Registered again (a proxy's new start under the same key): served.
  ASSERT_TRUE(Register("a").ok());
  Answer again;
  EXPECT_EQ(ReserveOrWait("a", again, nullptr), 0u);
  EXPECT_TRUE(again.Get().ok()) << again.Get().status().ToString();
}

TEST_F(RegistrationWaitTest, ARegistrationThatNeverComesEndsTheWaitNotFound) {
  MakeDecoder();
  Answer a;
  ASSERT_NE(ReserveOrWait("a", a, nullptr, 50ms), 0u);
  ASSERT_TRUE(WaitFor([&] { return a.Has(); }));
  EXPECT_EQ(a.Get().status().code(), StatusCode::kNotFound);
  EXPECT_NE(a.Get().status().message().find("request 'a' is not registered on this decoder: it "
                                            "did not register within"),
            std::string::npos)
      << a.Get().status().message();
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_awaiting_registration, 0u);
  EXPECT_EQ(counts.reservations_refused, 0u);
  EXPECT_EQ(a.calls(), 1);
  // A registration after that has nothing waiting.
  ASSERT_TRUE(Register("a").ok());
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(a.calls(), 1);
}

TEST_F(RegistrationWaitTest, AWaitingCallEndsWithItsCallerOrStopHoldingNothing) {
  MakeDecoder();
  Answer a, b;
  const uint64_t ticket = ReserveOrWait("a", a, nullptr);
  ASSERT_NE(ticket, 0u);
  ASSERT_NE(ReserveOrWait("b", b, nullptr), 0u);
  decoder_->AbandonReserve(ticket);
  ASSERT_TRUE(a.Has());
  EXPECT_EQ(a.Get().status().code(), StatusCode::kCancelled);
  ASSERT_TRUE(Register("a").ok());  // nothing of the abandoned call is served
  EXPECT_EQ(a.calls(), 1);
  decoder_->Stop();
  ASSERT_TRUE(b.Has());
  EXPECT_EQ(b.Get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u);
}

// The decode stream's side: a start that asks for it gets `registered`
// with its first item (here the first token), a start that does not gets
// it alone at once, and a refused start is an error item without it.
class FoldedRegisteredTest : public RegistrationWaitTest {
 protected:
  // A deadline `d` from now, as DecodeRequest.deadline_unix_ms.
  static int64_t UnixMsIn(std::chrono::milliseconds d) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               (std::chrono::system_clock::now() + d).time_since_epoch())
        .count();
  }
  static v1::DecodeStreamRequest Start(uint64_t handle, const std::string& id, bool fold,
                                       uint32_t max_tokens = 3) {
    v1::DecodeStreamRequest req;
    auto* start = req.mutable_start();
    start->set_handle(handle);
    start->set_registered_with_first_item(fold);
    auto* r = start->mutable_request();
    r->set_request_id(id);
    for (uint32_t t : PromptOf(id)) r->add_prompt_token_ids(t);
    r->mutable_params()->set_max_tokens(max_tokens);
    r->mutable_params()->set_ignore_eos(true);
    r->mutable_params()->set_top_p(1);
    return req;
  }
};

TEST_F(FoldedRegisteredTest, RegisteredGoesWithTheFirstTokenWhenTheStartAsks) {
  MakeDecoder();
  auto out = std::make_shared<Batches>();
  decoder::MuxSession session(*decoder_, out.get(), out);
  session.OnRequest(Start(1, "folded", /*fold=*/true));
  session.OnRequest(Start(2, "plain", /*fold=*/false));
  // Only the plain start's `registered` went out, alone.
  auto items = out->items();
  ASSERT_EQ(items.size(), 1u) << items[0].DebugString() << items.back().DebugString();
  EXPECT_EQ(items[0].handle(), 2u);
  EXPECT_TRUE(items[0].registered());
  EXPECT_EQ(items[0].token_ids_size(), 0);
  EXPECT_EQ(decoder_->counts().registered, 2u);

  auto t = decoder_->Reserve("folded", "p", PromptOf("folded"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  decoder_->OnKvNotice(SuccessNotice(*t, 11));
  ASSERT_TRUE(WaitFor([&] { return out->Ended(1); }));
  items = out->items();
  std::vector<v1::DecodeStreamItem> folded;
  for (const auto& item : items) {
    if (item.handle() == 1) folded.push_back(item);
  }
  ASSERT_FALSE(folded.empty());
  EXPECT_TRUE(folded[0].registered());
  ASSERT_GT(folded[0].token_ids_size(), 0) << folded[0].DebugString();
  EXPECT_EQ(folded[0].first_index(), 0u);
  EXPECT_EQ(folded[0].token_ids(0), 11u);
  for (size_t i = 1; i < folded.size(); ++i) EXPECT_FALSE(folded[i].registered());
  uint32_t tokens = 0;
  for (const auto& item : folded) tokens += static_cast<uint32_t>(item.token_ids_size());
  EXPECT_EQ(tokens, 3u);
  EXPECT_TRUE(folded.back().has_finished());
  session.Close();
}

TEST_F(FoldedRegisteredTest, AnErrorAfterAFoldedRegistrationCarriesRegistered) {
  MakeDecoder();
  auto out = std::make_shared<Batches>();
  decoder::MuxSession session(*decoder_, out.get(), out);
  // Its deadline passes while it waits for its KV: it ends in band, and the
  // item says it was registered (the proxy's culprit rule reads that).
  v1::DecodeStreamRequest start = Start(1, "a", /*fold=*/true);
  start.mutable_start()->mutable_request()->set_deadline_unix_ms(UnixMsIn(50ms));
  session.OnRequest(start);
  EXPECT_TRUE(out->items().empty());
  ASSERT_TRUE(WaitFor([&] { return out->Ended(1); }));
  const auto items = out->items();
  ASSERT_EQ(items.size(), 1u);
  EXPECT_TRUE(items[0].registered());
  ASSERT_TRUE(items[0].has_error());
  EXPECT_EQ(items[0].error().code(), static_cast<int>(StatusCode::kDeadlineExceeded))
      << items[0].error().message();
  // A refused start (its prompt is empty) is an error without `registered`.
  v1::DecodeStreamRequest bad = Start(2, "b", /*fold=*/true);
  bad.mutable_start()->mutable_request()->clear_prompt_token_ids();
  session.OnRequest(bad);
  ASSERT_TRUE(WaitFor([&] { return out->Ended(2); }));
  const auto all = out->items();
  EXPECT_FALSE(all.back().registered());
  EXPECT_TRUE(all.back().has_error());
  EXPECT_EQ(all.back().handle(), 2u);
  session.Close();
}

// The quiet end (docs/decode-stream.md, session 41): a start that asks for
// it and ends on the prefiller's token sends no item at all (not the token,
// `registered` or `finished`) and holds nothing after; the same start
// without asking sends its one item; a quiet start that decodes on, or
// fails, is sent as any other.
class QuietEndTest : public FoldedRegisteredTest {
 protected:
  static v1::DecodeStreamRequest Quiet(uint64_t handle, const std::string& id,
                                       uint32_t max_tokens) {
    v1::DecodeStreamRequest req = Start(handle, id, /*fold=*/true, max_tokens);
    req.mutable_start()->set_quiet_end_on_first_token(true);
    return req;
  }
  void Prefilled(const std::string& id, uint32_t first_token) {
    auto t = decoder_->Reserve(id, "p", PromptOf(id));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    decoder_->OnKvNotice(SuccessNotice(*t, first_token));
  }
  static std::vector<v1::DecodeStreamItem> Of(const std::vector<v1::DecodeStreamItem>& items,
                                              uint64_t handle) {
    std::vector<v1::DecodeStreamItem> out;
    for (const auto& item : items) {
      if (item.handle() == handle) out.push_back(item);
    }
    return out;
  }
};

TEST_F(QuietEndTest, ARequestThatEndsOnThePrefillersTokenSendsNothing) {
  MakeDecoder();
  auto out = std::make_shared<Batches>();
  decoder::MuxSession session(*decoder_, out.get(), out);
  session.OnRequest(Quiet(1, "quiet", 1));
  Prefilled("quiet", 11);
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().registered == 0; }));
  // The same request without asking, after it on the same stream: its
  // item is the stream's only one, so nothing went for the quiet one.
  session.OnRequest(Start(2, "loud", /*fold=*/true, 1));
  Prefilled("loud", 12);
  ASSERT_TRUE(WaitFor([&] { return out->Ended(2); }));
  const auto items = out->items();
  ASSERT_EQ(items.size(), 1u) << items[0].DebugString();
  EXPECT_EQ(items[0].handle(), 2u);
  EXPECT_TRUE(items[0].registered());
  EXPECT_EQ(items[0].first_index(), 0u);
  ASSERT_EQ(items[0].token_ids_size(), 1);
  EXPECT_EQ(items[0].token_ids(0), 12u);
  ASSERT_TRUE(items[0].has_finished());
  EXPECT_EQ(items[0].finished().completion_tokens(), 1u);
  EXPECT_EQ(decoder_->counts().stream_messages, 1u);
  EXPECT_EQ(decoder_->counts().stream_items, 1u);
  // Nothing held for either: no registration, no reservation.
  EXPECT_EQ(decoder_->counts().registered, 0u);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  session.Close();
}

TEST_F(QuietEndTest, AQuietStartThatDecodesOnOrFailsIsSentAsAnyOther) {
  MakeDecoder();
  auto out = std::make_shared<Batches>();
  decoder::MuxSession session(*decoder_, out.get(), out);
  // Three tokens: the first (the prefiller's) goes, then the rest and the end.
  session.OnRequest(Quiet(1, "on", 3));
  Prefilled("on", 11);
  ASSERT_TRUE(WaitFor([&] { return out->Ended(1); }));
  const auto on = Of(out->items(), 1);
  ASSERT_FALSE(on.empty());
  EXPECT_TRUE(on[0].registered());
  EXPECT_EQ(on[0].first_index(), 0u);
  ASSERT_GT(on[0].token_ids_size(), 0);
  EXPECT_EQ(on[0].token_ids(0), 11u);
  uint32_t tokens = 0;
  for (const auto& item : on) tokens += static_cast<uint32_t>(item.token_ids_size());
  EXPECT_EQ(tokens, 3u);
  ASSERT_TRUE(on.back().has_finished());
  EXPECT_EQ(on.back().finished().completion_tokens(), 3u);
  // Its deadline passes while it waits for its KV: the error goes in band.
  v1::DecodeStreamRequest late = Quiet(2, "late", 1);
  late.mutable_start()->mutable_request()->set_deadline_unix_ms(UnixMsIn(50ms));
  session.OnRequest(late);
  ASSERT_TRUE(WaitFor([&] { return out->Ended(2); }));
  const auto failed = Of(out->items(), 2);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_TRUE(failed[0].registered());
  ASSERT_TRUE(failed[0].has_error());
  EXPECT_EQ(failed[0].error().code(), static_cast<int>(StatusCode::kDeadlineExceeded));
  session.Close();
}

}  // namespace
}  // namespace tandem::worker_test
