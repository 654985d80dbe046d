// Issue 21, proxy replicas (docs/serving-workers.md "Proxy replicas",
// docs/failure-handling.md "A proxy dies"): a 2P2D CPU fleet with
// `proxy.replicas: 2`.
//   - a document sent through proxy 0, then through proxy 1, is prefilled
//     by the same prefiller the second time and reports cached tokens:
//     each proxy's own index follows the workers' KV events;
//   - a worker joined with --join-dns localhost:PORT (real getaddrinfo)
//     registers with the proxy listening there;
//   - kill -9 of proxy 0 under load: every request on proxy 1 completes
//     with `tandem generate`'s tokens, the workers keep serving, the
//     launcher restarts proxy 0 on its addresses, and the restarted proxy
//     routes the document to its holder with cached tokens at once (its
//     index came from the workers' snapshots). The time from the kill to
//     the restarted proxy's ready line (its index warm) is printed.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <thread>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 8;

// tandem_prefix_cache_queries_tokens_total of every prefiller.
std::vector<double> PrefillQueries(const Fleet& f) {
  std::vector<double> out;
  for (const auto& w : f.workers()) {
    if (w.role != "prefill") continue;
    auto m = Scrape(w.metrics);
    out.push_back(m.ok() ? MetricValue(*m, "tandem_prefix_cache_queries_tokens_total") : -1);
  }
  return out;
}

// Sends `prompt` through `proxy`; returns the completion and the index of
// the prefiller that prefilled it (the one whose query counter moved).
struct Served {
  Result<Completion> completion = InternalError("not sent");
  int prefiller = -1;
};
Served SendAndWatch(const Fleet& f, const std::string& proxy, const std::vector<uint32_t>& prompt) {
  const auto before = PrefillQueries(f);
  Served s;
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  s.completion = Generate(proxy, a);
  const auto after = PrefillQueries(f);
  for (size_t i = 0; i < after.size(); ++i) {
    if (after[i] > before[i]) s.prefiller = static_cast<int>(i);
  }
  return s;
}

TEST(ProxyReplicas, TwoProxiesFollowTheEventsAndSurviveAKill) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  FleetOptions o;
  o.prefill = 2;
  o.decode = 2;
  o.policy = "kv_aware";
  o.proxy_yaml = "  replicas: 2\n";
  o.log_level = "info";  // the launcher's and the proxies' restart lines
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Fleet& f = **fleet;

  // The state file: `proxies` with both, `proxy` is the first.
  const auto proxies = f.proxies();
  ASSERT_EQ(proxies.size(), 2u);
  EXPECT_EQ(proxies[0].grpc, f.proxy_grpc());
  EXPECT_EQ(proxies[0].internal, f.proxy_internal());
  EXPECT_EQ(proxies[0].pid, f.proxy_pid());
  EXPECT_NE(proxies[0].grpc, proxies[1].grpc);
  EXPECT_NE(proxies[0].internal, proxies[1].internal);
  EXPECT_NE(proxies[0].pid, proxies[1].pid);

  // References first (one `tandem generate` per prompt).
  const std::vector<uint32_t> doc = PromptIds(4242, 256, kVocab);
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 8; ++i) prompts.push_back(PromptIds(100 + i, 20 + 23 * i, kVocab));
  auto doc_ref = ReferenceGenerate(doc, kMaxTokens);
  ASSERT_TRUE(doc_ref.ok()) << doc_ref.status().ToString();
  std::vector<std::vector<uint32_t>> refs;
  for (const auto& p : prompts) {
    auto r = ReferenceGenerate(p, kMaxTokens);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    refs.push_back(*r);
  }

  // 1. The document through proxy 0, then through proxy 1.
  Served first = SendAndWatch(f, proxies[0].grpc, doc);
  ASSERT_TRUE(first.completion.ok()) << first.completion.status().ToString();
  EXPECT_EQ(first.completion->token_ids, *doc_ref);
  EXPECT_EQ(first.completion->cached_prompt_tokens, 0u);
  ASSERT_GE(first.prefiller, 0);
  Served second = SendAndWatch(f, proxies[1].grpc, doc);
  ASSERT_TRUE(second.completion.ok()) << second.completion.status().ToString();
  EXPECT_EQ(second.completion->token_ids, *doc_ref);
  EXPECT_EQ(second.prefiller, first.prefiller) << "proxy 1 did not route to the holder";
  EXPECT_GE(second.completion->cached_prompt_tokens, 240u);  // 15 of 16 blocks at least

  // 2. --join-dns: "localhost" resolves to 127.0.0.1; PORT is proxy 1's
  // internal listener. The ready line comes once that proxy registered it.
  const std::string port1 = proxies[1].internal.substr(proxies[1].internal.rfind(':') + 1);
  const std::string dns_log = f.log_path() + ".dns-worker";
  auto dns_worker = JoinWorker(f, "decode", "decode-dns", dns_log, {}, std::chrono::seconds(60),
                               {"--join-dns", "localhost:" + port1, "--discovery-interval-ms",
                                "200"});
  ASSERT_TRUE(dns_worker.ok()) << dns_worker.status().ToString() << "\n" << ReadText(dns_log);
  EXPECT_TRUE(WaitForLogLine(dns_log, "--join-dns localhost:" + port1 + ": found proxy 127.0.0.1:" +
                                          port1,
                             std::chrono::seconds(10))
                  .has_value())
      << ReadText(dns_log);
  EXPECT_EQ(StopProcess(dns_worker->pid, std::chrono::seconds(20)), 0);

  // 3. Load on both proxies; kill -9 of proxy 0 once proxy 1 has
  // completed some of its requests.
  std::atomic<int> done1{0}, failed1{0};
  std::vector<std::string> errors;
  std::mutex mu;
  std::vector<std::thread> load;
  for (int t = 0; t < 2; ++t) {
    load.emplace_back([&, t] {
      for (size_t i = 0; i < prompts.size(); ++i) {
        const size_t k = (i + static_cast<size_t>(t) * 3) % prompts.size();
        GenerateArgs a;
        a.prompt_ids = prompts[k];
        a.max_tokens = kMaxTokens;
        auto c = Generate(proxies[1].grpc, a);
        std::lock_guard lock(mu);
        if (!c.ok()) {
          ++failed1;
          errors.push_back(c.status().ToString());
        } else if (c->token_ids != refs[k]) {
          ++failed1;
          errors.push_back("prompt " + std::to_string(k) + ": tokens differ from tandem generate");
        }
        ++done1;
      }
    });
  }
  std::atomic<bool> stop0{false};
  std::atomic<int> ok0{0};
  std::thread on_proxy0([&] {
    for (int i = 0; i < 50 && !stop0; ++i) {
      GenerateArgs a;
      a.prompt_ids = prompts[static_cast<size_t>(i) % prompts.size()];
      a.max_tokens = kMaxTokens;
      a.timeout = std::chrono::milliseconds(10000);
      if (Generate(proxies[0].grpc, a).ok()) ++ok0;
    }
  });
  ASSERT_TRUE(WaitUntil([&] { return done1 >= 3; }, std::chrono::seconds(120)));
  const size_t log_from = ReadText(f.log_path()).size();
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(proxies[0].pid, SIGKILL), 0);

  // The launcher restarts it and rewrites the state file once it is ready
  // (its index rebuilt from the workers' snapshots).
  std::vector<ProxyAddr> now;
  const bool restarted = WaitUntil(
      [&] {
        now = ReadProxies(f.state_path());
        return now.size() == 2 && now[0].pid > 0 && now[0].pid != proxies[0].pid;
      },
      std::chrono::seconds(90));
  const double warm_ms = std::chrono::duration<double, std::milli>(
                             std::chrono::steady_clock::now() - killed_at)
                             .count();
  ASSERT_TRUE(restarted) << ReadText(f.log_path()).substr(log_from);
  std::cout << "proxy 0 killed -9; restarted and warm (ready line after the workers' snapshots) "
            << warm_ms << " ms after the kill\n";
  ::testing::Test::RecordProperty("proxy_restart_warm_ms", static_cast<int>(warm_ms));
  EXPECT_EQ(now[0].grpc, proxies[0].grpc);
  EXPECT_EQ(now[0].internal, proxies[0].internal);
  EXPECT_EQ(now[1].pid, proxies[1].pid);
  EXPECT_TRUE(WaitForLogLine(f.log_path(), "index warm: rebuilt from 4 workers' snapshots",
                             std::chrono::seconds(5), log_from)
                  .has_value())
      << ReadText(f.log_path()).substr(log_from);

  for (auto& t : load) t.join();
  stop0 = true;
  on_proxy0.join();
  EXPECT_EQ(done1.load(), 16);
  EXPECT_EQ(failed1.load(), 0) << (errors.empty() ? "" : errors.front());
  for (const auto& w : f.workers()) {
    EXPECT_EQ(kill(w.pid, 0), 0) << w.name << " is gone";
  }

  // 4. The restarted proxy 0 serves, with the index it rebuilt: the
  // document goes to its holder and reports cached tokens.
  Served third = SendAndWatch(f, now[0].grpc, doc);
  ASSERT_TRUE(third.completion.ok()) << third.completion.status().ToString();
  EXPECT_EQ(third.completion->token_ids, *doc_ref);
  EXPECT_EQ(third.prefiller, first.prefiller) << "the restarted proxy did not route to the holder";
  EXPECT_GE(third.completion->cached_prompt_tokens, 240u);
  for (size_t k = 0; k < 2; ++k) {
    GenerateArgs a;
    a.prompt_ids = prompts[k];
    a.max_tokens = kMaxTokens;
    auto c = Generate(now[0].grpc, a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, refs[k]);
  }
}

}  // namespace
}  // namespace tandem::testing
