// Admission at the proxy's front end: the in-flight limit and unique ids.
#include <gtest/gtest.h>

#include "proxy/generation_service.h"

namespace tandem::proxy {
namespace {

TEST(FrontendAdmit, RefusesAnIdAlreadyInFlightAndTakesItAgainAfterRelease) {
  Frontend fe(ServingLimits{}, LifecycleDeps{}, /*max_inflight=*/8, /*api_key=*/"");
  ASSERT_TRUE(fe.Admit("a").ok());
  Status dup = fe.Admit("a");
  EXPECT_EQ(dup.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(dup.message().find("request_id 'a'"), std::string::npos) << dup.ToString();
  EXPECT_EQ(fe.inflight(), 1u);  // the refused duplicate holds no slot
  ASSERT_TRUE(fe.Admit("b").ok());
  EXPECT_EQ(fe.inflight(), 2u);
  fe.Release("a");
  EXPECT_EQ(fe.inflight(), 1u);
  EXPECT_TRUE(fe.Admit("a").ok());
  fe.Release("a");
  fe.Release("b");
  fe.Release("b");  // a second release of the same id changes nothing
  EXPECT_EQ(fe.inflight(), 0u);
}

TEST(FrontendAdmit, FullProxyRefusesWithResourceExhaustedNamingTheLimit) {
  Frontend fe(ServingLimits{}, LifecycleDeps{}, /*max_inflight=*/2, "");
  ASSERT_TRUE(fe.Admit("x").ok());
  ASSERT_TRUE(fe.Admit("y").ok());
  Status full = fe.Admit("z");
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("proxy.max_inflight"), std::string::npos) << full.ToString();
  fe.Release("x");
  EXPECT_TRUE(fe.Admit("z").ok());
  EXPECT_EQ(fe.inflight(), 2u);
}

}  // namespace
}  // namespace tandem::proxy
