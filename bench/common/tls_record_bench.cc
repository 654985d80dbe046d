// One 512-byte TLS 1.3 application record (AES-128-GCM), read and written
// through OpenSSL's SSL_read / SSL_write against the same record opened and
// sealed directly (common/tls_record.h: since session 12 the provider's
// AES-128-GCM functions called per record on a context keyed once; session
// 11's version went through EVP_*Init_ex2 / Update / Final / ctrl). Issue
// 23: the proxy's decode-stream reader opens one record per 16-token step,
// cache-cold after the step's sleep. The "Evp" names stay for comparison
// with earlier results.
//
// The SSL pair is two FrameTls SSL objects (the framed connections'
// contexts, read-ahead on) joined by a BIO pair (memory, no syscalls: the
// read(2)/write(2) of a socket is the same on both paths and left out).
// Each timed iteration is one call; "Cold" touches 32 MiB outside the
// timing first, as bench/router's BM_ApplyColdEvents does, so that code and
// data are cold as after a 6 ms sim step. Times are manual (steady clock
// around the one call; the calls never block).
#include <benchmark/benchmark.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "common/frame_conn.h"
#include "common/tls_certs.h"
#include "common/tls_record.h"

namespace tandem {
namespace {

constexpr size_t kRecordBytes = 512;
constexpr size_t kThrashBytes = size_t{32} << 20;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "tls_record_bench: %s\n", what);
  ERR_print_errors_fp(stderr);
  std::exit(1);
}

// Reads and writes 32 MiB: the caches hold nothing of the timed path.
void Thrash() {
  static std::vector<char> mem(kThrashBytes, 1);
  for (size_t i = 0; i < mem.size(); i += 64) mem[i] = static_cast<char>(mem[i] + 1);
  benchmark::DoNotOptimize(mem.data());
}

// A handshaken client/server SSL pair over a BIO pair, TLS 1.3 with
// TLS_AES_128_GCM_SHA256.
struct SslPair {
  std::shared_ptr<FrameTls> tls;
  SSL* client = nullptr;
  SSL* server = nullptr;
  SslPair() {
    auto ca = CreateCaCertificate("bench-ca", 1);
    if (!ca.ok()) Die("CA");
    auto cert = IssueCertificate(*ca, "bench", {"127.0.0.1"}, 1);
    if (!cert.ok()) Die("certificate");
    auto t = FrameTls::Create(TlsPem{ca->cert, cert->cert, cert->key});
    if (!t.ok()) Die("FrameTls");
    tls = *t;
    client = tls->NewClient("127.0.0.1");
    server = tls->NewServer();
    if (client == nullptr || server == nullptr) Die("SSL_new");
    for (SSL* s : {client, server}) {
      if (SSL_set_ciphersuites(s, "TLS_AES_128_GCM_SHA256") != 1) Die("ciphersuites");
    }
    BIO* bc = nullptr;
    BIO* bs = nullptr;
    if (BIO_new_bio_pair(&bc, 1 << 17, &bs, 1 << 17) != 1) Die("BIO pair");
    SSL_set_bio(client, bc, bc);
    SSL_set_bio(server, bs, bs);
    SSL_set_connect_state(client);
    SSL_set_accept_state(server);
    for (int i = 0; i < 100; ++i) {
      const int c = SSL_do_handshake(client);
      const int s = SSL_do_handshake(server);
      if (c == 1 && s == 1) break;
    }
    if (!SSL_is_init_finished(client) || !SSL_is_init_finished(server)) Die("handshake");
    if (SSL_version(client) != TLS1_3_VERSION ||
        SSL_CIPHER_get_id(SSL_get_current_cipher(client)) != TLS1_3_CK_AES_128_GCM_SHA256) {
      Die("not TLS 1.3 AES-128-GCM");
    }
  }
  ~SslPair() {
    SSL_free(client);
    SSL_free(server);
  }
};

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void BM_SslRead(benchmark::State& state, bool cold) {
  SslPair p;
  std::vector<char> msg(kRecordBytes, 'x');
  std::vector<char> buf(64 << 10);
  for (auto _ : state) {
    if (SSL_write(p.client, msg.data(), kRecordBytes) != static_cast<int>(kRecordBytes)) {
      Die("SSL_write");
    }
    if (cold) Thrash();
    const auto t0 = std::chrono::steady_clock::now();
    const int n = SSL_read(p.server, buf.data(), static_cast<int>(buf.size()));
    const auto t1 = std::chrono::steady_clock::now();
    if (n != static_cast<int>(kRecordBytes)) Die("SSL_read");
    state.SetIterationTime(Seconds(t0, t1));
  }
}

void BM_SslWrite(benchmark::State& state, bool cold) {
  SslPair p;
  std::vector<char> msg(kRecordBytes, 'x');
  std::vector<char> buf(64 << 10);
  for (auto _ : state) {
    if (cold) Thrash();
    const auto t0 = std::chrono::steady_clock::now();
    const int n = SSL_write(p.client, msg.data(), kRecordBytes);
    const auto t1 = std::chrono::steady_clock::now();
    if (n != static_cast<int>(kRecordBytes)) Die("SSL_write");
    if (SSL_read(p.server, buf.data(), static_cast<int>(buf.size())) != n) Die("SSL_read");
    state.SetIterationTime(Seconds(t0, t1));
  }
}

struct EvpPair {
  TlsRecordCipher seal, open;
  EvpPair() {
    const uint8_t secret[32] = {7, 1, 2, 3};
    auto s = TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kSeal);
    auto o = TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kOpen);
    if (!s.ok() || !o.ok()) Die("TlsRecordCipher");
    seal = std::move(*s);
    open = std::move(*o);
  }
};

void BM_EvpOpen(benchmark::State& state, bool cold) {
  EvpPair p;
  std::vector<uint8_t> msg(kRecordBytes, 'x');
  std::vector<uint8_t> rec(TlsRecordBytes(kRecordBytes));
  for (auto _ : state) {
    if (!p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data()).ok()) Die("Seal");
    if (cold) Thrash();
    size_t n = 0;
    TlsContentType type{};
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = p.open.Open(rec, &n, &type);
    const auto t1 = std::chrono::steady_clock::now();
    if (!st.ok() || n != kRecordBytes) Die("Open");
    state.SetIterationTime(Seconds(t0, t1));
  }
}

void BM_EvpSeal(benchmark::State& state, bool cold) {
  EvpPair p;
  std::vector<uint8_t> msg(kRecordBytes, 'x');
  std::vector<uint8_t> rec(TlsRecordBytes(kRecordBytes));
  for (auto _ : state) {
    if (cold) Thrash();
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data());
    const auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) Die("Seal");
    size_t n = 0;
    TlsContentType type{};
    if (!p.open.Open(rec, &n, &type).ok()) Die("Open");
    state.SetIterationTime(Seconds(t0, t1));
  }
}

// Cold, paired: each iteration times one SSL call and one EVP call, each
// after its own thrash, so that both see the same moment of a shared host.
// Counters: the medians (ns) and their ratio.
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void BM_ColdPaired(benchmark::State& state, bool read) {
  SslPair ssl;
  EvpPair evp;
  std::vector<char> msg(kRecordBytes, 'x');
  std::vector<uint8_t> umsg(kRecordBytes, 'x');
  std::vector<char> buf(64 << 10);
  std::vector<uint8_t> rec(TlsRecordBytes(kRecordBytes));
  std::vector<double> ssl_ns, evp_ns;
  for (auto _ : state) {
    // OpenSSL.
    if (read && SSL_write(ssl.client, msg.data(), kRecordBytes) != static_cast<int>(kRecordBytes)) {
      Die("SSL_write");
    }
    Thrash();
    auto t0 = std::chrono::steady_clock::now();
    const int n = read ? SSL_read(ssl.server, buf.data(), static_cast<int>(buf.size()))
                       : SSL_write(ssl.client, msg.data(), kRecordBytes);
    auto t1 = std::chrono::steady_clock::now();
    if (n != static_cast<int>(kRecordBytes)) Die("SSL call");
    if (!read && SSL_read(ssl.server, buf.data(), static_cast<int>(buf.size())) != n) Die("SSL_read");
    const double a = Seconds(t0, t1);
    ssl_ns.push_back(a * 1e9);
    // EVP.
    if (read && !evp.seal.Seal(umsg, TlsContentType::kApplicationData, rec.data()).ok()) Die("Seal");
    Thrash();
    size_t m = 0;
    TlsContentType type{};
    t0 = std::chrono::steady_clock::now();
    const Status st = read ? evp.open.Open(rec, &m, &type)
                           : evp.seal.Seal(umsg, TlsContentType::kApplicationData, rec.data());
    t1 = std::chrono::steady_clock::now();
    if (!st.ok()) Die("EVP call");
    if (!read && !evp.open.Open(rec, &m, &type).ok()) Die("Open");
    const double b = Seconds(t0, t1);
    evp_ns.push_back(b * 1e9);
    state.SetIterationTime(a + b);
  }
  const double ms = Median(ssl_ns), me = Median(evp_ns);
  state.counters["ssl_med_ns"] = ms;
  state.counters["evp_med_ns"] = me;
  state.counters["evp/ssl"] = ms > 0 ? me / ms : 0;
}

constexpr int kColdIterations = 1000;

BENCHMARK_CAPTURE(BM_ColdPaired, read, true)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);
BENCHMARK_CAPTURE(BM_ColdPaired, write, false)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);

BENCHMARK_CAPTURE(BM_SslRead, warm, false)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_EvpOpen, warm, false)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_SslWrite, warm, false)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_EvpSeal, warm, false)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_SslRead, cold, true)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);
BENCHMARK_CAPTURE(BM_EvpOpen, cold, true)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);
BENCHMARK_CAPTURE(BM_SslWrite, cold, true)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);
BENCHMARK_CAPTURE(BM_EvpSeal, cold, true)->UseManualTime()->Unit(benchmark::kNanosecond)
    ->Iterations(kColdIterations);

}  // namespace
}  // namespace tandem

BENCHMARK_MAIN();
