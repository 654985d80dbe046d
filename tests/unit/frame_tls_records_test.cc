// FrameConn's own TLS 1.3 records (common/frame_tls_records.h; issue 23)
// against a plain OpenSSL peer that uses SSL_read / SSL_write on the other
// end of a real socket on 127.0.0.1, both ways: the records are standard
// TLS 1.3. Then what ends a connection: a record altered on the wire, an
// alert, a KeyUpdate, a record over the size limit.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/frame_reader.h"
#include "common/tls_pem.h"
#include "frame_test_support.h"
#include "tandem/v1/worker.pb.h"

namespace tandem {
namespace {

namespace pb = ::tandem::v1;
using frame_testing::Identity;
using frame_testing::Tls;

// A payload of `n` bytes that differs per frame.
std::string Payload(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + (i * 7 + seed) % 26);
  return s;
}

pb::ErrorInfo Frame(const std::string& text) {
  pb::ErrorInfo m;
  m.set_message(text);
  return m;
}

std::string FrameBytes(const std::string& text) {
  const std::string body = Frame(text).SerializeAsString();
  const auto n = static_cast<uint32_t>(body.size());
  std::string out = {static_cast<char>(n), static_cast<char>(n >> 8), static_cast<char>(n >> 16),
                     static_cast<char>(n >> 24)};
  return out + body;
}

// A context of OpenSSL's defaults (every TLS 1.3 ciphersuite offered) with
// the identity `pem`: nothing of FrameTls.
SSL_CTX* PlainContext(const TlsPem& pem, bool server) {
  SSL_CTX* ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  auto certs = ParsePemCertificates(pem.cert);
  auto cas = ParsePemCertificates(pem.ca);
  EXPECT_TRUE(certs.ok() && cas.ok());
  EvpKeyPtr key = ParsePemPrivateKey(pem.key);
  EXPECT_EQ(SSL_CTX_use_certificate(ctx, (*certs)[0].get()), 1);
  EXPECT_EQ(SSL_CTX_use_PrivateKey(ctx, key.get()), 1);
  EXPECT_EQ(X509_STORE_add_cert(SSL_CTX_get_cert_store(ctx), (*cas)[0].get()), 1);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  SSL_CTX_set_num_tickets(ctx, 0);
  return ctx;
}

// One plain OpenSSL endpoint on a blocking socket.
struct PlainPeer {
  SSL_CTX* ctx = nullptr;
  SSL* ssl = nullptr;
  int fd = -1;
  ~PlainPeer() {
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    if (fd >= 0) ::close(fd);
  }
  // A whole frame (u32 length + ErrorInfo) read with SSL_read: its text.
  std::string ReadFrame() {
    std::string head = ReadN(4);
    if (head.size() < 4) return "<closed>";
    const auto* h = reinterpret_cast<const uint8_t*>(head.data());
    const uint32_t n = h[0] | h[1] << 8 | h[2] << 16 | uint32_t{h[3]} << 24;
    pb::ErrorInfo m;
    EXPECT_TRUE(m.ParseFromString(ReadN(n)));
    return m.message();
  }
  std::string ReadN(size_t n) {
    std::string out(n, '\0');
    for (size_t got = 0; got < n;) {
      const int r = SSL_read(ssl, out.data() + got, static_cast<int>(n - got));
      if (r <= 0) return out.substr(0, got);
      got += static_cast<size_t>(r);
    }
    return out;
  }
  void WriteFrame(const std::string& text) {
    const std::string bytes = FrameBytes(text);
    ASSERT_EQ(SSL_write(ssl, bytes.data(), static_cast<int>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  // What SSL_write makes of `text`'s frame, not sent: the records' bytes.
  std::string SealedFrame(const std::string& text) {
    BIO* mem = BIO_new(BIO_s_mem());
    BIO* sock = SSL_get_wbio(ssl);
    BIO_up_ref(sock);
    SSL_set0_wbio(ssl, mem);
    WriteFrame(text);
    char* p = nullptr;
    const long len = BIO_get_mem_data(mem, &p);
    std::string out(p, static_cast<size_t>(len));
    SSL_set0_wbio(ssl, sock);
    return out;
  }
  void WriteRaw(const std::string& bytes) {
    ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
};

// A plain OpenSSL server on 127.0.0.1 for one connection: `serve` runs on
// its thread once the handshake is done.
class PlainServer {
 public:
  PlainServer(const TlsPem& pem, std::function<void(PlainPeer&)> serve) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(listen_fd_, 1), 0);
    EXPECT_EQ(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    address_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    peer_.ctx = PlainContext(pem, true);
    thread_ = std::thread([this, serve = std::move(serve)] {
      peer_.fd = accept(listen_fd_, nullptr, nullptr);
      peer_.ssl = SSL_new(peer_.ctx);
      SSL_set_fd(peer_.ssl, peer_.fd);
      if (SSL_accept(peer_.ssl) != 1) {
        ADD_FAILURE() << "SSL_accept failed";
        return;
      }
      serve(peer_);
    });
  }
  ~PlainServer() {
    thread_.join();
    ::close(listen_fd_);
  }
  const std::string& address() const { return address_; }
  PlainPeer& peer() { return peer_; }

 private:
  int listen_fd_ = -1;
  std::string address_;
  PlainPeer peer_;
  std::thread thread_;
};

// Our side as a client (a FrameConn on a reader thread of its own), whose
// frames are ErrorInfos: their texts.
class OurClient : public frame_testing::FrameClient {
 public:
  using FrameClient::FrameClient;
  std::vector<std::string> WaitTexts(size_t n) {
    std::vector<std::string> texts;
    for (const std::string& payload : WaitFrames(n)) {
      pb::ErrorInfo m;
      EXPECT_TRUE(m.ParseFromString(payload)) << "not an ErrorInfo";
      texts.push_back(m.message());
    }
    return texts;
  }
};

class FrameTlsRecordsTest : public ::testing::Test {
 protected:
  void SetUp() override { ca_ = frame_testing::MakeCa("fleet-ca"); }
  CertKeyPem ca_;
};

// Frames both ways, one of them over many records (> 2^14 bytes).
const std::vector<std::string>& Texts() {
  static const std::vector<std::string> texts = {"hello", Payload(100'000, 1), Payload(512, 2),
                                                 Payload(16'380, 3)};
  return texts;
}

TEST_F(FrameTlsRecordsTest, OurClientTalksToPlainOpenSslBothWays) {
  PlainServer server(Identity(ca_, "decode-0"), [](PlainPeer& p) {
    for (size_t i = 0; i < Texts().size(); ++i) p.WriteFrame(p.ReadFrame() + "/echo");
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  for (const std::string& t : Texts()) ASSERT_TRUE(client.conn().Send(Frame(t)).ok());
  const auto got = client.WaitTexts(Texts().size());
  ASSERT_EQ(got.size(), Texts().size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], Texts()[i] + "/echo") << i;
  EXPECT_TRUE(client.conn().sealing_records());
}

// Many frames of varying length (0 to ~20 kB: one to two records each,
// every record length a different cut of the AES blocks) both ways with a
// plain OpenSSL peer: the record contexts, keyed once and re-used per
// record, keep matching OpenSSL's records.
TEST_F(FrameTlsRecordsTest, ManyFramesOfVaryingLengthBothWaysWithPlainOpenSsl) {
  constexpr size_t kFrames = 1500;
  std::vector<std::string> texts;
  uint32_t x = 12345;
  for (size_t i = 0; i < kFrames; ++i) {
    x = x * 1103515245u + 12345u;
    const size_t n = i % 4 == 0 ? (x >> 8) % 600 : (x >> 8) % 20'000;
    texts.push_back(Payload(n, static_cast<int>(i)));
  }
  PlainServer server(Identity(ca_, "decode-0"), [&](PlainPeer& p) {
    for (size_t i = 0; i < kFrames; ++i) p.WriteFrame(p.ReadFrame() + "/echo");
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  for (const std::string& t : texts) ASSERT_TRUE(client.conn().Send(Frame(t)).ok());
  const auto got = client.WaitTexts(kFrames);
  ASSERT_EQ(got.size(), kFrames);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], texts[i] + "/echo") << i;
  EXPECT_TRUE(client.conn().sealing_records());
}

// What our server side's session saw.
struct Served {
  std::mutex mu;
  std::condition_variable cv;
  std::shared_ptr<FrameConn> conn;
  Status closed = Status::Ok();
  bool is_closed = false;
  Status WaitClosed() {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return is_closed; });
    return is_closed ? closed : InternalError("still open");
  }
};

class EchoSession final : public FrameSession {
 public:
  EchoSession(std::shared_ptr<FrameConn> conn, Served* served)
      : conn_(std::move(conn)), served_(served) {
    std::lock_guard lock(served_->mu);
    served_->conn = conn_;
  }
  Status OnFrame(std::string_view payload) override {
    pb::ErrorInfo m;
    if (!m.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("not an ErrorInfo");
    }
    return conn_->Send(Frame(m.message() + "/echo"));
  }
  void OnClosed(const Status& why) override {
    std::lock_guard lock(served_->mu);
    served_->closed = why;
    served_->is_closed = true;
    served_->cv.notify_all();
  }

 private:
  std::shared_ptr<FrameConn> conn_;
  Served* served_;
};

// A plain OpenSSL client connected to `address` (handshake done).
void DialPlain(PlainPeer& p, const std::string& address, const TlsPem& pem) {
  p.ctx = PlainContext(pem, false);
  p.fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
  ASSERT_EQ(connect(p.fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  p.ssl = SSL_new(p.ctx);
  SSL_set_fd(p.ssl, p.fd);
  ASSERT_EQ(SSL_connect(p.ssl), 1);
}

TEST_F(FrameTlsRecordsTest, PlainOpenSslTalksToOurServerBothWays) {
  Served served;
  auto server = frame_testing::Listen(Tls(Identity(ca_, "decode-0")),
                                      [&](const std::shared_ptr<FrameConn>& c) {
                                        return std::make_shared<EchoSession>(c, &served);
                                      });
  ASSERT_NE(server, nullptr);
  PlainPeer p;
  DialPlain(p, server->address(), Identity(ca_, "proxy"));
  for (const std::string& t : Texts()) {
    p.WriteFrame(t);
    EXPECT_EQ(p.ReadFrame(), t + "/echo");
  }
  std::lock_guard lock(served.mu);
  ASSERT_NE(served.conn, nullptr);
  EXPECT_TRUE(served.conn->sealing_records());
}

TEST_F(FrameTlsRecordsTest, AFlippedByteInARecordEndsTheConnectionNamingThePeer) {
  std::mutex mu;
  std::condition_variable cv;
  bool first_read = false;
  PlainServer server(Identity(ca_, "decode-0"), [&](PlainPeer& p) {
    p.WriteFrame("intact");
    {
      std::unique_lock lock(mu);
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return first_read; });
    }
    std::string rec = p.SealedFrame("altered");
    rec[rec.size() / 2] ^= 0x20;  // in the body
    p.WriteRaw(rec);
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  ASSERT_EQ(client.WaitTexts(1), std::vector<std::string>{"intact"});
  {
    std::lock_guard lock(mu);
    first_read = true;
  }
  cv.notify_all();
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable) << end.ToString();
  EXPECT_NE(end.message().find(server.address()), std::string::npos) << end.message();
  EXPECT_NE(end.message().find("failed authentication"), std::string::npos) << end.message();
  // Nothing of the altered record was delivered.
  EXPECT_EQ(client.WaitTexts(2), std::vector<std::string>{"intact"});
}

TEST_F(FrameTlsRecordsTest, AKeyUpdateAfterTheHandshakeEndsTheConnectionNamingIt) {
  PlainServer server(Identity(ca_, "decode-0"), [](PlainPeer& p) {
    ASSERT_EQ(p.ReadFrame(), "hi");
    ASSERT_EQ(SSL_key_update(p.ssl, SSL_KEY_UPDATE_NOT_REQUESTED), 1);
    p.WriteFrame("after the key update");
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  ASSERT_TRUE(client.conn().Send(Frame("hi")).ok());
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find("KeyUpdate"), std::string::npos) << end.message();
  EXPECT_TRUE(client.WaitTexts(1).empty());
}

TEST_F(FrameTlsRecordsTest, AnAlertEndsTheConnectionNamingIt) {
  PlainServer server(Identity(ca_, "decode-0"), [](PlainPeer& p) {
    p.WriteFrame("before the close");
    ASSERT_GE(SSL_shutdown(p.ssl), 0);  // close_notify
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find(server.address() + " closed the connection"), std::string::npos)
      << end.message();
  EXPECT_EQ(client.WaitTexts(1), std::vector<std::string>{"before the close"});
}

TEST_F(FrameTlsRecordsTest, ARecordOverTheSizeLimitIsRefused) {
  PlainServer server(Identity(ca_, "decode-0"), [](PlainPeer& p) {
    // A header announcing 2^14 + 257 bytes (only the header is needed).
    const size_t n = (1u << 14) + 257;
    p.WriteRaw(std::string{0x17, 0x03, 0x03, static_cast<char>(n >> 8), static_cast<char>(n)});
  });
  OurClient client(server.address(), Tls(Identity(ca_, "proxy")));
  const Status end = client.WaitEnd();
  EXPECT_EQ(end.code(), StatusCode::kUnavailable);
  EXPECT_NE(end.message().find("a TLS record of 16641 bytes; the limit is 16640 bytes"),
            std::string::npos)
      << end.message();
}

}  // namespace
}  // namespace tandem
