#include "common/config.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/net.h"
#include "common/yaml_reader.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

}  // namespace

Status CheckRouterLabel(std::string_view field, std::string_view value) {
  const bool chars_ok = std::all_of(value.begin(), value.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (value.size() > kMaxLabelChars || !chars_ok) {
    return InvalidArgumentError(fmt::format(
        "{} must be at most {} characters of A-Z a-z 0-9 . _ -, got '{}' ({} characters)", field,
        kMaxLabelChars, value.substr(0, 80), value.size()));
  }
  return Status::Ok();
}

namespace {

void ReadRole(YamlMap m, RoleConfig& r) {
  m.Read("replicas", r.replicas, 0, 256);
  m.ReadAddress("grpc", r.grpc);
  m.ReadAddress("metrics", r.metrics);
  m.Read("num_blocks", r.num_blocks, 0, 1u << 24);
  m.ReadLabel("node", r.node);
  m.ReadLabel("zone", r.zone);
  // Issue 18: ranks per worker (the model's divisibility is checked at start-up).
  m.Read("tensor_parallel", r.tensor_parallel, 1, 64);
  m.Read("pipeline_parallel", r.pipeline_parallel, 1, 64);
  m.Read("mux_listen", r.mux_listen);  // issue 23; checked in CrossCheck
  m.Read("watch_listen", r.watch_listen);  // issue 23; checked in CrossCheck
  m.Read("frame_listen", r.frame_listen);  // issue 23 (Prefill over TCP); checked in CrossCheck
  m.Read("reserve_listen", r.reserve_listen);  // issue 23 (Reserve over TCP); checked in CrossCheck
  m.ReadEnum("reserve_transport", r.reserve_transport, {"tcp", "grpc"});  // issue 23
  m.Read("load_interval_ms", r.load_interval_ms, 10, 5000);               // issue 23
  m.Finish();
}

void ReadAutoscale(YamlMap m, AutoscaleConfig& a) {
  m.Read("enabled", a.enabled);
  for (auto [key, r] : {std::pair{"prefill", &a.prefill}, std::pair{"decode", &a.decode}}) {
    YamlMap s = m.Sub(key);
    s.Read("min", r->min, 1, 256);
    s.Read("max", r->max, 1, 256);
    s.Finish();
  }
  m.Read("interval_s", a.interval_s, 0.05, 3600.0);
  m.Read("window_s", a.window_s, 0.1, 86400.0);
  m.Read("scale_up_cooldown_s", a.scale_up_cooldown_s, 0.0, 86400.0);
  m.Read("scale_down_cooldown_s", a.scale_down_cooldown_s, 0.0, 86400.0);
  m.Read("ttft_target_ms", a.ttft_target_ms, 1.0, 3.6e6);
  m.Read("itl_target_ms", a.itl_target_ms, 0.1, 3.6e6);
  m.Read("queued_prefill_tokens_target", a.queued_prefill_tokens_target, 1.0, 1e9);
  m.Read("awaiting_first_token_target", a.awaiting_first_token_target, 0.01, 1e6);
  m.Read("kv_usage_target", a.kv_usage_target, 0.01, 1.0);
  m.Read("scale_down_below", a.scale_down_below, 0.01, 0.99);
  m.Finish();
}

// security.internal_tls / public_tls: a word, or a mapping of PEM files.
void ReadSecurity(YamlMap m, SecurityConfig& s) {
  if (m.HasMapping("internal_tls")) {
    s.internal_tls = "files";
    YamlMap f = m.Sub("internal_tls");
    for (const char* k : {"ca_file", "cert_file", "key_file"}) f.Require(k);
    f.Read("ca_file", s.internal_ca_file);
    f.Read("cert_file", s.internal_cert_file);
    f.Read("key_file", s.internal_key_file);
    f.Finish();
  } else {
    m.ReadEnum("internal_tls", s.internal_tls, {"auto", "off"});
  }
  if (m.HasMapping("public_tls")) {
    s.public_tls = "files";
    YamlMap f = m.Sub("public_tls");
    for (const char* k : {"cert_file", "key_file"}) f.Require(k);
    f.Read("cert_file", s.public_cert_file);
    f.Read("key_file", s.public_key_file);
    f.Read("client_ca_file", s.public_client_ca_file);
    f.Finish();
  } else {
    m.ReadEnum("public_tls", s.public_tls, {"off", "auto"});
  }
  m.Read("dir", s.dir);
  m.Read("api_keys_file", s.api_keys_file);
  m.Finish();
}

void ReadAll(YamlMap& top, FleetConfig& c) {
  top.Require("model");
  {
    YamlMap m = top.Sub("model");
    m.Require("path");
    m.Read("name", c.model.name);
    m.Read("path", c.model.path);
    m.Read("revision", c.model.revision);
    m.ReadEnum("backend", c.model.backend, {"cpu", "cuda", "sim"});
    m.ReadEnum("dtype", c.model.dtype, {"f32", "bf16", "f16"});
    m.Read("max_model_len", c.model.max_model_len, 0, 1u << 20);
    m.Read("batch_invariant", c.model.batch_invariant);
    m.Finish();
  }
  {
    YamlMap m = top.Sub("cache");
    m.Read("block_size", c.cache.block_size, 1, 1024);
    m.Read("num_blocks", c.cache.num_blocks, 1, 1u << 24);
    m.Read("salt", c.cache.salt);
    m.Read("host_tier_blocks", c.cache.host_tier_blocks, 0, 1u << 30);
    m.Read("prefault", c.cache.prefault);
    if (m.Has("disk_tier")) {
      YamlMap d = m.Sub("disk_tier");
      d.Require("path");
      d.Require("max_gib");
      d.Read("path", c.cache.disk_tier_path);
      d.Read("max_gib", c.cache.disk_tier_max_gib, 0.0001, 1e6);
      d.Finish();
    }
    m.Finish();
  }
  {
    YamlMap m = top.Sub("scheduler");
    m.Read("max_num_seqs", c.scheduler.max_num_seqs, 1, 4096);
    m.Read("max_batched_tokens", c.scheduler.max_batched_tokens, 1, 1u << 20);
    m.Read("max_waiting", c.scheduler.max_waiting, 0, 1u << 20);
    m.Read("schedule_conservativeness", c.scheduler.schedule_conservativeness, 0.0, 10.0);
    // A fleet file without `threads` asks for the automatic count (0: the
    // cores shared among the file's workers, engine.cc); FleetConfig's own
    // default stays 1 for configs built in code.
    c.scheduler.threads = 0;
    m.Read("threads", c.scheduler.threads, 0, 256);
    m.Finish();
  }
  {
    YamlMap m = top.Sub("proxy");
    m.ReadAddress("grpc", c.proxy.grpc);
    m.ReadAddress("http", c.proxy.http);
    m.ReadAddress("metrics", c.proxy.metrics);
    m.ReadAddress("internal", c.proxy.internal);
    m.Read("max_inflight", c.proxy.max_inflight, 1, 1u << 20);
    m.Read("default_max_tokens", c.proxy.default_max_tokens, 1, 1u << 20);
    m.Read("max_tokens_limit", c.proxy.max_tokens_limit, 1, 1u << 20);
    m.Read("api_key", c.proxy.api_key);
    m.ReadEnum("chat_template", c.proxy.chat_template, {"auto", "chatml", "llama3", "mistral"});
    m.Read("http_idle_timeout_seconds", c.proxy.http_idle_timeout_seconds, 0.1, 3600.0);
    m.Read("max_migrations", c.proxy.max_migrations, 0, 100);
    m.Read("drain_seconds", c.proxy.drain_seconds, 0.0, 3600.0);
    m.Read("liveness_timeout_seconds", c.proxy.liveness_timeout_seconds, 0.2, 600.0);
    m.Read("replicas", c.proxy.replicas, 1, 64);  // issue 21
    m.Read("restart", c.proxy.restart);
    m.Read("decode_stream", c.proxy.decode_stream);  // issue 23
    m.ReadEnum("decode_transport", c.proxy.decode_transport, {"tcp", "grpc"});  // issue 23
    m.ReadEnum("watch_transport", c.proxy.watch_transport, {"tcp", "grpc"});  // issue 23
    m.ReadEnum("prefill_transport", c.proxy.prefill_transport, {"tcp", "grpc"});  // issue 23
    m.ReadEnum("register_transport", c.proxy.register_transport, {"tcp", "grpc"});  // issue 23
    m.ReadEnum("grpc_server", c.proxy.grpc_server, {"auto", "grpc", "native"});  // issue 23
    {
      YamlMap l = m.Sub("limits");
      ProxyLimitsConfig& x = c.proxy.limits;
      l.Read("max_request_bytes", x.max_request_bytes, 1024, uint64_t{64} << 20);
      l.Read("max_prompt_tokens", x.max_prompt_tokens, 0, 1u << 24);
      l.Read("max_stop_strings", x.max_stop_strings, 0, 1024);
      l.Read("max_stop_string_bytes", x.max_stop_string_bytes, 1, 1u << 16);
      l.Read("max_stop_token_ids", x.max_stop_token_ids, 0, 1u << 16);
      l.Read("max_http_header_bytes", x.max_http_header_bytes, 1024, uint64_t{1} << 24);
      l.Read("max_http_body_bytes", x.max_http_body_bytes, 1024, uint64_t{64} << 20);
      l.Read("max_connections", x.max_connections, 1, 1u << 20);
      l.Read("handshake_timeout_seconds", x.handshake_timeout_seconds, 0.1, 3600.0);
      l.Read("max_pipelined_requests", x.max_pipelined_requests, 1, 1024);
      l.Finish();
    }
    m.ReadEnum("admission", c.proxy.admission, {"queue", "slo"});
    {
      YamlMap o = m.Sub("slo");
      o.Read("ttft_ms", c.proxy.slo_ttft_ms, 0, 3'600'000);
      o.Read("tpot_ms", c.proxy.slo_tpot_ms, 0, 3'600'000);
      o.Read("attainment", c.proxy.slo_attainment, 0.0, 0.99);
      o.Finish();
    }
    m.Finish();
  }
  {
    YamlMap m = top.Sub("router");
    m.ReadEnum("policy", c.router.policy, {"kv_aware", "least_loaded", "round_robin", "random"});
    m.Read("prefill_weight", c.router.prefill_weight, 0.0, 1e6);
    m.Read("temperature", c.router.temperature, 0.0, 1e6);
    m.Read("local_prefill_threshold_tokens", c.router.local_prefill_threshold_tokens, 0,
           1u << 20);
    m.Read("seed", c.router.seed, 0, UINT64_MAX);
    m.Read("hot_prefix_threshold", c.router.hot_prefix_threshold, 0.0, 1e6);
    m.Read("hot_prefix_min_load_blocks", c.router.hot_prefix_min_load_blocks, 0.0, 1e9);
    m.Read("transfer_cost_per_ms", c.router.transfer_cost_per_ms, 0.0, 1e6);
    m.Read("load_report_lag_ms", c.router.load_report_lag_ms, 0.0, 60000.0);
    m.Read("max_prediction_age_s", c.router.max_prediction_age_s, 0.001, 3600.0);
    {
      YamlMap t = m.Sub("topology");
      t.Read("same_node_bandwidth_gbps", c.router.same_node_bandwidth_gbps, 0.001, 1e5);
      t.Read("cross_node_bandwidth_gbps", c.router.cross_node_bandwidth_gbps, 0.001, 1e5);
      t.Read("cross_zone_bandwidth_gbps", c.router.cross_zone_bandwidth_gbps, 0.001, 1e5);
      t.Finish();
    }
    m.Finish();
  }
  {
    YamlMap m = top.Sub("transport");
    m.ReadEnum("backend", c.transport.backend, {"ucx", "loopback"});
    m.Read("lease_seconds", c.transport.lease_seconds, 0.1, 86400.0);
    m.Read("peer_timeout_seconds", c.transport.peer_timeout_seconds, 0.1, 600.0);
    m.Read("encrypt", c.transport.encrypt);
    m.ReadEnum("push", c.transport.push, {"streaming", "after_prefill"});
    m.Read("checksum", c.transport.checksum);
    m.ReadEnum("device_path", c.transport.device_path, {"auto", "direct", "staged"});
    m.Finish();
  }
  {
    YamlMap m = top.Sub("logging");
    m.ReadEnum("level", c.logging.level, {"trace", "debug", "info", "warn", "error"});
    m.ReadEnum("format", c.logging.format, {"text", "json"});
    m.Finish();
  }
  {
    YamlMap m = top.Sub("observability");
    m.ReadAddress("otlp_endpoint", c.observability.otlp_endpoint);
    m.Read("trace_sample_ratio", c.observability.trace_sample_ratio, 0.0, 1.0);
    if (m.Has("otlp_tls")) {
      c.observability.otlp_tls = true;
      YamlMap t = m.Sub("otlp_tls");
      t.Require("ca_file");
      t.Read("ca_file", c.observability.otlp_ca_file);
      t.Read("cert_file", c.observability.otlp_cert_file);
      t.Read("key_file", c.observability.otlp_key_file);
      t.Finish();
    }
    m.Finish();
  }
  ReadSecurity(top.Sub("security"), c.security);
  if (top.Has("sim")) {
    YamlMap m = top.Sub("sim");
    c.sim.present = true;
    // The profiles of src/sim/hardware_profile.cc (a unit test keeps the lists equal).
    m.ReadEnum("profile", c.sim.profile, {"H100", "H200", "A100", "L40S"});
    m.Require("model_shape");
    m.Read("model_shape", c.sim.model_shape);
    m.Read("tensor_parallel", c.sim.tensor_parallel, 1, 64);
    m.Read("gpus_per_node", c.sim.gpus_per_node, 1, 1024);
    m.ReadEnum("intra_node_link", c.sim.intra_node_link, {"nvlink", "pcie", "rdma", "ethernet"});
    m.ReadEnum("inter_node_link", c.sim.inter_node_link, {"nvlink", "pcie", "rdma", "ethernet"});
    m.Read("compute_efficiency", c.sim.compute_efficiency, 0.01, 1.0);
    m.Read("memory_efficiency", c.sim.memory_efficiency, 0.01, 1.0);
    m.Read("gpu_memory_utilization", c.sim.gpu_memory_utilization, 0.05, 1.0);
    m.Read("step_overhead_us", c.sim.step_overhead_us, 0.0, 1e6);
    m.Read("kv_scale", c.sim.kv_scale, 1, 1u << 20);
    m.Read("link_gbps", c.sim.link_gbps, 0.0, 1e5);
    m.Read("link_latency_us", c.sim.link_latency_us, 0.0, 1e6);
    m.Read("pcie_gbps", c.sim.pcie_gbps, 0.001, 1e5);
    m.Read("nvme_gbps", c.sim.nvme_gbps, 0.001, 1e5);
    m.Read("eos_probability", c.sim.eos_probability, 0.0, 1.0);
    m.Finish();
  }
  ReadRole(top.Sub("prefill"), c.prefill);
  ReadRole(top.Sub("decode"), c.decode);
  ReadRole(top.Sub("both"), c.both);
  ReadAutoscale(top.Sub("autoscale"), c.autoscale);
  top.Finish();
}

// Checks that involve more than one key.
void CrossCheck(const FleetConfig& c, YamlErrors& errors, int line) {
  const ObservabilityConfig& o = c.observability;
  if (o.otlp_cert_file.empty() != o.otlp_key_file.empty()) {
    errors.Add(line, "observability.otlp_tls: cert_file and key_file go together (a client "
                     "certificate and its key), or neither");
  }
  if (o.otlp_tls && o.otlp_ca_file.empty()) {
    errors.Add(line, "observability.otlp_tls.ca_file must not be empty: it is the CA the "
                     "collector's certificate is verified against");
  }
  if (o.otlp_tls && o.otlp_endpoint.empty()) {
    errors.Add(line, "observability.otlp_tls is set but observability.otlp_endpoint is empty: "
                     "there is no collector to dial");
  }
  // Issue 23: the framed TCP listeners (decode stream, Prefill, Watch,
  // Reserve): auto, off or host:port, a fixed port only for one replica,
  // and set only where the role serves it.
  for (auto [role, rc] : {std::pair{"prefill", &c.prefill}, std::pair{"decode", &c.decode},
                          std::pair{"both", &c.both}}) {
    const bool is_prefill = std::string_view(role) == "prefill";
    const bool is_decode = std::string_view(role) == "decode";
    const struct {
      const char* key;
      const std::string* value;
      const char* refused;  // why this role cannot have it; null: it can
    } listeners[] = {
        {"mux_listen", &rc->mux_listen,
         is_prefill ? "only decode and both workers serve the decode stream" : nullptr},
        {"frame_listen", &rc->frame_listen,
         is_decode ? "only prefill and both workers serve Prefill" : nullptr},
        {"watch_listen", &rc->watch_listen, nullptr},
        {"reserve_listen", &rc->reserve_listen,
         is_prefill ? "only decode and both workers serve Reserve" : nullptr},
    };
    for (const auto& l : listeners) {
      const std::string& v = *l.value;
      if (v == "auto" || v == "off") continue;
      if (l.refused != nullptr) {
        errors.Add(line, fmt::format("{}.{} is '{}': {}", role, l.key, v, l.refused));
      } else if (auto hp = ParseHostPort(v); !hp.ok() || hp->host.empty()) {
        errors.Add(line, fmt::format("{}.{} is '{}': expected auto, off or host:port", role, l.key, v));
      } else if (hp->port != 0 && rc->replicas > 1) {
        errors.Add(line, fmt::format("{}.{} '{}' has a fixed port but {}.replicas is {}: use "
                                     "port 0 (or auto) so that each worker gets its own",
                                     role, l.key, v, role, rc->replicas));
      }
    }
    if (is_decode && rc->reserve_transport != "tcp") {
      errors.Add(line, fmt::format("decode.reserve_transport is '{}': only prefill and both "
                                   "workers call Reserve",
                                   rc->reserve_transport));
    }
  }
  if (c.proxy.default_max_tokens > c.proxy.max_tokens_limit) {
    errors.Add(line, fmt::format("proxy.default_max_tokens ({}) exceeds proxy.max_tokens_limit ({})",
                                 c.proxy.default_max_tokens, c.proxy.max_tokens_limit));
  }
  if ((c.prefill.replicas > 0) != (c.decode.replicas > 0)) {
    errors.Add(line, fmt::format("a disaggregated fleet needs both prefill and decode workers; "
                                 "got prefill.replicas={} and decode.replicas={}",
                                 c.prefill.replicas, c.decode.replicas));
  }
  if (c.prefill.replicas + c.decode.replicas + c.both.replicas == 0) {
    errors.Add(line, "the fleet has no workers: set prefill.replicas and decode.replicas, "
                     "or both.replicas");
  }
  if (c.model.path.empty()) errors.Add(line, "model.path must not be empty");
  for (auto [role, r] : {std::pair{"prefill", &c.autoscale.prefill},
                         std::pair{"decode", &c.autoscale.decode}}) {
    if (r->min > r->max) {
      errors.Add(line, fmt::format("autoscale.{0}.min ({1}) exceeds autoscale.{0}.max ({2})", role,
                                   r->min, r->max));
    }
  }
  if (c.autoscale.enabled && c.prefill.replicas + c.decode.replicas == 0) {
    errors.Add(line, "autoscale.enabled scales prefill and decode workers; this fleet has none "
                     "(set prefill.replicas and decode.replicas)");
  }
  if (c.model.backend == "sim" && !c.sim.present) {
    errors.Add(line, "model.backend 'sim' needs a 'sim' section (at least sim.model_shape: the "
                     "config.json of the simulated model)");
  }
  if (c.model.backend != "cuda" && c.transport.device_path != "auto") {
    errors.Add(line, fmt::format("transport.device_path '{}' is only read with model.backend "
                                 "'cuda' (a device KV pool); model.backend is '{}'",
                                 c.transport.device_path, c.model.backend));
  }
  if (c.model.backend != "sim" && c.sim.present) {
    errors.Add(line, fmt::format("a 'sim' section is only read with model.backend 'sim'; "
                                 "model.backend is '{}'", c.model.backend));
  }
}

}  // namespace

Result<FleetConfig> ParseFleetConfig(const std::string& text, const std::string& name,
                                     const std::string& base_dir) {
  YamlErrors errors(name);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    errors.Add(e.mark.line >= 0 ? e.mark.line + 1 : 0, fmt::format("YAML syntax error: {}", e.msg));
    return InvalidArgumentError(errors.Joined());
  }
  if (!root.IsDefined() || root.IsNull()) {
    return InvalidArgumentError(fmt::format("{}: the file is empty", name));
  }
  FleetConfig cfg;
  YamlMap top(&errors, root, "");
  ReadAll(top, cfg);
  if (errors.empty()) CrossCheck(cfg, errors, 0);
  if (!errors.empty()) return InvalidArgumentError(errors.Joined());

  if (!cfg.model.path.empty() && fs::path(cfg.model.path).is_relative()) {
    cfg.model.path = (fs::path(base_dir) / cfg.model.path).lexically_normal().string();
  }
  if (cfg.model.name.empty()) {
    cfg.model.name = fs::path(cfg.model.path).lexically_normal().filename().string();
    if (cfg.model.name.empty()) {
      cfg.model.name = fs::path(cfg.model.path).lexically_normal().parent_path().filename();
    }
  }
  for (std::string* p : {&cfg.security.internal_ca_file, &cfg.security.internal_cert_file,
                         &cfg.security.internal_key_file, &cfg.security.public_cert_file,
                         &cfg.security.public_key_file, &cfg.security.public_client_ca_file,
                         &cfg.security.dir, &cfg.security.api_keys_file,
                         &cfg.observability.otlp_ca_file, &cfg.observability.otlp_cert_file,
                         &cfg.observability.otlp_key_file}) {
    if (!p->empty() && fs::path(*p).is_relative()) {
      *p = (fs::path(base_dir) / *p).lexically_normal().string();
    }
  }
  if (!cfg.cache.disk_tier_path.empty() && fs::path(cfg.cache.disk_tier_path).is_relative()) {
    cfg.cache.disk_tier_path = (fs::path(base_dir) / cfg.cache.disk_tier_path).lexically_normal().string();
  }
  if (!cfg.sim.model_shape.empty() && fs::path(cfg.sim.model_shape).is_relative()) {
    cfg.sim.model_shape = (fs::path(base_dir) / cfg.sim.model_shape).lexically_normal().string();
  }
  // Everything a simulated fleet reports carries its model name (metrics
  // label `model`, logs, bench reports): make it say so.
  if (cfg.model.backend == "sim" && cfg.model.name.find("simulated") == std::string::npos) {
    cfg.model.name += "-simulated";
  }
  cfg.source_path = name;
  return cfg;
}

Result<FleetConfig> LoadFleetConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError(fmt::format("{}: cannot open the config file", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const fs::path base = fs::absolute(fs::path(path)).parent_path();
  auto cfg = ParseFleetConfig(ss.str(), path, base.string());
  if (cfg.ok() && cfg->cache.salt.empty()) {
    // `tandem launch` hands its children the random salt it made (docs/security.md).
    if (const char* env = std::getenv(kCacheSaltEnv); env != nullptr) cfg->cache.salt = env;
  }
  return cfg;
}

}  // namespace tandem
