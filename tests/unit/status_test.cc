#include "common/status.h"

#include <gtest/gtest.h>

#include <memory>

namespace tandem {
namespace {

Result<int> ParsePositive(int v) {
  if (v <= 0) return InvalidArgumentError("value must be positive, got " + std::to_string(v));
  return v;
}

Result<int> Doubled(int v) {
  TANDEM_ASSIGN_OR_RETURN(int x, ParsePositive(v));
  return 2 * x;
}

Status Chain(int v) {
  TANDEM_RETURN_IF_ERROR(Doubled(v).status());
  return Status::Ok();
}

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  const Status s = NotFoundError("model 'x' is not served");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: model 'x' is not served");
  EXPECT_EQ(s.WithContext("route").message(), "route: model 'x' is not served");
  EXPECT_EQ(s.WithContext("route").code(), StatusCode::kNotFound);
}

TEST(Status, ResultPropagates) {
  auto ok = Doubled(21);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 42);
  auto bad = Doubled(-3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "value must be positive, got -3");
  EXPECT_EQ(Chain(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Chain(1).ok());
  EXPECT_EQ(bad.value_or(7), 7);
}

TEST(Status, ResultFromOkStatusIsAnError) {
  Result<int> r(Status::Ok());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Status, ResultHoldsMoveOnly) {
  Result<std::unique_ptr<int>> r(std::make_unique<int>(5));
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

TEST(Status, CodeNamesMatchGrpc) {
  EXPECT_EQ(StatusCodeName(StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnauthenticated), 16);
}

}  // namespace
}  // namespace tandem
