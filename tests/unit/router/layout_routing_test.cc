// Issue 18: the router pairs a prefiller with a decoder only when their
// rank layouts can exchange KV (parallel::KvLayoutsPairable: equal layouts,
// or different ones that both split the model — the slice push). A layout
// that cannot split the model (pipeline_parallel 6 over 5 layers) stands
// for an incompatible one.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "router/router.h"

namespace tandem::router {
namespace {

struct Layout {
  uint32_t tp, pp;
};

WorkerInfo Info(const std::string& name, WorkerRole role, Layout l) {
  WorkerInfo info;
  info.name = name;
  info.role = role;
  info.epoch = 1;
  info.num_blocks = 1000;
  info.tensor_parallel = l.tp;
  info.pipeline_parallel = l.pp;
  info.num_layers = 5;
  info.num_kv_heads = 2;
  return info;
}

TEST(LayoutRouting, PairsOnlyCompatibleLayoutsUnderEveryPolicy) {
  for (const char* policy : {"kv_aware", "least_loaded", "round_robin", "random"}) {
    SCOPED_TRACE(policy);
    auto router = Router::Create({.policy = policy}).value();
    std::map<WorkerId, std::string> layout_of;
    auto add = [&](const std::string& name, WorkerRole role, Layout l) {
      const WorkerId id = router->AddWorker(Info(name, role, l)).value();
      layout_of[id] = std::to_string(l.tp) + "x" + std::to_string(l.pp);
    };
    add("p-tp2", WorkerRole::kPrefill, {2, 1});
    add("p-tp1", WorkerRole::kPrefill, {1, 1});
    add("d-tp1", WorkerRole::kDecode, {1, 1});
    add("d-pp2", WorkerRole::kDecode, {1, 2});
    add("d-pp6", WorkerRole::kDecode, {1, 6});  // cannot split 5 layers
    std::map<std::string, int> prefills, decodes, cross;
    for (uint64_t i = 0; i < 40; ++i) {
      const std::vector<uint64_t> hashes = {(i + 1) * 0x9E3779B97F4A7C15ull};
      auto d = router->Route({hashes, 20});
      ASSERT_TRUE(d.ok()) << d.status().ToString();
      ASSERT_FALSE(d->local_prefill);
      ++prefills[layout_of[d->prefill]];
      ++decodes[layout_of[d->decode]];
      if (layout_of[d->prefill] != layout_of[d->decode]) ++cross[policy];
      router->EndPrefill(d->prefill_ticket);
    }
    EXPECT_EQ(decodes.count("1x6"), 0u) << "paired with a decoder whose layout cannot hold the KV";
    EXPECT_GT(prefills["2x1"] + prefills["1x1"], 0);
    if (std::string(policy) == "round_robin") {
      // Every prefiller and every compatible decoder takes turns, across layouts.
      EXPECT_GT(prefills["2x1"], 0);
      EXPECT_GT(prefills["1x1"], 0);
      EXPECT_GT(decodes["1x1"], 0);
      EXPECT_GT(decodes["1x2"], 0);
      EXPECT_GT(cross[policy], 0);
    }
  }
}

TEST(LayoutRouting, NoCompatiblePairIsUnavailableAndSaysWhy) {
  for (const char* policy : {"kv_aware", "round_robin"}) {
    SCOPED_TRACE(policy);
    auto router = Router::Create({.policy = policy}).value();
    ASSERT_TRUE(router->AddWorker(Info("p", WorkerRole::kPrefill, {2, 1})).ok());
    ASSERT_TRUE(router->AddWorker(Info("d", WorkerRole::kDecode, {1, 6})).ok());
    const std::vector<uint64_t> hashes = {42};
    auto d = router->Route({hashes, 20});
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(d.status().message().find("KV layout"), std::string::npos) << d.status().message();
    // A decoder of another layout that splits the model joins: routing works.
    ASSERT_TRUE(router->AddWorker(Info("d2", WorkerRole::kDecode, {1, 2})).ok());
    auto ok = router->Route({hashes, 20});
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
    EXPECT_EQ(ok->decode, router->FindWorker("d2").value());
  }
}

TEST(LayoutRouting, PrefillerIsNotPairedWithAnIncompatibleAggregatedWorker) {
  // round_robin would alternate between the two prefill-capable workers.
  auto router = Router::Create({.policy = "round_robin"}).value();
  ASSERT_TRUE(router->AddWorker(Info("p-tp2", WorkerRole::kPrefill, {2, 1})).ok());
  const WorkerId both = router->AddWorker(Info("both-pp6", WorkerRole::kBoth, {1, 6})).value();
  for (uint64_t i = 0; i < 6; ++i) {
    const std::vector<uint64_t> hashes = {i + 1};
    auto d = router->Route({hashes, 20});
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->prefill, both);  // it prefills for itself (no transfer)
    EXPECT_EQ(d->decode, both);
    router->EndPrefill(d->prefill_ticket);
  }
}

}  // namespace
}  // namespace tandem::router
