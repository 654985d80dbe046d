// The framed TCP transport (common/frame_conn.h, common/frame_server.h,
// common/frame_reader.h, common/frame_loop.h; issue 23): frames round trip
// in order over mutual TLS and plaintext, on a reader thread of their own
// and on a shared frame loop; an
// over-limit frame is refused with a clear error on both sides; a peer
// without a certificate of the fleet CA is refused by the server and a
// server without one by the client; a peer that does not read never blocks
// the sender and is disconnected at the bound; four threads sending at
// once while the reader reads interleave no frame nor record. On one frame loop, a
// connection that breaks ends alone, a peer that never answers holds up
// no other connection's frames, and a deadline given without a wake-up
// (WakeBy) holds; a name is resolved off the loop's thread. Real sockets on
// 127.0.0.1. (A name's several addresses: frame_conn_dial_test.cc.)
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/frame_loop.h"
#include "common/frame_reader.h"
#include "common/net.h"
#include "frame_test_support.h"
#include "tandem/v1/worker.pb.h"

namespace tandem {
namespace {

namespace pb = ::tandem::v1;
using frame_testing::Identity;
using frame_testing::Tls;

// What a server session saw.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> cancels;
  std::shared_ptr<FrameConn> conn;
  Status closed = Status::Ok();
  bool is_closed = false;

  template <class Pred>
  bool WaitFor(Pred p) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20), p);
  }
};

// Answers each DecodeStreamRequest{cancel: n} with an item of handle n.
class EchoSession final : public FrameSession {
 public:
  EchoSession(std::shared_ptr<FrameConn> conn, Seen* seen, bool echo, bool stale_error)
      : conn_(std::move(conn)), seen_(seen), echo_(echo), stale_error_(stale_error) {
    std::lock_guard lock(seen_->mu);
    seen_->conn = conn_;
  }
  Status OnFrame(std::string_view payload) override {
    pb::DecodeStreamRequest req;
    if (!req.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("not a DecodeStreamRequest");
    }
    {
      std::lock_guard lock(seen_->mu);
      seen_->cancels.push_back(req.cancel());
    }
    seen_->cv.notify_all();
    Status st = Status::Ok();
    if (echo_) {
      pb::DecodeStreamResponse resp;
      resp.add_items()->set_handle(req.cancel());
      st = conn_->Send(resp);
    }
    // An entry some other TLS call on this thread could have left behind
    // (after the echo: the writer's own test is
    // AStaleOpenSslErrorOnTheWritersThreadIsNotItsConnectionsFailure).
    if (stale_error_) ERR_raise_data(ERR_LIB_USER, 1, "stale entry left by the test");
    return st;
  }
  void OnClosed(const Status& why) override {
    {
      std::lock_guard lock(seen_->mu);
      seen_->closed = why;
      seen_->is_closed = true;
    }
    seen_->cv.notify_all();
  }

 private:
  std::shared_ptr<FrameConn> conn_;
  Seen* seen_;
  bool echo_;
  bool stale_error_;
};

std::unique_ptr<FrameServer> Serve(std::shared_ptr<FrameTls> tls, Seen* seen, FrameOptions o = {},
                                   bool echo = true, bool stale_error = false) {
  return frame_testing::Listen(
      std::move(tls),
      [seen, echo, stale_error](const std::shared_ptr<FrameConn>& c) {
        return std::make_shared<EchoSession>(c, seen, echo, stale_error);
      },
      o);
}

// frame_testing::FrameClient whose frames are DecodeStreamResponses.
class Client : public frame_testing::FrameClient {
 public:
  using FrameClient::FrameClient;
  // Waits for `n` answers (one handle each, or the end); the handles received.
  std::vector<uint64_t> WaitHandles(size_t n) {
    std::vector<uint64_t> handles;
    for (const std::string& payload : WaitFrames(n)) {
      pb::DecodeStreamResponse r;
      EXPECT_TRUE(r.ParseFromString(payload)) << "not a DecodeStreamResponse";
      for (const auto& item : r.items()) handles.push_back(item.handle());
    }
    return handles;
  }
};

// A TCP relay on 127.0.0.1 for one connection to `port`: what the client
// sends goes on as it comes; what the server sends reaches the client one
// byte per write, so the client's reads find TLS records in pieces. Not
// dribbling: what the server sends goes on as it comes, except between
// Hold() and Open(), when it waits (in a small receive buffer, so the
// server's writes soon find its socket full).
class DribblingRelay {
 public:
  explicit DribblingRelay(int port, bool dribble = true) : dribble_(dribble) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(listen_fd_, 1), 0);
    EXPECT_EQ(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this, port] { Run(port); });
  }
  ~DribblingRelay() {
    Open();  // a test that failed early: nothing waits
    ::shutdown(listen_fd_, SHUT_RDWR);  // ends a pending accept
    thread_.join();
    close(listen_fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void Hold() {
    std::lock_guard lock(mu_);
    held_ = true;
  }
  void Open() {
    std::lock_guard lock(mu_);
    held_ = false;
    cv_.notify_all();
  }

 private:
  void Run(int port) {
    const int c = accept(listen_fd_, nullptr, nullptr);
    if (c < 0) return;
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    if (!dribble_) {
      const int small = 4096;
      setsockopt(s, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      std::thread up([c, s] {
        char buf[16 << 10];
        for (ssize_t n; (n = recv(c, buf, sizeof buf, 0)) > 0;) {
          if (send(s, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
        }
        ::shutdown(s, SHUT_RDWR);
      });
      char buf[16 << 10];
      bool open = true;
      for (ssize_t n; open && (n = recv(s, buf, sizeof buf, 0)) > 0;) {
        if (!dribble_) {
          std::unique_lock lock(mu_);
          cv_.wait(lock, [&] { return !held_; });
          lock.unlock();
          open = send(c, buf, static_cast<size_t>(n), MSG_NOSIGNAL) == n;
          continue;
        }
        for (ssize_t i = 0; open && i < n; ++i) open = send(c, buf + i, 1, MSG_NOSIGNAL) == 1;
      }
      ::shutdown(c, SHUT_RDWR);
      up.join();
    }
    close(s);
    close(c);
  }
  int listen_fd_ = -1;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  const bool dribble_;
  bool held_ = false;  // guarded by mu_
  std::thread thread_;
};

pb::DecodeStreamRequest Cancel(uint64_t n) {
  pb::DecodeStreamRequest r;
  r.set_cancel(n);
  return r;
}

class FrameConnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ca_ = frame_testing::MakeCa("fleet-ca");
    ASSERT_FALSE(HasFailure());
  }
  CertKeyPem ca_;
};

void RoundTrip(std::shared_ptr<FrameTls> server_tls, std::shared_ptr<FrameTls> client_tls) {
  Seen seen;
  auto server = Serve(server_tls, &seen);
  ASSERT_NE(server, nullptr);
  Client client(server->address(), client_tls);
  constexpr uint64_t kFrames = 200;
  // Sent before the connection is even up: they wait, in order.
  for (uint64_t i = 1; i <= kFrames; ++i) ASSERT_TRUE(client.conn().Send(Cancel(i)).ok());
  const auto got = client.WaitHandles(kFrames);
  ASSERT_EQ(got.size(), kFrames);
  for (uint64_t i = 0; i < kFrames; ++i) EXPECT_EQ(got[i], i + 1);
  EXPECT_EQ(server->accepted(), 1u);
  EXPECT_EQ(server->refused(), 0u);
}

TEST_F(FrameConnTest, FramesRoundTripInOrderOverMutualTls) {
  RoundTrip(Tls(Identity(ca_, "decode-0")), Tls(Identity(ca_, "proxy")));
}

TEST_F(FrameConnTest, FramesRoundTripInOrderOverPlaintext) { RoundTrip(nullptr, nullptr); }

// Four threads Send at once on one connection while its reader is busy
// with the answers (with records sealed here, or over plaintext, the reader
// reads, and opens records, without the connection's mutex): every frame
// arrives once, in each sender's order, in records that authenticate (two
// writers interleaving a record's bytes, or sealing out of sequence, would
// end the connection). Every other frame goes through SendParts, ~20 kB in
// two parts: several records a frame.
void ConcurrentSenders(std::shared_ptr<FrameTls> server_tls, std::shared_ptr<FrameTls> client_tls) {
  Seen seen;
  auto server = Serve(server_tls, &seen);
  ASSERT_NE(server, nullptr);
  Client client(server->address(), client_tls);
  ASSERT_TRUE(client.conn().Send(Cancel(1)).ok());
  ASSERT_EQ(client.WaitHandles(1).size(), 1u);  // connected (and authenticated)
  EXPECT_EQ(client.conn().sealing_records(), client_tls != nullptr);
  // The big part first: the oneof's last field (the cancel) is what parses.
  pb::DecodeStreamRequest big;
  big.mutable_start()->mutable_request()->mutable_prompt_token_ids_fixed32()->Resize(5000, 7);
  const std::string big_bytes = big.SerializeAsString();
  constexpr uint64_t kSenders = 4;
  constexpr uint64_t kFrames = 200;
  std::atomic<int> failed{0};
  std::vector<std::thread> senders;
  for (uint64_t s = 0; s < kSenders; ++s) {
    senders.emplace_back([&, s] {
      for (uint64_t i = 0; i < kFrames; ++i) {
        const pb::DecodeStreamRequest cancel = Cancel((s + 1) << 32 | i);
        const Status st = i % 2 == 0 ? client.conn().Send(cancel)
                                     : client.conn().SendParts({big_bytes, cancel.SerializeAsString()});
        if (!st.ok()) failed.fetch_add(1);
      }
    });
  }
  for (std::thread& t : senders) t.join();
  EXPECT_EQ(failed.load(), 0);
  const auto got = client.WaitHandles(1 + kSenders * kFrames);
  ASSERT_EQ(got.size(), 1 + kSenders * kFrames) << "the connection ended";
  std::vector<uint64_t> next(kSenders, 0);
  for (size_t k = 1; k < got.size(); ++k) {
    const uint64_t s = (got[k] >> 32) - 1;
    ASSERT_LT(s, kSenders) << got[k];
    EXPECT_EQ(got[k] & 0xffffffffu, next[s]) << "sender " << s;
    ++next[s];
  }
  for (uint64_t s = 0; s < kSenders; ++s) EXPECT_EQ(next[s], kFrames) << "sender " << s;
  EXPECT_FALSE(client.ended());
  std::lock_guard lock(seen.mu);
  EXPECT_FALSE(seen.is_closed) << seen.closed.ToString();
  EXPECT_EQ(seen.cancels.size(), 1 + kSenders * kFrames);
}

TEST_F(FrameConnTest, FourConcurrentSendersWhileTheReaderReadsOverMutualTls) {
  ConcurrentSenders(Tls(Identity(ca_, "decode-0")), Tls(Identity(ca_, "proxy")));
}

TEST_F(FrameConnTest, FourConcurrentSendersWhileTheReaderReadsOverPlaintext) {
  ConcurrentSenders(nullptr, nullptr);
}

// Stop() closes the listening socket: a dial to a stopped server is refused
// by the kernel at once, instead of being accepted into a backlog nobody
// reads (where a client waits out its handshake timeout). A connection
// open before Stop() is ended with it.
TEST_F(FrameConnTest, AStoppedServerRefusesADialAtOnce) {
  Seen seen;
  auto server = Serve(Tls(Identity(ca_, "decode-0")), &seen);
  ASSERT_NE(server, nullptr);
  const std::string addr = server->address();
  Client client(addr, Tls(Identity(ca_, "proxy")));
  ASSERT_TRUE(client.conn().Send(Cancel(1)).ok());
  ASSERT_EQ(client.WaitHandles(1).size(), 1u);
  server->Stop();
  ASSERT_TRUE(seen.WaitFor([&] { return seen.is_closed; }));

  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1))));
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sin), sizeof(sin));
  const int err = errno;
  ::close(fd);
  EXPECT_EQ(rc, -1) << "the stopped server's port still accepts connections";
  EXPECT_EQ(err, ECONNREFUSED) << std::strerror(err);
}

// The reader does not clear the thread's OpenSSL error queue before every
// read (frame_conn.cc ReadLocked): an entry another TLS call on its thread
// left there must not be taken for the connection's failure. The client's
// reader finds one in its queue at every read, and the server's bytes
// reach it one at a time: its reads that find part of a record (WANT_READ)
// are judged with the entry there, and the connection lives.
TEST_F(FrameConnTest, AStaleOpenSslErrorOnTheReadersThreadIsNotItsConnectionsFailure) {
  Seen seen;
  auto server = Serve(Tls(Identity(ca_, "decode-0")), &seen, {}, /*echo=*/true,
                      /*stale_error=*/true);
  ASSERT_NE(server, nullptr);
  const std::string addr = server->address();
  DribblingRelay relay(std::stoi(addr.substr(addr.rfind(':') + 1)));
  Client client(relay.address(), Tls(Identity(ca_, "proxy")), {}, nullptr,
                /*stale_error=*/true);
  ASSERT_TRUE(client.conn().Send(Cancel(1)).ok());
  ASSERT_EQ(client.WaitHandles(1).size(), 1u);
  for (uint64_t i = 2; i <= 20; ++i) ASSERT_TRUE(client.conn().Send(Cancel(i)).ok());
  const auto got = client.WaitHandles(20);
  ASSERT_EQ(got.size(), 20u);
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(got[i], i + 1);
  EXPECT_FALSE(client.ended());
  std::lock_guard lock(seen.mu);
  EXPECT_FALSE(seen.is_closed) << seen.closed.ToString();
}

// Nor does the writer clear it before every write (frame_conn.cc
// FlushLocked, issue 23): the sending thread has an entry in its queue at
// every Send, and the client's side holds back what the server sends (a
// relay) until ~10 MiB were sent, so the server's writes find the
// socket full (WANT_WRITE, judged with the entry there) and leave the rest
// to the I/O thread. Then every frame arrives, in order, and neither
// side's connection fails.
TEST_F(FrameConnTest, AStaleOpenSslErrorOnTheWritersThreadIsNotItsConnectionsFailure) {
  Seen seen;
  auto server = Serve(Tls(Identity(ca_, "decode-0")), &seen, {}, /*echo=*/false);
  ASSERT_NE(server, nullptr);
  const std::string addr = server->address();
  DribblingRelay relay(std::stoi(addr.substr(addr.rfind(':') + 1)), /*dribble=*/false);
  Client client(relay.address(), Tls(Identity(ca_, "proxy")));
  ASSERT_TRUE(client.conn().Send(Cancel(1)).ok());
  ASSERT_TRUE(seen.WaitFor([&] { return !seen.cancels.empty(); }));  // handshake done
  std::shared_ptr<FrameConn> conn;
  {
    std::lock_guard lock(seen.mu);
    conn = seen.conn;
  }
  relay.Hold();
  constexpr uint64_t kFrames = 200;
  pb::DecodeStreamResponse batch;
  auto* item = batch.add_items();
  item->mutable_token_ids()->Resize(16 << 10, 12345);  // ~48 KiB a frame
  for (uint64_t i = 1; i <= kFrames; ++i) {
    item->set_handle(i);
    ERR_raise_data(ERR_LIB_USER, 1, "stale entry left by the test");
    ASSERT_TRUE(conn->Send(batch).ok()) << "frame " << i;
  }
  ERR_clear_error();
  relay.Open();
  const auto got = client.WaitHandles(kFrames);
  ASSERT_EQ(got.size(), kFrames);
  for (uint64_t i = 0; i < kFrames; ++i) EXPECT_EQ(got[i], i + 1);
  EXPECT_FALSE(client.ended());
  EXPECT_FALSE(conn->closed());
  std::lock_guard lock(seen.mu);
  EXPECT_FALSE(seen.is_closed) << seen.closed.ToString();
}

TEST_F(FrameConnTest, AFrameOverTheLimitIsRefusedWithAClearErrorOnBothSides) {
  FrameOptions small;
  small.max_frame_bytes = 1024;
  Seen seen;
  auto server = Serve(Tls(Identity(ca_, "decode-0")), &seen, small);
  ASSERT_NE(server, nullptr);
  FrameOptions large;
  large.max_frame_bytes = 1 << 20;
  Client client(server->address(), Tls(Identity(ca_, "proxy")), large);
  pb::DecodeStreamRequest big;
  big.mutable_start()->mutable_request()->mutable_prompt_token_ids()->Resize(2000, 7);
  // The sender's own limit: refused, nothing sent, the connection stays.
  FrameOptions tiny;
  tiny.max_frame_bytes = 16;
  auto limited = FrameConn::Client(server->address(), nullptr, tiny);
  Status refused = limited->Send(big);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("exceeds the limit of 16 bytes"), std::string::npos)
      << refused.message();
  EXPECT_FALSE(limited->closed());

  ASSERT_TRUE(client.conn().Send(Cancel(1)).ok());
  ASSERT_EQ(client.WaitHandles(1).size(), 1u);
  ASSERT_TRUE(client.conn().Send(big).ok());  // within the client's limit, over the server's
  ASSERT_TRUE(seen.WaitFor([&] { return seen.is_closed; }));
  EXPECT_EQ(seen.closed.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(seen.closed.message().find("the limit is 1024 bytes"), std::string::npos)
      << seen.closed.message();
  EXPECT_FALSE(client.WaitEnd().ok());  // the server closed it
  EXPECT_EQ(seen.cancels, std::vector<uint64_t>{1});
}

TEST_F(FrameConnTest, AClientWithoutAFleetCertificateIsRefused) {
  Seen seen;
  auto server = Serve(Tls(Identity(ca_, "decode-0")), &seen);
  ASSERT_NE(server, nullptr);
  {
    // Its own certificate is from another CA (it trusts the fleet's).
    Client client(server->address(), Tls(frame_testing::Stranger(ca_, "stranger")));
    // The handshake may have failed already: then the send fails too.
    (void)client.conn().Send(Cancel(1));
    EXPECT_FALSE(client.WaitEnd().ok());
  }
  {
    // No TLS at all.
    Client client(server->address(), nullptr);
    // The handshake may have failed already: then the send fails too.
    (void)client.conn().Send(Cancel(2));
    EXPECT_FALSE(client.WaitEnd().ok());
  }
  // The server counts a refusal right after closing: wait for the count.
  EXPECT_TRUE(server->WaitForRefused(2, std::chrono::seconds(20)));
  EXPECT_EQ(server->accepted(), 0u);
  EXPECT_EQ(server->refused(), 2u);
  std::lock_guard lock(seen.mu);
  EXPECT_TRUE(seen.cancels.empty());
}

TEST_F(FrameConnTest, AServerWithoutAFleetCertificateIsRefusedByTheClient) {
  Seen seen;
  // It would accept the fleet's clients.
  auto server = Serve(Tls(frame_testing::Stranger(ca_, "impostor")), &seen);
  ASSERT_NE(server, nullptr);
  Client client(server->address(), Tls(Identity(ca_, "proxy")));
  // The handshake may have failed already: then the send fails too.
  (void)client.conn().Send(Cancel(1));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find("certificate"), std::string::npos) << end.message();
  std::lock_guard lock(seen.mu);
  EXPECT_TRUE(seen.cancels.empty());
}

TEST_F(FrameConnTest, TheClientVerifiesTheDialledHost) {
  Seen seen;
  // A fleet certificate, but for another host.
  auto cert = IssueCertificate(ca_, "decode-0", {"10.1.2.3"}, 1);
  ASSERT_TRUE(cert.ok());
  auto server = Serve(Tls(TlsPem{ca_.cert, cert->cert, cert->key}), &seen);
  ASSERT_NE(server, nullptr);
  Client client(server->address(), Tls(Identity(ca_, "proxy")));
  // The handshake may have failed already: then the send fails too.
  (void)client.conn().Send(Cancel(1));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find("certificate"), std::string::npos) << end.message();
}

TEST_F(FrameConnTest, APeerThatDoesNotReadNeverBlocksTheSenderAndIsDisconnectedAtTheBound) {
  FrameOptions o;
  o.max_buffered_bytes = 1 << 20;
  Seen seen;
  auto server = Serve(nullptr, &seen, o, /*echo=*/false);
  ASSERT_NE(server, nullptr);
  // A raw client that sends one frame and then never reads.
  auto hp = ParseHostPort(server->address());
  ASSERT_TRUE(hp.ok());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  const int small = 4096;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(hp->port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  std::string frame;
  Cancel(9).SerializeToString(&frame);
  const uint32_t n = static_cast<uint32_t>(frame.size());
  std::string wire(reinterpret_cast<const char*>(&n), 4);  // little-endian host
  wire += frame;
  ASSERT_EQ(write(fd, wire.data(), wire.size()), static_cast<ssize_t>(wire.size()));
  ASSERT_TRUE(seen.WaitFor([&] { return seen.conn != nullptr; }));
  std::shared_ptr<FrameConn> conn;
  {
    std::lock_guard lock(seen.mu);
    conn = seen.conn;
  }
  pb::DecodeStreamResponse batch;
  auto* item = batch.add_items();
  item->mutable_token_ids()->Resize(16 << 10, 12345);  // ~48 KiB a frame
  Status st = Status::Ok();
  int sent = 0;
  for (; sent < 100000 && st.ok(); ++sent) st = conn->Send(batch);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("does not read fast enough"), std::string::npos) << st.message();
  EXPECT_LT(sent, 100000);
  EXPECT_TRUE(conn->closed());
  ASSERT_TRUE(seen.WaitFor([&] { return seen.is_closed; }));  // the session ended too
  EXPECT_EQ(seen.closed.code(), StatusCode::kUnavailable);
  close(fd);
}

// A listening socket on 127.0.0.1 that never accepts: connections to it
// complete (the kernel's backlog) and are never answered.
class SilentPeer {
 public:
  SilentPeer() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(fd_, 8), 0);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    address_ = HostPort{"127.0.0.1", ntohs(a.sin_port)}.ToString();
  }
  ~SilentPeer() { ::close(fd_); }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

TEST_F(FrameConnTest, OnOneLoopABrokenConnectionEndsAloneAndASilentPeerHoldsUpNoOne) {
  FrameLoop loop("test-loop");
  Seen seen_a, seen_b;
  auto server_a = Serve(Tls(Identity(ca_, "decode-0")), &seen_a);
  auto server_b = Serve(Tls(Identity(ca_, "decode-1")), &seen_b);
  ASSERT_TRUE(server_a && server_b);
  SilentPeer silent;
  auto proxy_tls = Tls(Identity(ca_, "proxy"));
  Client a(server_a->address(), proxy_tls, {}, &loop);
  Client b(server_b->address(), proxy_tls, {}, &loop);
  FrameOptions short_handshake;
  short_handshake.handshake_timeout = std::chrono::milliseconds(300);
  Client late(silent.address(), proxy_tls, short_handshake, &loop);  // ends at its deadline
  Client dead(silent.address(), proxy_tls, {}, &loop);               // waits 10 s
  ASSERT_TRUE(a.conn().Send(Cancel(1)).ok());
  ASSERT_TRUE(b.conn().Send(Cancel(1)).ok());
  ASSERT_EQ(a.WaitHandles(1).size(), 1u);
  ASSERT_EQ(b.WaitHandles(1).size(), 1u);

  // The peer that never answers ends at its own handshake deadline.
  const Status late_end = late.WaitEnd();
  EXPECT_EQ(late_end.code(), StatusCode::kUnavailable) << late_end.ToString();
  EXPECT_NE(late_end.message().find("within the timeout"), std::string::npos) << late_end.message();

  // a's server closes a's connection: a ends, the others do not.
  {
    std::lock_guard lock(seen_a.mu);
    ASSERT_NE(seen_a.conn, nullptr);
    seen_a.conn->Close(UnavailableError("server gone"));
  }
  EXPECT_EQ(a.WaitEnd().code(), StatusCode::kUnavailable);

  // b's frames keep flowing, in order, while `dead` is still unanswered.
  constexpr uint64_t kFrames = 100;
  for (uint64_t i = 2; i <= kFrames; ++i) ASSERT_TRUE(b.conn().Send(Cancel(i)).ok());
  const auto got = b.WaitHandles(kFrames);
  ASSERT_EQ(got.size(), kFrames);
  for (uint64_t i = 0; i < kFrames; ++i) EXPECT_EQ(got[i], i + 1);
  EXPECT_FALSE(b.ended());
  EXPECT_FALSE(dead.ended());
}

// A lookup that waits until the test lets it go (a DNS server that is slow
// to answer), then asks getaddrinfo for an IPv4 address.
// Issue 23 (dec-parts): a deadline handed to the loop with WakeBy (as a
// new Prefill call's) holds although nothing wakes the loop for it: the
// owner is asked again (before_wait) at the deadline, not before it; and
// when another connection's frame wakes the loop first (which then turns
// its timer off), the loop keeps the deadline itself. The owner's due work
// runs once per deadline, at or after it.
TEST_F(FrameConnTest, OnOneLoopADeadlineGivenByWakeByHoldsWithoutAWakeUp) {
  using SteadyClock = std::chrono::steady_clock;
  static constexpr auto kNone = SteadyClock::time_point::max();
  FrameLoop loop("test-loop");
  Seen seen, seen_other;
  auto server = Serve(nullptr, &seen, {}, /*echo=*/false);
  auto other_server = Serve(nullptr, &seen_other);
  ASSERT_TRUE(server && other_server);
  Client other(other_server->address(), nullptr, {}, &loop);
  struct Owner {
    std::mutex mu;
    std::condition_variable cv;
    SteadyClock::time_point deadline = kNone;
    std::vector<SteadyClock::time_point> due;  // when each deadline was found due
  } owner;
  auto conn = FrameConn::Client(server->address(), nullptr, {});
  FrameReader reader(conn, &loop);
  FrameReader::Hooks hooks;
  hooks.on_frame = [](std::string_view) { return Status::Ok(); };
  hooks.before_wait = [&owner] {
    std::lock_guard lock(owner.mu);
    const auto now = SteadyClock::now();
    if (owner.deadline == kNone || now < owner.deadline) return owner.deadline;
    owner.due.push_back(now);
    owner.deadline = kNone;
    owner.cv.notify_all();
    return kNone;
  };
  hooks.on_end = [](const Status&) {};
  ASSERT_TRUE(reader.Start("unused", std::move(hooks), nullptr));
  struct Ender {  // the connection ends before the loop goes, whatever the test found
    FrameConn& conn;
    FrameReader& reader;
    ~Ender() {
      conn.Close(CancelledError("test over"));
      reader.Wake();
      reader.Join();
    }
  } ender{*conn, reader};
  ASSERT_TRUE(conn->Send(Cancel(1)).ok());
  ASSERT_TRUE(seen.WaitFor([&] { return seen.cancels.size() == 1; }));
  const auto due_after = [&owner](size_t n) {
    std::unique_lock lock(owner.mu);
    owner.cv.wait_for(lock, std::chrono::seconds(20), [&] { return owner.due.size() >= n; });
    return owner.due;
  };
  // 1. Nothing else happens on the loop: its timer wakes it at the deadline.
  auto at = SteadyClock::now() + std::chrono::milliseconds(100);
  {
    std::lock_guard lock(owner.mu);
    owner.deadline = at;
  }
  reader.WakeBy(at);
  auto due = due_after(1);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_GE(due[0], at);
  // 2. Another connection's answer wakes the loop before the deadline.
  at = SteadyClock::now() + std::chrono::milliseconds(300);
  {
    std::lock_guard lock(owner.mu);
    owner.deadline = at;
  }
  reader.WakeBy(at);
  ASSERT_TRUE(other.conn().Send(Cancel(2)).ok());
  EXPECT_EQ(other.WaitHandles(1), std::vector<uint64_t>{2});
  due = due_after(2);
  ASSERT_EQ(due.size(), 2u);
  EXPECT_GE(due[1], at);
}

struct SlowDns {
  static inline std::mutex mu;
  static inline std::condition_variable cv;
  static inline bool asked = false;
  static inline bool answer = false;
  static int Lookup(const char* host, const char* port, const addrinfo* hints, addrinfo** res) {
    std::unique_lock lock(mu);
    asked = true;
    cv.notify_all();
    cv.wait(lock, [] { return answer; });
    lock.unlock();
    addrinfo v4 = *hints;
    v4.ai_family = AF_INET;  // the servers listen on 127.0.0.1 only
    return getaddrinfo(host, port, &v4, res);
  }
};

TEST_F(FrameConnTest, OnOneLoopANameIsResolvedOffTheLoopThread) {
  EXPECT_FALSE(FrameConn::Client("127.0.0.1:1", nullptr, {})->NeedsLookup());
  EXPECT_FALSE(FrameConn::Client("[::1]:1", nullptr, {})->NeedsLookup());
  EXPECT_TRUE(FrameConn::Client("localhost:1", nullptr, {})->NeedsLookup());

  FrameLoop loop("test-loop");
  Seen seen_a, seen_b;
  auto server_a = Serve(Tls(Identity(ca_, "decode-0")), &seen_a);
  auto server_b = Serve(Tls(Identity(ca_, "decode-1")), &seen_b);
  ASSERT_TRUE(server_a && server_b);
  auto proxy_tls = Tls(Identity(ca_, "proxy"));
  const std::string named = "localhost:" + server_a->address().substr(server_a->address().rfind(':') + 1);
  FrameOptions slow_dns;
  slow_dns.lookup = &SlowDns::Lookup;
  Client a(named, proxy_tls, slow_dns, &loop);
  {
    std::unique_lock lock(SlowDns::mu);
    SlowDns::cv.wait(lock, [] { return SlowDns::asked; });
  }
  // While a's name is unanswered, the loop serves b.
  Client b(server_b->address(), proxy_tls, {}, &loop);
  ASSERT_TRUE(b.conn().Send(Cancel(7)).ok());
  EXPECT_EQ(b.WaitHandles(1), std::vector<uint64_t>{7});
  EXPECT_FALSE(a.ended());
  {
    std::lock_guard lock(SlowDns::mu);
    SlowDns::answer = true;
  }
  SlowDns::cv.notify_all();
  // Then a connects (TLS verified against the name dialled) and answers.
  ASSERT_TRUE(a.conn().Send(Cancel(9)).ok());
  EXPECT_EQ(a.WaitHandles(1), std::vector<uint64_t>{9});
  EXPECT_FALSE(a.ended());
}

}  // namespace
}  // namespace tandem
