// Admission at the proxy's front end: the in-flight limit; request ids play
// no part in it (the client's id is a label, docs/security.md).
#include <gtest/gtest.h>

#include <atomic>

#include "proxy/generation_service.h"

namespace tandem::proxy {
namespace {

TEST(FrontendAdmit, FullProxyRefusesWithResourceExhaustedNamingTheLimit) {
  Frontend fe(ServingLimits{}, LifecycleDeps{}, /*max_inflight=*/2, "");
  ASSERT_TRUE(fe.Admit().ok());
  ASSERT_TRUE(fe.Admit().ok());
  Status full = fe.Admit();
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("proxy.max_inflight"), std::string::npos) << full.ToString();
  EXPECT_EQ(fe.inflight(), 2u);  // the refused request holds no slot
  fe.Release();
  EXPECT_TRUE(fe.Admit().ok());
  EXPECT_EQ(fe.inflight(), 2u);
  fe.Release();
  fe.Release();
  EXPECT_EQ(fe.inflight(), 0u);
}

TEST(FrontendRate, TenantBucketsRefuseNamingTheLimitAndWhenToRetry) {
  auto tenants = Tenants::Parse("",
                                "- key: k1\n  tenant: slow\n  requests_per_second: 0.001\n"
                                "  burst_requests: 2\n",
                                "keys.yaml");
  ASSERT_TRUE(tenants.ok()) << tenants.status().ToString();
  Frontend fe(ServingLimits{}, LifecycleDeps{}, 8, std::move(tenants).value());
  auto t = fe.Authenticate("Bearer k1");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(fe.ChargeRequest(*t).status.ok());
  EXPECT_TRUE(fe.ChargeRequest(*t).status.ok());
  RateRefusal r = fe.ChargeRequest(*t);
  EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status.message().find("requests_per_second"), std::string::npos) << r.status.ToString();
  EXPECT_GT(r.retry_after_seconds, 100.0);  // 1 request at 0.001/s
  EXPECT_TRUE(fe.ChargeRequest(nullptr).status.ok());  // no tenant: no limit
}

TEST(WorkPool, RunsEveryJobAndTheDestructorRunsWhatIsQueued) {
  std::atomic<int> ran{0};
  {
    WorkPool pool(2);
    EXPECT_EQ(pool.threads(), 2u);
    for (int i = 0; i < 100; ++i) pool.Submit([&ran] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 100);
}

}  // namespace
}  // namespace tandem::proxy

namespace tandem::proxy {
namespace {

// The tenant's default priority, its min_priority and weight reach the
// validated request (docs/scheduling.md).
TEST(FrontendPriority, TenantDefaultLimitAndWeight) {
  auto tenants = Tenants::Parse("",
                                "- key: k1\n  tenant: batch\n  priority: 10\n  min_priority: 5\n"
                                "  weight: 3\n",
                                "keys.yaml");
  ASSERT_TRUE(tenants.ok()) << tenants.status().ToString();
  ServingLimits limits;
  limits.model = "m";
  limits.vocab_size = 100;
  limits.max_model_len = 64;
  Frontend fe(limits, LifecycleDeps{}, 8, std::move(tenants).value());
  auto t = fe.Authenticate("Bearer k1");
  ASSERT_TRUE(t.ok());
  ClientRequest req;
  req.prompt_token_ids = {1, 2, 3};
  auto v = fe.Validate(req, *t);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->priority, 10);
  EXPECT_EQ(v->tenant, "batch");
  EXPECT_DOUBLE_EQ(v->tenant_weight, 3.0);
  req.priority = 7;
  v = fe.Validate(req, *t);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->priority, 7);
  req.priority = 4;
  v = fe.Validate(req, *t);
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("min_priority"), std::string::npos) << v.status().ToString();
  EXPECT_NE(v.status().message().find("batch"), std::string::npos);
}

}  // namespace
}  // namespace tandem::proxy
