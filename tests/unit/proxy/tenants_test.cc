// API keys and tenants (proxy/tenants.h): the keys file, authentication,
// cache salts, and the token buckets of per-tenant rate limits.
#include "proxy/tenants.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tandem::proxy {
namespace {

constexpr const char* kKeys = R"(
- key: key-alice-1
  tenant: alice
- key: key-alice-2
  tenant: alice
- key: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
  tenant: bob
- key: key-carol
  tenant: carol
  group: team
- key: key-dave
  tenant: dave
  group: team
)";

TEST(Tenants, NoKeysMeansAnOpenApiAndOneTenantWithoutSalt) {
  auto t = Tenants::Parse("", "", "");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->required());
  auto who = (*t)->Authenticate("");
  ASSERT_TRUE(who.ok());
  EXPECT_EQ((*who)->name, "default");
  EXPECT_EQ((*who)->cache_salt, "");
  EXPECT_TRUE((*t)->Authenticate("Bearer anything").ok());
}

TEST(Tenants, ProxyApiKeyAloneIsTheDefaultTenant) {
  auto t = Tenants::Parse("s3cret", "", "");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE((*t)->required());
  auto ok = (*t)->Authenticate("Bearer s3cret");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)->name, "default");
  EXPECT_EQ((*ok)->cache_salt, "");  // a fleet with one key hashes as before
  EXPECT_TRUE((*t)->Authenticate("bearer s3cret").ok());  // the scheme is case-insensitive
  for (const char* bad :
       {"", "s3cret", "Bearer ", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret"}) {
    auto r = (*t)->Authenticate(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << bad;
    EXPECT_NE(r.status().message().find("Bearer KEY"), std::string::npos);
  }
}

TEST(Tenants, KeysFileTenantsGroupsAndHashedKeys) {
  auto t = Tenants::Parse("admin-key", kKeys, "keys.yaml");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto name = [&](const char* auth) {
    auto r = (*t)->Authenticate(auth);
    return r.ok() ? (*r)->name : std::string("<") + r.status().ToString() + ">";
  };
  EXPECT_EQ(name("Bearer key-alice-1"), "alice");
  EXPECT_EQ(name("Bearer key-alice-2"), "alice");
  EXPECT_EQ(name("Bearer test"), "bob");  // sha256("test") is stored, not the key
  EXPECT_EQ(name("Bearer admin-key"), "default");
  EXPECT_EQ((*t)->Authenticate("Bearer sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08")
                .status().code(), StatusCode::kUnauthenticated);  // the digest is not the key
  EXPECT_EQ((*t)->Authenticate("Bearer key-erin").status().code(), StatusCode::kUnauthenticated);

  auto salt = [&](const char* auth) { return (*(*t)->Authenticate(auth))->cache_salt; };
  EXPECT_NE(salt("Bearer key-alice-1"), salt("Bearer test"));
  EXPECT_NE(salt("Bearer key-alice-1"), salt("Bearer admin-key"));
  EXPECT_NE(salt("Bearer key-alice-1"), "");
  EXPECT_EQ(salt("Bearer key-carol"), salt("Bearer key-dave"));  // group `team` shares
  EXPECT_NE(salt("Bearer key-carol"), salt("Bearer key-alice-1"));
  EXPECT_EQ(Sha256Hex("test"), "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
}

TEST(Tenants, BadKeysFilesNameTheEntryAndField) {
  auto err = [](const std::string& text) {
    auto t = Tenants::Parse("", text, "keys.yaml");
    return t.ok() ? std::string("<ok>") : t.status().message();
  };
  EXPECT_NE(err("key: a\ntenant: b\n").find("list"), std::string::npos);
  EXPECT_NE(err("- tenant: b\n").find("[0].key"), std::string::npos);
  EXPECT_NE(err("- key: k\n").find("[0].tenant"), std::string::npos);
  EXPECT_NE(err("- key: k\n  tenant: b\n  colour: red\n").find("unknown key 'colour' in '[0]'"), std::string::npos);
  EXPECT_NE(err("- key: sha256:abc\n  tenant: b\n").find("64 hex digits"), std::string::npos);
  EXPECT_NE(err("- key: k\n  tenant: 'a b'\n").find("[0].tenant"), std::string::npos);
  EXPECT_NE(err("- key: k\n  tenant: a\n- key: k\n  tenant: b\n").find("twice"),
            std::string::npos);
  EXPECT_NE(err("- key: k1\n  tenant: a\n- key: k2\n  tenant: a\n  group: g\n").find("same ones"),
            std::string::npos);
  EXPECT_NE(err("- key: k\n  tenant: a\n  requests_per_second: -1\n").find("requests_per_second"),
            std::string::npos);
  auto missing = Tenants::Load("", "/nonexistent/keys.yaml");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("security.api_keys_file"), std::string::npos);
}

TEST(TokenBucket, RefillsAtItsRateUpToTheBurst) {
  using namespace std::chrono_literals;
  TokenBucket b(RateLimit{2.0, 3.0});  // 2 per second, burst 3
  const auto t0 = TokenBucket::Clock::time_point{} + 1h;
  EXPECT_EQ(b.Take(1, t0), 0);
  EXPECT_EQ(b.Take(2, t0), 0);
  EXPECT_DOUBLE_EQ(b.Take(1, t0), 0.5);       // empty: one token in 0.5 s
  EXPECT_EQ(b.Take(1, t0 + 500ms), 0);         // refilled exactly one
  EXPECT_DOUBLE_EQ(b.Take(2, t0 + 500ms), 1.0);
  EXPECT_EQ(b.Take(3, t0 + 100s), 0);          // capped at the burst
  EXPECT_TRUE(std::isinf(b.Take(4, t0 + 200s)));  // more than the burst: never
  TokenBucket unlimited;
  EXPECT_EQ(unlimited.Take(1e9, t0), 0);
}

TEST(Tenants, RateLimitsRefuseWithResourceExhaustedNamingTheLimit) {
  auto t = Tenants::Parse("", R"(
- key: k-slow
  tenant: slow
  requests_per_second: 0.001
  burst_requests: 2
  tokens_per_second: 0.001
  burst_tokens: 100
)", "keys.yaml");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const Tenant& slow = **(*t)->Authenticate("Bearer k-slow");
  EXPECT_TRUE((*t)->ChargeRequest(slow).status.ok());
  EXPECT_TRUE((*t)->ChargeRequest(slow).status.ok());
  RateRefusal r = (*t)->ChargeRequest(slow);
  EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status.message().find("tenant 'slow'"), std::string::npos) << r.status.ToString();
  EXPECT_NE(r.status.message().find("requests per second"), std::string::npos);
  EXPECT_GT(r.retry_after_seconds, 0);
  EXPECT_TRUE((*t)->ChargeTokens(slow, 60).status.ok());
  RateRefusal tok = (*t)->ChargeTokens(slow, 60);
  EXPECT_EQ(tok.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(tok.status.message().find("tokens per second"), std::string::npos);
  RateRefusal never = (*t)->ChargeTokens(slow, 500);
  EXPECT_NE(never.status.message().find("burst_tokens"), std::string::npos);
}

}  // namespace
}  // namespace tandem::proxy

namespace tandem::proxy {
namespace {

// Scheduling fields of the keys file (docs/scheduling.md).
TEST(TenantsScheduling, PriorityMinPriorityAndWeightAreReadAndChecked) {
  auto t = Tenants::Parse("",
                          "- key: k1\n  tenant: batch\n  priority: 10\n  min_priority: 5\n"
                          "  weight: 2.5\n- key: k2\n  tenant: chat\n",
                          "keys.yaml");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto batch = (*t)->Authenticate("Bearer k1");
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ((*batch)->priority, 10);
  EXPECT_EQ((*batch)->min_priority, std::optional<int32_t>(5));
  EXPECT_DOUBLE_EQ((*batch)->weight, 2.5);
  auto chat = (*t)->Authenticate("Bearer k2");
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ((*chat)->priority, 0);
  EXPECT_FALSE((*chat)->min_priority.has_value());
  EXPECT_DOUBLE_EQ((*chat)->weight, 1.0);

  for (const auto& [yaml, needle] : std::vector<std::pair<std::string, std::string>>{
           {"- key: k\n  tenant: a\n  priority: 1.5\n", "[0].priority is 1.5"},
           {"- key: k\n  tenant: a\n  priority: 1\n  min_priority: 2\n", "below its min_priority"},
           {"- key: k\n  tenant: a\n  weight: 0\n", "weight"},
           {"- key: k\n  tenant: a\n  priority: 1\n- key: l\n  tenant: a\n  priority: 2\n",
            "appears again"}}) {
    auto bad = Tenants::Parse("", yaml, "keys.yaml");
    ASSERT_FALSE(bad.ok()) << yaml;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(needle), std::string::npos) << bad.status().ToString();
  }
}

}  // namespace
}  // namespace tandem::proxy
