#include "common/config.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace tandem {
namespace {

constexpr const char* kGood = R"(model:
  path: ../models/tandem-kjv
cache:
  block_size: 16
prefill:
  replicas: 1
decode:
  replicas: 1
)";

Result<FleetConfig> Parse(const std::string& text) {
  return ParseFleetConfig(text, "configs/x.yaml", "/repo/configs");
}

std::string ErrorOf(const std::string& text) {
  auto r = Parse(text);
  EXPECT_FALSE(r.ok()) << "expected an error for:\n" << text;
  return r.ok() ? "" : r.status().message();
}

TEST(Config, GoodFileWithDefaults) {
  auto r = Parse(kGood);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->model.path, "/repo/models/tandem-kjv");  // relative to the file's folder
  EXPECT_EQ(r->model.name, "tandem-kjv");                // default: folder name
  EXPECT_EQ(r->cache.block_size, 16u);
  EXPECT_EQ(r->prefill.replicas, 1u);
  EXPECT_EQ(r->decode.replicas, 1u);
  EXPECT_EQ(r->both.replicas, 0u);
  EXPECT_EQ(r->router.policy, "kv_aware");
  EXPECT_EQ(r->proxy.grpc, "127.0.0.1:50051");
  EXPECT_DOUBLE_EQ(r->transport.lease_seconds, 30.0);
  EXPECT_FALSE(r->transport.encrypt);
  EXPECT_EQ(r->transport.push, "streaming");
}

TEST(Config, TransportEncrypt) {
  auto on = tandem::ParseFleetConfig(
      "model:\n  path: m\ntransport:\n  encrypt: true\nboth:\n  replicas: 1\n", "x.yaml", "/r");
  ASSERT_TRUE(on.ok()) << on.status().message();
  EXPECT_TRUE(on->transport.encrypt);
  auto bad = tandem::ParseFleetConfig(
      "model:\n  path: m\ntransport:\n  encrypt: maybe\nboth:\n  replicas: 1\n", "x.yaml", "/r");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("transport.encrypt"), std::string::npos)
      << bad.status().message();
}

TEST(Config, DecodeMuxListenAndDecodeTransport) {  // issue 23
  auto r = Parse(kGood);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->decode.mux_listen, "auto");
  EXPECT_EQ(r->proxy.decode_transport, "tcp");
  auto set = Parse(
      "model:\n  path: m\nproxy:\n  decode_transport: grpc\nboth:\n  replicas: 1\n  mux_listen: "
      "127.0.0.1:0\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->proxy.decode_transport, "grpc");
  EXPECT_EQ(set->both.mux_listen, "127.0.0.1:0");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nproxy:\n  decode_transport: udp\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'proxy.decode_transport' must be one of 'tcp', 'grpc', got 'udp'");
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  mux_listen: nowhere\n")
                .find("both.mux_listen is 'nowhere': expected auto, off or host:port"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\n  mux_listen: 127.0.0.1:0\n"
                    "decode:\n  replicas: 1\n")
                .find("prefill.mux_listen"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 2\n  mux_listen: 127.0.0.1:7000\n")
                .find("has a fixed port but both.replicas is 2"),
            std::string::npos);
}

TEST(Config, PrefillFrameListenAndPrefillTransport) {  // issue 23, prefill-tcp
  auto r = Parse(kGood);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->prefill.frame_listen, "auto");
  EXPECT_EQ(r->proxy.prefill_transport, "tcp");
  auto set = Parse(
      "model:\n  path: m\nproxy:\n  prefill_transport: grpc\nboth:\n  replicas: 1\n  frame_listen: "
      "127.0.0.1:0\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->proxy.prefill_transport, "grpc");
  EXPECT_EQ(set->both.frame_listen, "127.0.0.1:0");
  auto off = Parse("model:\n  path: m\nprefill:\n  replicas: 1\n  frame_listen: off\n"
                   "decode:\n  replicas: 1\n");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_EQ(off->prefill.frame_listen, "off");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nproxy:\n  prefill_transport: udp\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'proxy.prefill_transport' must be one of 'tcp', 'grpc', got 'udp'");
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  frame_listen: nowhere\n")
                .find("both.frame_listen is 'nowhere': expected auto, off or host:port"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n"
                    "  frame_listen: 127.0.0.1:0\n")
                .find("decode.frame_listen is '127.0.0.1:0': only prefill and both workers serve Prefill"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 2\n  frame_listen: 127.0.0.1:7000\n"
                    "decode:\n  replicas: 1\n")
                .find("has a fixed port but prefill.replicas is 2"),
            std::string::npos);
}

// The decoder's framed Reserve listener and the
// prefiller's choice of transport.
TEST(Config, ReserveListenAndTransport) {  // issue 23, reserve-tcp
  auto defaults = Parse("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n");
  ASSERT_TRUE(defaults.ok()) << defaults.status().message();
  EXPECT_EQ(defaults->decode.reserve_listen, "auto");
  EXPECT_EQ(defaults->prefill.reserve_transport, "tcp");
  auto set = Parse("model:\n  path: m\nprefill:\n  replicas: 1\n  reserve_transport: grpc\n"
                   "decode:\n  replicas: 1\n  reserve_listen: off\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->prefill.reserve_transport, "grpc");
  EXPECT_EQ(set->decode.reserve_listen, "off");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  reserve_transport: udp\n"),
            "configs/x.yaml:5: key 'both.reserve_transport' must be one of 'tcp', 'grpc', got 'udp'");
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  reserve_listen: nowhere\n")
                .find("both.reserve_listen is 'nowhere': expected auto, off or host:port"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\n  reserve_listen: 127.0.0.1:0\n"
                    "decode:\n  replicas: 1\n")
                .find("prefill.reserve_listen is '127.0.0.1:0': only decode and both workers serve Reserve"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n"
                    "  reserve_transport: grpc\n")
                .find("decode.reserve_transport is 'grpc': only prefill and both workers call Reserve"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 2\n"
                    "  reserve_listen: 127.0.0.1:7000\n")
                .find("decode.reserve_listen '127.0.0.1:7000' has a fixed port but decode.replicas is 2"),
            std::string::npos);
}

// How often a busy worker samples its load for its Watch streams.
TEST(Config, LoadIntervalPerRole) {  // issue 23
  auto defaults = Parse("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n");
  ASSERT_TRUE(defaults.ok()) << defaults.status().message();
  EXPECT_EQ(defaults->prefill.load_interval_ms, 150u);
  EXPECT_EQ(defaults->decode.load_interval_ms, 150u);
  auto set = Parse(
      "model:\n  path: m\nprefill:\n  replicas: 1\n  load_interval_ms: 300\n"
      "decode:\n  replicas: 1\n  load_interval_ms: 10\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->prefill.load_interval_ms, 300u);
  EXPECT_EQ(set->decode.load_interval_ms, 10u);
  EXPECT_EQ(
      ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  load_interval_ms: 9\n"),
      "configs/x.yaml:5: key 'both.load_interval_ms' must be an integer in [10, 5000], got '9'");
  EXPECT_EQ(
      ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  load_interval_ms: 5001\n"),
      "configs/x.yaml:5: key 'both.load_interval_ms' must be an integer in [10, 5000], got '5001'");
}

TEST(Config, WatchListenAndWatchTransport) {  // issue 23
  auto r = Parse(kGood);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->prefill.watch_listen, "auto");
  EXPECT_EQ(r->decode.watch_listen, "auto");
  EXPECT_EQ(r->proxy.watch_transport, "tcp");
  auto set = Parse(
      "model:\n  path: m\nproxy:\n  watch_transport: grpc\nprefill:\n  replicas: 1\n  "
      "watch_listen: 127.0.0.1:0\ndecode:\n  replicas: 1\n  watch_listen: off\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->proxy.watch_transport, "grpc");
  EXPECT_EQ(set->prefill.watch_listen, "127.0.0.1:0");
  EXPECT_EQ(set->decode.watch_listen, "off");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nproxy:\n  watch_transport: quic\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'proxy.watch_transport' must be one of 'tcp', 'grpc', got 'quic'");
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  watch_listen: nowhere\n")
                .find("both.watch_listen is 'nowhere': expected auto, off or host:port"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 2\n  watch_listen: 127.0.0.1:7000\n"
                    "decode:\n  replicas: 1\n")
                .find("prefill.watch_listen '127.0.0.1:7000' has a fixed port but prefill.replicas is 2"),
            std::string::npos);
}

TEST(Config, TransportPushIsStreamingOrAfterPrefill) {
  auto r = Parse("model:\n  path: m\ntransport:\n  push: after_prefill\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->transport.push, "after_prefill");
  EXPECT_EQ(ErrorOf("model:\n  path: m\ntransport:\n  push: eager\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'transport.push' must be one of 'streaming', 'after_prefill', "
            "got 'eager'");
}

TEST(Config, ObservabilityTracingIsOffByDefault) {
  auto d = Parse("model:\n  path: m\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->observability.otlp_endpoint, "");
  EXPECT_EQ(d->observability.trace_sample_ratio, 0.0);
  auto r = Parse(
      "model:\n  path: m\nobservability:\n  otlp_endpoint: 127.0.0.1:4317\n"
      "  trace_sample_ratio: 0.25\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->observability.otlp_endpoint, "127.0.0.1:4317");
  EXPECT_EQ(r->observability.trace_sample_ratio, 0.25);
  const std::string ratio = ErrorOf(
      "model:\n  path: m\nobservability:\n  trace_sample_ratio: 1.5\nboth:\n  replicas: 1\n");
  EXPECT_NE(ratio.find("observability.trace_sample_ratio"), std::string::npos) << ratio;
  EXPECT_NE(ratio.find("configs/x.yaml:4"), std::string::npos) << ratio;
  const std::string endpoint = ErrorOf(
      "model:\n  path: m\nobservability:\n  otlp_endpoint: collector\nboth:\n  replicas: 1\n");
  EXPECT_NE(endpoint.find("observability.otlp_endpoint"), std::string::npos) << endpoint;
  // observability.otlp_tls: the CA is required, a client certificate comes
  // with its key, and relative paths are the config file's.
  auto tls = Parse(
      "model:\n  path: m\nobservability:\n  otlp_endpoint: 127.0.0.1:4317\n  otlp_tls:\n"
      "    ca_file: ca.pem\n    cert_file: /etc/c.pem\n    key_file: c.key\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(tls.ok()) << tls.status().message();
  EXPECT_TRUE(tls->observability.otlp_tls);
  EXPECT_EQ(tls->observability.otlp_ca_file, "/repo/configs/ca.pem");
  EXPECT_EQ(tls->observability.otlp_cert_file, "/etc/c.pem");
  EXPECT_EQ(tls->observability.otlp_key_file, "/repo/configs/c.key");
  const std::string half = ErrorOf(
      "model:\n  path: m\nobservability:\n  otlp_endpoint: 127.0.0.1:4317\n  otlp_tls:\n"
      "    ca_file: ca.pem\n    cert_file: c.pem\nboth:\n  replicas: 1\n");
  EXPECT_NE(half.find("cert_file and key_file go together"), std::string::npos) << half;
  const std::string no_ca = ErrorOf(
      "model:\n  path: m\nobservability:\n  otlp_endpoint: 127.0.0.1:4317\n  otlp_tls:\n"
      "    cert_file: c.pem\n    key_file: c.key\nboth:\n  replicas: 1\n");
  EXPECT_NE(no_ca.find("observability.otlp_tls.ca_file"), std::string::npos) << no_ca;
  const std::string no_endpoint = ErrorOf(
      "model:\n  path: m\nobservability:\n  otlp_tls:\n    ca_file: ca.pem\n"
      "both:\n  replicas: 1\n");
  EXPECT_NE(no_endpoint.find("observability.otlp_endpoint is empty"), std::string::npos)
      << no_endpoint;
  const std::string unknown = ErrorOf(
      "model:\n  path: m\nobservability:\n  otlp: x\nboth:\n  replicas: 1\n");
  EXPECT_NE(unknown.find("unknown key 'otlp' in 'observability'"), std::string::npos) << unknown;
}

TEST(Config, TransportChecksumIsOnByDefaultAndCanBeTurnedOff) {
  auto d = Parse("model:\n  path: m\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_TRUE(d->transport.checksum);
  auto r = Parse("model:\n  path: m\ntransport:\n  checksum: false\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_FALSE(r->transport.checksum);
  const std::string bad =
      ErrorOf("model:\n  path: m\ntransport:\n  checksum: maybe\nboth:\n  replicas: 1\n");
  EXPECT_NE(bad.find("transport.checksum"), std::string::npos) << bad;
}

// Issue 16: transport.device_path (docs/cuda.md), read with backend cuda only.
TEST(Config, TransportDevicePathIsAutoDirectOrStagedForCudaOnly) {
  auto d = Parse("model:\n  path: m\n  backend: cuda\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->transport.device_path, "auto");
  for (const char* v : {"direct", "staged", "auto"}) {
    auto r = Parse(std::string("model:\n  path: m\n  backend: cuda\ntransport:\n  device_path: ") +
                   v + "\nboth:\n  replicas: 1\n");
    ASSERT_TRUE(r.ok()) << v << ": " << r.status().message();
    EXPECT_EQ(r->transport.device_path, v);
  }
  EXPECT_EQ(ErrorOf("model:\n  path: m\n  backend: cuda\ntransport:\n  device_path: rdma\n"
                    "both:\n  replicas: 1\n"),
            "configs/x.yaml:5: key 'transport.device_path' must be one of 'auto', 'direct', "
            "'staged', got 'rdma'");
  const std::string cpu =
      ErrorOf("model:\n  path: m\ntransport:\n  device_path: direct\nboth:\n  replicas: 1\n");
  EXPECT_NE(cpu.find("transport.device_path 'direct' is only read with model.backend 'cuda'"),
            std::string::npos)
      << cpu;
}

TEST(Config, BatchInvariantDefaultsToTrueAndParsesBothValues) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_TRUE(d->model.batch_invariant);  // docs/cuda.md: determinism by default
  const std::string base = "model:\n  path: m\n  backend: cuda\n  batch_invariant: ";
  auto off = Parse(base + "false\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_FALSE(off->model.batch_invariant);
  auto on = Parse(base + "true\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(on.ok()) << on.status().message();
  EXPECT_TRUE(on->model.batch_invariant);
  EXPECT_EQ(ErrorOf(base + "sometimes\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'model.batch_invariant' must be true or false, got 'sometimes'");
}

TEST(Config, UnknownKeyNamesLineAndSuggests) {
  const std::string text = R"(model:
  path: m
prefill:
  replicas: 1
decode:
  replicas: 1
prefil:
  replicas: 2
)";
  EXPECT_EQ(ErrorOf(text), "configs/x.yaml:7: unknown key 'prefil' (did you mean 'prefill'?)");
}

TEST(Config, UnknownNestedKey) {
  const std::string text = std::string(kGood) + "cache:\n  blok_size: 32\n";
  // The duplicate 'cache' is reported too; both name their lines.
  const std::string err = ErrorOf(text);
  EXPECT_NE(err.find("configs/x.yaml:9: duplicate key 'cache' (first at line 3)"), std::string::npos)
      << err;
}

TEST(Config, UnknownNestedKeyInSection) {
  const std::string text = R"(model:
  path: m
  backnd: cpu
both:
  replicas: 1
)";
  EXPECT_EQ(ErrorOf(text),
            "configs/x.yaml:3: unknown key 'backnd' in 'model' (did you mean 'backend'?)");
}

TEST(Config, NoSuggestionForFarKeys) {
  const std::string text = std::string(kGood) + "zzzzzzzz: 1\n";
  EXPECT_EQ(ErrorOf(text), "configs/x.yaml:9: unknown key 'zzzzzzzz'");
}

TEST(Config, BadValuesNameKeyAndLimit) {
  EXPECT_EQ(ErrorOf("model:\n  path: m\ncache:\n  block_size: 0\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'cache.block_size' must be an integer in [1, 1024], got '0'");
  EXPECT_EQ(ErrorOf("model:\n  path: m\ncache:\n  block_size: sixteen\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'cache.block_size' must be an integer in [1, 1024], got "
            "'sixteen'");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nrouter:\n  policy: fastest\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'router.policy' must be one of 'kv_aware', 'least_loaded', "
            "'round_robin', 'random', got 'fastest'");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nproxy:\n  grpc: localhost\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'proxy.grpc': address 'localhost' must be host:port (e.g. "
            "127.0.0.1:50051)");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nlogging:\n  format: xml\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'logging.format' must be one of 'text', 'json', got 'xml'");
  EXPECT_EQ(
      ErrorOf("model:\n  path: m\ntransport:\n  lease_seconds: -1\nboth:\n  replicas: 1\n"),
      "configs/x.yaml:4: key 'transport.lease_seconds' must be a number in [0.1, 86400], got "
      "'-1'");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  node: host a\n"),
            "configs/x.yaml:5: key 'both.node' must be at most 63 characters of A-Z a-z 0-9 . _ -, "
            "got 'host a' (6 characters)");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\n  zone: " + std::string(64, 'z') + "\n"),
            "configs/x.yaml:5: key 'both.zone' must be at most 63 characters of A-Z a-z 0-9 . _ -, "
            "got '" + std::string(64, 'z') + "' (64 characters)");
  auto ok = Parse("model:\n  path: m\nprefill:\n  replicas: 1\n  node: gpu-node_3.rack-a\n"
                  "  zone: " + std::string(63, 'z') + "\ndecode:\n  replicas: 1\n");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->prefill.node, "gpu-node_3.rack-a");
  EXPECT_EQ(ok->prefill.zone, std::string(63, 'z'));
}

TEST(Config, EveryErrorIsReported) {
  const std::string err =
      ErrorOf("model:\n  path: m\ncache:\n  block_size: 0\n  num_blocks: x\nbogus: 1\n");
  EXPECT_NE(err.find("x.yaml:4:"), std::string::npos) << err;
  EXPECT_NE(err.find("x.yaml:5:"), std::string::npos) << err;
  EXPECT_NE(err.find("x.yaml:6: unknown key 'bogus'"), std::string::npos) << err;
}

TEST(Config, MissingAndStructuralErrors) {
  EXPECT_EQ(ErrorOf("both:\n  replicas: 1\n"),
            "configs/x.yaml:1: missing required key 'model'");
  EXPECT_EQ(ErrorOf("model:\n  name: x\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:2: missing required key 'model.path'");
  EXPECT_EQ(ErrorOf("model: [1, 2]\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:1: 'model' must be a mapping of keys to values");
  EXPECT_EQ(ErrorOf(""), "configs/x.yaml: the file is empty");
  const std::string syntax = ErrorOf("model:\n  path: [unclosed\n");
  EXPECT_EQ(syntax.rfind("configs/x.yaml:", 0), 0u) << syntax;
  EXPECT_NE(syntax.find("YAML syntax error"), std::string::npos) << syntax;
}

TEST(Config, CrossFieldChecks) {
  EXPECT_EQ(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 2\n"),
            "configs/x.yaml: a disaggregated fleet needs both prefill and decode workers; got "
            "prefill.replicas=2 and decode.replicas=0");
  EXPECT_EQ(ErrorOf("model:\n  path: m\n"),
            "configs/x.yaml: the fleet has no workers: set prefill.replicas and "
            "decode.replicas, or both.replicas");
  EXPECT_EQ(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\nproxy:\n  default_max_tokens: 9\n"
                    "  max_tokens_limit: 8\n"),
            "configs/x.yaml: proxy.default_max_tokens (9) exceeds proxy.max_tokens_limit (8)");
}

// security.api_keys_file (issue 19): a path relative to the config file.
TEST(Config, SecurityApiKeysFile) {
  auto none = Parse(kGood);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->security.api_keys_file, "");
  auto r = Parse(std::string(kGood) + "security:\n  api_keys_file: keys/tenants.yaml\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->security.api_keys_file, "/repo/configs/keys/tenants.yaml");
  EXPECT_NE(ErrorOf(std::string(kGood) + "security:\n  api_key_file: k.yaml\n")
                .find("did you mean 'api_keys_file'"),
            std::string::npos);
}

// proxy.replicas and proxy.restart (issue 21): defaults, values, limits.
TEST(Config, ProxyReplicas) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->proxy.replicas, 1u);
  EXPECT_TRUE(d->proxy.restart);
  auto r = Parse(std::string(kGood) + "proxy:\n  replicas: 4\n  restart: false\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->proxy.replicas, 4u);
  EXPECT_FALSE(r->proxy.restart);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  replicas: 0\n").find("proxy.replicas"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  replicas: 65\n").find("proxy.replicas"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  restart: maybe\n").find("proxy.restart"),
            std::string::npos);
}

// proxy.limits (issue 19, docs/configuration.md): defaults and range checks.
TEST(Config, ProxyLimits) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->proxy.limits.max_request_bytes, 4u << 20);
  EXPECT_EQ(d->proxy.limits.max_prompt_tokens, 0u);
  EXPECT_EQ(d->proxy.limits.max_stop_token_ids, 64u);
  EXPECT_EQ(d->proxy.limits.max_connections, 1024u);
  EXPECT_EQ(d->proxy.limits.max_pipelined_requests, 8u);
  auto r = Parse(std::string(kGood) +
                 "proxy:\n  limits:\n    max_request_bytes: 2048\n    max_prompt_tokens: 100\n"
                 "    max_stop_strings: 2\n    max_stop_string_bytes: 8\n"
                 "    max_stop_token_ids: 3\n    max_http_header_bytes: 4096\n"
                 "    max_http_body_bytes: 8192\n    max_connections: 5\n"
                 "    max_pipelined_requests: 2\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ProxyLimitsConfig& l = r->proxy.limits;
  EXPECT_EQ(l.max_request_bytes, 2048u);
  EXPECT_EQ(l.max_prompt_tokens, 100u);
  EXPECT_EQ(l.max_stop_strings, 2u);
  EXPECT_EQ(l.max_stop_string_bytes, 8u);
  EXPECT_EQ(l.max_stop_token_ids, 3u);
  EXPECT_EQ(l.max_http_header_bytes, 4096u);
  EXPECT_EQ(l.max_http_body_bytes, 8192u);
  EXPECT_EQ(l.max_connections, 5u);
  EXPECT_EQ(l.max_pipelined_requests, 2u);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  limits:\n    max_connections: 0\n")
                .find("proxy.limits.max_connections"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  limits:\n    max_stop_tokens: 3\n")
                .find("did you mean 'max_stop_token_ids'"),
            std::string::npos);
}

// An empty cache.salt comes from $TANDEM_CACHE_SALT (set by `tandem launch`
// for its children); a salt in the file wins.
TEST(Config, CacheSaltFromTheEnvironment) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem-salt-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string plain = (dir / "plain.yaml").string(), salted = (dir / "salted.yaml").string();
  { std::ofstream(plain) << kGood; }
  {
    std::string text = kGood;
    text.replace(text.find("  block_size: 16\n"), 0, "  salt: from-file\n");
    std::ofstream(salted) << text;
  }
  ::unsetenv(kCacheSaltEnv);
  auto none = LoadFleetConfig(plain);
  ASSERT_TRUE(none.ok()) << none.status().message();
  EXPECT_EQ(none->cache.salt, "");
  ::setenv(kCacheSaltEnv, "from-env", 1);
  auto env = LoadFleetConfig(plain);
  auto file = LoadFleetConfig(salted);
  ::unsetenv(kCacheSaltEnv);
  ASSERT_TRUE(env.ok() && file.ok());
  EXPECT_EQ(env->cache.salt, "from-env");
  EXPECT_EQ(file->cache.salt, "from-file");
  std::filesystem::remove_all(dir);
}

// KV tiers (docs/engine.md, "KV tiers"): off by default; the disk tier's
// path resolves against the file's directory; both keys are range-checked.
TEST(Config, KvTierKeys) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->cache.host_tier_blocks, 0u);
  EXPECT_TRUE(d->cache.disk_tier_path.empty());
  auto r = Parse("model:\n  path: m\ncache:\n  host_tier_blocks: 4096\n  disk_tier:\n"
                 "    path: kv\n    max_gib: 2.5\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->cache.host_tier_blocks, 4096u);
  EXPECT_EQ(r->cache.disk_tier_path, "/repo/configs/kv");
  EXPECT_DOUBLE_EQ(r->cache.disk_tier_max_gib, 2.5);
  EXPECT_EQ(ErrorOf("model:\n  path: m\ncache:\n  disk_tier:\n    path: kv\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:5: missing required key 'cache.disk_tier.max_gib'");
  EXPECT_EQ(ErrorOf("model:\n  path: m\ncache:\n  disk_tier:\n    path: kv\n    max_gib: 0\n"
                    "both:\n  replicas: 1\n"),
            "configs/x.yaml:6: key 'cache.disk_tier.max_gib' must be a number in [0.0001, 1000000], got '0'");
  EXPECT_NE(ErrorOf("model:\n  path: m\ncache:\n  host_tier_blocks: -1\nboth:\n  replicas: 1\n")
                .find("cache.host_tier_blocks"),
            std::string::npos);
}

// cache.prefault (docs/serving-workers.md, "KV pool residency"): on by
// default, a strict boolean.
TEST(Config, CachePrefaultKey) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->cache.prefault);
  auto off = Parse("model:\n  path: m\ncache:\n  prefault: false\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_FALSE(off->cache.prefault);
  EXPECT_EQ(ErrorOf("model:\n  path: m\ncache:\n  prefault: lazy\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'cache.prefault' must be true or false, got 'lazy'");
}

TEST(Config, ScheduleConservativenessKey) {  // docs/engine.md "Growth reserve"
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->scheduler.schedule_conservativeness, 1.0);
  auto off = Parse("model:\n  path: m\nscheduler:\n  schedule_conservativeness: 0\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_DOUBLE_EQ(off->scheduler.schedule_conservativeness, 0.0);
  EXPECT_EQ(ErrorOf("model:\n  path: m\nscheduler:\n  schedule_conservativeness: -0.5\nboth:\n  replicas: 1\n"),
            "configs/x.yaml:4: key 'scheduler.schedule_conservativeness' must be a number in [0, 10], "
            "got '-0.5'");
}

TEST(Config, AutoscaleKeys) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->autoscale.enabled);
  EXPECT_EQ(d->autoscale.prefill.min, 1u);
  EXPECT_EQ(d->autoscale.decode.max, 4u);
  auto r = Parse(std::string(kGood) +
                 "autoscale:\n  enabled: true\n  prefill:\n    min: 2\n    max: 6\n  decode:\n"
                 "    max: 3\n  scale_up_cooldown_s: 4\n  scale_down_cooldown_s: 9\n"
                 "  ttft_target_ms: 250\n  itl_target_ms: 20\n  kv_usage_target: 0.5\n"
                 "  awaiting_first_token_target: 2\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->autoscale.enabled);
  EXPECT_EQ(r->autoscale.prefill.min, 2u);
  EXPECT_EQ(r->autoscale.prefill.max, 6u);
  EXPECT_EQ(r->autoscale.decode.min, 1u);
  EXPECT_EQ(r->autoscale.decode.max, 3u);
  EXPECT_DOUBLE_EQ(r->autoscale.scale_up_cooldown_s, 4.0);
  EXPECT_DOUBLE_EQ(r->autoscale.scale_down_cooldown_s, 9.0);
  EXPECT_DOUBLE_EQ(r->autoscale.ttft_target_ms, 250.0);
  EXPECT_DOUBLE_EQ(r->autoscale.itl_target_ms, 20.0);
  EXPECT_DOUBLE_EQ(r->autoscale.kv_usage_target, 0.5);
  EXPECT_DOUBLE_EQ(r->autoscale.awaiting_first_token_target, 2.0);
  EXPECT_DOUBLE_EQ(d->autoscale.awaiting_first_token_target, 1.0);
  EXPECT_EQ(ErrorOf(std::string(kGood) + "autoscale:\n  decode:\n    min: 5\n    max: 2\n"),
            "configs/x.yaml: autoscale.decode.min (5) exceeds autoscale.decode.max (2)");
  EXPECT_NE(ErrorOf(std::string(kGood) + "autoscale:\n  prefill:\n    min: 0\n")
                .find("autoscale.prefill.min"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "autoscale:\n  kv_usage_target: 2\n")
                .find("autoscale.kv_usage_target"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "autoscale:\n  cooldown: 2\n").find("'cooldown' in 'autoscale'"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nboth:\n  replicas: 1\nautoscale:\n  enabled: true\n")
                .find("autoscale.enabled"),
            std::string::npos);
}

TEST(Config, MissingFile) {
  auto r = LoadFleetConfig("/nonexistent/fleet.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "/nonexistent/fleet.yaml: cannot open the config file");
}

// The configs shipped in configs/ must all be valid.
TEST(Config, ShippedConfigsLoad) {
  namespace fs = std::filesystem;
  int n = 0;
  for (const auto& e : fs::directory_iterator(fs::path(TANDEM_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".yaml") continue;
    auto r = LoadFleetConfig(e.path().string());
    EXPECT_TRUE(r.ok()) << r.status().message();
    ++n;
  }
  EXPECT_GE(n, 3);
}

// security (docs/security.md): the TLS keys take a word or a mapping of files.
TEST(Config, SecurityDefaultsAndForms) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->security.internal_tls, "auto");
  EXPECT_EQ(d->security.public_tls, "off");
  EXPECT_EQ(d->proxy.internal, "127.0.0.1:0");

  auto files = Parse(std::string(kGood) +
                     "security:\n  internal_tls:\n    ca_file: tls/ca.pem\n    cert_file: "
                     "tls/w.pem\n    key_file: /abs/w.key\n  public_tls:\n    cert_file: p.pem\n"
                     "    key_file: p.key\n  dir: sec\n");
  ASSERT_TRUE(files.ok()) << files.status().message();
  EXPECT_EQ(files->security.internal_tls, "files");
  EXPECT_EQ(files->security.internal_ca_file, "/repo/configs/tls/ca.pem");
  EXPECT_EQ(files->security.internal_key_file, "/abs/w.key");
  EXPECT_EQ(files->security.public_tls, "files");
  EXPECT_EQ(files->security.public_cert_file, "/repo/configs/p.pem");
  EXPECT_EQ(files->security.public_client_ca_file, "");
  EXPECT_EQ(files->security.dir, "/repo/configs/sec");

  auto off = Parse(std::string(kGood) + "security:\n  internal_tls: off\n  public_tls: auto\n");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_EQ(off->security.internal_tls, "off");
  EXPECT_EQ(off->security.public_tls, "auto");
}

TEST(Config, SecurityErrorsNameTheKey) {
  EXPECT_NE(ErrorOf(std::string(kGood) + "security:\n  internal_tls: maybe\n")
                .find("security.internal_tls"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "security:\n  internal_tls:\n    ca_file: a.pem\n")
                .find("missing required key 'security.internal_tls.cert_file'"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "security:\n  public_tls:\n    cert_file: a\n    "
                                         "key_file: b\n    ca_file: c\n")
                .find("unknown key 'ca_file' in 'security.public_tls'"),
            std::string::npos);
}

// proxy.admission and proxy.slo (issue 22, docs/configuration.md).
TEST(Config, ProxyAdmissionAndSlo) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->proxy.admission, "queue");
  EXPECT_EQ(d->proxy.slo_ttft_ms, 0u);
  EXPECT_EQ(d->proxy.slo_tpot_ms, 0u);
  auto r = Parse(std::string(kGood) + "proxy:\n  admission: slo\n  slo:\n    ttft_ms: 500\n    tpot_ms: 40\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->proxy.admission, "slo");
  EXPECT_EQ(r->proxy.slo_ttft_ms, 500u);
  EXPECT_EQ(r->proxy.slo_tpot_ms, 40u);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  admission: drop\n").find("proxy.admission"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  slo:\n    ttft_ms: -1\n").find("proxy.slo.ttft_ms"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kGood) + "proxy:\n  slo:\n    ttft: 5\n").find("unknown key 'ttft' in 'proxy.slo'"),
            std::string::npos);
}

// Issue 18: tensor_parallel / pipeline_parallel per role section (default 1;
// the model's divisibility is checked at start-up: rank_layout_test).
TEST(Config, RoleRankLayout) {
  auto d = Parse(kGood);
  ASSERT_TRUE(d.ok());
  for (const RoleConfig* r : {&d->prefill, &d->decode, &d->both}) {
    EXPECT_EQ(r->tensor_parallel, 1u);
    EXPECT_EQ(r->pipeline_parallel, 1u);
  }
  auto r = Parse("model:\n  path: m\nprefill:\n  replicas: 1\n  tensor_parallel: 2\n"
                 "decode:\n  replicas: 1\n  pipeline_parallel: 2\nboth:\n  tensor_parallel: 4\n"
                 "  pipeline_parallel: 3\n");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->prefill.tensor_parallel, 2u);
  EXPECT_EQ(r->prefill.pipeline_parallel, 1u);
  EXPECT_EQ(r->decode.tensor_parallel, 1u);
  EXPECT_EQ(r->decode.pipeline_parallel, 2u);
  EXPECT_EQ(r->both.tensor_parallel, 4u);
  EXPECT_EQ(r->both.pipeline_parallel, 3u);
  EXPECT_NE(ErrorOf(std::string(kGood) + "both:\n  tensor_parallel: 0\n")
                .find("key 'both.tensor_parallel' must be an integer in [1, 64], got '0'"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n"
                    "  pipeline_parallel: 65\n")
                .find("key 'decode.pipeline_parallel' must be an integer in [1, 64], got '65'"),
            std::string::npos);
  EXPECT_NE(ErrorOf("model:\n  path: m\nprefill:\n  replicas: 1\n  tensor_parallel: two\n"
                    "decode:\n  replicas: 1\n")
                .find("prefill.tensor_parallel"),
            std::string::npos);
}

// Issue 23 (docs/grpc-frontend.md): the public gRPC port's server.
TEST(Config, ProxyGrpcServerIsAutoByDefaultAndNativeOrGrpcOnRequest) {
  auto d = Parse("model:\n  path: m\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->proxy.grpc_server, "auto");
  auto g = Parse("model:\n  path: m\nproxy:\n  grpc_server: grpc\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(g->proxy.grpc_server, "grpc");
  // auto with public TLS is fine (it picks native at start-up).
  auto a = Parse("model:\n  path: m\nsecurity:\n  public_tls: auto\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(a.ok()) << a.status().message();
  auto n = Parse("model:\n  path: m\nproxy:\n  grpc_server: native\nboth:\n  replicas: 1\n");
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(n->proxy.grpc_server, "native");
  const std::string bad =
      ErrorOf("model:\n  path: m\nproxy:\n  grpc_server: h2o\nboth:\n  replicas: 1\n");
  EXPECT_NE(bad.find("grpc_server"), std::string::npos) << bad;
  EXPECT_NE(bad.find("native"), std::string::npos) << bad;
  // native serves public TLS too (docs/grpc-frontend.md "TLS").
  auto tls = Parse(
      "model:\n  path: m\nproxy:\n  grpc_server: native\nsecurity:\n  public_tls: auto\n"
      "both:\n  replicas: 1\n");
  ASSERT_TRUE(tls.ok()) << tls.status().message();
  EXPECT_EQ(tls->proxy.grpc_server, "native");
}

}  // namespace
}  // namespace tandem
