// Issue 19, tenants (docs/security.md "Tenants and limits"), on a real 1P1D
// fleet: API keys from security.api_keys_file on both APIs, and the tenant
// salt keeping each tenant's cached prefixes its own (a group shares).
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;

// One HTTP/1.1 request on a fresh connection (Connection: close); the whole
// response, or "" when the connection failed.
std::string HttpCall(const std::string& address, const std::string& request) {
  const auto colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

std::string PostCompletion(const std::string& address, const std::string& auth_header) {
  const std::string body = R"({"prompt": "Once upon a time", "max_tokens": 2})";
  return HttpCall(address, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                           "Content-Type: application/json\r\n" + auth_header +
                           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
}

TEST(TenantFleet, TenantsShareNoCacheEntriesAndBadKeysAreRefused) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("tandem-tenants-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream keys(dir + "/keys.yaml");
    // bob's key is stored as its SHA-256 ("key-bob").
    keys << "- key: key-alice\n  tenant: alice\n"
         << "- key: sha256:f031fc74d10cf0c1284dc15f679c18b1e8e05f9d1966adefba6c6463cdcef658\n"
         << "  tenant: bob\n"
         << "- key: key-carol\n  tenant: carol\n  group: team\n"
         << "- key: key-dave\n  tenant: dave\n  group: team\n";
  }
  FleetOptions o;  // 1P1D
  o.extra_yaml = "security:\n  api_keys_file: " + dir + "/keys.yaml\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();

  auto run = [&](const std::string& key, const std::vector<uint32_t>& prompt) {
    GenerateArgs a;
    a.prompt_ids = prompt;
    a.max_tokens = 2;
    a.api_key = key;
    return Generate(proxy, a);
  };
  const auto prompt = PromptIds(19, 100, kVocab);  // 6 full blocks of 16
  auto a1 = run("key-alice", prompt);
  ASSERT_TRUE(a1.ok()) << a1.status().ToString();
  EXPECT_EQ(a1->cached_prompt_tokens, 0u);
  auto a2 = run("key-alice", prompt);
  ASSERT_TRUE(a2.ok()) << a2.status().ToString();
  EXPECT_EQ(a2->cached_prompt_tokens, 96u) << "alice's own repeat hits her cache";
  // Bob asks for alice's prompt: no hit (the side channel is closed) ...
  auto b1 = run("key-bob", prompt);
  ASSERT_TRUE(b1.ok()) << b1.status().ToString();
  EXPECT_EQ(b1->cached_prompt_tokens, 0u) << "bob must not see alice's cached prefix";
  EXPECT_EQ(b1->token_ids, a1->token_ids);  // same answer, computed again
  // ... and his repeat hits his own.
  auto b2 = run("key-bob", prompt);
  ASSERT_TRUE(b2.ok()) << b2.status().ToString();
  EXPECT_EQ(b2->cached_prompt_tokens, 96u);

  // carol and dave share the group `team`: dave's first request hits carol's.
  const auto team_prompt = PromptIds(20, 100, kVocab);
  auto c1 = run("key-carol", team_prompt);
  ASSERT_TRUE(c1.ok()) << c1.status().ToString();
  EXPECT_EQ(c1->cached_prompt_tokens, 0u);
  auto d1 = run("key-dave", team_prompt);
  ASSERT_TRUE(d1.ok()) << d1.status().ToString();
  EXPECT_EQ(d1->cached_prompt_tokens, 96u) << "a group shares its cache";
  auto a3 = run("key-alice", team_prompt);
  ASSERT_TRUE(a3.ok()) << a3.status().ToString();
  EXPECT_EQ(a3->cached_prompt_tokens, 0u) << "outside the group: no hit";

  // Bad keys: UNAUTHENTICATED on gRPC, 401 on HTTP; good ones pass on HTTP too.
  for (const std::string key : {"", "key-mallory", "key-alic"}) {
    auto bad = run(key, prompt);
    ASSERT_FALSE(bad.ok()) << "key '" << key << "'";
    EXPECT_EQ(bad.status().code(), StatusCode::kUnauthenticated) << bad.status().ToString();
  }
  const std::string http = (*fleet)->proxy_http();
  for (const std::string header : {"", "Authorization: Bearer key-mallory\r\n",
                                   "Authorization: key-alice\r\n"}) {
    const std::string resp = PostCompletion(http, header);
    EXPECT_EQ(resp.rfind("HTTP/1.1 401", 0), 0u) << "header '" << header << "': " << resp;
    EXPECT_NE(resp.find("invalid_api_key"), std::string::npos) << resp;
  }
  const std::string ok = PostCompletion(http, "Authorization: Bearer key-bob\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  EXPECT_NE(ok.find("\"completion_tokens\":2"), std::string::npos) << ok;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tandem::testing
