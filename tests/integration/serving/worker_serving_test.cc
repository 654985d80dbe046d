// Real `tandem decode`, `tandem prefill` and `tandem both` processes on
// loopback with real gRPC and real UCX; this test plays the proxy
// (DESIGN.md section 2): Decode (registered) -> Prefill(decoder) -> tokens.
// Outputs must equal the in-process engine, token for token.
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <set>
#include <tuple>

#include "common/block_hash.h"
#include "serving_harness.h"

namespace tandem::serving_test {
namespace {

struct Fleet {
  fs::path dir;
  std::string fleet_file;
  std::unique_ptr<cli::Supervisor> sup;
  cli::Child* decode = nullptr;
  cli::Child* prefill = nullptr;
  cli::Child* both = nullptr;
  std::unique_ptr<pb::Decoder::Stub> decoder;
  std::unique_ptr<pb::Prefiller::Stub> prefiller;
  std::unique_ptr<pb::Decoder::Stub> both_decoder;
  Reference ref;
};

Fleet* g_fleet = nullptr;
std::atomic<int> g_next_id{0};

std::string NewId(const std::string& what) { return what + "-" + std::to_string(g_next_id++); }

class WorkerServingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_fleet = new Fleet();
    Fleet& f = *g_fleet;
    f.dir = fs::temp_directory_path() / ("tandem-serving-" + std::to_string(getpid()));
    f.fleet_file = WriteFleetFile(f.dir);
    auto cfg = model::LoadModelConfig(ModelDir());
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    f.ref.config = *cfg;
    auto w = model::LoadWeights(ModelDir(), *cfg);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    f.ref.weights = std::move(w).value();

    f.sup = std::make_unique<cli::Supervisor>();
    auto d = StartWorker(*f.sup, f.fleet_file, "decode", "decode-0");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    f.decode = *d;
    auto p = StartWorker(*f.sup, f.fleet_file, "prefill", "prefill-0");
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    f.prefill = *p;
    auto b = StartWorker(*f.sup, f.fleet_file, "both", "both-0");
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    f.both = *b;
    auto ch = [&f](const std::string& a) { return InternalChannel(f.fleet_file, a); };
    f.decoder = pb::Decoder::NewStub(ch(f.decode->grpc));
    f.prefiller = pb::Prefiller::NewStub(ch(f.prefill->grpc));
    f.both_decoder = pb::Decoder::NewStub(ch(f.both->grpc));
  }

  static void TearDownTestSuite() {
    if (g_fleet != nullptr && g_fleet->sup) {
      // SIGTERM: every worker drains and exits 0.
      EXPECT_EQ(g_fleet->sup->StopAll(10s), 0);
      for (const auto& c : g_fleet->sup->children()) {
        EXPECT_TRUE(WIFEXITED(c.exit_status) && WEXITSTATUS(c.exit_status) == 0)
            << cli::DescribeExit(c);
      }
    }
    if (g_fleet != nullptr) {
      std::error_code ec;
      fs::remove_all(g_fleet->dir, ec);
    }
    delete g_fleet;
    g_fleet = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(g_fleet, nullptr);
    ASSERT_NE(g_fleet->decode, nullptr);
    ASSERT_NE(g_fleet->prefill, nullptr);
  }

  static uint32_t Vocab() { return std::min<uint32_t>(g_fleet->ref.config.vocab_size, 4096); }

  static pb::DecodeRequest MakeDecode(const std::string& id, const std::vector<uint32_t>& prompt,
                                      uint32_t max_tokens, bool ignore_eos = true) {
    pb::DecodeRequest r;
    r.set_request_id(id);
    r.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    *r.mutable_params() = Greedy(max_tokens, ignore_eos);
    return r;
  }
  // As a proxy of session 39 sends it to a decoder that takes the prompt
  // from the prefiller's Reserve: its length and digest, none of its tokens.
  static pb::DecodeRequest MakeDecodeByReference(const std::string& id,
                                                 const std::vector<uint32_t>& prompt,
                                                 uint32_t max_tokens) {
    pb::DecodeRequest r = MakeDecode(id, {}, max_tokens);
    r.set_prompt_length(static_cast<uint32_t>(prompt.size()));
    r.set_prompt_digest(PromptDigest(prompt));
    return r;
  }
  static pb::PrefillRequest MakePrefill(const std::string& id, const std::vector<uint32_t>& prompt,
                                        uint32_t max_tokens, bool ignore_eos = true) {
    pb::PrefillRequest r;
    r.set_request_id(id);
    r.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    *r.mutable_params() = Greedy(max_tokens, ignore_eos);
    r.set_decoder_address(g_fleet->decode->grpc);
    r.set_decoder_name("decode-0");
    return r;
  }

  // The proxy's path for one request, disaggregated.
  // `prefill_prompt`: what the Prefill carries, when not `prompt` (a start
  // by reference to another prompt).
  static Outcome RunDisaggregated(const std::vector<uint32_t>& prompt, uint32_t max_tokens,
                                  bool ignore_eos = true,
                                  std::chrono::milliseconds prefill_deadline = 60s,
                                  bool by_reference = false,
                                  const std::vector<uint32_t>* prefill_prompt = nullptr) {
    const std::string id = NewId("req");
    Outcome out;
    DecodeCall call(*g_fleet->decoder, by_reference
                                           ? MakeDecodeByReference(id, prompt, max_tokens)
                                           : MakeDecode(id, prompt, max_tokens, ignore_eos));
    out.registered = call.ReadRegistered();
    if (!out.registered) {
      out.decode_status = call.Finish();
      return out;
    }
    grpc::ClientContext pctx;
    const auto deadline = std::chrono::system_clock::now() + prefill_deadline;
    pctx.set_deadline(deadline);
    pb::PrefillRequest req =
        MakePrefill(id, prefill_prompt ? *prefill_prompt : prompt, max_tokens, ignore_eos);
    // The request's deadline, as the proxy sends it: the prefiller's
    // Reserve waits for at most the time it leaves.
    req.set_deadline_unix_ms(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline.time_since_epoch()).count());
    out.prefill_status = g_fleet->prefiller->Prefill(&pctx, req, &out.prefill);
    if (!out.prefill_status.ok()) call.Cancel();
    call.ReadInto(out);
    out.decode_status = call.Finish();
    return out;
  }

  static void ExpectMatchesReference(const Outcome& o, const std::vector<uint32_t>& prompt,
                                     uint32_t max_tokens, bool ignore_eos = true) {
    ASSERT_TRUE(o.registered);
    ASSERT_TRUE(o.prefill_status.ok()) << o.prefill_status.error_message();
    ASSERT_TRUE(o.decode_status.ok()) << o.decode_status.error_message();
    const auto want = g_fleet->ref.Generate(prompt, max_tokens, ignore_eos);
    EXPECT_EQ(o.tokens, want) << "prompt of " << prompt.size() << " tokens";
    EXPECT_TRUE(o.indices_ok);
    ASSERT_TRUE(o.finished.has_value());
    EXPECT_EQ(o.finished->completion_tokens(), want.size());
    ASSERT_FALSE(o.tokens.empty());
    EXPECT_EQ(o.prefill.first_token_id(), o.tokens[0]);
    const uint32_t blocks = static_cast<uint32_t>((prompt.size() + kBlockSize - 1) / kBlockSize);
    EXPECT_EQ(o.prefill.transferred_blocks() + o.prefill.decoder_cached_blocks(), blocks);
    EXPECT_EQ(o.finished->decoder_cached_prompt_tokens(),
              std::min<uint32_t>(o.prefill.decoder_cached_blocks() * kBlockSize, prompt.size()));
  }
};

TEST_F(WorkerServingTest, GreedyOutputEqualsTheEngineTokenForToken) {
  // Short, exactly one block, several blocks, longer than a prefill chunk
  // (max_batched_tokens 64), and one that may stop at end of sequence.
  const std::vector<std::pair<uint32_t, uint32_t>> cases = {{5, 8}, {16, 6}, {37, 10}, {150, 12}, {90, 5}};
  uint32_t seed = 100;
  for (auto [len, max_tokens] : cases) {
    const auto prompt = Prompt(len, seed++, Vocab());
    const Outcome o = RunDisaggregated(prompt, max_tokens);
    ExpectMatchesReference(o, prompt, max_tokens);
    EXPECT_GT(o.prefill.transferred_bytes(), 0u);
    EXPECT_EQ(o.finished->finish_reason(), pb::FINISH_REASON_LENGTH);
  }
  const auto prompt = Prompt(20, 7, Vocab());
  const Outcome o = RunDisaggregated(prompt, 40, /*ignore_eos=*/false);
  ExpectMatchesReference(o, prompt, 40, false);
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
}

TEST_F(WorkerServingTest, SharedPrefixIsReusedOnBothSides) {
  auto a = Prompt(48, 200, Vocab());  // three full blocks in common
  auto b = a;
  const auto tail_a = Prompt(10, 201, Vocab());
  const auto tail_b = Prompt(13, 202, Vocab());
  a.insert(a.end(), tail_a.begin(), tail_a.end());
  b.insert(b.end(), tail_b.begin(), tail_b.end());
  const Outcome first = RunDisaggregated(a, 6);
  ExpectMatchesReference(first, a, 6);
  const Outcome second = RunDisaggregated(b, 6);
  ExpectMatchesReference(second, b, 6);
  EXPECT_GE(second.prefill.decoder_cached_blocks(), 3u);
  EXPECT_GE(second.finished->decoder_cached_prompt_tokens(), 48u);
  EXPECT_GE(second.prefill.cached_prompt_tokens(), 32u);
  EXPECT_LT(second.prefill.transferred_blocks(), (b.size() + kBlockSize - 1) / kBlockSize);
  auto positive = [](double v) { return v > 0; };
  const std::string& dm = g_fleet->decode->metrics;
  const std::string& pm = g_fleet->prefill->metrics;
  EXPECT_GT(WaitForMetric(dm, "tandem_prefix_cache_hits_tokens_total", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(pm, "tandem_prefix_cache_hits_tokens_total", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(dm, "tandem_decode_step_seconds_count", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(pm, "tandem_kv_transfer_bytes_total", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(pm, "tandem_kv_transfer_seconds_count", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(pm, "tandem_kv_transfer_overhead_ratio_count", positive).value_or(0), 0);
  EXPECT_GT(WaitForMetric(pm, "tandem_prefill_seconds_count", positive).value_or(0), 0);
}

TEST_F(WorkerServingTest, ConcurrentRequestsAllMatch) {
  constexpr int kN = 8;
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < kN; ++i) prompts.push_back(Prompt(6 + 5 * i, 300 + i, Vocab()));
  std::vector<Outcome> outs(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] { outs[i] = RunDisaggregated(prompts[i], 8); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kN; ++i) ExpectMatchesReference(outs[i], prompts[i], 8);
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
}

TEST_F(WorkerServingTest, AggregatedWorkerPrefillsLocally) {
  ASSERT_NE(g_fleet->both, nullptr);
  const auto prompt = Prompt(70, 400, Vocab());
  pb::DecodeRequest req = MakeDecode(NewId("local"), prompt, 9);
  req.set_prefill_locally(true);
  DecodeCall call(*g_fleet->both_decoder, req);
  ASSERT_TRUE(call.ReadRegistered());
  Outcome o;
  call.ReadInto(o);
  ASSERT_TRUE(call.Finish().ok());
  EXPECT_EQ(o.tokens, g_fleet->ref.Generate(prompt, 9, true));
  EXPECT_TRUE(o.indices_ok);
  ASSERT_TRUE(o.finished.has_value());
  EXPECT_EQ(o.finished->completion_tokens(), 9u);
  EXPECT_EQ(WaitForIdle(g_fleet->both->metrics), "");
}

TEST_F(WorkerServingTest, FullDecoderHoldsReservesUntilLeasesFreeUnwrittenReservations) {
  // Two registered requests whose reservations this test takes (as a
  // prefiller that never writes) fill the decoder.
  const auto big1 = Prompt(300, 500, Vocab());
  const auto big2 = Prompt(300, 501, Vocab());
  std::vector<std::unique_ptr<DecodeCall>> holders;
  for (const auto* big : {&big1, &big2}) {
    const std::string id = NewId("hold");
    holders.push_back(std::make_unique<DecodeCall>(*g_fleet->decoder, MakeDecode(id, *big, 4)));
    ASSERT_TRUE(holders.back()->ReadRegistered());
    pb::ReserveRequest rr;
    rr.set_request_id(id);
    rr.set_prefiller("test");
    rr.mutable_prompt_token_ids()->Add(big->begin(), big->end());
    pb::ReserveResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(g_fleet->decoder->Reserve(&ctx, rr, &resp).ok());
    ASSERT_TRUE(resp.has_target()) << resp.error().message();
    EXPECT_EQ(resp.target().slots_size(), 19);
  }
  const std::string& dm = g_fleet->decode->metrics;
  const double kv_waits = MetricValue(Scrape(dm), "tandem_decode_kv_waits_total").value_or(-1);
  ASSERT_GE(kv_waits, 0);
  // A real request whose deadline comes long before the leases end (1.5
  // s): its reservation waits for blocks, none come free, it is refused
  // RESOURCE_EXHAUSTED before the deadline; nothing held.
  const auto short_prompt = Prompt(100, 502, Vocab());
  const Outcome refused = RunDisaggregated(short_prompt, 4, true, 1500ms);
  EXPECT_EQ(refused.prefill_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.prefill_status.error_message();
  EXPECT_NE(refused.prefill_status.error_message().find("no KV blocks came free"), std::string::npos)
      << refused.prefill_status.error_message();
  EXPECT_EQ(WaitForMetric(dm, "tandem_kv_reservations", [](double v) { return v == 2; }).value_or(-1), 2);
  EXPECT_GE(WaitForMetric(dm, "tandem_kv_reservations_refused_total", [](double v) { return v >= 1; })
                .value_or(0), 1);

  // One that may wait (60 s): it waits while the holders' leases run.
  const auto prompt = Prompt(100, 504, Vocab());
  auto served = std::async(std::launch::async, [&] { return RunDisaggregated(prompt, 4); });
  EXPECT_GE(WaitForMetric(dm, "tandem_decode_kv_waits_total",
                          [&](double v) { return v >= kv_waits + 2; })
                .value_or(0),
            kv_waits + 2);
  // No KV ever comes for the holders: the leases expire, their blocks are
  // freed and their streams end with UNAVAILABLE; the waiting request gets
  // the blocks and is served, token-exact.
  for (auto& h : holders) {
    Outcome out;
    h->ReadInto(out);
    const grpc::Status st = h->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    ASSERT_TRUE(out.error.has_value());
    EXPECT_EQ(out.error->code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  }
  ExpectMatchesReference(served.get(), prompt, 4);
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_GE(WaitForMetric(dm, "tandem_kv_lease_expired_total", [](double v) { return v >= 2; })
                .value_or(0), 2);
  // And the decoder serves again.
  const auto again = Prompt(40, 503, Vocab());
  ExpectMatchesReference(RunDisaggregated(again, 5), again, 5);
}

TEST_F(WorkerServingTest, CancelAtEveryStageFreesEverything) {
  // Before the prefill: the stream alone.
  {
    DecodeCall call(*g_fleet->decoder, MakeDecode(NewId("c0"), Prompt(30, 600, Vocab()), 8));
    ASSERT_TRUE(call.ReadRegistered());
    call.Cancel();
    EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // A reservation whose writer gives up: cancel of the stream while this
  // test holds the reservation, then the prefiller-side error notice is
  // simulated by the lease (covered above); here: cancel the Prefill RPC.
  {
    const auto prompt = Prompt(120, 601, Vocab());
    const std::string id = NewId("c1");
    DecodeCall call(*g_fleet->decoder, MakeDecode(id, prompt, 8));
    ASSERT_TRUE(call.ReadRegistered());
    grpc::ClientContext pctx;
    pb::PrefillResponse resp;
    std::thread canceller([&] { pctx.TryCancel(); });
    grpc::Status st = g_fleet->prefiller->Prefill(&pctx, MakePrefill(id, prompt, 8), &resp);
    canceller.join();
    call.Cancel();
    (void)call.Finish();
    (void)st;  // CANCELLED, or OK if it won the race
  }
  // Mid-decode: a long completion cancelled after its first tokens.
  {
    const auto prompt = Prompt(25, 602, Vocab());
    const std::string id = NewId("c2");
    DecodeCall call(*g_fleet->decoder, MakeDecode(id, prompt, 400));
    ASSERT_TRUE(call.ReadRegistered());
    grpc::ClientContext pctx;
    pb::PrefillResponse resp;
    ASSERT_TRUE(g_fleet->prefiller->Prefill(&pctx, MakePrefill(id, prompt, 400), &resp).ok());
    Outcome o;
    call.ReadInto(o, 2);
    EXPECT_FALSE(o.tokens.empty());
    call.Cancel();
    (void)call.Finish();
  }
  // A prefill whose deadline has passed is refused, nothing computed.
  {
    const auto prompt = Prompt(25, 603, Vocab());
    pb::PrefillRequest pr = MakePrefill(NewId("c3"), prompt, 4);
    pr.set_deadline_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch()).count() - 1000);
    grpc::ClientContext pctx;
    pb::PrefillResponse resp;
    EXPECT_EQ(g_fleet->prefiller->Prefill(&pctx, pr, &resp).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // A prefill for a request the decoder does not know: the decoder's answer.
  {
    const auto prompt = Prompt(25, 604, Vocab());
    grpc::ClientContext pctx;
    pb::PrefillResponse resp;
    EXPECT_EQ(g_fleet->prefiller->Prefill(&pctx, MakePrefill(NewId("c4"), prompt, 4), &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics, 15s), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
  const auto again = Prompt(40, 605, Vocab());
  ExpectMatchesReference(RunDisaggregated(again, 5), again, 5);
}

TEST_F(WorkerServingTest, CancelsAtRandomPointsLeaveNothingBehind) {
  // Concurrent requests, each cancelled at one of: right after
  // `registered`, while its Prefill runs, after some tokens, or never.
  constexpr int kN = 32;
  std::vector<std::thread> threads;
  std::atomic<int> completed{0};
  std::atomic<int> refused{0};
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      const auto prompt = Prompt(10 + (i * 13) % 90, 800 + i, Vocab());
      const std::string id = NewId("rnd");
      DecodeCall call(*g_fleet->decoder, MakeDecode(id, prompt, 30));
      if (!call.ReadRegistered()) return;
      const int stage = i % 4;
      if (stage == 0) {
        call.Cancel();
        (void)call.Finish();
        return;
      }
      grpc::ClientContext pctx;
      pb::PrefillResponse resp;
      if (stage == 1) {
        std::thread canceller([&] {
          std::this_thread::sleep_for(std::chrono::microseconds(200 * (i % 7)));
          pctx.TryCancel();
          call.Cancel();
        });
        (void)g_fleet->prefiller->Prefill(&pctx, MakePrefill(id, prompt, 30), &resp);
        canceller.join();
        (void)call.Finish();
        return;
      }
      const grpc::Status pst = g_fleet->prefiller->Prefill(&pctx, MakePrefill(id, prompt, 30), &resp);
      if (!pst.ok()) {
        // The only acceptable failure: the decoder had no room just then.
        if (pst.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
        else ADD_FAILURE() << pst.error_code() << " " << pst.error_message();
        call.Cancel();
        (void)call.Finish();
        return;
      }
      Outcome o;
      call.ReadInto(o, stage == 2 ? 1 + i % 3 : 0);
      if (stage == 2) call.Cancel();
      const grpc::Status dst = call.Finish();
      if (stage == 3) {
        EXPECT_TRUE(dst.ok()) << dst.error_message();
        EXPECT_EQ(o.tokens.size(), 30u);
        ++completed;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GE(completed.load() + refused.load(), kN / 4);
  EXPECT_GT(completed.load(), 0);
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics, 15s), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
  const auto again = Prompt(33, 899, Vocab());
  ExpectMatchesReference(RunDisaggregated(again, 6), again, 6);
}

// Prefill with the start (docs/decode-stream.md): the proxy sends the Prefill
// right after the decode start, so the prefiller's Reserve may reach the
// decoder first. Forced here: the Prefill goes alone, the decoder holds its
// Reserve (counted in tandem_decode_registration_waits_total) until the
// Decode stream registers the request, and the output equals the engine's.
// A start the decoder refuses answers the held Reserve with its refusal: the
// Prefill fails with it and nothing is left reserved or queued.
TEST_F(WorkerServingTest, AReserveBeforeTheRegistrationIsHeldUntilTheStartRegisters) {
  const std::string kWaits = "tandem_decode_registration_waits_total";
  const auto waits_now = [&] {
    return MetricValue(Scrape(g_fleet->decode->metrics), kWaits).value_or(-1);
  };
  // Prefill alone; its status and reply.
  const auto prefill_alone = [](const std::string& id, const std::vector<uint32_t>& prompt,
                                uint32_t max_tokens) {
    return std::async(std::launch::async, [id, prompt, max_tokens] {
      grpc::ClientContext pctx;
      const auto deadline = std::chrono::system_clock::now() + 60s;
      pctx.set_deadline(deadline);
      pb::PrefillRequest req = MakePrefill(id, prompt, max_tokens);
      req.set_deadline_unix_ms(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline.time_since_epoch())
              .count());
      pb::PrefillResponse resp;
      grpc::Status st = g_fleet->prefiller->Prefill(&pctx, req, &resp);
      return std::make_pair(st, resp);
    });
  };

  const double before = waits_now();
  ASSERT_GE(before, 0) << "the decoder exports no " << kWaits;
  const auto prompt = Prompt(37, 950, Vocab());
  const std::string id = NewId("early");
  auto prefill = prefill_alone(id, prompt, 6);
  const auto waited = WaitForMetric(
      g_fleet->decode->metrics, kWaits, [&](double v) { return v >= before + 1; }, 20s);
  ASSERT_TRUE(waited && *waited == before + 1) << "the Reserve did not wait for the registration";
  Outcome o;
  DecodeCall call(*g_fleet->decoder, MakeDecode(id, prompt, 6));
  o.registered = call.ReadRegistered();
  std::tie(o.prefill_status, o.prefill) = prefill.get();
  call.ReadInto(o);
  o.decode_status = call.Finish();
  ExpectMatchesReference(o, prompt, 6);

  // The start refused (more tokens than the context holds): so is the Reserve.
  const auto other = Prompt(20, 951, Vocab());
  const std::string refused_id = NewId("early-refused");
  auto refused = prefill_alone(refused_id, other, 4);
  const auto waited2 = WaitForMetric(
      g_fleet->decode->metrics, kWaits, [&](double v) { return v >= before + 2; }, 20s);
  ASSERT_TRUE(waited2 && *waited2 == before + 2);
  DecodeCall bad(*g_fleet->decoder,
                 MakeDecode(refused_id, other, g_fleet->ref.config.max_position_embeddings));
  EXPECT_FALSE(bad.ReadRegistered());
  EXPECT_EQ(bad.Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const auto [st, resp] = refused.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("its registration on this decoder was refused"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
}

// The prompt goes once (docs/decode-stream.md): the decoder advertises that
// it takes the prompt from the prefiller's Reserve; a start that names the
// prompt by length and digest decodes exactly what the engine does (several
// prefill chunks, pushed over UCX). A Prefill for another prompt of the same
// length is refused at its Reserve, naming the registered digest, and
// nothing is left reserved on either worker.
TEST_F(WorkerServingTest, AStartByReferenceTakesThePromptFromThePrefillersReserve) {
  auto worker = pb::Worker::NewStub(InternalChannel(g_fleet->fleet_file, g_fleet->decode->grpc));
  grpc::ClientContext ictx;
  pb::WorkerInfo info;
  ASSERT_TRUE(worker->GetInfo(&ictx, pb::GetInfoRequest(), &info).ok());
  EXPECT_TRUE(info.takes_prompt_from_reserve());

  const auto prompt = Prompt(150, 960, Vocab());
  const Outcome o = RunDisaggregated(prompt, 8, true, 60s, /*by_reference=*/true);
  ExpectMatchesReference(o, prompt, 8);
  EXPECT_GT(o.prefill.transferred_bytes(), 0u);

  const auto other = Prompt(150, 961, Vocab());
  const Outcome bad = RunDisaggregated(prompt, 8, true, 60s, true, &other);
  ASSERT_TRUE(bad.registered);
  EXPECT_EQ(bad.prefill_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << bad.prefill_status.error_message();
  EXPECT_NE(
      bad.prefill_status.error_message().find(fmt::format(
          "differs from the registered one (150 tokens, digest {:016x})", PromptDigest(prompt))),
      std::string::npos)
      << bad.prefill_status.error_message();
  EXPECT_TRUE(bad.tokens.empty());
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
}

TEST_F(WorkerServingTest, BadInputIsRefusedBeforeAnythingIsReserved) {
  auto bad = Prompt(10, 900, Vocab());
  bad[3] = g_fleet->ref.config.vocab_size;  // one past the vocabulary
  DecodeCall call(*g_fleet->decoder, MakeDecode(NewId("bad"), bad, 4));
  EXPECT_FALSE(call.ReadRegistered());
  const grpc::Status st = call.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("out of range"), std::string::npos) << st.error_message();

  const auto good = Prompt(10, 901, Vocab());
  const uint32_t too_many = g_fleet->ref.config.max_position_embeddings;
  DecodeCall call2(*g_fleet->decoder, MakeDecode(NewId("long"), good, too_many));
  EXPECT_FALSE(call2.ReadRegistered());
  EXPECT_EQ(call2.Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  grpc::ClientContext pctx;
  pb::PrefillResponse resp;
  EXPECT_EQ(g_fleet->prefiller->Prefill(&pctx, MakePrefill(NewId("bad"), bad, 4), &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(WaitForIdle(g_fleet->decode->metrics), "");
  EXPECT_EQ(WaitForIdle(g_fleet->prefill->metrics), "");
}

TEST_F(WorkerServingTest, WatchDeliversSnapshotEventsAndLoad) {
  const auto warm = Prompt(64, 700, Vocab());
  ExpectMatchesReference(RunDisaggregated(warm, 3), warm, 3);

  auto worker = pb::Worker::NewStub(InternalChannel(g_fleet->fleet_file, g_fleet->decode->grpc));
  grpc::ClientContext ictx;
  pb::WorkerInfo info;
  ASSERT_TRUE(worker->GetInfo(&ictx, pb::GetInfoRequest(), &info).ok());
  EXPECT_EQ(info.name(), "decode-0");
  EXPECT_EQ(info.role(), pb::WORKER_ROLE_DECODE);
  EXPECT_EQ(info.block_size(), kBlockSize);
  EXPECT_EQ(info.num_blocks(), kDecoderBlocks);
  EXPECT_EQ(info.transport_backend(), "ucx");
  EXPECT_EQ(info.grpc_address(), g_fleet->decode->grpc);
  EXPECT_NE(info.epoch(), 0u);
  EXPECT_GT(info.block_bytes(), 0u);

  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + 20s);
  auto reader = worker->Watch(&wctx, pb::WatchRequest());
  pb::WorkerUpdate u;
  ASSERT_TRUE(reader->Read(&u));
  ASSERT_TRUE(u.has_snapshot());
  EXPECT_EQ(u.epoch(), info.epoch());
  EXPECT_GE(u.snapshot().block_hashes_size(), 4);  // the warm prompt's full blocks
  const uint64_t snapshot_id = u.snapshot_event_id();

  // A new prompt: its blocks arrive as stored events after the snapshot.
  const auto fresh = Prompt(50, 701, Vocab());
  std::thread t([&] { ExpectMatchesReference(RunDisaggregated(fresh, 3), fresh, 3); });
  bool stored = false, load = false;
  uint64_t last_id = snapshot_id;
  while ((!stored || !load) && reader->Read(&u)) {
    if (u.has_event()) {
      EXPECT_EQ(u.event().event_id(), last_id + 1);
      last_id = u.event().event_id();
      stored |= u.event().has_stored() && u.event().stored().block_hashes_size() > 0;
    }
    if (u.has_load()) {
      load = true;
      EXPECT_EQ(u.load().free_blocks() + u.load().active_decode_blocks(), kDecoderBlocks);
    }
  }
  t.join();
  EXPECT_TRUE(stored);
  EXPECT_TRUE(load);
  // Idle (issue 23): the load is reported when it changed, and otherwise
  // repeated as the stream's keep-alive (the liveness signal), so the idle
  // worker's stream goes on carrying the same report.
  std::vector<pb::LoadReport> idle;
  while (reader->Read(&u)) {
    if (!u.has_load()) continue;
    if (u.load().running_requests() != 0 || u.load().num_reservations() != 0 ||
        u.load().registered_requests() != 0) {
      idle.clear();  // the request is still ending
      continue;
    }
    idle.push_back(u.load());
    if (idle.size() == 3) break;
  }
  ASSERT_EQ(idle.size(), 3u);
  EXPECT_EQ(idle[1].SerializeAsString(), idle[2].SerializeAsString());
  EXPECT_EQ(idle[1].free_blocks() + idle[1].active_decode_blocks(), kDecoderBlocks);
  // The seat turnover the router's seat-wait prediction reads (docs/router.md):
  // the two requests above each held a decode seat and gave it back.
  EXPECT_GE(idle[1].seats_released_total(), 2u);
  EXPECT_GT(idle[1].seat_seconds_total(), 0.0);
  // Idle, the worker samples its load only every keep-alive period; work
  // arriving wakes it at once (the reservation, the engine's steps), so the
  // report of the busy decoder comes while the request runs.
  const auto next = Prompt(40, 702, Vocab());
  std::atomic<bool> done{false};
  std::thread busy([&] {
    ExpectMatchesReference(RunDisaggregated(next, 48), next, 48);
    done = true;
  });
  bool seen_busy = false;
  uint32_t growth_reserve = 0;  // the most its growth reserve kept (docs/engine.md)
  float growth_ratio = 0;       // and its ratio (0.7 at the start)
  int loads_after_done = 0;
  while ((!seen_busy || growth_reserve == 0) && loads_after_done < 3 && reader->Read(&u)) {
    if (!u.has_load()) continue;
    seen_busy |= u.load().running_requests() > 0 || u.load().num_reservations() > 0;
    growth_reserve = std::max(growth_reserve, u.load().kv_growth_reserve_blocks());
    growth_ratio = std::max(growth_ratio, u.load().kv_growth_ratio());
    if (done) ++loads_after_done;
  }
  busy.join();
  EXPECT_TRUE(seen_busy) << "no load report showed the request while it ran";
  // Its 40-token prompt and 48 tokens end at 87 KV tokens, 6 blocks: while
  // it held fewer, the decoder kept some free for it to grow into.
  EXPECT_GT(growth_reserve, 0u) << "no load report carried the decoder's growth reserve";
  EXPECT_GT(growth_ratio, 0.0f) << "no load report carried the decoder's growth ratio";
  wctx.TryCancel();
  (void)reader->Finish();
}

// Issue 23: a watcher that asks for batches (as the proxy does) gets each
// round's events and load report in one update, nothing but batches after
// the snapshot, with the event ids consecutive across them.
TEST_F(WorkerServingTest, BatchedWatchCarriesEveryEventInOrder) {
  auto worker = pb::Worker::NewStub(InternalChannel(g_fleet->fleet_file, g_fleet->prefill->grpc));
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + 20s);
  pb::WatchRequest wreq;
  wreq.set_batched(true);
  auto reader = worker->Watch(&wctx, wreq);
  pb::WorkerUpdate u;
  ASSERT_TRUE(reader->Read(&u));
  ASSERT_TRUE(u.has_snapshot());
  uint64_t last_id = u.snapshot_event_id();

  const auto fresh = Prompt(80, 710, Vocab());  // 5 full blocks, new to the prefiller
  std::thread t([&] { ExpectMatchesReference(RunDisaggregated(fresh, 2), fresh, 2); });
  const size_t want = fresh.size() / kBlockSize;  // the prompt's full blocks
  std::set<uint64_t> stored;
  bool load = false;
  while ((stored.size() < want || !load) && reader->Read(&u)) {
    EXPECT_EQ(u.kind_case(), pb::WorkerUpdate::KIND_NOT_SET);
    for (const auto& e : u.events()) {
      EXPECT_EQ(e.event_id(), last_id + 1);
      last_id = e.event_id();
      if (e.has_stored()) stored.insert(e.stored().block_hashes().begin(), e.stored().block_hashes().end());
    }
    load |= u.has_batched_load();
  }
  t.join();
  EXPECT_GE(stored.size(), want);
  EXPECT_TRUE(load);
  wctx.TryCancel();
  (void)reader->Finish();
}

TEST(WorkerShutdownTest, SigtermDrainsThenExitsZero) {
  const fs::path dir = fs::temp_directory_path() / ("tandem-serving-stop-" + std::to_string(getpid()));
  const std::string fleet = WriteFleetFile(dir);
  cli::Supervisor sup;
  auto d = StartWorker(sup, fleet, "decode", "decode-stop");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto stub = pb::Decoder::NewStub(InternalChannel(fleet, (*d)->grpc));
  pb::DecodeRequest req;
  req.set_request_id("inflight");
  req.add_prompt_token_ids(5);
  req.add_prompt_token_ids(6);
  *req.mutable_params() = Greedy(4, true);
  auto call = std::make_unique<DecodeCall>(*stub, req);
  ASSERT_TRUE(call->ReadRegistered());

  // The event that the drain began: the worker ends its Watch streams (it
  // leaves routing first thing on SIGTERM; docs/failure-handling.md).
  auto worker = pb::Worker::NewStub(InternalChannel(fleet, (*d)->grpc));
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  auto watch = worker->Watch(&watch_ctx, pb::WatchRequest());
  pb::WorkerUpdate update;
  ASSERT_TRUE(watch->Read(&update)) << "no snapshot on Watch";
  ASSERT_EQ(kill((*d)->pid, SIGTERM), 0);
  while (watch->Read(&update)) {
  }
  EXPECT_TRUE(watch->Finish().ok()) << "the Watch stream did not end as a drain ends it";
  // Draining: new work is refused, the open stream still stands. (The
  // decoder's draining flag is set right after the streams end: a first
  // attempt in that instant is let through and cancelled; bounded.)
  grpc::Status refused;
  for (int i = 0; i < 20; ++i) {
    req.set_request_id("late-" + std::to_string(i));
    DecodeCall late(*stub, req);
    if (late.ReadRegistered()) {
      late.Cancel();
      (void)late.Finish();
      continue;
    }
    refused = late.Finish();
    break;
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  call->Cancel();
  (void)call->Finish();
  EXPECT_EQ(sup.StopAll(10s), 0);
  ASSERT_EQ(sup.children().size(), 1u);
  const auto& c = sup.children().front();
  EXPECT_TRUE(WIFEXITED(c.exit_status) && WEXITSTATUS(c.exit_status) == 0) << cli::DescribeExit(c);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace tandem::serving_test
