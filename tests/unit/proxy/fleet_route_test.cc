// Fleet::Route with excluded workers (a retry's): the decisions it makes
// must not fill the decoder in the router's eyes (docs/failure-handling.md,
// "Under load").
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/config.h"
#include "proxy/fleet.h"

namespace tandem::proxy {
namespace {

constexpr uint32_t kBlocks = 100;
constexpr uint32_t kPromptTokens = 48;  // 3 blocks
// Strings assigned from std::string, not from literals: GCC 12 warns
// (-Wrestrict, a false positive) on short literals assigned here.
const std::string kModel = "m", kDtype = "f32", kPort = ":1";

class FleetRouteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto router = router::Router::Create(RouterConfig{}, router::RouterOptions{});
    ASSERT_TRUE(router.ok());
    FleetRequirements req;
    req.model = kModel;
    fleet_ = std::make_unique<Fleet>(req, std::move(router).value());
  }
  void Add(const std::string& name, router::WorkerRole role) {
    WorkerRecord w;
    w.name = name;
    w.role = role;
    w.grpc_address = name + kPort;
    w.protocol_version = 1;
    w.model = kModel;
    w.block_size = 16;
    w.kv_dtype = kDtype;
    w.block_bytes = 4096;
    w.num_blocks = kBlocks;
    ASSERT_TRUE(fleet_->Register(w).ok());
  }
  int64_t FreeBlocks(const std::string& name) {
    return fleet_->router().load(*fleet_->router().FindWorker(name))->free_blocks;
  }
  std::vector<uint64_t> hashes_ = {11, 12, 13};
  std::unique_ptr<Fleet> fleet_;
};

// Session 14's Failure.LeaseExpiryWithStoppedPrefiller under load: the only
// prefiller in routing was excluded after its loaded prefills outlasted the
// lease, and each retry's Route (and the lifecycle's waits for the registry
// to drop it, 11 calls) routed 8 times and dropped every decision, whose
// decode blocks counted until the decoder's next report. The decoder looked
// full and every request failed "no decoder has room". Now the excluded
// worker is no candidate: the call is refused without a decision, and the
// decoder's room is untouched.
TEST_F(FleetRouteTest, RoutesAvoidingAnExcludedWorkerLeaveTheDecoderItsRoom) {
  Add("p0", router::WorkerRole::kPrefill);
  Add("d0", router::WorkerRole::kDecode);
  for (int call = 0; call < 11; ++call) {
    auto r = fleet_->Route(hashes_, kPromptTokens, {"p0"});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
    EXPECT_NE(r.status().message().find("every worker that could take the request refused it"),
              std::string::npos)
        << r.status().ToString();
  }
  EXPECT_EQ(FreeBlocks("d0"), int64_t{kBlocks});
  auto r = fleet_->Route(hashes_, kPromptTokens);  // the retry that goes back to p0
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->prefill_name, "p0");
  EXPECT_EQ(FreeBlocks("d0"), int64_t{kBlocks} - 3);
}

// With another pair, an excluded worker costs no decision either.
TEST_F(FleetRouteTest, AnExcludedPrefillerLeavesOneDecisionOnTheOther) {
  Add("p0", router::WorkerRole::kPrefill);
  Add("p1", router::WorkerRole::kPrefill);
  Add("d0", router::WorkerRole::kDecode);
  for (int call = 0; call < 50; ++call) {  // 150 blocks at a 100-block decoder
    auto r = fleet_->Route(hashes_, kPromptTokens, {"p0"});
    ASSERT_TRUE(r.ok()) << "call " << call << ": " << r.status().ToString();
    EXPECT_EQ(r->prefill_name, "p1");
    fleet_->router().EndPrefill(r->decision.prefill_ticket);  // its reply came
    EXPECT_EQ(FreeBlocks("d0"), int64_t{kBlocks} - 3) << "call " << call;
    fleet_->router().EndAttempt(r->decision.prefill_ticket, /*prefill_ended=*/true);  // it finished
  }
  EXPECT_EQ(FreeBlocks("d0"), int64_t{kBlocks});
  EXPECT_EQ(fleet_->router().counters().workers.at(0).prefill_routes, 0u) << "p0 was never chosen";
}

}  // namespace
}  // namespace tandem::proxy
