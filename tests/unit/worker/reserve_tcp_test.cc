// Decoder.Reserve over framed TCP (issue 23, docs/serving-workers.md
// "Reserve transport"): the decoder's listener (decoder/reserve_tcp.h) in
// front of a real Decoder, called by the prefiller's link
// (prefiller/reserve_tcp_link.h) over real sockets on 127.0.0.1 with the
// fleet's mutual TLS: targets and refusals per call, a deadline, a broken
// connection (pending calls UNAVAILABLE, a new connection for the next
// call), a reply that could not be sent (its reservation released at once),
// a reply that came after its call's deadline (its target handed over),
// peers without a fleet certificate refused, and the gRPC fallback for a
// decoder without the listener. The fleet suites run the same code through
// `tandem launch` (tests/integration: the default transport).
#include <future>

#include "../frame_test_support.h"
#include "decoder/decoder_service.h"
#include "decoder/reserve_tcp.h"
#include "prefiller/prefiller_service.h"
#include "prefiller/reserve_tcp_link.h"
#include "reserve_test_util.h"
#include "tandem/v1/worker.pb.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using frame_testing::Identity;
using frame_testing::Tls;
using prefiller::PrefillJob;
using prefiller::ReserveTarget;

// Decoder.Reserve as the listener serves it, answered inline (a decoder
// without decode seats never waits).
void ServeNow(decoder::Decoder& decoder, const v1::ReserveRequest& req, v1::ReserveResponse* resp) {
  const uint64_t ticket = decoder::ServeReserve(
      decoder, req, {},
      [resp](const Result<decoder::KvTargetInfo>& t) { decoder::FillReserveResponse(t, resp); });
  EXPECT_EQ(ticket, 0u);
}

// Records the jobs that went to the gRPC link instead (a decoder without a
// framed address), answering each NOT_FOUND at once.
class FallbackLink final : public prefiller::DecoderLink {
 public:
  void Reserve(const PrefillJob& job, const std::string&, ReserveDone done) override {
    {
      std::lock_guard lock(mu_);
      ids_.push_back(job.request_id);
    }
    std::thread([done = std::move(done)] { done(NotFoundError("fallback")); }).detach();
  }
  std::string EncodeNotice(const prefiller::NoticeSpec& n) override { return "notice:" + n.request_id; }
  std::vector<std::string> Ids() {
    std::lock_guard lock(mu_);
    return ids_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> ids_;
};

// A listener whose sessions read every frame and answer none.
class Silent final : public FrameSession {
 public:
  Status OnFrame(std::string_view) override { return Status::Ok(); }
  void OnClosed(const Status&) override {}
};

// A listener with the identity `pem` whose sessions answer nothing.
std::unique_ptr<FrameServer> SilentListener(const TlsPem& pem) {
  return frame_testing::Listen(Tls(pem), [](const std::shared_ptr<FrameConn>&) {
    return std::make_shared<Silent>();
  });
}

// A listener whose sessions keep the request frames and answer only when
// told, with `answer`'s reply (the decoder reserving late).
class Late final : public FrameSession {
 public:
  explicit Late(std::shared_ptr<FrameConn> conn) : conn_(std::move(conn)) {}
  Status OnFrame(std::string_view payload) override {
    v1::ReserveFrame f;
    if (!f.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("not a ReserveFrame");
    }
    std::lock_guard lock(mu_);
    requests_.push_back(std::move(f));
    return Status::Ok();
  }
  void OnClosed(const Status&) override {}
  size_t NumRequests() {
    std::lock_guard lock(mu_);
    return requests_.size();
  }
  // Answers the first request with what `serve` makes of it.
  Status Answer(const std::function<void(const v1::ReserveRequest&, v1::ReserveResponse*)>& serve) {
    v1::ReserveFrame reply;
    {
      std::lock_guard lock(mu_);
      if (requests_.empty()) return FailedPreconditionError("no request");
      reply.set_call_id(requests_.front().call_id());
      serve(requests_.front().request(), reply.mutable_response());
    }
    return conn_->Send(reply);
  }

 private:
  const std::shared_ptr<FrameConn> conn_;
  std::mutex mu_;
  std::vector<v1::ReserveFrame> requests_;  // guarded by mu_
};

class ReserveTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ca_ = frame_testing::MakeCa("fleet-ca");
    ASSERT_FALSE(HasFailure());
    node_ = Node::Make("reserve-tcp-unit", 32);
    ASSERT_NE(node_, nullptr);
    Build(/*max_seats=*/0);
  }
  // A decoder with `max_seats` decode seats behind a new listener, and a
  // prefiller's link to it.
  void Build(uint32_t max_seats) {
    decoder::DecoderOptions o;
    o.lease_seconds = 30;
    o.max_seats = max_seats;
    decoder_ = std::make_unique<decoder::Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
    Serve();
    Link();
  }
  void Link() {
    auto fallback = std::make_unique<FallbackLink>();
    fallback_ = fallback.get();
    link_ = prefiller::MakeTcpDecoderLink(std::move(fallback), Tls(Identity(ca_, "prefill-0")),
                                          "prefiller-descriptor");
    link_->SetSeatWaitHandler([this](const std::string& request_id) {
      std::lock_guard lock(seat_waits_mu_);
      seat_waits_.push_back(request_id);
    });
  }
  // The request ids the link's seat-wait handler was given, in order.
  std::vector<std::string> SeatWaits() {
    std::lock_guard lock(seat_waits_mu_);
    return seat_waits_;
  }
  void TearDown() override {
    link_.reset();  // its connections end first
    if (server_) server_->Stop();
    if (decoder_) decoder_->Stop();
  }
  // Decode seats: a decoder with one seat, requests a, b and c registered
  // (prompts pa, pb, pc), a's call holding the seat and b's (`b`) waiting.
  void OneSeatTakenAndACallWaiting(const std::vector<uint32_t>& pa, const std::vector<uint32_t>& pb,
                                   const std::vector<uint32_t>& pc, Outcome& b) {
    link_.reset();
    server_->Stop();
    decoder_->Stop();
    Build(/*max_seats=*/1);
    Register("a", pa);
    Register("b", pb);
    Register("c", pc);
    ASSERT_TRUE(Call(Job("a", pa, server_->address())).ok());
    link_->Reserve(Job("b", pb, server_->address()), "prefill-0", b.Done());
    ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_waiting == 1; }));
    EXPECT_NE(b.f.wait_for(0s), std::future_status::ready);
  }
  void Serve(FrameOptions frame = {}) {
    decoder::ReserveTcpOptions so;
    so.address = "127.0.0.1:0";
    so.tls = Tls(Identity(ca_, "decode-0"));
    so.frame = frame;
    auto server = decoder::ServeReserveTcp(*decoder_, so);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
  }
  std::shared_ptr<RecordingSink> Register(const std::string& id,
                                          const std::vector<uint32_t>& prompt) {
    return RegisterRequest(*decoder_, id, prompt);
  }
  PrefillJob Job(const std::string& id, std::vector<uint32_t> prompt, const std::string& address) {
    PrefillJob j;
    j.request_id = id;
    j.prompt_ids = std::move(prompt);
    j.decoder_address = "decoder-grpc:1";
    j.decoder_name = "decode-0";
    j.decoder_reserve_address = address;
    return j;
  }
  Result<ReserveTarget> Call(const PrefillJob& job) {
    Outcome o;
    link_->Reserve(job, "prefill-0", o.Done());
    return o.Get();
  }
  uint32_t Reservations() { return decoder_->counts().reservations; }

  CertKeyPem ca_;
  std::unique_ptr<Node> node_;
  std::unique_ptr<decoder::Decoder> decoder_;
  std::unique_ptr<FrameServer> server_;
  FallbackLink* fallback_ = nullptr;
  std::unique_ptr<prefiller::DecoderLink> link_;
  std::mutex seat_waits_mu_;
  std::vector<std::string> seat_waits_;  // guarded by seat_waits_mu_
};

TEST_F(ReserveTcpTest, CallsOnOneConnectionGetTheDecodersTargets) {
  const auto pa = Prompt(40, 1), pb = Prompt(20, 2);
  Register("a", pa);
  Register("b", pb);
  Outcome a, b;
  link_->Reserve(Job("a", pa, server_->address()), "prefill-0", a.Done());
  link_->Reserve(Job("b", pb, server_->address()), "prefill-0", b.Done());
  auto ta = a.Get(), tb = b.Get();
  ASSERT_TRUE(ta.ok()) << ta.status().ToString();
  ASSERT_TRUE(tb.ok()) << tb.status().ToString();
  EXPECT_EQ(ta->slots.size(), 3u);  // 40 tokens in 16-token blocks
  EXPECT_EQ(tb->slots.size(), 2u);
  EXPECT_NE(ta->reservation_id, tb->reservation_id);
  EXPECT_EQ(ta->generation, node_->transport->generation());
  EXPECT_EQ(ta->transport_descriptor, node_->transport->LocalDescriptor());
  EXPECT_FALSE(ta->capability.empty());
  EXPECT_GT(ta->lease_expiry, std::chrono::system_clock::now() + 20s);
  EXPECT_EQ(Reservations(), 2u);
  EXPECT_EQ(server_->accepted(), 1u);  // both calls on one connection
  EXPECT_TRUE(fallback_->Ids().empty());
}

TEST_F(ReserveTcpTest, TheDecodersRefusalsKeepTheirStatus) {
  const auto big = Prompt(300, 3);  // 19 of the 32 blocks
  Register("a", big);
  Register("b", Prompt(300, 4));
  ASSERT_TRUE(Call(Job("a", big, server_->address())).ok());
  // A request that ended here (a call for one never seen waits for its
  // registration: registration_wait_test).
  Register("nope", big);
  decoder_->Cancel("nope");
  auto none = Call(Job("nope", big, server_->address()));
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().ToString();
  auto full = Call(Job("b", Prompt(300, 4), server_->address()));
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted) << full.status().ToString();
  auto other = Call(Job("b", Prompt(40, 5), server_->address()));  // not its prompt
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument) << other.status().ToString();
  EXPECT_EQ(Reservations(), 1u);
  EXPECT_EQ(decoder_->counts().reservations_refused, 1u);
}

TEST_F(ReserveTcpTest, ADeadlineEndsTheCallWhenTheDecoderDoesNotAnswer) {
  auto silent = SilentListener(Identity(ca_, "decode-1"));
  ASSERT_NE(silent, nullptr);
  PrefillJob job = Job("a", Prompt(20, 6), silent->address());
  job.deadline = std::chrono::system_clock::now() + 300ms;
  auto r = Call(job);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  silent->Stop();
}

TEST_F(ReserveTcpTest, ABrokenConnectionEndsItsCallsAndTheNextCallDialsAgain) {
  auto silent = SilentListener(Identity(ca_, "decode-1"));
  ASSERT_NE(silent, nullptr);
  const std::string address = silent->address();
  Outcome a, b;
  link_->Reserve(Job("a", Prompt(20, 7), address), "prefill-0", a.Done());
  link_->Reserve(Job("b", Prompt(20, 8), address), "prefill-0", b.Done());
  ASSERT_TRUE(WaitFor([&] { return silent->accepted() == 1; }));
  // As the decoder's process going away mid-call.
  silent.reset();
  for (Outcome* o : {&a, &b}) {
    auto r = o->Get();
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
    EXPECT_NE(r.status().message().find("reserve connection to decoder"), std::string::npos);
  }
  // Nothing listens there now: the next call dials again and fails the same way.
  auto c = Call(Job("c", Prompt(20, 9), address));
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
  // The real decoder's listener killed: no reservation is left there.
  const auto prompt = Prompt(20, 10);
  Register("d", prompt);
  const std::string real = server_->address();
  server_.reset();
  auto d = Call(Job("d", prompt, real));
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status().ToString();
  EXPECT_EQ(Reservations(), 0u);
  // A new listener (a restarted decoder's): the link dials it afresh.
  Serve();
  auto again = Call(Job("d", prompt, server_->address()));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(Reservations(), 1u);
}

// Decoders that come and go leave no entries behind: the link keeps one per
// live connection, and drops the ended ones when it dials a new decoder.
TEST_F(ReserveTcpTest, TheLinkKeepsNoEntryForADecoderThatWentAway) {
  const auto prompt = Prompt(20, 12);
  Register("a", prompt);
  ASSERT_TRUE(Call(Job("a", prompt, server_->address())).ok());
  auto gone = SilentListener(Identity(ca_, "decode-1"));
  ASSERT_NE(gone, nullptr);
  Outcome lost;
  link_->Reserve(Job("b", Prompt(20, 13), gone->address()), "prefill-0", lost.Done());
  ASSERT_TRUE(WaitFor([&] { return gone->accepted() == 1; }));
  EXPECT_EQ(prefiller::TcpDecoderLinkEntries(*link_).total, 2u);
  gone.reset();  // that decoder goes away: its connection ends
  EXPECT_EQ(lost.Get().status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(WaitFor([&] { return prefiller::TcpDecoderLinkEntries(*link_).ended == 1; }));
  // A new decoder: dialling it drops the ended entry.
  auto next = SilentListener(Identity(ca_, "decode-2"));
  ASSERT_NE(next, nullptr);
  Outcome pending;
  link_->Reserve(Job("c", Prompt(20, 14), next->address()), "prefill-0", pending.Done());
  const auto entries = prefiller::TcpDecoderLinkEntries(*link_);
  EXPECT_EQ(entries.total, 2u);  // the first decoder's and the new one's
  EXPECT_EQ(entries.ended, 0u);
  next.reset();
  EXPECT_EQ(pending.Get().status().code(), StatusCode::kUnavailable);
}

TEST_F(ReserveTcpTest, AReplyThatCannotBeSentReleasesItsReservation) {
  // A frame limit between the request's size and the reply's: the decoder
  // reserves, cannot send the reply and closes the connection. The reply's
  // size is measured on a probe reservation, then released.
  const auto prompt = Prompt(4, 11);
  Register("a", prompt);
  Register("probe", prompt);
  v1::ReserveFrame request;
  request.set_call_id(1);
  prefiller::FillReserveRequest(Job("a", prompt, ""), "prefill-0", "prefiller-descriptor", {},
                                request.mutable_request());
  v1::ReserveFrame reply;
  reply.set_call_id(1);
  v1::ReserveRequest probe = request.request();
  probe.set_request_id("probe");
  ServeNow(*decoder_, probe, reply.mutable_response());
  ASSERT_TRUE(reply.response().has_target());
  decoder::KvNoticeInfo release;
  release.request_id = "probe";
  release.reservation_id = reply.response().target().reservation_id();
  release.generation = reply.response().target().generation();
  release.capability = reply.response().target().capability();
  release.error = CancelledError("probe");
  decoder_->OnKvNotice(release);
  decoder_->Cancel("probe");
  ASSERT_EQ(Reservations(), 0u);
  const size_t limit = request.ByteSizeLong() + 8;
  ASSERT_GT(reply.ByteSizeLong(), limit + 8);

  server_->Stop();
  FrameOptions small;
  small.max_frame_bytes = static_cast<uint32_t>(limit);
  Serve(small);
  auto r = Call(Job("a", prompt, server_->address()));
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  // Released at once, as by the prefiller's error notice: nothing held, and
  // the request is registered again for a retry.
  // (The decoder forgets the reservation, then the engine frees its blocks:
  // wait for both.)
  EXPECT_TRUE(WaitFor(
      [&] { return Reservations() == 0 && node_->engine->stats().free_blocks == 32u; }));
  EXPECT_EQ(node_->engine->stats().free_blocks, 32u);
  EXPECT_EQ(decoder_->counts().unreceived_replies_released, 1u);
  server_->Stop();
  Serve();
  auto retry = Call(Job("a", prompt, server_->address()));
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  EXPECT_EQ(Reservations(), 1u);
}

// The decoder reserved, but its reply came after the call's deadline here
// (session 15: a prefiller SIGSTOPped past it reads the reply only after its
// loop ended the call): the call still ends DEADLINE_EXCEEDED, and the
// target goes to the late-target handler, so the prefiller can tell the
// decoder (its lease would only quarantine a live writer's reservation).
// Before, the reply was dropped.
TEST_F(ReserveTcpTest, AReplyAfterTheDeadlineHandsItsTargetToTheLateTargetHandler) {
  std::mutex mu;
  std::vector<std::pair<std::string, ReserveTarget>> late;
  link_->SetLateTargetHandler([&](const std::string& id, ReserveTarget t) {
    std::lock_guard lock(mu);
    late.emplace_back(id, std::move(t));
  });
  std::shared_ptr<Late> session;
  std::mutex session_mu;
  auto slow = frame_testing::Listen(Tls(Identity(ca_, "decode-1")),
                                    [&](const std::shared_ptr<FrameConn>& conn) {
                                      std::lock_guard lock(session_mu);
                                      session = std::make_shared<Late>(conn);
                                      return session;
                                    });
  ASSERT_NE(slow, nullptr);
  const auto prompt = Prompt(20, 15);
  Register("a#1", prompt);
  PrefillJob job = Job("a#1", prompt, slow->address());
  job.deadline = std::chrono::system_clock::now() + 300ms;
  Outcome o;
  link_->Reserve(job, "prefill-0", o.Done());
  auto r = o.Get();  // the event: the call ended here
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  std::shared_ptr<Late> s;
  {
    std::lock_guard lock(session_mu);
    s = session;
  }
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->NumRequests(), 1u);
  uint64_t reservation = 0;
  ASSERT_TRUE(s->Answer([&](const v1::ReserveRequest& req, v1::ReserveResponse* resp) {
                 ServeNow(*decoder_, req, resp);
                 reservation = resp->target().reservation_id();
               }).ok());
  ASSERT_NE(reservation, 0u);
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return !late.empty();
  }));
  std::lock_guard lock(mu);
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].first, "a#1");
  EXPECT_EQ(late[0].second.reservation_id, reservation);
  EXPECT_EQ(late[0].second.generation, node_->transport->generation());
  EXPECT_EQ(late[0].second.transport_descriptor, node_->transport->LocalDescriptor());
  EXPECT_FALSE(late[0].second.capability.empty());
  EXPECT_EQ(o.runs.load(), 1);  // the call's `done` ran once, with the deadline
  slow->Stop();
}

TEST_F(ReserveTcpTest, APeerWithoutAFleetClientCertificateIsRefused) {
  const auto prompt = Prompt(20, 12);
  Register("a", prompt);
  const TlsPem stranger = frame_testing::Stranger(ca_, "stranger");  // it trusts the fleet's server
  for (auto tls : {Tls(stranger), std::shared_ptr<FrameTls>()}) {  // then no TLS at all
    auto link = prefiller::MakeTcpDecoderLink(std::make_unique<FallbackLink>(), tls);
    Outcome o;
    link->Reserve(Job("a", prompt, server_->address()), "stranger", o.Done());
    EXPECT_EQ(o.Get().status().code(), StatusCode::kUnavailable);
  }
  EXPECT_TRUE(server_->WaitForRefused(2, std::chrono::seconds(20)));
  EXPECT_EQ(server_->accepted(), 0u);
  EXPECT_EQ(Reservations(), 0u);  // nothing reached the decoder
  // A server without a fleet certificate is refused by the prefiller.
  auto impostor = SilentListener(frame_testing::Stranger(ca_, "impostor"));
  ASSERT_NE(impostor, nullptr);
  auto r = Call(Job("a", prompt, impostor->address()));
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_EQ(impostor->accepted(), 0u);
  impostor->Stop();
}

TEST_F(ReserveTcpTest, ADecoderWithoutTheListenerIsReservedOverGrpc) {
  auto r = Call(Job("a", Prompt(20, 13), ""));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "fallback");
  EXPECT_EQ(fallback_->Ids(), std::vector<std::string>{"a"});
  EXPECT_EQ(link_->EncodeNotice({.request_id = "a"}), "notice:a");  // the gRPC link's encoding
  EXPECT_EQ(server_->accepted(), 0u);
}

// Decode seats (docs/serving-workers.md): a call to a decoder whose one
// seat is taken waits on the connection, and is answered when the seat
// frees; one whose wait runs out is refused before the call's deadline
// (RESOURCE_EXHAUSTED, not DEADLINE_EXCEEDED), nothing reserved.
TEST_F(ReserveTcpTest, ACallWaitsForADecodeSeatOnTheConnection) {
  const auto pa = Prompt(40, 11), pb = Prompt(20, 12), pc = Prompt(20, 13);
  Outcome b;
  OneSeatTakenAndACallWaiting(pa, pb, pc, b);
  ASSERT_FALSE(HasFatalFailure());
  // Another call on the same connection is not held up behind the waiting one.
  Register("nope", pc);
  decoder_->Cancel("nope");
  auto none = Call(Job("nope", pc, server_->address()));
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().ToString();
  decoder_->Cancel("a");
  auto tb = b.Get();
  ASSERT_TRUE(tb.ok()) << tb.status().ToString();
  EXPECT_EQ(tb->slots.size(), 2u);
  EXPECT_EQ(Reservations(), 2u);  // b's, and a's orphaned one
  // c: 1 s deadline, so the decoder may hold it 750 ms; refused then.
  PrefillJob jc = Job("c", pc, server_->address());
  jc.deadline = std::chrono::system_clock::now() + 1s;
  auto tc = Call(jc);
  EXPECT_EQ(tc.status().code(), StatusCode::kResourceExhausted) << tc.status().ToString();
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserve_waits, 2u);
  EXPECT_EQ(counts.reserve_waits_expired, 1u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(Reservations(), 2u);
  EXPECT_EQ(server_->accepted(), 1u);
}

// The prefiller's connection ends while one of its calls waits for a seat:
// the call leaves the decoder's queue at once (not at the end of its
// 9.5 s wait), nothing reserved for it; the seat that frees later goes
// to a later call.
TEST_F(ReserveTcpTest, AConnectionThatEndsTakesItsWaitingCallsOutOfTheQueue) {
  const auto pa = Prompt(40, 14), pb = Prompt(20, 15), pc = Prompt(20, 16);
  Outcome b;
  OneSeatTakenAndACallWaiting(pa, pb, pc, b);
  ASSERT_FALSE(HasFatalFailure());
  link_.reset();  // the prefiller's connection closes
  const auto tb = b.Get();
  EXPECT_EQ(tb.status().code(), StatusCode::kUnavailable) << tb.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_waiting == 0; }));
  EXPECT_EQ(decoder_->counts().reserve_waits_expired, 0u);
  EXPECT_EQ(Reservations(), 1u);  // a's only
  // A new connection's call gets the seat a frees.
  Link();
  Outcome c;
  link_->Reserve(Job("c", pc, server_->address()), "prefill-0", c.Done());
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_waiting == 1; }));
  decoder_->Cancel("a");
  auto tc = c.Get();
  ASSERT_TRUE(tc.ok()) << tc.status().ToString();
  EXPECT_EQ(decoder_->counts().reserve_waits, 2u);
  EXPECT_EQ(decoder_->counts().unreceived_replies_released, 0u);  // b's was never reserved
}

// The link tells its prefiller when a call waits for a seat
// (ReserveFrame.seat_wait, which the link asks for): once, before the call's
// reply, so that the prefiller stops counting the call in its admission
// budget. A call answered at once (a's, c's) is never told.
TEST_F(ReserveTcpTest, AWaitingCallIsToldSoBeforeItsReply) {
  const auto pa = Prompt(40, 17), pb = Prompt(20, 18), pc = Prompt(20, 19);
  Outcome b;
  OneSeatTakenAndACallWaiting(pa, pb, pc, b);
  ASSERT_FALSE(HasFatalFailure());
  // The handler runs on the link's thread once the decoder's frame is read.
  ASSERT_TRUE(WaitFor([&] { return !SeatWaits().empty(); }));
  EXPECT_EQ(SeatWaits(), std::vector<std::string>{"b"});
  EXPECT_NE(b.f.wait_for(0s), std::future_status::ready);  // the reply comes later
  decoder_->Cancel("a");
  auto tb = b.Get();
  ASSERT_TRUE(tb.ok()) << tb.status().ToString();
  // c finds a seat (a's freed one went to b; cancelling b frees it again).
  decoder_->Cancel("b");
  ASSERT_TRUE(Call(Job("c", pc, server_->address())).ok());
  EXPECT_EQ(SeatWaits(), std::vector<std::string>{"b"});
  EXPECT_EQ(decoder_->counts().reserve_waits, 1u);
}

// Prefill with the start (docs/decode-stream.md): a call that reaches the
// decoder before its request's registration waits on the connection and is
// answered once the registration comes; the prefiller is not told it waits
// for a seat (it does not: the start is on its way). Later calls on the
// connection are not held up behind it.
TEST_F(ReserveTcpTest, ACallBeforeItsRegistrationIsAnsweredWhenTheRegistrationComes) {
  const auto pa = Prompt(20, 21), pb = Prompt(20, 22);
  Outcome a;
  link_->Reserve(Job("a", pa, server_->address()), "prefill-0", a.Done());
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_awaiting_registration == 1; }));
  EXPECT_NE(a.f.wait_for(0s), std::future_status::ready);
  Register("b", pb);
  ASSERT_TRUE(Call(Job("b", pb, server_->address())).ok());
  EXPECT_NE(a.f.wait_for(0s), std::future_status::ready);
  Register("a", pa);
  auto ta = a.Get();
  ASSERT_TRUE(ta.ok()) << ta.status().ToString();
  EXPECT_EQ(ta->slots.size(), 2u);
  EXPECT_EQ(Reservations(), 2u);
  EXPECT_TRUE(SeatWaits().empty());
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.registration_waits, 1u);
  EXPECT_EQ(counts.reserve_waits, 0u);
  EXPECT_EQ(counts.reserves_awaiting_registration, 0u);
}

}  // namespace
}  // namespace tandem::worker_test
