// ProxyRegistrar (issue 21): --join lists, --join-dns re-resolution with a
// resolver hook whose answer changes, periodic re-registration. The real
// counterpart (getaddrinfo of "localhost", real proxies) is
// tests/integration/fleet/proxy_replicas_test.cc.
#include "worker/proxy_registrar.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "../captured_log.h"
#include "common/net.h"

namespace tandem::worker {
namespace {

// Records every registration; addresses in `refuse` are refused, those in
// `down` are unreachable.
struct FakeProxies {
  std::mutex mu;
  std::condition_variable called;
  std::map<std::string, int> calls;
  std::set<std::string> down, refuse;
  Status Register(const std::string& a, std::chrono::milliseconds) {
    std::lock_guard lock(mu);
    ++calls[a];
    called.notify_all();
    if (refuse.count(a)) return FailedPreconditionError("the proxy at " + a + " refused");
    if (down.count(a)) return UnavailableError("connection refused");
    return Status::Ok();
  }
  int Calls(const std::string& a) {
    std::lock_guard lock(mu);
    return calls[a];
  }
  // Until `a` has been called at least `n` times (a bound only against a
  // hang: the registrar's own retry pace decides when).
  int WaitCalls(const std::string& a, int n) {
    std::unique_lock lock(mu);
    called.wait_for(lock, std::chrono::seconds(30), [&] { return calls[a] >= n; });
    return calls[a];
  }
};

TEST(ProxyRegistrar, ParseJoinList) {
  auto l = ParseJoinList("127.0.0.1:1, 127.0.0.1:2,127.0.0.1:1", "--join");
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ(*l, (std::vector<std::string>{"127.0.0.1:1", "127.0.0.1:2"}));
  EXPECT_TRUE(ParseJoinList("", "--join")->empty());
  auto bad = ParseJoinList("127.0.0.1:1,nope", "--join");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--join: 'nope'"), std::string::npos);
  EXPECT_FALSE(ParseJoinList("127.0.0.1:0", "--join").ok());
}

TEST(ProxyRegistrar, BadDnsFlagIsRefused) {
  FakeProxies f;
  RegistrarOptions o;
  o.join_dns = "proxies.example";  // no port
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--join-dns"), std::string::npos);
}

TEST(ProxyRegistrar, JoinListRegistersWithEveryProxyAndAgainOnRefresh) {
  FakeProxies f;
  RegistrarOptions o;
  o.join = {"10.0.0.1:7000", "10.0.0.2:7000"};
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  EXPECT_EQ(f.Calls("10.0.0.1:7000"), 1);
  EXPECT_EQ(f.Calls("10.0.0.2:7000"), 1);
  // A proxy goes down (and comes back, restarted): the refresh keeps trying.
  f.down.insert("10.0.0.2:7000");
  (*r)->RefreshOnce(false);
  EXPECT_FALSE((*r)->targets().at("10.0.0.2:7000"));
  f.down.clear();
  (*r)->RefreshOnce(false);
  EXPECT_TRUE((*r)->targets().at("10.0.0.2:7000"));
  EXPECT_EQ(f.Calls("10.0.0.1:7000"), 3);
  EXPECT_EQ(f.Calls("10.0.0.2:7000"), 3);
}

// Issue 23: a proxy that accepted the registration is not asked again every
// refresh_interval (only every registered_refresh_interval, here an hour,
// or on Kick: its Watch stream was cancelled); one that failed is retried
// every refresh_interval until it answers.
TEST(ProxyRegistrar, OnlyFailingProxiesAreRetriedUntilAKick) {
  FakeProxies f;
  RegistrarOptions o;
  o.join = {"10.0.0.1:7000", "10.0.0.2:7000"};
  o.refresh_interval = std::chrono::milliseconds(5);
  o.registered_refresh_interval = std::chrono::hours(1);
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  {
    std::lock_guard lock(f.mu);
    f.down.insert("10.0.0.2:7000");  // goes down after start-up
  }
  (*r)->RefreshOnce(false);
  EXPECT_FALSE((*r)->targets().at("10.0.0.2:7000"));
  (*r)->Start();
  // The failing one is retried by the refresh thread (bounded wait).
  EXPECT_GE(f.WaitCalls("10.0.0.2:7000", 6), 6);
  EXPECT_EQ(f.Calls("10.0.0.1:7000"), 2);  // initial + the explicit RefreshOnce
  {
    std::lock_guard lock(f.mu);
    f.down.clear();  // back (restarted)
  }
  // Every call from here on succeeds: the refresh thread's next retry is
  // the one that brings it back.
  const int failed = f.Calls("10.0.0.2:7000");
  EXPECT_GT(f.WaitCalls("10.0.0.2:7000", failed + 1), failed);
  // A Watch stream was cancelled: every proxy gets the registration again.
  (*r)->Kick();
  EXPECT_EQ(f.WaitCalls("10.0.0.1:7000", 3), 3);
  (*r)->Stop();
  // The refresh thread has stopped, so its successful retry has been recorded.
  EXPECT_TRUE((*r)->targets().at("10.0.0.2:7000"));
  (*r)->Kick();  // after Stop: nothing
  EXPECT_EQ(f.Calls("10.0.0.1:7000"), 3);
}

using testing::CapturedLog;

// A fleet stop drains the proxy first, and each worker, kicked by its Watch
// ending, tries the proxy before its own SIGTERM: not a warning per worker.
// A proxy registered with before that stops answering is logged at info,
// and warned about only once it has failed for lost_warn_after; one never
// registered with warns at once.
TEST(ProxyRegistrar, AProxyThatWasRegisteredWithWarnsOnlyIfItStaysDown) {
  CapturedLog log;
  FakeProxies f;
  RegistrarOptions o;
  o.join = {"10.0.0.1:7000"};
  o.lost_warn_after = std::chrono::hours(1);
  auto patient = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  o.lost_warn_after = std::chrono::milliseconds(0);
  auto eager = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_TRUE(patient.ok() && eager.ok());
  ASSERT_TRUE((*patient)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  ASSERT_TRUE((*eager)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  log.Take();
  using Levels = std::map<std::string, int>;
  f.down.insert("10.0.0.1:7000");
  for (int i = 0; i < 3; ++i) (*patient)->RefreshOnce(false);
  EXPECT_EQ(log.Take(), (Levels{{"info", 1}}));  // the first failure, once, at info
  (*eager)->RefreshOnce(false);  // down for lost_warn_after (0) already
  EXPECT_EQ(log.Take(), (Levels{{"info", 1}, {"warning", 1}}));
  (*eager)->RefreshOnce(false);  // warned once, not per retry
  EXPECT_EQ(log.Take(), Levels{});
  // Back, then down again: the grace starts over.
  f.down.clear();
  (*patient)->RefreshOnce(false);
  EXPECT_EQ(log.Take(), (Levels{{"info", 1}}));  // registered again
  f.down.insert("10.0.0.1:7000");
  (*patient)->RefreshOnce(false);
  EXPECT_EQ(log.Take(), (Levels{{"info", 1}}));
  // Never registered with: a warning at the first failure, as before.
  o.join = {"10.0.0.9:7000"};
  f.down.insert("10.0.0.9:7000");
  auto fresh = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_TRUE(fresh.ok());
  (*fresh)->RefreshOnce(false);
  EXPECT_EQ(log.Take(), (Levels{{"warning", 1}}));
}

TEST(ProxyRegistrar, JoinListRefusalFailsStartUp) {
  FakeProxies f;
  f.refuse.insert("10.0.0.2:7000");
  RegistrarOptions o;
  o.join = {"10.0.0.1:7000", "10.0.0.2:7000"};
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); });
  ASSERT_TRUE(r.ok());
  Status s = (*r)->RegisterInitial(std::chrono::milliseconds(0));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("10.0.0.2:7000 refused"), std::string::npos);
}

TEST(ProxyRegistrar, DnsAnswerChangesAreFollowed) {
  FakeProxies f;
  std::mutex mu;
  std::vector<std::string> answer = {"10.0.0.1"};
  bool fail = false;
  RegistrarOptions o;
  o.join_dns = "tandem-proxy.ns.svc:7001";
  std::vector<std::string> asked;
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); },
      [&](const std::string& host) -> Result<std::vector<std::string>> {
        std::lock_guard lock(mu);
        asked.push_back(host);
        if (fail) return UnavailableError("SERVFAIL");
        return answer;
      });
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  EXPECT_EQ(asked, std::vector<std::string>{"tandem-proxy.ns.svc"});
  EXPECT_EQ(f.Calls("10.0.0.1:7001"), 1);

  // Scale up: a second proxy appears.
  answer = {"10.0.0.2", "10.0.0.1"};
  (*r)->RefreshOnce(true);
  EXPECT_EQ(f.Calls("10.0.0.1:7001"), 2);
  EXPECT_EQ(f.Calls("10.0.0.2:7001"), 1);
  EXPECT_EQ((*r)->targets().size(), 2u);

  // A failed lookup keeps the last answer.
  fail = true;
  (*r)->RefreshOnce(true);
  EXPECT_EQ(f.Calls("10.0.0.1:7001"), 3);
  EXPECT_EQ(f.Calls("10.0.0.2:7001"), 2);

  // Scale down: the first one vanishes and is no longer registered with.
  fail = false;
  answer = {"10.0.0.2"};
  (*r)->RefreshOnce(true);
  (*r)->RefreshOnce(false);
  EXPECT_EQ(f.Calls("10.0.0.1:7001"), 3);
  EXPECT_EQ(f.Calls("10.0.0.2:7001"), 4);
  const auto t = (*r)->targets();
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.count("10.0.0.2:7001"));
}

TEST(ProxyRegistrar, DnsWithNoProxyFailsAfterTheRetryWindow) {
  FakeProxies f;
  RegistrarOptions o;
  o.join_dns = "nothing.example:7001";
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); },
      [](const std::string&) -> Result<std::vector<std::string>> {
        return std::vector<std::string>{};
      });
  ASSERT_TRUE(r.ok());
  Status s = (*r)->RegisterInitial(std::chrono::milliseconds(0));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("--join-dns nothing.example:7001"), std::string::npos);
}

TEST(ProxyRegistrar, RealResolverFindsLocalhost) {
  auto ips = ResolveProxyAddresses("localhost");
  ASSERT_TRUE(ips.ok()) << ips.status().message();
  EXPECT_NE(std::find(ips->begin(), ips->end(), "127.0.0.1"), ips->end());
}

// Session 16: a name with no A record is read for its AAAA records (an
// IPv6-only cluster); before, --join-dns found no proxy there. A name with
// both is read for its A records only.
TEST(ProxyRegistrar, RealResolverFallsBackToIpv6) {
  auto v6 = ResolveProxyAddresses("::1");
  ASSERT_TRUE(v6.ok()) << v6.status().message();
  EXPECT_EQ(*v6, std::vector<std::string>{"::1"});
  auto v4 = ResolveProxyAddresses("127.0.0.1");
  ASSERT_TRUE(v4.ok()) << v4.status().message();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1"});
}

TEST(ProxyRegistrar, AnIpv6AnswerIsRegisteredWithInBrackets) {
  FakeProxies f;
  RegistrarOptions o;
  o.join_dns = "tandem-proxy.ns.svc:7001";
  auto r = ProxyRegistrar::Create(
      o, [&](const std::string& a, std::chrono::milliseconds d) { return f.Register(a, d); },
      [&](const std::string&) -> Result<std::vector<std::string>> {
        return std::vector<std::string>{"fd00::5", "fd00::6"};
      });
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->RegisterInitial(std::chrono::milliseconds(0)).ok());
  EXPECT_EQ(f.Calls("[fd00::5]:7001"), 1);
  EXPECT_EQ(f.Calls("[fd00::6]:7001"), 1);
  const auto hp = ParseHostPort("[fd00::5]:7001");
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->host, "fd00::5");
  EXPECT_EQ(hp->port, 7001);
}

}  // namespace
}  // namespace tandem::worker
