// A framed client connection's dial over a peer name's several addresses
// (common/frame_conn.h; session 16): a TCP connect still pending after its
// address's share of the connect + handshake deadline is abandoned for the
// next address, so an address that drops SYNs silently (a firewall, a dead
// host's IP) costs that share, not the whole deadline; a refused one moves
// on at once; when every address fails, the error names each with its
// error (refused / timed out) at the deadline; a TLS handshake that fails
// moves on to no other address; localhost reaches a server on 127.0.0.1
// where it resolves to ::1 first. On a reader thread of its own and on a
// frame loop (whose epoll registration follows the new socket). Real
// sockets on 127.0.0.1; the name's addresses come from a lookup the test
// injects (FrameOptions::lookup).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/frame_loop.h"
#include "common/frame_server.h"
#include "frame_addr_support.h"
#include "frame_test_support.h"

namespace tandem {
namespace {

using frame_testing::Identity;
using frame_testing::LocalPort;
using frame_testing::ManyAddresses;
using frame_testing::PortOf;
using frame_testing::Tls;
using SteadyClock = std::chrono::steady_clock;

// A port on 127.0.0.1 whose SYNs are dropped without an answer, as a
// firewall's or a dead host's: a listener with an accept queue of one
// (listen(fd, 0)) that one connection, never accepted, fills. Linux then
// drops further SYNs (with net.ipv4.tcp_abort_on_overflow 0; `usable()`
// says whether it is), so a connect to it neither completes nor fails.
class SilentPort {
 public:
  SilentPort() : listener_(/*listening=*/true, /*backlog=*/0) {
    std::ifstream abort_on_overflow("/proc/sys/net/ipv4/tcp_abort_on_overflow");
    int v = -1;
    abort_on_overflow >> v;
    usable_ = v == 0;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(listener_.port())));
    filler_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(connect(filler_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
    // The filler is in the accept queue once the listener is readable.
    pollfd p{listener_.fd(), POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 20000), 1) << "the filler connection never reached the accept queue";
  }
  ~SilentPort() { ::close(filler_); }
  SilentPort(const SilentPort&) = delete;
  SilentPort& operator=(const SilentPort&) = delete;
  const std::string& port() const { return listener_.port(); }
  bool usable() const { return usable_; }

 private:
  LocalPort listener_;
  int filler_ = -1;
  bool usable_ = false;
};

// Sends each frame back.
class EchoSession final : public FrameSession {
 public:
  explicit EchoSession(std::shared_ptr<FrameConn> conn) : conn_(std::move(conn)) {}
  Status OnFrame(std::string_view payload) override { return conn_->SendParts({payload}); }
  void OnClosed(const Status&) override {}

 private:
  std::shared_ptr<FrameConn> conn_;
};

class FrameConnDialTest : public ::testing::Test {
 protected:
  std::unique_ptr<FrameServer> Echo(std::shared_ptr<FrameTls> tls) {
    return frame_testing::Listen(std::move(tls), [](const std::shared_ptr<FrameConn>& c) {
      return std::make_shared<EchoSession>(c);
    });
  }
  std::string Timed(const std::string& port) {
    return fmt::format("127.0.0.1:{} {}", port, std::strerror(ETIMEDOUT));
  }
  std::string Refused(const std::string& port) {
    return fmt::format("127.0.0.1:{} {}", port, std::strerror(ECONNREFUSED));
  }
  // A name (localhost) whose first address is port `first` and whose
  // second is a server: the TLS handshake runs on the second, on a reader
  // thread of its own and on a frame loop, within the default deadline.
  void ExpectTheSecondAddressReached(const std::string& first) {
    auto server = Echo(Tls(Identity(ca_, "decode-0")));
    ASSERT_NE(server, nullptr);
    const FrameOptions o = ManyAddresses::Options({first, PortOf(server->address())});
    ASSERT_EQ(o.handshake_timeout, std::chrono::seconds(10));
    auto proxy_tls = Tls(Identity(ca_, "proxy"));
    const std::string named = "localhost:" + first;
    FrameLoop loop("test-loop");
    frame_testing::FrameClient own(named, proxy_tls, o);
    frame_testing::FrameClient looped(named, proxy_tls, o, &loop);
    ASSERT_TRUE(own.conn().SendParts({"own"}).ok());
    ASSERT_TRUE(looped.conn().SendParts({"looped"}).ok());
    // The echo comes only over an open (authenticated) connection, and a
    // connection not open by the deadline ends: an echo and no end is a
    // connection made within the deadline.
    EXPECT_EQ(own.WaitFrames(1), std::vector<std::string>{"own"});
    EXPECT_EQ(looped.WaitFrames(1), std::vector<std::string>{"looped"});
    EXPECT_FALSE(own.ended());
    EXPECT_FALSE(looped.ended());
    EXPECT_EQ(own.conn().dials(), 2u);
    EXPECT_EQ(looped.conn().dials(), 2u);
    EXPECT_EQ(own.conn().PeerCommonName(), "decode-0");
  }
  CertKeyPem ca_ = frame_testing::MakeCa("dial-test-ca");
};

#define SKIP_UNLESS_SILENT(port) \
  if (!(port).usable()) GTEST_SKIP() << "net.ipv4.tcp_abort_on_overflow is not 0 here"

// The name's first address drops SYNs: after its share (the default
// attempt timeout of 1 s, under half of the 10 s deadline) the second is
// dialled, and the TLS handshake runs on that one. Before session 16 the
// first used up the whole deadline and the connection never came.
TEST_F(FrameConnDialTest, ASilentFirstAddressGivesWayToTheNextWithinTheDeadline) {
  SilentPort silent;
  SKIP_UNLESS_SILENT(silent);
  ExpectTheSecondAddressReached(silent.port());
}

// Three silent addresses and a deadline of 1.5 s: each gets its share
// (0.5 s: under the 1 s attempt timeout, which would leave the third no
// time), and the connection fails at the deadline, not before, naming
// each address as timed out.
TEST_F(FrameConnDialTest, ANameWhoseAddressesAllStaySilentFailsAtTheDeadlineNamingEach) {
  SilentPort a, b, c;
  SKIP_UNLESS_SILENT(a);
  FrameOptions o = ManyAddresses::Options({a.port(), b.port(), c.port()});
  o.handshake_timeout = std::chrono::milliseconds(1500);
  const std::string named = "localhost:" + a.port();
  FrameLoop loop("test-loop");
  const auto start = SteadyClock::now();
  frame_testing::FrameClient own(named, nullptr, o);
  frame_testing::FrameClient looped(named, nullptr, o, &loop);
  const std::string want = fmt::format("cannot connect to {}: {}; {}; {}", named, Timed(a.port()),
                                       Timed(b.port()), Timed(c.port()));
  for (frame_testing::FrameClient* client : {&own, &looped}) {
    const Status end = client->WaitEnd();
    EXPECT_GE(SteadyClock::now() - start, o.handshake_timeout);
    EXPECT_EQ(end.code(), StatusCode::kUnavailable) << end.ToString();
    EXPECT_EQ(end.message(), want);
    EXPECT_EQ(client->conn().dials(), 3u);
  }
}

// A refused address moves on at once, a silent one at its share: the
// third address, a server, is reached; and where the silent one is the
// last, the error names the refusal and the timeout.
TEST_F(FrameConnDialTest, ARefusedAddressMovesOnAtOnceAndASilentOneAtItsShare) {
  LocalPort refusing(/*listening=*/false);
  SilentPort silent;
  SKIP_UNLESS_SILENT(silent);
  auto server = Echo(nullptr);
  ASSERT_NE(server, nullptr);
  const std::string named = "localhost:" + refusing.port();
  frame_testing::FrameClient reached(
      named, nullptr,
      ManyAddresses::Options({refusing.port(), silent.port(), PortOf(server->address())}));
  ASSERT_TRUE(reached.conn().SendParts({"third"}).ok());
  EXPECT_EQ(reached.WaitFrames(1), std::vector<std::string>{"third"});
  EXPECT_FALSE(reached.ended());
  EXPECT_EQ(reached.conn().dials(), 3u);

  FrameOptions o = ManyAddresses::Options({refusing.port(), silent.port()});
  o.handshake_timeout = std::chrono::milliseconds(800);
  frame_testing::FrameClient failed(named, nullptr, o);
  const Status end = failed.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable) << end.ToString();
  EXPECT_EQ(end.message(), fmt::format("cannot connect to {}: {}; {}", named, Refused(refusing.port()),
                                       Timed(silent.port())));
}

// Session 15 (conn-addrs): a peer's name that resolves to an address
// that refuses (::1 first for localhost, a worker on 127.0.0.1) is
// connected to on its next address, on the same Connect, on a reader
// thread of its own and on a frame loop (whose epoll registration follows
// the new socket).
TEST_F(FrameConnDialTest, ANameWhoseFirstAddressRefusesConnectsToTheNext) {
  LocalPort refusing(/*listening=*/false);
  ExpectTheSecondAddressReached(refusing.port());
}

TEST_F(FrameConnDialTest, ANameWhoseAddressesAllRefuseFailsNamingEach) {
  LocalPort a(/*listening=*/false), b(/*listening=*/false);
  frame_testing::FrameClient client("localhost:" + a.port(), nullptr,
                                    ManyAddresses::Options({a.port(), b.port()}));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_EQ(end.message(), fmt::format("cannot connect to localhost:{}: {}; {}", a.port(),
                                       Refused(a.port()), Refused(b.port())));
}

// A TLS handshake that fails after TCP connected is not an address's
// problem: the next address is not dialled.
TEST_F(FrameConnDialTest, ATlsHandshakeFailureMovesOnToNoOtherAddress) {
  auto impostor = Echo(Tls(frame_testing::Stranger(ca_, "impostor")));
  ASSERT_NE(impostor, nullptr);
  LocalPort next(/*listening=*/true);
  frame_testing::FrameClient client(
      "localhost:" + PortOf(impostor->address()), Tls(Identity(ca_, "proxy")),
      ManyAddresses::Options({PortOf(impostor->address()), next.port()}));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find("TLS handshake"), std::string::npos) << end.message();
  EXPECT_EQ(client.conn().dials(), 1u);
  EXPECT_EQ(next.Accepted(), 0);
}

// The real thing, where the host resolves localhost to an IPv6 address
// before 127.0.0.1 (Debian's /etc/hosts): a worker on 127.0.0.1 is reached.
TEST_F(FrameConnDialTest, LocalhostReachesAServerOn127001WhenItResolvesToIpv6First) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  bool v6_first = false;
  if (getaddrinfo("localhost", "1", &hints, &res) == 0) {
    v6_first = res->ai_family == AF_INET6;
    bool v4 = false;
    for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next)
      v4 = v4 || ai->ai_family == AF_INET;
    v6_first = v6_first && v4;
    freeaddrinfo(res);
  }
  if (!v6_first)
    GTEST_SKIP() << "localhost does not resolve to an IPv6 address before an IPv4 one here";
  auto server = Echo(nullptr);
  ASSERT_NE(server, nullptr);
  frame_testing::FrameClient client("localhost:" + PortOf(server->address()), nullptr);
  ASSERT_TRUE(client.conn().SendParts({"v4"}).ok());
  EXPECT_EQ(client.WaitFrames(1), std::vector<std::string>{"v4"});
  EXPECT_FALSE(client.ended());
}

}  // namespace
}  // namespace tandem
