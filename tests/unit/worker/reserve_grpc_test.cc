// Decoder.Reserve over gRPC (reserve_transport: grpc): a reply that its
// prefiller never received must not leave the reservation behind. The real
// tandem.v1.Decoder service in front of a real Decoder, on 127.0.0.1, called
// by the prefiller's real gRPC link. A server interceptor holds the
// decoder's reply (the call's Finish batch) until the test lets it go, so
// the client's deadline passes after the decoder reserved and before its
// reply left: gRPC drops a reply that comes after the deadline. Before, the
// reservation stayed until its lease (30 s) and then, its prefiller being
// alive, in quarantine until that prefiller restarted or died
// (docs/failure-handling.md "Quarantine"). The framed transport's unsent
// reply is reserve_tcp_test's.
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <condition_variable>
#include <future>

#include "common/rpc_server.h"
#include "decoder/decoder_service.h"
#include "prefiller/prefiller_service.h"
#include "reserve_test_util.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

namespace gx = grpc::experimental;
using prefiller::PrefillJob;
using prefiller::ReserveTarget;

// Holds Decoder.Reserve calls at one point, until the test lets them go:
// kReply holds the call's Finish batch (the decoder reserved, its reply has
// not left), kRequest the request before the handler runs (the decoder has
// not reserved yet). Records the status of every Finish batch. Any thread.
class CallGate {
 public:
  enum class Point { kNone, kRequest, kReply };
  struct Held {
    gx::InterceptorBatchMethods* batch;
    grpc::ServerContextBase* ctx;  // the call's
  };
  void Hold(Point p) {
    std::lock_guard lock(mu_);
    hold_ = p;
  }
  // Keeps `batch` when it is at the held point; false: it goes on now.
  bool Take(gx::InterceptorBatchMethods* batch, grpc::ServerContextBase* ctx) {
    using H = gx::InterceptionHookPoints;
    std::lock_guard lock(mu_);
    if (batch->QueryInterceptionHookPoint(H::PRE_SEND_STATUS)) {
      statuses_.push_back(batch->GetSendStatus().error_code());
    }
    const bool at =
        (hold_ == Point::kReply && batch->QueryInterceptionHookPoint(H::PRE_SEND_STATUS)) ||
        (hold_ == Point::kRequest && batch->QueryInterceptionHookPoint(H::POST_RECV_MESSAGE));
    if (!at) return false;
    held_.push_back({batch, ctx});
    cv_.notify_all();
    return true;
  }
  // Waits (bounded) until a call is held; returns its context.
  grpc::ServerContextBase* WaitHeld() {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, 20s, [&] { return !held_.empty(); })) return nullptr;
    return held_.front().ctx;
  }
  // Lets the held calls go (and stops holding).
  void ReleaseAll() {
    std::vector<Held> go;
    {
      std::lock_guard lock(mu_);
      hold_ = Point::kNone;
      go.swap(held_);
    }
    for (const Held& h : go) h.batch->Proceed();
  }
  std::vector<grpc::StatusCode> statuses() {
    std::lock_guard lock(mu_);
    return statuses_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  Point hold_ = Point::kNone;              // guarded by mu_
  std::vector<Held> held_;                 // guarded by mu_
  std::vector<grpc::StatusCode> statuses_;  // guarded by mu_: each Finish's
};

class HoldCalls final : public gx::Interceptor {
 public:
  HoldCalls(CallGate& gate, grpc::ServerContextBase* ctx) : gate_(gate), ctx_(ctx) {}
  void Intercept(gx::InterceptorBatchMethods* batch) override {
    if (gate_.Take(batch, ctx_)) return;  // Proceed comes from ReleaseAll
    batch->Proceed();
  }

 private:
  CallGate& gate_;
  grpc::ServerContextBase* const ctx_;
};

class HoldCallsFactory final : public gx::ServerInterceptorFactoryInterface {
 public:
  explicit HoldCallsFactory(CallGate& gate) : gate_(gate) {}
  gx::Interceptor* CreateServerInterceptor(gx::ServerRpcInfo* info) override {
    if (std::string_view(info->method()) != "/tandem.v1.Decoder/Reserve") return nullptr;
    return new HoldCalls(gate_, info->server_context());
  }

 private:
  CallGate& gate_;
};

class ReserveGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = Node::Make("reserve-grpc-unit", kBlocks);
    ASSERT_NE(node_, nullptr);
    // A live prefiller's transport, which the decoder watches (its
    // descriptor goes with every Reserve, as a real prefiller's does).
    kvtransfer::TransportOptions wo;
    wo.backend = "loopback";
    wo.agent_name = "reserve-grpc-writer";
    wo.block_bytes = TinyLayout().block_bytes();
    wo.num_blocks = 2;
    auto writer = kvtransfer::CreateTransport(wo);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    writer_ = std::move(writer).value();
    decoder::DecoderOptions o;
    o.lease_seconds = 30;
    o.verify_checksums = false;  // no KV bytes move here
    o.max_seats = max_seats_;
    decoder_ = std::make_unique<decoder::Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
    service_ = decoder::MakeDecoderService(*decoder_, *node_->transport);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    std::vector<std::unique_ptr<gx::ServerInterceptorFactoryInterface>> hooks;
    hooks.push_back(std::make_unique<HoldCallsFactory>(gate_));
    b.experimental().SetInterceptorCreators(std::move(hooks));
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
    link_ = prefiller::MakeGrpcDecoderLink(RpcCredentials(), writer_->LocalDescriptor());
  }
  void TearDown() override {
    gate_.ReleaseAll();
    link_.reset();
    ShutDownServer();
    service_.reset();
    if (decoder_) decoder_->Stop();
  }
  // Returns once every call's OnDone has run (gRPC's Shutdown waits for
  // its callback requests).
  void ShutDownServer() {
    if (!server_) return;
    server_->Shutdown(std::chrono::system_clock::now() + 5s);
    server_.reset();
  }
  std::shared_ptr<RecordingSink> Register(const std::string& id,
                                          const std::vector<uint32_t>& prompt) {
    return RegisterRequest(*decoder_, id, prompt);
  }
  PrefillJob Job(const std::string& id, std::vector<uint32_t> prompt) {
    PrefillJob j;
    j.request_id = id;
    j.prompt_ids = std::move(prompt);
    j.decoder_address = address_;
    j.decoder_name = "decode-0";
    return j;
  }
  // Reserves `prompt` for `id` with a 300 ms deadline while the gate holds
  // the call at `at`; returns the held call's server context once the
  // client's call has ended DEADLINE_EXCEEDED (the event), null if none was
  // held.
  grpc::ServerContextBase* CallPastItsDeadline(const std::string& id,
                                               const std::vector<uint32_t>& prompt,
                                               CallGate::Point at) {
    gate_.Hold(at);
    PrefillJob job = Job(id, prompt);
    job.deadline = std::chrono::system_clock::now() + 300ms;
    Outcome o;
    link_->Reserve(job, "prefill-0", o.Done());
    grpc::ServerContextBase* call = gate_.WaitHeld();
    auto r = o.Get();
    EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
    return call;
  }
  Result<ReserveTarget> Call(const PrefillJob& job) {
    Outcome o;
    link_->Reserve(job, "prefill-0", o.Done());
    return o.Get();
  }
  // A success notice for `t` (no KV moves: checksums are off) starts the
  // decode of request `id`, which `sink` sees finish.
  void ExpectDecodes(const std::string& id, const ReserveTarget& t, RecordingSink& sink) {
    decoder::KvNoticeInfo n;
    n.request_id = id;
    n.reservation_id = t.reservation_id;
    n.generation = t.generation;
    n.first_token_id = 7;
    n.capability = t.capability;
    decoder_->OnKvNotice(n);
    ASSERT_TRUE(WaitFor([&] { return sink.Ended(); }));
    std::lock_guard lock(sink.mu_);
    EXPECT_TRUE(sink.finished) << sink.error.ToString();
    EXPECT_EQ(sink.tokens.size(), 4u);
  }
  uint32_t Reservations() { return decoder_->counts().reservations; }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }

  static constexpr uint32_t kBlocks = 32;
  uint32_t max_seats_ = 0;  // decode seats (ReserveGrpcSeatsTest: 1)
  std::unique_ptr<Node> node_;
  std::unique_ptr<kvtransfer::Transport> writer_;
  std::unique_ptr<decoder::Decoder> decoder_;
  std::unique_ptr<grpc::Service> service_;
  CallGate gate_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<prefiller::DecoderLink> link_;
};

// The decoder reserved, but its reply left only after the call had ended
// (the client's deadline passed; the server learnt of it first).
TEST_F(ReserveGrpcTest, AReplyAfterTheCallEndedReleasesItsReservationAtOnce) {
  const auto prompt = Prompt(40, 1);  // 3 blocks of 16 tokens
  auto sink = Register("a", prompt);
  // The decoder reserved; its reply waits; the call ended here without it.
  grpc::ServerContextBase* call = CallPastItsDeadline("a", prompt, CallGate::Point::kReply);
  ASSERT_NE(call, nullptr);
  EXPECT_EQ(Reservations(), 1u);
  EXPECT_EQ(FreeBlocks(), kBlocks - 3);
  ASSERT_TRUE(WaitFor([&] { return call->IsCancelled(); }));  // and the server knows
  gate_.ReleaseAll();  // the reply goes out now: gRPC drops it
  // Released at once, as by the prefiller's error notice: not at the lease,
  // nor quarantined after it (the prefiller is alive and never knew of it).
  // (The decoder forgets the reservation, then the engine frees its blocks.)
  EXPECT_TRUE(WaitFor([&] { return Reservations() == 0 && FreeBlocks() == kBlocks; }))
      << Reservations() << " reservations, " << FreeBlocks() << " free blocks";
  EXPECT_EQ(decoder_->counts().quarantined_reservations, 0u);
  EXPECT_EQ(decoder_->counts().leases_expired, 0u);
  EXPECT_EQ(decoder_->counts().unreceived_replies_released, 1u);
  // The request is registered again: the proxy's retry reserves it.
  EXPECT_FALSE(sink->Ended());
  auto retry = Call(Job("a", prompt));
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  EXPECT_EQ(Reservations(), 1u);
}

// The decoder handled the Reserve only after the call's deadline (a slow
// or starved handler): it reserves, sees the deadline passed, releases and
// ends the call DEADLINE_EXCEEDED without the target.
TEST_F(ReserveGrpcTest, AReserveHandledAfterTheDeadlineEndsWithoutItsTarget) {
  const auto prompt = Prompt(40, 4);
  auto sink = Register("a", prompt);
  // Not handled yet; the call ended here.
  grpc::ServerContextBase* call = CallPastItsDeadline("a", prompt, CallGate::Point::kRequest);
  ASSERT_NE(call, nullptr);
  EXPECT_EQ(Reservations(), 0u);
  // The server's own view of the deadline has passed too (checked, not slept).
  ASSERT_TRUE(WaitFor([&] { return std::chrono::system_clock::now() >= call->deadline(); }));
  gate_.ReleaseAll();  // the handler runs now
  EXPECT_TRUE(WaitFor([&] { return Reservations() == 0 && FreeBlocks() == kBlocks; }))
      << Reservations() << " reservations, " << FreeBlocks() << " free blocks";
  ShutDownServer();  // every OnDone has run
  EXPECT_EQ(gate_.statuses(), std::vector<grpc::StatusCode>{grpc::StatusCode::DEADLINE_EXCEEDED});
  EXPECT_EQ(Reservations(), 0u);
  EXPECT_FALSE(sink->Ended());  // registered again, for the proxy's retry
}

TEST_F(ReserveGrpcTest, AReplyTheClientReceivedKeepsItsReservation) {
  const auto prompt = Prompt(40, 2);
  auto sink = Register("a", prompt);
  auto t = Call(Job("a", prompt));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ShutDownServer();  // the event: the call's OnDone has run
  EXPECT_EQ(gate_.statuses(), std::vector<grpc::StatusCode>{grpc::StatusCode::OK});
  EXPECT_EQ(Reservations(), 1u);
  EXPECT_EQ(FreeBlocks(), kBlocks - t->slots.size());
  EXPECT_EQ(decoder_->counts().stale_notices, 0u);  // nothing tried to release it
  EXPECT_EQ(decoder_->counts().unreceived_replies_released, 0u);
  // It is still the request's: the prefiller's notice starts the decode.
  ExpectDecodes("a", *t, *sink);
}

// The proxy retried the request through another prefiller, whose Reserve
// came while the first reply was held: the first reply's release frees the
// first reservation only; the second stays the request's.
TEST_F(ReserveGrpcTest, AnUnreceivedReplyLeavesTheRequestsNewerReservationAlone) {
  const auto prompt = Prompt(40, 3);
  auto sink = Register("a", prompt);
  grpc::ServerContextBase* call = CallPastItsDeadline("a", prompt, CallGate::Point::kReply);
  ASSERT_NE(call, nullptr);
  ASSERT_TRUE(WaitFor([&] { return call->IsCancelled(); }));
  gate_.Hold(CallGate::Point::kNone);
  auto second = Call(Job("a", prompt));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(Reservations(), 2u);
  gate_.ReleaseAll();
  EXPECT_TRUE(WaitFor([&] {
    return Reservations() == 1 && FreeBlocks() == kBlocks - second->slots.size();
  })) << Reservations() << " reservations, " << FreeBlocks() << " free blocks";
  ShutDownServer();  // every OnDone has run: nothing else is released
  EXPECT_EQ(Reservations(), 1u);
  EXPECT_FALSE(sink->Ended());
  ExpectDecodes("a", *second, *sink);
}

// Decode seats (docs/serving-workers.md): a decoder with one seat.
class ReserveGrpcSeatsTest : public ReserveGrpcTest {
 protected:
  void SetUp() override {
    max_seats_ = 1;
    ReserveGrpcTest::SetUp();
  }
};

TEST_F(ReserveGrpcSeatsTest, AWaitingCallIsAnsweredWhenASeatFrees) {
  const auto pa = Prompt(40, 5), pb = Prompt(20, 6);
  Register("a", pa);
  auto sink_b = Register("b", pb);
  ASSERT_TRUE(Call(Job("a", pa)).ok());
  Outcome b;
  link_->Reserve(Job("b", pb), "prefill-0", b.Done());
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_waiting == 1; }));
  EXPECT_NE(b.f.wait_for(0s), std::future_status::ready);
  decoder_->Cancel("a");  // a's stream went away: its seat is b's
  auto t = b.Get();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->slots.size(), 2u);
  ShutDownServer();  // every OnDone has run: the target stays b's
  EXPECT_EQ(gate_.statuses(),
            (std::vector<grpc::StatusCode>{grpc::StatusCode::OK, grpc::StatusCode::OK}));
  EXPECT_EQ(decoder_->counts().reserve_waits, 1u);
  ExpectDecodes("b", *t, *sink_b);
}

// A client that stops waiting (its own deadline, shorter than the seat
// wait it asked for) takes its call out of the decoder's queue at once:
// nothing is reserved for it, and the seat that frees later goes to no one.
TEST_F(ReserveGrpcSeatsTest, ACallCancelledWhileWaitingLeavesTheQueueHoldingNothing) {
  const auto pa = Prompt(40, 7), pb = Prompt(20, 8);
  Register("a", pa);
  Register("b", pb);
  ASSERT_TRUE(Call(Job("a", pa)).ok());
  auto stub =
      v1::Decoder::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  v1::ReserveRequest req;
  req.set_request_id("b");
  req.set_prefiller("prefill-0");
  req.mutable_prompt_token_ids()->Add(pb.begin(), pb.end());
  req.set_seat_wait_ms(30'000);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 300ms);
  v1::ReserveResponse resp;
  const grpc::Status st = stub->Reserve(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  // The server learns of it and takes the call out of the queue (not at
  // the end of its 30 s wait).
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().reserves_waiting == 0; }));
  EXPECT_EQ(decoder_->counts().reserve_waits, 1u);
  EXPECT_EQ(decoder_->counts().reserve_waits_expired, 0u);
  decoder_->Cancel("a");  // the seat frees: no one takes it
  EXPECT_EQ(Reservations(), 1u);  // a's, orphaned, waiting for its prefiller's notice
  ShutDownServer();
  EXPECT_EQ(Reservations(), 1u);
  EXPECT_EQ(decoder_->counts().seats_taken, 0u);
}

}  // namespace
}  // namespace tandem::worker_test
