// A sim 1P1D fleet (simulated H100s running Llama-3-8B) launched with
// `tandem launch`: the same request gives the same tokens, one at a time or
// all at once; sequences run to max_tokens; KV crossed the transport at the
// paced link speed; every worker and the proxy say `simulated`; a fleet
// full by its decoder's own report queues a request its pool holds.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <sys/wait.h>

#include <cstdio>
#include <future>
#include <thread>

#include "../fleet/fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kMaxTokens = 24;

// A sim 1P1D fleet (simulated H100s running Llama-3-8B, or the model shape
// `shape` of configs/sim/models; kv_aware routing): `sim_lines` go into its
// `sim` section, `more_yaml` after that section.
FleetOptions SimOneP1D(const std::string& sim_lines = "", const std::string& more_yaml = "",
                       const std::string& shape = "llama-3-8b") {
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  o.max_batched_tokens = 512;
  o.policy = "kv_aware";
  o.model_yaml = "  backend: sim\n  name: itest\n  max_model_len: 4096\n";
  o.extra_yaml = fmt::format(
      "sim:\n  profile: H100\n  model_shape: {}/configs/sim/models/{}\n  kv_scale: 256\n{}{}",
      TANDEM_SOURCE_DIR, shape, sim_lines, more_yaml);
  return o;
}

TEST(SimFleet, OneP1DServesDeterministicallyAndSaysSimulated) {
  FleetOptions o = SimOneP1D("  link_gbps: 100\n  link_latency_us: 10\n",
                             // The whole push after the prefill, so that
                             // tandem_kv_transfer_seconds times every byte
                             // (streaming times only what is left after the
                             // first token; kv_streaming_test covers sim
                             // streaming).
                             "transport:\n  push: after_prefill\n");
  // A setting of one role reaches that role's workers only (the decoder keeps
  // the default 150 ms): tandem_worker_load_interval_seconds below.
  o.prefill_yaml = "  load_interval_ms: 300\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();


  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 8; ++i) prompts.push_back(PromptIds(100 + i, 60 + 97 * i, 4000));
  std::vector<std::vector<uint32_t>> first;
  for (const auto& p : prompts) {
    GenerateArgs a;
    a.prompt_ids = p;
    a.max_tokens = kMaxTokens;
    a.ignore_eos = false;  // sim tokens are never eos: requests run to max_tokens anyway
    auto c = Generate(proxy, a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->token_ids.size(), kMaxTokens);
    EXPECT_EQ(c->completion_tokens, kMaxTokens);
    for (uint32_t t : c->token_ids) EXPECT_LT(t, 4096u);
    first.push_back(c->token_ids);
  }
  EXPECT_NE(first[0], first[1]);
  // Again, all at once (batched on both workers, prompts now cached): same tokens.
  std::vector<std::future<Result<Completion>>> futures;
  for (const auto& p : prompts) {
    futures.push_back(std::async(std::launch::async, [&proxy, p] {
      GenerateArgs a;
      a.prompt_ids = p;
      a.max_tokens = kMaxTokens;
      a.temperature = 0.9f;  // one-hot logits: sampling settings do not change sim tokens
      a.seed = 5;
      return Generate(proxy, a);
    }));
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    auto c = futures[i].get();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, first[i]) << "prompt " << i;
  }

  // Everything says simulated.
  auto pm = Scrape((*fleet)->proxy_metrics());
  ASSERT_TRUE(pm.ok()) << pm.status().ToString();
  EXPECT_NE(pm->find("model=\"itest-simulated\""), std::string::npos);
  double transfer_bytes = 0, transfer_seconds = 0;
  for (const auto& w : (*fleet)->workers()) {
    auto m = Scrape(w.metrics);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(MetricValue(*m, "tandem_simulated_info"), 1.0) << w.name;
    EXPECT_DOUBLE_EQ(MetricValue(*m, "tandem_worker_load_interval_seconds"),
                     w.role == "prefill" ? 0.3 : 0.15)
        << w.name;
    EXPECT_NE(m->find("profile=\"H100\""), std::string::npos) << w.name;
    EXPECT_NE(m->find("kv_scale=\"256\""), std::string::npos) << w.name;
    EXPECT_NE(m->find("model=\"itest-simulated\""), std::string::npos) << w.name;
    transfer_bytes += MetricValue(*m, "tandem_kv_transfer_bytes_total");
    transfer_seconds += MetricValue(*m, "tandem_kv_transfer_seconds_sum");
  }
  // Real bytes crossed UCX (8 KiB per block at scale 256), no faster than a
  // 100 Gb/s link moves their unscaled size (lower bound: the host may be slow).
  EXPECT_GT(transfer_bytes, 0);
  EXPECT_GE(transfer_seconds, transfer_bytes * 256 * 8 / 100e9);
  auto stopped = (*fleet)->Stop(std::chrono::seconds(30));
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(*stopped, 0);
}

// A prompt as long as a 128k context (8,192 blocks of 16 tokens), with KV
// checksums (the default) and transport.encrypt: its KV notice carries 8 +
// 16 bytes per block, ~200 KB. Until session 22 the transports sent at most
// 64 KiB in a notice, so every such push failed and the request, prefilled
// three times, ended UNAVAILABLE (found replaying the Mooncake trace).
TEST(SimFleet, APromptAsLongAs128kOfContextIsServedWithChecksumsAndTags) {
  // Llama-3.1-8B's shape: its context is 128k (Llama-3-8B's is 8k).
  FleetOptions o = SimOneP1D("", "transport:\n  encrypt: true\n", "llama-3.1-8b");
  o.model_yaml = "  backend: sim\n  name: itest\n  max_model_len: 131072\n";
  o.max_batched_tokens = 8192;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  GenerateArgs a;
  a.prompt_ids = PromptIds(300, 131072 - 4, 4000);
  a.max_tokens = 4;
  a.timeout = std::chrono::seconds(120);
  auto c = Generate((*fleet)->proxy_grpc(), a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids.size(), 4u);
  EXPECT_EQ(c->prompt_tokens, 131072u - 4);
  // The prompt's KV crossed the transport and was checked: one notice, no
  // mismatch, every block pushed.
  double pushed = 0, failures = 0;
  for (const auto& w : (*fleet)->workers()) {
    pushed += Metric(w.metrics, "tandem_kv_transfer_bytes_total");
    failures += Metric(w.metrics, "tandem_kv_checksum_failures_total");
  }
  EXPECT_GE(pushed, 8192.0 * 8192);  // 8 KiB per block at kv_scale 256
  EXPECT_EQ(failures, 0);
  auto stopped = (*fleet)->Stop(std::chrono::seconds(30));
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(*stopped, 0);
}

// Decode seats in routing (docs/router.md, "Decode seats"): the launcher's
// 32-seat decoder and a 4-seat one joined by hand (the same KV pool) share a
// burst of 72 streams by their seats (about 4 of every 36), not half each as
// the KV-block cost alone splits it.
TEST(SimFleet, ABurstFillsDecodersByTheirSeats) {
  FleetOptions o = SimOneP1D();
  o.max_num_seqs = 32;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  // The small decoder's file: the fleet's with 4 seats.
  std::string text = ReadText((*fleet)->config_path());
  const std::string seats = "max_num_seqs: 32\n";
  const size_t at = text.find(seats);
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, seats.size(), "max_num_seqs: 4\n");
  const std::string small_config = (*fleet)->config_path() + ".small.yaml";
  {
    FILE* f = fopen(small_config.c_str(), "w");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(fwrite(text.data(), 1, text.size(), f), text.size());
    fclose(f);
  }
  auto small = JoinWorker(**fleet, "decode", "decode-small", (*fleet)->log_path() + ".small", {},
                          std::chrono::seconds(60), {}, small_config);
  ASSERT_TRUE(small.ok()) << small.status().ToString();

  constexpr int kStreams = 72;
  static constexpr uint32_t kTokens = 64;
  const std::string proxy = (*fleet)->proxy_grpc();
  std::vector<std::future<Result<Completion>>> futures;
  for (int i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [&proxy, i] {
      GenerateArgs a;
      a.prompt_ids = PromptIds(300 + i, 32, 4000);
      a.max_tokens = kTokens;
      return Generate(proxy, a);
    }));
  }
  for (auto& f : futures) {
    auto c = f.get();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->completion_tokens, kTokens);
  }
  const std::string pm = (*fleet)->proxy_metrics();
  const double to_small =
      LabeledMetric(pm, "tandem_router_decisions_total", "chosen_worker=\"decode-small\"");
  const double to_big = LabeledMetric(pm, "tandem_router_decisions_total", "chosen_worker=\"decode-0\"");
  EXPECT_GE(to_small + to_big, kStreams);
  EXPECT_GE(to_small, 1);
  EXPECT_LE(to_small, 18) << "by KV blocks alone it gets about half (36)";
  EXPECT_GT(Metric(pm, "tandem_router_seat_deferred_total"), 0);
  EXPECT_EQ(StopProcess(small->pid, std::chrono::seconds(30)), 0);
}

// A decoder full by its own load report (docs/router.md "Room", session
// 24): two long streams fill a 64-block decoder as they decode (31 blocks
// each at their end); a request whose 25 blocks neither the router's
// estimate nor the decoder's last report has room for is routed to it all
// the same, as its pool holds them (`room=wait`), and its Reserve waits
// there until a stream ends, instead of being refused "no decoder has
// room" (the router's answer until session 23).
TEST(SimFleet, AFleetFullByItsDecodersReportQueuesTheRequest) {
  FleetOptions o = SimOneP1D();
  o.decode_yaml = "  num_blocks: 64\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();
  const std::string pm = (*fleet)->proxy_metrics();
  std::string dm;
  for (const auto& w : (*fleet)->workers()) {
    if (w.role == "decode") dm = w.metrics;
  }
  ASSERT_FALSE(dm.empty());
  static constexpr uint32_t kLong = 480;
  std::vector<std::future<Result<Completion>>> longs;
  for (uint32_t i = 0; i < 2; ++i) {
    longs.push_back(std::async(std::launch::async, [&proxy, i] {
      GenerateArgs a;
      a.prompt_ids = PromptIds(500 + i, 16, 4000);
      a.max_tokens = kLong;
      return Generate(proxy, a);
    }));
  }
  // 52 of 64 blocks in use (12 free) by a scrape; the decoder's reports,
  // sent as its load changes, said 20 or fewer free blocks well before.
  ASSERT_TRUE(WaitUntil([&] { return Metric(dm, "tandem_kv_cache_usage_ratio") >= 0.8; },
                        std::chrono::seconds(60)));
  GenerateArgs a;
  a.prompt_ids = PromptIds(600, 400, 4000);  // 25 blocks
  a.max_tokens = 8;
  auto queued = Generate(proxy, a);
  ASSERT_TRUE(queued.ok()) << queued.status().ToString();
  EXPECT_EQ(queued->completion_tokens, 8u);
  EXPECT_GE(Metric(pm, "tandem_router_room_by_wait_total"), 1);
  EXPECT_GE(Metric(dm, "tandem_decode_kv_waits_total"), 1);
  for (auto& f : longs) {
    auto c = f.get();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->completion_tokens, kLong);
  }
}

struct CmdOut {
  int code = -1;
  std::string out;
};

CmdOut RunTandem(const std::string& args) {
  const std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  CmdOut r;
  if (p == nullptr) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WEXITSTATUS(status);
  return r;
}

TEST(SimCli, PlanPrintsItsReasoningAndRefusesBadInput) {
  const std::string model = std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/llama-3-8b";
  // Llama-3-8B on an H100, 4096-token prompts: 537 MB of KV. At 10 Gb/s it
  // takes 0.43 s against a 0.12 s prefill (ratio 3.4): aggregate.
  CmdOut slow = RunTandem("plan --model " + model + " --hardware H100 --link-gbps 10 --rate 4 "
                          "--input-tokens 4096 --output-tokens 256 --itl-slo-ms 25");
  EXPECT_EQ(slow.code, 0) << slow.out;
  EXPECT_NE(slow.out.find("simulated"), std::string::npos) << slow.out;
  EXPECT_NE(slow.out.find("transfer / prefill"), std::string::npos) << slow.out;
  EXPECT_NE(slow.out.find("aggregated  "), std::string::npos) << slow.out;
  // At 400 Gb/s (ratio 0.09) the tight ITL SLO makes disaggregation pay.
  CmdOut fast = RunTandem("plan --model " + model + " --link-gbps 400 --rate 4 "
                          "--input-tokens 4096 --output-tokens 256 --itl-slo-ms 25 --json");
  EXPECT_EQ(fast.code, 0) << fast.out;
  EXPECT_NE(fast.out.find("\"recommendation\": \"disaggregated\""), std::string::npos) << fast.out;
  EXPECT_NE(fast.out.find("\"simulated\": true"), std::string::npos) << fast.out;
  // A fleet file gives the defaults.
  CmdOut cfg = RunTandem("plan --config " + std::string(TANDEM_SOURCE_DIR) +
                         "/configs/sim-1p1d.yaml --rate 2 --input-tokens 512-2048 --output-tokens 128");
  EXPECT_EQ(cfg.code, 0) << cfg.out;
  EXPECT_NE(cfg.out.find("100 Gb/s"), std::string::npos) << cfg.out;
  CmdOut bad = RunTandem("plan --model " + model + " --rate 1 --input-tokens 10-5 --output-tokens 8");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("--input-tokens must be N or MIN-MAX"), std::string::npos) << bad.out;
  CmdOut hw = RunTandem("plan --model " + model + " --hardware B200 --rate 1 --input-tokens 8 "
                        "--output-tokens 8");
  EXPECT_EQ(hw.code, 1);
  EXPECT_NE(hw.out.find("known: H100, H200, A100, L40S"), std::string::npos) << hw.out;
}

}  // namespace
}  // namespace tandem::testing
