#include "common/net.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

TEST(Net, ParsesHostPort) {
  auto hp = ParseHostPort("127.0.0.1:50051");
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 50051);
  EXPECT_EQ(hp->ToString(), "127.0.0.1:50051");
  auto v6 = ParseHostPort("[::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->ToString(), "[::1]:0");
}

TEST(Net, RejectsBadAddresses) {
  for (const char* bad : {"", "127.0.0.1", ":80", "host:", "host:70000", "host:12a", "host:-1"}) {
    auto r = ParseHostPort(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseHostPort("h:70000").status().message().find("[0, 65535]"), std::string::npos);
}

TEST(Net, PicksAFreePort) {
  auto p = PickFreePort("127.0.0.1");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_GT(*p, 0);
}

}  // namespace
}  // namespace tandem
