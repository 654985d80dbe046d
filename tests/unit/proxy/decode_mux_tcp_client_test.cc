// The proxy's decode stream over framed TCP (proxy/decode_mux_tcp_client.h;
// issue 23) against a scripted decoder on a real FrameServer: events arrive
// in order on either delivery thread; a cancel reaches the decoder and ends
// the request CANCELLED; a decoder that cannot be dialled, that is not of
// the fleet CA, or that closes the connection ends every request on it with
// UNAVAILABLE and from_worker = false (the lifecycle then retries or
// migrates, as for a broken gRPC stream); a start to a decoder that reads
// the fixed32 prompt, written in parts, is the message's bytes. Real sockets on 127.0.0.1; the
// whole path with real decoders is decode_stream_test. And (issue 23
// session 36, DecodeMuxSend) the stream's side of a transport that releases
// the handle lock for its send, as framed TCP does: a batch read meanwhile
// reaches its request, on a transport whose sends the test holds.
#include "proxy/decode_mux_tcp_client.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../frame_test_support.h"
#include "common/frame_server.h"
#include "common/net.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

// What one request saw.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  bool registered = false;
  std::vector<uint32_t> tokens;
  bool finished = false;
  bool errored = false;
  Status error = Status::Ok();
  bool from_worker = true;

  DecodeEvents Events() {
    DecodeEvents e;
    e.on_registered = [this] { Set([&] { registered = true; }); };
    e.on_tokens = [this](uint32_t, std::span<const uint32_t> ids) {
      Set([&] { tokens.insert(tokens.end(), ids.begin(), ids.end()); });
    };
    e.on_finished = [this](Finish, uint32_t, uint32_t, uint32_t) { Set([&] { finished = true; }); };
    e.on_error = [this](Status s, bool w) {
      Set([&] {
        errored = true;
        error = s;
        from_worker = w;
      });
    };
    return e;
  }
  bool WaitEnd() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20), [&] { return finished || errored; });
  }

 private:
  // Notifies under the lock: the waiter may destroy this (a stack object)
  // as soon as it sees the end, which it cannot before the notify is done.
  template <class F>
  void Set(F f) {
    std::lock_guard lock(mu);
    f();
    cv.notify_all();
  }
};

// A decoder that answers a start of max_tokens 1 with registered, tokens
// and finished; of max_tokens 2 by closing the connection; others not at
// all (until cancelled: the cancel's handle is recorded). While `hold` is
// set it answers nothing (it waits, reading no further frame, until the
// test clears it).
struct Script {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> cancels;
  std::vector<std::string> starts;  // each start's frame payload, as read
  bool hold = false;
};

class ScriptedDecoder final : public FrameSession {
 public:
  ScriptedDecoder(std::shared_ptr<FrameConn> conn, Script* script)
      : conn_(std::move(conn)), script_(script) {}
  Status OnFrame(std::string_view payload) override {
    pb::DecodeStreamRequest req;
    if (!req.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("bad frame");
    }
    if (req.kind_case() == pb::DecodeStreamRequest::kCancel) {
      {
        std::lock_guard lock(script_->mu);
        script_->cancels.push_back(req.cancel());
      }
      script_->cv.notify_all();
      return Status::Ok();
    }
    {
      std::lock_guard lock(script_->mu);
      script_->starts.emplace_back(payload);
    }
    const uint32_t max_tokens = req.start().request().params().max_tokens();
    if (max_tokens == 2) return UnavailableError("scripted close");
    if (max_tokens != 1) return Status::Ok();
    {
      std::unique_lock lock(script_->mu);
      if (!script_->cv.wait_for(lock, std::chrono::seconds(20), [&] { return !script_->hold; })) {
        return DeadlineExceededError("the test never released the held answer");
      }
    }
    pb::DecodeStreamResponse resp;
    auto* item = resp.add_items();
    item->set_handle(req.start().handle());
    item->set_registered(true);
    item->set_first_index(1);
    item->add_token_ids(42);
    item->add_token_ids(43);
    item->mutable_finished()->set_finish_reason(pb::FINISH_REASON_LENGTH);
    return conn_->Send(resp);
  }
  void OnClosed(const Status&) override {}

 private:
  std::shared_ptr<FrameConn> conn_;
  Script* script_;
};

std::unique_ptr<FrameServer> Serve(std::shared_ptr<FrameTls> tls, Script* script) {
  return frame_testing::Listen(std::move(tls), [script](const std::shared_ptr<FrameConn>& c) {
    return std::make_shared<ScriptedDecoder>(c, script);
  });
}

DecodeArgs Args(uint32_t max_tokens) {
  DecodeArgs a;
  a.request_id = "req";
  a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{1, 2, 3});
  a.params.max_tokens = max_tokens;
  a.deadline = std::chrono::system_clock::time_point::max();
  a.attempt = 1;
  return a;
}

class DecodeMuxTcpClientTest : public ::testing::TestWithParam<bool> {
 protected:
  // A scripted decoder and the proxy's stream to it over mutual TLS (a
  // 32 kB frame spans several records), delivering on the parameter's
  // thread.
  void OpenOverTls() {
    const CertKeyPem ca = frame_testing::MakeCa("fleet-ca");
    server_ = Serve(frame_testing::Tls(frame_testing::Identity(ca, "decode-0")), &script_);
    ASSERT_NE(server_, nullptr);
    mux_ = DecodeMuxTcpClient::Open(server_->address(),
                                    frame_testing::Tls(frame_testing::Identity(ca, "proxy")),
                                    /*deliver_on_grpc_thread=*/GetParam());
  }
  // One request on the stream, answered by the script: tokens 42, 43.
  void StartAndFinish(const DecodeArgs& args) {
    Seen seen;
    DecodeEvents e = seen.Events();
    ASSERT_NE(mux_->Start(args, e), nullptr);
    ASSERT_TRUE(seen.WaitEnd());
    EXPECT_TRUE(seen.finished);
    EXPECT_EQ(seen.tokens, (std::vector<uint32_t>{42, 43}));
  }
  std::vector<std::string> Starts() {
    std::lock_guard lock(script_.mu);
    return script_.starts;
  }

  Script script_;
  std::unique_ptr<FrameServer> server_;
  std::shared_ptr<DecodeMuxTcpClient> mux_;
};

TEST_P(DecodeMuxTcpClientTest, EventsCancelAndABrokenConnection) {
  Script script;
  auto server = Serve(nullptr, &script);
  ASSERT_NE(server, nullptr);
  auto mux = DecodeMuxTcpClient::Open(server->address(), nullptr, /*deliver_on_grpc_thread=*/GetParam());

  Seen done;
  DecodeEvents e1 = done.Events();
  // The receiver's hot bytes are only prefetched, never read: freed
  // memory, a range past HotBytes::kMaxBytes and none change nothing.
  {
    auto freed = std::make_unique<char[]>(256);
    e1.hot[0] = {freed.get(), 256};
  }
  e1.hot[1] = {&done, 1u << 20};
  ASSERT_NE(mux->Start(Args(1), e1), nullptr);
  ASSERT_TRUE(done.WaitEnd());
  EXPECT_TRUE(done.registered);
  EXPECT_EQ(done.tokens, (std::vector<uint32_t>{42, 43}));
  EXPECT_TRUE(done.finished);
  EXPECT_FALSE(done.errored);

  Seen cancelled;
  DecodeEvents e2 = cancelled.Events();
  auto call = mux->Start(Args(100), e2);
  ASSERT_NE(call, nullptr);
  call->Cancel();
  ASSERT_TRUE(cancelled.WaitEnd());
  EXPECT_EQ(cancelled.error.code(), StatusCode::kCancelled);
  EXPECT_FALSE(cancelled.from_worker);
  {
    std::unique_lock lock(script.mu);
    ASSERT_TRUE(script.cv.wait_for(lock, std::chrono::seconds(20),
                                   [&] { return !script.cancels.empty(); }));
    EXPECT_EQ(script.cancels.size(), 1u);  // the handle of the second start
    EXPECT_EQ(script.cancels[0], 2u);
  }

  // A request waiting on the stream when the decoder closes it.
  Seen waiting, closer;
  DecodeEvents e3 = waiting.Events();
  DecodeEvents e4 = closer.Events();
  ASSERT_NE(mux->Start(Args(100), e3), nullptr);
  ASSERT_NE(mux->Start(Args(2), e4), nullptr);
  for (Seen* s : {&waiting, &closer}) {
    ASSERT_TRUE(s->WaitEnd());
    EXPECT_TRUE(s->errored);
    EXPECT_EQ(s->error.code(), StatusCode::kUnavailable) << s->error.ToString();
    EXPECT_FALSE(s->from_worker);
  }
  // The stream is over (DecodeMux::EndAll marks it ended before it fails
  // the requests): the next request needs a new one.
  Seen late;
  DecodeEvents e5 = late.Events();
  EXPECT_TRUE(mux->ended());
  EXPECT_EQ(mux->Start(Args(1), e5), nullptr);
  mux->Stop();
}

// With the receivers' token table set, a batch's tokens are prefetched from
// it (issue 23, tok-chain): delivery is unchanged, an id past the table
// included (43 here; the detokenizer gives it no bytes), and a table set
// again (or none) takes effect for the next batch.
TEST_P(DecodeMuxTcpClientTest, ATokenTableOnlyPrefetches) {
  Script script;
  auto server = Serve(nullptr, &script);
  ASSERT_NE(server, nullptr);
  auto mux = DecodeMuxTcpClient::Open(server->address(), nullptr, /*deliver_on_grpc_thread=*/GetParam());
  model::TokenBytesTable table;
  for (int i = 0; i < 43; ++i) ASSERT_TRUE(table.Add(std::to_string(i), /*special=*/false));
  const model::TokenBytesTable* tables[] = {&table, nullptr};
  for (const model::TokenBytesTable* t : tables) {
    mux->SetTokenTable(t);
    Seen done;
    DecodeEvents e = done.Events();
    ASSERT_NE(mux->Start(Args(1), e), nullptr);
    ASSERT_TRUE(done.WaitEnd());
    EXPECT_TRUE(done.registered);
    EXPECT_EQ(done.tokens, (std::vector<uint32_t>{42, 43}));
    EXPECT_TRUE(done.finished);
  }
  mux->Stop();
}

// Issue 23 (dec-parts): a start to a decoder that reads the fixed32 prompt
// leaves in parts (DecodeStartInParts); the decoder reads, byte for byte,
// the message's serialization, and answers it as any start.
TEST_P(DecodeMuxTcpClientTest, AStartInPartsReachesTheDecoderAsTheMessage) {
  ASSERT_NO_FATAL_FAILURE(OpenOverTls());
  DecodeArgs args = Args(1);
  std::vector<uint32_t> ids(8000);
  for (uint32_t i = 0; i < ids.size(); ++i) ids[i] = i * 2654435761u;
  args.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  args.prompt_fixed32 = true;
  args.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  for (int i = 0; i < 2; ++i) ASSERT_NO_FATAL_FAILURE(StartAndFinish(args));
  const std::vector<std::string> starts = Starts();
  ASSERT_EQ(starts.size(), 2u);
  for (uint64_t handle = 1; handle <= 2; ++handle) {
    pb::DecodeStreamRequest want;
    auto* start = want.mutable_start();
    start->set_handle(handle);
    FillDecodeRequest(args, start->mutable_request());
    start->set_traceparent(args.traceparent);
    EXPECT_EQ(starts[handle - 1], want.SerializeAsString()) << "handle " << handle;
  }
  pb::DecodeStreamRequest got;
  ASSERT_TRUE(got.ParseFromString(starts[0]));
  EXPECT_EQ(std::vector<uint32_t>(got.start().request().prompt_token_ids_fixed32().begin(),
                                  got.start().request().prompt_token_ids_fixed32().end()),
            ids);
  mux_->Stop();
}

// Session 14 (issue 23): with the client's own packed varints in the args
// the start carries those bytes as the request's prompt_token_ids (a
// decoder that reads fixed32 reads that field too), and the decoder parses
// the message the message way builds with the varint field: the same ids.
TEST_P(DecodeMuxTcpClientTest, TheClientsVarintsReachTheDecoderAsItsPromptField) {
  ASSERT_NO_FATAL_FAILURE(OpenOverTls());
  DecodeArgs args = Args(1);
  std::vector<uint32_t> ids(8000);
  std::string varints;  // the shortest packed encoding, as a client writes it
  for (uint32_t i = 0; i < ids.size(); ++i) {
    ids[i] = (i * 2654435761u) % 128256u;  // 1- to 3-byte varints
    for (uint32_t v = ids[i]; ; v >>= 7) {
      if (v < 0x80) {
        varints.push_back(static_cast<char>(v));
        break;
      }
      varints.push_back(static_cast<char>((v & 0x7f) | 0x80));
    }
  }
  args.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  args.prompt_varints = varints;
  args.prompt_fixed32 = true;
  ASSERT_NO_FATAL_FAILURE(StartAndFinish(args));
  const std::vector<std::string> starts = Starts();
  ASSERT_EQ(starts.size(), 1u);
  const std::string& start = starts[0];
  EXPECT_NE(start.find(varints), std::string::npos);  // the client's bytes, as they came
  EXPECT_LT(start.size(), varints.size() + 256);
  pb::DecodeStreamRequest got;
  ASSERT_TRUE(got.ParseFromString(start));
  EXPECT_EQ(got.start().request().prompt_token_ids_fixed32_size(), 0);
  EXPECT_EQ(std::vector<uint32_t>(got.start().request().prompt_token_ids().begin(),
                                  got.start().request().prompt_token_ids().end()),
            ids);
  pb::DecodeStreamRequest want;
  want.mutable_start()->set_handle(1);
  DecodeArgs as_varints = args;
  as_varints.prompt_varints = {};
  as_varints.prompt_fixed32 = false;
  FillDecodeRequest(as_varints, want.mutable_start()->mutable_request());
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  mux_->Stop();
}

// The quiet end (session 41, docs/decode-stream.md): a start for it says
// so, in parts or as a message; a forgotten request leaves the stream's
// table with no message to the decoder and gets no event after; an item
// for its handle that comes anyway (a decoder that does not know the flag)
// is dropped.
TEST_P(DecodeMuxTcpClientTest, AForgottenRequestSendsNothingAndGetsNoEvents) {
  ASSERT_NO_FATAL_FAILURE(OpenOverTls());
  DecodeArgs parts = Args(1);
  parts.prompt_ids = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>(64, 9));
  parts.prompt_fixed32 = true;     // a start in parts: the flag in its tail
  DecodeArgs message = Args(100);  // the message way; the script holds it
  message.prompt_by_reference = true;
  for (DecodeArgs* a : {&parts, &message}) a->quiet_end_on_first_token = true;

  // The scripted decoder answers max_tokens 1, held until both are
  // forgotten: the answer, read after the Forget, reaches nobody. (An item
  // delivered before the Forget is delivered: the proxy then had it first,
  // as before the quiet end; not what this test is about.)
  {
    std::lock_guard lock(script_.mu);
    script_.hold = true;
  }
  Seen answered, held, cancelled;
  DecodeEvents e1 = answered.Events();
  auto c1 = mux_->Start(parts, e1);
  ASSERT_NE(c1, nullptr);
  c1->Forget();
  DecodeEvents e2 = held.Events();
  auto c2 = mux_->Start(message, e2);
  ASSERT_NE(c2, nullptr);
  c2->Forget();
  EXPECT_EQ(mux_->num_requests(), 0u);
  {
    std::lock_guard lock(script_.mu);
    script_.hold = false;
  }
  script_.cv.notify_all();
  // A request cancelled after them: its cancel is the only one the decoder reads.
  DecodeEvents e3 = cancelled.Events();
  auto c3 = mux_->Start(Args(100), e3);
  ASSERT_NE(c3, nullptr);
  c3->Cancel();
  ASSERT_TRUE(cancelled.WaitEnd());
  {
    std::unique_lock lock(script_.mu);
    ASSERT_TRUE(script_.cv.wait_for(lock, std::chrono::seconds(20),
                                    [&] { return !script_.cancels.empty(); }));
    EXPECT_EQ(script_.cancels, std::vector<uint64_t>{3});
  }
  // And a request after that one, answered: the stream reads on, in order,
  // so the forgotten request's item (read before it) reached nobody.
  ASSERT_NO_FATAL_FAILURE(StartAndFinish(Args(1)));
  for (Seen* s : {&answered, &held}) {
    std::lock_guard lock(s->mu);
    EXPECT_FALSE(s->finished || s->errored);
  }
  const std::vector<std::string> starts = Starts();
  ASSERT_EQ(starts.size(), 4u);
  for (int i : {0, 1}) {
    pb::DecodeStreamRequest got;
    ASSERT_TRUE(got.ParseFromString(starts[i]));
    EXPECT_TRUE(got.start().quiet_end_on_first_token()) << i;
  }
  pb::DecodeStreamRequest plain;
  ASSERT_TRUE(plain.ParseFromString(starts[2]));
  EXPECT_FALSE(plain.start().quiet_end_on_first_token());
  mux_->Stop();
}

INSTANTIATE_TEST_SUITE_P(DeliveryThread, DecodeMuxTcpClientTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "grpc" : "reader"; });

TEST(DecodeMuxTcpClient, NothingListeningEndsTheRequestUnavailable) {
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  // The connect runs on the reader thread: when it fails before Start, the
  // stream is already over and Start says so (null; the worker client then
  // opens a new one). Open again until a request is on the stream first.
  std::shared_ptr<DecodeMuxTcpClient> mux;
  std::shared_ptr<Call> call;
  Seen s;
  for (int i = 0; i < 50 && call == nullptr; ++i) {
    if (mux) {
      EXPECT_TRUE(mux->ended());
      mux->Stop();
    }
    mux = DecodeMuxTcpClient::Open(HostPort{"127.0.0.1", *port}.ToString(), nullptr);
    DecodeEvents e = s.Events();
    call = mux->Start(Args(1), e);
  }
  ASSERT_NE(call, nullptr);
  ASSERT_TRUE(s.WaitEnd());
  EXPECT_EQ(s.error.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.error.message().find("cannot connect"), std::string::npos) << s.error.message();
  EXPECT_FALSE(s.from_worker);
  mux->Stop();
}

TEST(DecodeMuxTcpClient, ADecoderOutsideTheFleetCaIsRefused) {
  const CertKeyPem ca = frame_testing::MakeCa("fleet-ca");
  // Its certificate is from another CA (it trusts the fleet's).
  auto server_tls = frame_testing::Tls(frame_testing::Stranger(ca, "decode-0"));
  auto client_tls = frame_testing::Tls(frame_testing::Identity(ca, "proxy"));
  ASSERT_TRUE(server_tls && client_tls);
  Script script;
  auto server = Serve(server_tls, &script);
  ASSERT_NE(server, nullptr);
  auto mux = DecodeMuxTcpClient::Open(server->address(), client_tls);
  Seen s;
  DecodeEvents e = s.Events();
  ASSERT_NE(mux->Start(Args(1), e), nullptr);
  ASSERT_TRUE(s.WaitEnd());
  EXPECT_EQ(s.error.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.error.message().find("certificate"), std::string::npos) << s.error.message();
  EXPECT_FALSE(s.from_worker);
  EXPECT_FALSE(s.registered);
  mux->Stop();
}

// Records every send ("start 1", "cancel 1", ...). While held, a start
// waits in its send (the handle lock released, as framed TCP does) until
// the test lets it go.
class HeldMux final : public DecodeMux {
 public:
  using DecodeMux::Deliver;

  void Hold() {
    std::lock_guard lock(test_mu_);
    hold_ = true;
  }
  // Waits until a start is held in its send.
  void WaitHeld() {
    std::unique_lock lock(test_mu_);
    cv_.wait(lock, [this] { return held_; });
  }
  void Release() {
    std::lock_guard lock(test_mu_);
    hold_ = held_ = false;
    cv_.notify_all();
  }
  std::vector<std::string> sent() {
    std::lock_guard lock(test_mu_);
    return sent_;
  }

 private:
  void SendLocked(std::unique_lock<std::mutex>& lock, pb::DecodeStreamRequest msg) override {
    lock.unlock();
    std::unique_lock t(test_mu_);
    if (msg.has_start() && hold_) {
      held_ = true;
      cv_.notify_all();
      cv_.wait(t, [this] { return !hold_; });
    }
    sent_.push_back(msg.has_start() ? "start " + std::to_string(msg.start().handle())
                                    : "cancel " + std::to_string(msg.cancel()));
  }
  void CancelRpc() override {}

  std::mutex test_mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  bool held_ = false;
  std::vector<std::string> sent_;
};

TEST(DecodeMuxSend, ABatchIsDeliveredWhileAStartIsOnTheWire) {
  auto mux = std::make_shared<HeldMux>();
  Seen a, b;
  DecodeEvents ea = a.Events(), eb = b.Events();
  ASSERT_NE(mux->Start(Args(4), ea), nullptr);  // handle 1, sent at once
  mux->Hold();
  std::thread starter([&] { ASSERT_NE(mux->Start(Args(4), eb), nullptr); });  // handle 2, held
  mux->WaitHeld();
  // Handle 1's tokens arrive while handle 2's start is being sent.
  const std::vector<uint32_t> ids = {7, 8};
  DecodeItem item;
  item.handle = 1;
  item.first_index = 1;
  item.token_ids = ids;
  mux->Deliver(std::span<const DecodeItem>(&item, 1));
  {
    std::lock_guard lock(a.mu);
    EXPECT_EQ(a.tokens, ids);
  }
  EXPECT_EQ(mux->sent(), (std::vector<std::string>{"start 1"}));  // still held
  mux->Release();
  starter.join();
  EXPECT_EQ(mux->sent(), (std::vector<std::string>{"start 1", "start 2"}));
}

}  // namespace
}  // namespace tandem::proxy
