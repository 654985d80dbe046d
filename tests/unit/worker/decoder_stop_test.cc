// Decoder::Stop cuts what is still open (docs/failure-handling.md "Leave"):
// open streams end UNAVAILABLE, the engine's requests are aborted, every
// reservation is released, and nothing the engine or the transport
// delivers afterwards runs decoder code — also once the decoder is gone.
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>

#include "decoder/decode_mux.h"
#include "decoder/kv_notice.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "tandem/v1/worker.pb.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using decoder::Decoder;
using decoder::DecodeSpec;

// A decode stream's output whose writes stay in flight until the test says
// they are done (as gRPC's are): later batches wait in the session.
class HeldOutput final : public decoder::MuxOutput {
 public:
  bool Write(const v1::DecodeStreamResponse& batch) override {
    std::lock_guard lock(mu_);
    for (const auto& item : batch.items()) items_.push_back(item);
    return false;
  }
  void EndStream() override {
    std::lock_guard lock(mu_);
    ended_ = true;
  }
  std::vector<v1::DecodeStreamItem> items() {
    std::lock_guard lock(mu_);
    return items_;
  }
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }

 private:
  std::mutex mu_;
  std::vector<v1::DecodeStreamItem> items_;  // guarded by mu_
  bool ended_ = false;                       // guarded by mu_
};

class DecoderStopTest : public ::testing::Test {
 protected:
  void MakeNode() {
    // The gate holds the engine between two steps.
    node_ = Node::Make("decode-stop", 32, nullptr, [gate = gate_](engine::EngineOptions& o) {
      o.on_step = [gate](const engine::StepStats&) { gate->AtStep(); };
    });
    ASSERT_NE(node_, nullptr);
    decoder::DecoderOptions o;
    o.verify_checksums = false;
    decoder_ = std::make_unique<Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
  }
  DecodeSpec Spec(const std::string& id, const std::vector<uint32_t>& prompt, uint32_t max_tokens,
                  bool local) {
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = prompt;
    s.sampling = Greedy(max_tokens);
    s.prefill_locally = local;
    return s;
  }
  void ExpectShutdownEnd(RecordingSink& sink) {
    std::lock_guard lock(sink.mu_);
    EXPECT_TRUE(sink.errored) << "Stop returned with the stream open";
    EXPECT_FALSE(sink.finished);
    EXPECT_EQ(sink.error.code(), StatusCode::kUnavailable) << sink.error.ToString();
    EXPECT_NE(sink.error.message().find("this decoder is shutting down"), std::string::npos)
        << sink.error.ToString();
  }
  // A request of the engine's own (no decoder) run to its end: the engine
  // thread went through steps after whatever came before.
  void RunProbe() {
    auto done = std::make_shared<std::promise<void>>();
    engine::GenerateRequest r;
    r.request_id = "probe";
    r.prompt_ids = Prompt(20, 99);
    r.sampling = Greedy(2);
    r.on_output = [done](const engine::RequestOutput& out) {
      if (out.finished) done->set_value();
    };
    ASSERT_TRUE(node_->engine->Submit(std::move(r)).ok());
    ASSERT_EQ(done->get_future().wait_for(10s), std::future_status::ready);
  }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }

  std::shared_ptr<StepGate> gate_ = std::make_shared<StepGate>();
  std::unique_ptr<Node> node_;
  std::unique_ptr<Decoder> decoder_;
};

// A stream decoding when Stop comes (its first token out, the engine held
// between two steps): Stop ends it UNAVAILABLE before it returns, aborts
// the engine's request (its blocks are free) and refuses new work. The
// engine outlives the decoder: its later steps run nothing of it.
TEST_F(DecoderStopTest, StopEndsAStreamStillDecodingAndTheEngineRunsNothingOfItAfter) {
  gate_->Hold();
  GateRelease release{*gate_};
  MakeNode();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(decoder_->Register(Spec("a", Prompt(20, 40), 400, /*local=*/true), sink).ok());
  ASSERT_TRUE(gate_->WaitParked()) << "the engine ran no step";
  ASSERT_EQ(node_->engine->stats().num_running, 1u);
  ASSERT_LT(FreeBlocks(), 32u);
  size_t tokens = 0;
  {
    std::lock_guard lock(sink->mu_);
    tokens = sink->tokens.size();
  }
  EXPECT_EQ(tokens, 1u);

  decoder_->Stop();
  ExpectShutdownEnd(*sink);
  EXPECT_EQ(node_->engine->stats().num_running, 0u) << "the engine still decodes the request";
  EXPECT_EQ(FreeBlocks(), 32u);
  EXPECT_EQ(decoder_->counts().registered, 0u);
  auto again = std::make_shared<RecordingSink>();
  EXPECT_EQ(decoder_->Register(Spec("b", Prompt(20, 41), 4, true), again).code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(decoder_->Reserve("a", "p", Prompt(20, 40)).status().code(), StatusCode::kUnavailable);

  decoder_.reset();
  gate_->Release();
  RunProbe();
  std::lock_guard lock(sink->mu_);
  EXPECT_EQ(sink->tokens.size(), tokens) << "tokens reached the stream after Stop";
  EXPECT_FALSE(sink->finished);
}

// A push on the wire when Stop comes (the prefiller's data write held 1 s
// by the fault hook): Stop ends the waiting stream UNAVAILABLE and
// releases the reservation. The notice, which lands after Stop, runs
// nothing: no engine request, no block held, not even counted.
TEST_F(DecoderStopTest, StopReleasesAReservationWithAPushOnTheWireAndItsLateNoticeRunsNothing) {
  MakeNode();
  // The notices reach the decoder as decoder_service.cc routes them.
  std::atomic<int> delivered{0};
  node_->transport->SetNotificationCallback([&](kvtransfer::Notification note) {
    auto info = decoder::ParseKvNotice(note.payload);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    decoder_->OnKvNotice(*info);
    ++delivered;
  });
  kvtransfer::TransportOptions wo;
  wo.backend = "loopback";
  wo.agent_name = "writer-stop";
  wo.block_bytes = TinyLayout().block_bytes();
  wo.num_blocks = 4;
  wo.fault.delay_ms = 1000;
  wo.fault.delay_writes = 1;
  auto writer = kvtransfer::CreateTransport(wo);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  const auto prompt = Prompt(40, 42);  // 3 blocks
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(decoder_->Register(Spec("a", prompt, 4, /*local=*/false), sink).ok());
  auto t = decoder_->Reserve("a", "writer-stop", prompt, (*writer)->LocalDescriptor());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(FreeBlocks(), 29u);

  auto peer = (*writer)->ImportPeer(t->transport_descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  std::vector<kvtransfer::BlockPair> pairs;
  for (uint32_t i = 0; i < t->slots.size(); ++i) pairs.push_back({i, t->slots[i]});
  v1::KvNotice n;
  n.set_request_id(t->request_id);
  n.set_reservation_id(t->reservation_id);
  n.set_generation(t->generation);
  n.set_first_token_id(7);
  n.set_capability(t->capability);
  auto x = (*writer)->PrepareBlockWrite(*peer, pairs, n.SerializeAsString());
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  ASSERT_TRUE((*writer)->Post(*x).ok());
  ASSERT_TRUE(WaitFor([&] { return (*writer)->stats().faults_injected == 1; }))
      << "the data write never went on the wire";

  decoder_->Stop();
  ExpectShutdownEnd(*sink);
  EXPECT_EQ(decoder_->counts().reservations, 0u);
  EXPECT_EQ(FreeBlocks(), 32u) << "a KV block is still reserved";

  // The held write lands, then its notice.
  ASSERT_TRUE(WaitFor([&] { return delivered.load() == 1; }));
  ASSERT_TRUE(WaitFor([&] { return (*writer)->stats().inflight_requests == 0; }));
  EXPECT_EQ(decoder_->counts().stale_notices, 0u) << "the stopped decoder acted on the notice";
  EXPECT_EQ(node_->engine->stats().num_running, 0u) << "the late notice started a request";
  EXPECT_EQ(FreeBlocks(), 32u);
  (*writer)->Release(*x).IgnoreError();
  node_->transport->SetNotificationCallback({});
}

// The same through a decode stream (Decoder.DecodeStream): the request's
// end is an in-band error item, and the stream's batches still waiting
// when the decoder is gone leave without it (they count into the tally
// the stream shares, not into the decoder).
TEST_F(DecoderStopTest, StopEndsADecodeStreamRequestInBandAndItsLastBatchLeavesAfterTheDecoder) {
  gate_->Hold();
  GateRelease release{*gate_};
  MakeNode();
  auto out = std::make_shared<HeldOutput>();
  decoder::MuxSession session(*decoder_, out.get(), out);
  v1::DecodeStreamRequest req;
  auto* start = req.mutable_start();
  start->set_handle(5);
  auto* r = start->mutable_request();
  r->set_request_id("a");
  for (uint32_t id : Prompt(20, 43)) r->add_prompt_token_ids(id);
  r->mutable_params()->set_max_tokens(400);
  r->mutable_params()->set_ignore_eos(true);
  r->mutable_params()->set_top_p(1);
  r->set_prefill_locally(true);
  session.OnRequest(req);
  ASSERT_TRUE(gate_->WaitParked()) << "the engine ran no step; stream: "
                                   << (out->items().empty() ? "" : out->items()[0].DebugString());
  ASSERT_EQ(out->items().size(), 1u) << "the `registered` write is in flight";

  decoder_->Stop();
  const std::shared_ptr<decoder::StreamTally> tally = decoder_->stream_tally();
  decoder_.reset();
  gate_->Release();
  RunProbe();
  session.OnWriteDone(true);  // the waiting batch (the end) leaves
  session.OnWriteDone(true);
  session.Close();
  // The first token goes with `registered` or with the end (whether it
  // came before Register returned): two items either way.
  const auto items = out->items();
  ASSERT_EQ(items.size(), 2u);
  EXPECT_TRUE(items[0].registered());
  EXPECT_EQ(items[0].token_ids_size() + items[1].token_ids_size(), 1);
  ASSERT_TRUE(items[1].has_error()) << "the request never ended on the stream";
  EXPECT_EQ(items[1].handle(), 5u);
  EXPECT_EQ(items[1].error().code(), static_cast<int>(StatusCode::kUnavailable));
  EXPECT_EQ(items[1].error().message(), "this decoder is shutting down");
  EXPECT_EQ(tally->messages(), 2u);
  EXPECT_EQ(tally->items(), 2u);
  EXPECT_TRUE(out->ended());
}

}  // namespace
}  // namespace tandem::worker_test
