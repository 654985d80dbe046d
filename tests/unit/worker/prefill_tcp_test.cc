// Prefill over framed TCP (issue 23, docs/serving-workers.md "Prefill
// transport"): the prefiller's listener (prefiller/prefill_tcp.h) in front
// of a real Prefiller (a fake DecoderLink holds each Reserve, as in
// prefiller_test), called by the proxy's client (proxy/prefill_tcp_client.h)
// over real sockets on 127.0.0.1 with the fleet's mutual TLS: results and
// statuses per call id, cancel, deadline, a broken connection (no
// reservation left behind: the decoder gets the error notice), and a peer
// without a fleet client certificate refused. The fleet suites run the same
// code through `tandem launch` (tests/integration/fleet, failure, serving).
#include <poll.h>

#include <condition_variable>
#include <future>
#include <sstream>

#include "../frame_test_support.h"
#include "prefiller/prefill_tcp.h"
#include "proxy/prefill_tcp_client.h"
#include "tandem/v1/worker.pb.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using prefiller::NoticeSpec;
using prefiller::PrefillJob;
using prefiller::ReserveTarget;
using ProxyResult = Result<proxy::PrefillResult>;
namespace pb = ::tandem::v1;

// Holds each Reserve until the test answers it; notices as "id|reservation|code".
class HoldingLink final : public prefiller::DecoderLink {
 public:
  void Reserve(const PrefillJob& job, const std::string&, ReserveDone done) override {
    std::lock_guard lock(mu_);
    pending_.push_back(std::move(done));
    prompts_.push_back(job.prompt_ids);
    ids_.push_back(job.request_id);
  }
  std::string EncodeNotice(const NoticeSpec& n) override {
    std::ostringstream s;
    s << n.request_id << "|" << n.reservation_id << "|" << static_cast<int>(n.error.code());
    return s.str();
  }
  void Answer(Result<ReserveTarget> r) {
    ReserveDone done;
    {
      std::lock_guard lock(mu_);
      ASSERT_FALSE(pending_.empty());
      done = std::move(pending_.front());
      pending_.erase(pending_.begin());
    }
    std::thread([done = std::move(done), r = std::move(r)]() mutable { done(std::move(r)); }).join();
  }
  size_t NumReserves() {
    std::lock_guard lock(mu_);
    return prompts_.size();
  }
  std::vector<uint32_t> Prompt(size_t i) {
    std::lock_guard lock(mu_);
    return prompts_.at(i);
  }
  std::string Id(size_t i) {
    std::lock_guard lock(mu_);
    return ids_.at(i);
  }

 private:
  std::mutex mu_;
  std::vector<ReserveDone> pending_;
  std::vector<std::vector<uint32_t>> prompts_;
  std::vector<std::string> ids_;
};

// One call's outcome.
struct Outcome {
  std::promise<ProxyResult> p;
  std::future<ProxyResult> f = p.get_future();
  std::atomic<int> runs{0};
  std::function<void(ProxyResult)> Done() {
    return [this](ProxyResult r) {
      if (runs.fetch_add(1) == 0) p.set_value(std::move(r));
    };
  }
  ProxyResult Get() {
    EXPECT_EQ(f.wait_for(20s), std::future_status::ready);
    return f.get();
  }
};

using frame_testing::Identity;
using frame_testing::Tls;

class PrefillTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ca_ = frame_testing::MakeCa("fleet-ca");
    ASSERT_FALSE(HasFailure());
    node_ = Node::Make("prefill-tcp-unit", 64, progress_);
    ASSERT_NE(node_, nullptr);
    kvtransfer::TransportOptions o;
    o.backend = "loopback";
    o.agent_name = "decode-target";
    o.block_bytes = TinyLayout().block_bytes();
    o.num_blocks = 16;
    auto t = kvtransfer::CreateTransport(o);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    target_ = std::move(t).value();
    target_->SetNotificationCallback([this](kvtransfer::Notification n) {
      std::lock_guard lock(mu_);
      notices_.push_back(n.payload);
    });
    prefiller::PrefillerOptions po;
    po.name = "prefill-tcp-unit";
    po.engine_progress = progress_;
    // One request reserving at a time: the tests hold a Reserve while later
    // calls wait in the service queue behind it.
    po.max_batched_tokens = 1;
    prefiller_ = std::make_unique<prefiller::Prefiller>(*node_->engine, *node_->transport, link_, po);
    prefiller_->Start();
    prefiller::PrefillTcpOptions so;
    so.address = "127.0.0.1:0";
    so.tls = Tls(Identity(ca_, "prefill-0"));
    so.on_connection = [this] { connections_.fetch_add(1); };
    so.on_closed = [this](const std::string&, const Status&) { closed_.fetch_add(1); };
    auto server = prefiller::ServePrefillTcp(*prefiller_, so);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    client_ = proxy::PrefillTcpClient::Open(server_->address(), Tls(Identity(ca_, "proxy")));
  }
  void TearDown() override {
    if (client_) client_->Stop();
    if (server_) server_->Stop();
    if (prefiller_) prefiller_->Stop();
  }
  proxy::PrefillArgs Args(const std::string& id, std::vector<uint32_t> prompt) {
    proxy::PrefillArgs a;
    a.request_id = id;
    a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(std::move(prompt));
    a.params.max_tokens = 4;
    a.params.temperature = 0;
    a.deadline = std::chrono::system_clock::time_point::max();
    a.decoder_address = "fake:1";
    a.decoder_name = "fake";
    a.attempt = 1;
    return a;
  }
  ReserveTarget Target(std::vector<uint32_t> slots, uint64_t reservation) {
    ReserveTarget t;
    t.reservation_id = reservation;
    t.generation = target_->generation();
    t.transport_descriptor = target_->LocalDescriptor();
    t.slots = std::move(slots);
    return t;
  }
  // Frames are read in order: once a later call on the same connection is
  // queued at the prefiller, every earlier frame (a cancel) was handled.
  void Barrier() {
    Outcome probe;
    auto call = client_->Start(Args("probe", Prompt(10, 99)), probe.Done());
    ASSERT_NE(call, nullptr);
    ASSERT_TRUE(WaitFor([&] { return prefiller_->counts().queued == 1; }));
    call->Cancel();
    EXPECT_EQ(probe.Get().status().code(), StatusCode::kCancelled);
    ASSERT_TRUE(WaitFor([&] { return prefiller_->counts().queued == 0; }));
  }
  std::vector<std::string> Notices() {
    std::lock_guard lock(mu_);
    return notices_;
  }
  // The prefiller holds nothing for the call any more (its error notice,
  // freeing the decoder's reservation, went out).
  void ExpectNoticeAndNothingLeft(const std::string& notice) {
    ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
    EXPECT_EQ(Notices()[0], notice);
    EXPECT_TRUE(WaitFor([&] {
      const auto c = prefiller_->counts();
      return c.queued == 0 && c.inflight == 0;
    }));
  }

  CertKeyPem ca_;
  std::shared_ptr<prefiller::EngineProgress> progress_ = std::make_shared<prefiller::EngineProgress>();
  std::unique_ptr<Node> node_;
  std::unique_ptr<kvtransfer::Transport> target_;
  HoldingLink link_;
  std::unique_ptr<prefiller::Prefiller> prefiller_;
  std::unique_ptr<FrameServer> server_;
  std::shared_ptr<proxy::PrefillTcpClient> client_;
  std::atomic<int> connections_{0};
  std::atomic<int> closed_{0};  // connections the listener saw end
  std::mutex mu_;
  std::vector<std::string> notices_;
};

constexpr int kCancelled = static_cast<int>(StatusCode::kCancelled);

TEST_F(PrefillTcpTest, CallsOnOneConnectionGetTheirOwnReplies) {
  Outcome a, b;
  const auto pa = Prompt(40, 1), pb = Prompt(20, 2);
  auto ca = client_->Start(Args("a", pa), a.Done());
  auto cb = client_->Start(Args("b", pb), b.Done());
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(cb, nullptr);
  // One reservation at a time (the prefiller's rule): a's first.
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  EXPECT_EQ(link_.Id(0), "a#1");  // keyed by the attempt, as over gRPC
  EXPECT_EQ(link_.Prompt(0), pa);  // the ids arrived intact
  link_.Answer(Target({5, 6, 7}, 1));
  auto ra = a.Get();
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  EXPECT_EQ(ra->transferred_blocks, 3u);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 2; }));
  EXPECT_EQ(link_.Prompt(1), pb);
  link_.Answer(Target({8, 9}, 2));
  auto rb = b.Get();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  EXPECT_EQ(rb->transferred_blocks, 2u);
  EXPECT_EQ(client_->num_calls(), 0u);
  EXPECT_EQ(connections_.load(), 1);
  EXPECT_EQ(server_->accepted(), 1u);
  cb->Cancel();  // after completion: no effect, `done` ran once
  EXPECT_EQ(b.runs.load(), 1);
}

// Session 8 (docs/serving-workers.md, "Prompt and hash encoding"): the prompt as
// fixed32 (a prefiller that advertises reads_fixed32_prompt) and as packed
// varints (an older one) reaches the prefiller's job as the same ids; so
// does the client's own varint bytes, forwarded as prompt_token_ids
// (session 14).
TEST_F(PrefillTcpTest, BothPromptEncodingsArriveIntact) {
  const auto p = Prompt(40, 16);
  std::string varints;  // p's shortest packed encoding, as a client writes it
  for (uint32_t id : p) {
    for (; id >= 0x80; id >>= 7) varints.push_back(static_cast<char>((id & 0x7f) | 0x80));
    varints.push_back(static_cast<char>(id));
  }
  ASSERT_GT(varints.size(), p.size());  // 2-byte varints among them
  for (const int encoding : {0, 1, 2}) {
    const bool fixed32 = encoding != 1;
    SCOPED_TRACE(encoding == 0 ? "fixed32" : encoding == 1 ? "varint" : "client varints");
    Outcome o;
    auto args = Args(encoding == 0 ? "f" : encoding == 1 ? "v" : "c", p);
    args.prompt_fixed32 = fixed32;
    if (encoding == 2) args.prompt_varints = varints;
    ASSERT_NE(client_->Start(args, o.Done()), nullptr);
    const size_t n = static_cast<size_t>(encoding) + 1;
    ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == n; }));
    EXPECT_EQ(link_.Prompt(n - 1), p);
    link_.Answer(Target({5, 6, 7}, n));
    auto r = o.Get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
}

TEST_F(PrefillTcpTest, AnErrorKeepsItsStatusAndMessage) {
  Outcome a;
  ASSERT_NE(client_->Start(Args("a", Prompt(20, 3)), a.Done()), nullptr);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  link_.Answer(ResourceExhaustedError("decoder 'fake' has no free blocks"));
  auto r = a.Get();
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("decoder 'fake' has no free blocks"), std::string::npos)
      << r.status().message();
  // A refusal at once (Submit's own error) too: a deadline already past.
  Outcome late;
  auto args = Args("late", Prompt(10, 4));
  args.deadline = std::chrono::system_clock::now() - 1s;
  ASSERT_NE(client_->Start(args, late.Done()), nullptr);
  EXPECT_EQ(late.Get().status().code(), StatusCode::kDeadlineExceeded);
}

TEST_F(PrefillTcpTest, CancelEndsTheCallAndFreesTheDecodersReservation) {
  Outcome a;
  auto call = client_->Start(Args("a", Prompt(20, 6)), a.Done());
  ASSERT_NE(call, nullptr);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  call->Cancel();
  EXPECT_EQ(a.Get().status().code(), StatusCode::kCancelled);
  // The cancel frame reaches the prefiller: once the decoder's answer
  // comes, it frees the reservation (error notice) instead of pushing.
  Barrier();
  link_.Answer(Target({1, 2}, 7));
  ExpectNoticeAndNothingLeft("a#1|7|" + std::to_string(kCancelled));
  call->Cancel();  // idempotent
  EXPECT_EQ(a.runs.load(), 1);
}

TEST_F(PrefillTcpTest, ADeadlineEndsTheCallOnBothSides) {
  Outcome a;
  auto args = Args("a", Prompt(20, 8));
  args.deadline = std::chrono::system_clock::now() + 300ms;
  ASSERT_NE(client_->Start(args, a.Done()), nullptr);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  // The reservation is still pending when the deadline passes.
  auto r = a.Get();
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  Barrier();  // the client's cancel frame (or the listener's own expiry) was handled
  link_.Answer(Target({3, 4}, 9));
  ExpectNoticeAndNothingLeft("a#1|9|" + std::to_string(kCancelled));
}

// A bare framed client (no deadline timer of its own): the listener alone
// expires the call, replies DEADLINE_EXCEEDED and cancels the work.
TEST_F(PrefillTcpTest, TheListenerExpiresADeadlineOnItsOwnClock) {
  auto conn = FrameConn::Client(server_->address(), Tls(Identity(ca_, "bare")), FrameOptions{});
  std::mutex mu;
  std::condition_variable cv;
  std::vector<pb::PrefillFrame> got;
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    if (!conn->Connect().ok()) return;
    while (!stop.load()) {
      pollfd fd{conn->fd(), conn->Events(), 0};
      poll(&fd, 1, 20);
      Status st = conn->Progress(fd.revents, [&](std::string_view payload) {
        pb::PrefillFrame f;
        if (!f.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
          return InvalidArgumentError("not a PrefillFrame");
        }
        std::lock_guard lock(mu);
        got.push_back(std::move(f));
        cv.notify_all();
        return Status::Ok();
      });
      if (!st.ok()) return;
    }
  });
  pb::PrefillFrame req;
  req.set_call_id(7);
  auto* r = req.mutable_request();
  r->set_request_id("bare");
  r->set_attempt(1);
  for (uint32_t t : Prompt(20, 15)) r->add_prompt_token_ids(t);
  r->mutable_params()->set_max_tokens(4);
  r->mutable_params()->set_top_p(1.0f);
  r->set_decoder_address("fake:1");
  req.set_timeout_us(300'000);
  // Joined however the test ends.
  struct Join {
    std::function<void()> fn;
    ~Join() { fn(); }
  } join{[&] {
    stop.store(true);
    conn->Close(UnavailableError("test over"));
    if (reader.joinable()) reader.join();
  }};
  ASSERT_TRUE(conn->Send(req).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }))  // reserving when it expires
      << (got.empty() ? std::string("no reply") : got[0].DebugString());
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 20s, [&] { return !got.empty(); }));
    EXPECT_EQ(got[0].call_id(), 7u);
    ASSERT_TRUE(got[0].has_error());
    EXPECT_EQ(got[0].error().code(), static_cast<int>(StatusCode::kDeadlineExceeded));
  }
  link_.Answer(Target({9, 10}, 13));
  ExpectNoticeAndNothingLeft("bare#1|13|" + std::to_string(kCancelled));
  join.fn();
  std::lock_guard lock(mu);
  EXPECT_EQ(got.size(), 1u);  // nothing more for that call
}

TEST_F(PrefillTcpTest, ABrokenConnectionEndsEveryCallAndCancelsTheWork) {
  Outcome a, b;
  ASSERT_NE(client_->Start(Args("a", Prompt(20, 9)), a.Done()), nullptr);
  ASSERT_NE(client_->Start(Args("b", Prompt(20, 10)), b.Done()), nullptr);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  server_->Stop();  // as the prefiller's process going away
  for (Outcome* o : {&a, &b}) {
    auto r = o->Get();
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
    EXPECT_NE(r.status().message().find("prefill connection to"), std::string::npos);
  }
  EXPECT_TRUE(client_->ended());
  Outcome c;
  EXPECT_EQ(client_->Start(Args("c", Prompt(10, 11)), c.Done()), nullptr);
  link_.Answer(Target({5, 6}, 11));
  ExpectNoticeAndNothingLeft("a#1|11|" + std::to_string(kCancelled));
}

TEST_F(PrefillTcpTest, TheProxyGoingAwayCancelsItsCalls) {
  Outcome a;
  ASSERT_NE(client_->Start(Args("a", Prompt(20, 12)), a.Done()), nullptr);
  ASSERT_TRUE(WaitFor([&] { return link_.NumReserves() == 1; }));
  client_->Stop();
  EXPECT_EQ(a.Get().status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(WaitFor([&] { return closed_.load() == 1; }));  // the listener cancelled its calls
  link_.Answer(Target({7, 8}, 12));
  ExpectNoticeAndNothingLeft("a#1|12|" + std::to_string(kCancelled));
}

TEST_F(PrefillTcpTest, APeerWithoutAFleetClientCertificateIsRefused) {
  const TlsPem stranger = frame_testing::Stranger(ca_, "stranger");  // it trusts the fleet's server
  // The fixture's own client, a fleet identity, is accepted (it connects
  // without waiting for a call).
  ASSERT_TRUE(WaitFor([&] { return server_->accepted() == 1; }));
  for (auto tls : {Tls(stranger), std::shared_ptr<FrameTls>()}) {  // then no TLS at all
    auto c = proxy::PrefillTcpClient::Open(server_->address(), tls);
    Outcome a;
    auto call = c->Start(Args("x", Prompt(10, 13)), a.Done());
    if (call) {
      EXPECT_EQ(a.Get().status().code(), StatusCode::kUnavailable);
    }
    c->Stop();
  }
  EXPECT_TRUE(server_->WaitForRefused(2, std::chrono::seconds(20)));
  EXPECT_EQ(link_.NumReserves(), 0u);  // nothing reached the prefiller
  EXPECT_EQ(server_->accepted(), 1u);
  EXPECT_EQ(connections_.load(), 1);
}

TEST_F(PrefillTcpTest, NothingListeningIsUnavailable) {
  auto c = proxy::PrefillTcpClient::Open("127.0.0.1:1", Tls(Identity(ca_, "proxy")));
  Outcome a;
  auto call = c->Start(Args("x", Prompt(10, 14)), a.Done());
  if (call) {
    EXPECT_EQ(a.Get().status().code(), StatusCode::kUnavailable);
  }
  EXPECT_TRUE(WaitFor([&] { return c->ended(); }));
  c->Stop();
}

}  // namespace
}  // namespace tandem::worker_test
