// The fleet configuration: one YAML file describes a whole fleet (model,
// cache, scheduler, proxy, router, transport, logging and the prefill /
// decode / both worker groups). Every key is documented in
// docs/configuration.md; unknown keys and bad values are errors naming the
// file, the line and the key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem {

struct ModelConfig {
  std::string name;      // model id served to clients; default: the folder name
  std::string path;      // Hugging Face model directory (resolved against the file)
  std::string revision;  // folded into block hashes; bump when weights change
  std::string backend = "cpu";  // cpu | cuda | sim
  std::string dtype = "f32";    // compute/KV dtype: f32 | bf16 | f16
  uint32_t max_model_len = 0;   // 0 = the model's max_position_embeddings
  // Bit-identical rows whatever the batch and the chunking (docs/cuda.md).
  // cuda: selects the invariant kernels (default, the product's determinism
  // promise); false trades it for speed. cpu: always invariant, false is
  // accepted and changes nothing. sim: no math, ignored.
  bool batch_invariant = true;
};

struct CacheConfig {
  uint32_t block_size = 16;    // tokens per KV block; must match across a fleet
  uint32_t num_blocks = 1024;  // KV blocks per worker
  // Per-fleet secret folded into block hashes. Empty in the file: the
  // loader takes $TANDEM_CACHE_SALT (`tandem launch` sets a random one for
  // its children; kCacheSaltEnv).
  std::string salt;
  // Lower KV tiers (docs/engine.md, "KV tiers").
  uint32_t host_tier_blocks = 0;  // host-memory tier, in blocks; 0: off
  std::string disk_tier_path;     // cache.disk_tier.path; empty: no disk tier
  double disk_tier_max_gib = 0;   // cache.disk_tier.max_gib
  // Make the KV pool resident at start-up (docs/serving-workers.md, "KV pool
  // residency"); false: pages fault in as blocks are first written.
  bool prefault = true;
};

struct SchedulerConfig {
  uint32_t max_num_seqs = 64;         // running sequences per worker
  uint32_t max_batched_tokens = 512;  // tokens per engine step (chunked prefill budget)
  uint32_t max_waiting = 256;         // bounded waiting queue; past it: RESOURCE_EXHAUSTED
  uint32_t threads = 1;               // compute threads per worker
  // A decoder's growth reserve (docs/engine.md "Growth reserve"): SGLang's
  // --schedule-conservativeness; 0 turns it off.
  double schedule_conservativeness = 1.0;
};

// proxy.limits: what one client may send (docs/configuration.md, "proxy.limits";
// docs/security.md, "Hostile input"). Every refusal names the key.
struct ProxyLimitsConfig {
  uint64_t max_request_bytes = 4u << 20;     // one encoded gRPC Generate request
  uint32_t max_prompt_tokens = 0;            // 0: the model's context (max_model_len - 1)
  uint32_t max_stop_strings = 16;
  uint32_t max_stop_string_bytes = 256;
  uint32_t max_stop_token_ids = 64;
  uint64_t max_http_header_bytes = 16u << 10;  // past it: 431
  uint64_t max_http_body_bytes = 4u << 20;     // past it: 413
  uint32_t max_connections = 1024;             // open HTTP connections; past it: 429
                                               // (native gRPC: its own; past it: closed)
  double handshake_timeout_seconds = 20.0;     // native gRPC: TLS handshake + HTTP/2 preface
  uint32_t max_pipelined_requests = 8;         // HTTP requests read ahead on one connection
};

struct ProxyConfig {
  std::string grpc = "127.0.0.1:50051";
  std::string http = "127.0.0.1:8000";
  std::string metrics = "127.0.0.1:9090";
  std::string internal = "127.0.0.1:0";  // Registry listener for workers (internal plane)
  uint32_t max_inflight = 1024;        // admitted requests; past it: RESOURCE_EXHAUSTED
  uint32_t default_max_tokens = 128;   // when a request leaves max_tokens unset
  uint32_t max_tokens_limit = 1024;    // largest max_tokens a request may ask for
  std::string api_key;                 // empty: no authentication
  std::string chat_template = "auto";  // auto (tokenizer_config.json) | chatml | llama3 | mistral
  double http_idle_timeout_seconds = 60.0;  // an HTTP connection idle this long is closed
  uint32_t max_migrations = 3;         // decoder lost mid-stream: re-routes per request
  double drain_seconds = 30.0;         // SIGTERM: grace for in-flight requests
  double liveness_timeout_seconds = 2.0;  // a worker silent this long leaves routing
  ProxyLimitsConfig limits;            // proxy.limits
  // SLO admission (issue 22, docs/scheduling.md "Deadlines and SLOs"):
  // queue: every request waits for its turn; slo: a request whose best
  // predicted TTFT exceeds its TTFT SLO is refused at once (429 /
  // RESOURCE_EXHAUSTED with retry-after).
  std::string admission = "queue";     // queue | slo
  // proxy.slo: the fleet's default objectives for requests that set none,
  // in ms (0: none).
  uint32_t slo_ttft_ms = 0;
  uint32_t slo_tpot_ms = 0;
  // proxy.slo.attainment (docs/scheduling.md, "Calibrated admission"): under
  // `slo`, the share of admitted requests meant to meet their TTFT SLO; the
  // recent prediction error at that quantile is added to the prediction.
  // 0: the prediction alone.
  double slo_attainment = 0.9;
  // Issue 21, proxy replicas (docs/serving-workers.md, "Proxy replicas").
  uint32_t replicas = 1;  // `tandem launch` starts this many proxies; ports: port + index
  bool restart = true;    // the launcher restarts a proxy that dies (signal, non-zero exit)
  // Issue 23 (docs/decode-stream.md): one multiplexed DecodeStream per
  // decoder that advertises it, instead of one Decode RPC per request.
  bool decode_stream = true;
  // Issue 23 (docs/decode-stream.md "Transport"): what carries that stream
  // to a decoder that serves both: tcp (its framed TCP listener,
  // decode.mux_listen) | grpc (Decoder.DecodeStream).
  std::string decode_transport = "tcp";
  // Issue 23 (docs/serving-workers.md "Watch transport"): what carries the Watch
  // stream from a worker that serves both: tcp (its framed TCP listener,
  // <role>.watch_listen) | grpc (Worker.Watch).
  std::string watch_transport = "tcp";
  // Issue 23 (docs/serving-workers.md "Prefill transport"): what carries
  // Prefill to a prefiller that serves both: tcp (its framed TCP listener,
  // prefill.frame_listen) | grpc (Prefiller.Prefill).
  std::string prefill_transport = "tcp";
  // Issue 23 (docs/serving-workers.md "Register transport"): what the
  // workers' registrations use on proxy.internal, read by the proxy and the
  // workers alike: tcp (framed RegisterRequest/RegisterResponse; the proxy
  // runs no gRPC server) | grpc (Registry.Register).
  std::string register_transport = "tcp";
  // Issue 23 (docs/grpc-frontend.md): what serves the public gRPC port.
  // grpc: gRPC C++; native: the proxy's own HTTP/2 server (nghttp2),
  // plaintext or TLS.
  std::string grpc_server = "auto";  // auto | grpc | native (auto: native)
};

struct RouterConfig {
  std::string policy = "kv_aware";  // kv_aware | least_loaded | round_robin | random
  double prefill_weight = 1.0;
  double temperature = 0.0;                   // 0: pick the minimum cost
  uint32_t local_prefill_threshold_tokens = 0;  // conditional disaggregation; 0 = off
  uint64_t seed = 0x7461'6e64'656d'0001;  // temperature sampling and the random policy
  double hot_prefix_threshold = 1.0;       // guard when the cached worker's load > (1+t) x mean
  double hot_prefix_min_load_blocks = 64;  // ... and above this many blocks
  double transfer_cost_per_ms = 1.0;       // cost units per ms of estimated KV transfer
  double load_report_lag_ms = 5.0;         // a routed request counts until a report this much later
  double max_prediction_age_s = 10.0;      // predictions expire after this
  // router.topology: link bandwidths in GB/s (1e9 bytes/s) between a
  // prefiller and a decoder on the same node, the same zone, other zones.
  double same_node_bandwidth_gbps = 13.0;
  double cross_node_bandwidth_gbps = 1.25;
  double cross_zone_bandwidth_gbps = 0.5;
};

struct TransportConfig {
  std::string backend = "ucx";  // ucx | loopback (loopback: single process only)
  double lease_seconds = 30.0;  // a reservation whose KV never arrives expires after this
  double peer_timeout_seconds = 3.0;  // peer loss surfaces as an error within this
  // AES-256-GCM over every pushed KV block, per-reservation keys
  // (docs/security.md, "KV plane"); costs a staging copy of the pool on
  // prefillers and the seal/open time (bench/results/kv_encrypt.md).
  bool encrypt = false;
  // streaming: the prefiller pushes KV while it computes it (per chunk and
  // layer group); after_prefill: once the whole prompt is done.
  std::string push = "streaming";
  // End-to-end KV checksums (docs/failure-handling.md): the prefiller sends
  // XXH3-64 of every pushed block with the notice, the decoder verifies them
  // before decoding and fails the request closed on a mismatch.
  bool checksum = true;
  // model.backend cuda only (docs/cuda.md): how device KV travels. auto:
  // direct when this machine's UCX supports CUDA memory, else staged;
  // direct: UCX registers the device pool (refused at start-up where UCX
  // cannot); staged: through pinned host memory.
  std::string device_path = "auto";
};

// security (docs/security.md). The TLS keys take a word or a mapping of
// PEM files; the word is kept in `internal_tls` / `public_tls` and the
// mapping form reads as "files".
struct SecurityConfig {
  // Internal plane (proxy <-> workers, prefiller -> decoder): mutual TLS.
  std::string internal_tls = "auto";  // auto (tandem launch issues certificates) | off | files
  std::string internal_ca_file;       // internal_tls files: the fleet CA peers must chain to
  std::string internal_cert_file;     // ... this process's certificate
  std::string internal_key_file;      // ... and its private key
  // Public plane (clients -> proxy gRPC and HTTP): server TLS.
  std::string public_tls = "off";     // off | auto (tandem launch issues one) | files
  std::string public_cert_file;       // public_tls files: the proxy's certificate
  std::string public_key_file;        // ... its private key
  std::string public_client_ca_file;  // ... optional: clients must present a certificate of it
  std::string dir;  // where tandem launch keeps CA and certificates; "" = next to the state file
  // Tenants: YAML list of {key, tenant, group?, rate limits?}; "" = no tenants
  // file (proxy.api_key, when set, is then the only key). Relative to the file.
  std::string api_keys_file;
};

// The simulated GPU of model.backend `sim` (docs/sim.md): a roofline timing
// model of `profile` running the model shape in `model_shape`; KV moved
// between workers is the shape's real size divided by `kv_scale`, paced as
// if it crossed a link of `link_gbps`.
struct SimConfig {
  bool present = false;          // the file has a `sim` section
  std::string profile = "H100";  // H100 | H200 | A100 | L40S
  std::string model_shape;       // config.json (or its folder) of the simulated model
  uint32_t tensor_parallel = 1;  // GPUs per stage of every sim worker (a role's key wins)
  // Where a tp x pp worker's simulated GPUs sit and which links join them
  // (docs/sim.md "Tensor and pipeline parallelism"): nvlink|pcie|rdma|ethernet.
  uint32_t gpus_per_node = 8;
  std::string intra_node_link = "nvlink";
  std::string inter_node_link = "rdma";
  double compute_efficiency = 0.5;
  double memory_efficiency = 0.8;
  double gpu_memory_utilization = 0.9;
  double step_overhead_us = 0;
  uint32_t kv_scale = 256;       // real KV bytes per byte stored and moved
  double link_gbps = 100;        // 0: KV transfers are not paced
  double link_latency_us = 10;
  // Onboarding from the lower KV tiers (cache.host_tier_blocks, cache.disk_tier).
  double pcie_gbps = 400;        // host memory -> device
  double nvme_gbps = 56;         // disk -> device
  // Each output token is the model's eos with this probability (a function
  // of the running hash: deterministic), so requests end before max_tokens
  // as real ones do (geometric lengths, mean 1 / p); 0: every sequence runs
  // to max_tokens (a request with ignore_eos runs on past an eos).
  double eos_probability = 0;
};

struct LoggingConfig {
  std::string level = "info";  // trace | debug | info | warn | error
  std::string format = "text";  // text | json (one JSON object per line)
};

// observability (docs/observability.md): OTLP/gRPC span export.
struct ObservabilityConfig {
  std::string otlp_endpoint;       // host:port of an OTLP/gRPC collector; "" = tracing off
  double trace_sample_ratio = 0;   // 0..1: share of requests traced without a client traceparent
  // observability.otlp_tls: the collector is dialled over TLS, its
  // certificate verified against otlp_ca_file; otlp_cert_file/key_file (both
  // or neither) are a client certificate for collectors that require one.
  // All empty: plaintext gRPC.
  bool otlp_tls = false;  // the otlp_tls section is present
  std::string otlp_ca_file, otlp_cert_file, otlp_key_file;
};

// One group of identical workers. A port of 0 picks a free port; a port P
// with N replicas gives ports P .. P+N-1.
struct RoleConfig {
  uint32_t replicas = 0;
  std::string grpc = "127.0.0.1:0";
  std::string metrics = "127.0.0.1:0";
  uint32_t num_blocks = 0;  // 0: cache.num_blocks
  std::string node;  // router label of these workers (same node: fast KV link); "" = unset
  std::string zone;  // router label "zone"
  // Model parallelism (issue 18, docs/parallelism.md): each worker of this
  // role is a group of tensor_parallel x pipeline_parallel rank processes
  // (backend sim: one process that models them). Checked against the model
  // at start-up (parallel::CheckLayout; the error names the key).
  uint32_t tensor_parallel = 1;
  uint32_t pipeline_parallel = 1;
  // Issue 23 (docs/decode-stream.md "Transport"), decode and both roles:
  // where the worker serves the decode stream over framed TCP. auto: the
  // host of its gRPC address, any free port; off: not served (proxies use
  // the gRPC DecodeStream); or "host:port".
  std::string mux_listen = "auto";
  // Issue 23 (docs/serving-workers.md "Watch transport"), every role: where the
  // worker serves its Watch stream over framed TCP. auto: the host of its
  // gRPC address, any free port; off: not served (proxies use the gRPC
  // Worker.Watch); or "host:port".
  std::string watch_listen = "auto";
  // Issue 23 (docs/serving-workers.md "Prefill transport"), prefill and
  // both roles: where the worker serves Prefill over framed TCP. auto: the
  // host of its gRPC address, any free port; off: not served (proxies use
  // the gRPC Prefiller.Prefill); or "host:port".
  std::string frame_listen = "auto";
  // Issue 23 (docs/serving-workers.md "Reserve transport"), decode and both
  // roles: where the worker serves Decoder.Reserve over framed TCP. auto:
  // the host of its gRPC address, any free port; off: not served
  // (prefillers call the gRPC Decoder.Reserve); or "host:port".
  std::string reserve_listen = "auto";
  // Issue 23, prefill and both roles: how the worker's prefiller calls
  // decoders' Reserve: tcp (over a decoder's reserve_listen; gRPC with a
  // decoder that advertises none) | grpc (Decoder.Reserve always).
  std::string reserve_transport = "tcp";
  // Issue 23, every role: how often a busy worker samples its load for its
  // Watch streams (docs/serving-workers.md "Load reports"): each sample that
  // changed what the router reads goes out with the KV events queued since.
  // What the router must see at once (a prompt's stored blocks, a request's
  // end, a decode step's evictions) goes at once regardless.
  uint32_t load_interval_ms = 150;
};

// autoscale: the proxy's planner (src/proxy/planner.h) and `tandem launch`
// following it (src/cli/autoscaler.h); docs/configuration.md, "autoscale",
// and docs/scheduling.md, "Autoscaling".
struct AutoscaleRoleConfig {
  uint32_t min = 1;  // workers of this role the planner never goes under
  uint32_t max = 4;  // ... nor over
};
struct AutoscaleConfig {
  bool enabled = false;
  AutoscaleRoleConfig prefill;
  AutoscaleRoleConfig decode;
  double interval_s = 2.0;             // planner evaluation and launcher poll period
  double window_s = 20.0;              // TTFT/ITL percentiles over this much recent time
  double scale_up_cooldown_s = 10.0;   // at least this long between two raises of a role
  double scale_down_cooldown_s = 30.0;  // ... after any change before a role is lowered
  double ttft_target_ms = 1000.0;      // p90 TTFT the prefillers are sized for
  double itl_target_ms = 50.0;         // p90 ITL the decoders are sized for
  double queued_prefill_tokens_target = 8192;  // queued prefill tokens per prefiller
  double awaiting_first_token_target = 1.0;  // requests awaiting their first token per prefiller
  double kv_usage_target = 0.7;        // decoders' mean KV usage
  double scale_down_below = 0.6;       // lower only if the load on one fewer stays under this
};

struct FleetConfig {
  ModelConfig model;
  CacheConfig cache;
  SchedulerConfig scheduler;
  ProxyConfig proxy;
  RouterConfig router;
  TransportConfig transport;
  LoggingConfig logging;
  ObservabilityConfig observability;
  SecurityConfig security;
  SimConfig sim;
  RoleConfig prefill;
  RoleConfig decode;
  RoleConfig both;
  AutoscaleConfig autoscale;

  std::string source_path;  // the file this was read from ("" for strings)
};

// A router label value (`node`, `zone`): empty (unset) or 1..63 characters
// of A-Z a-z 0-9 . _ - (a Kubernetes label value without the
// start/end rule). InvalidArgument naming `field` and the limit otherwise.
inline constexpr size_t kMaxLabelChars = 63;
Status CheckRouterLabel(std::string_view field, std::string_view value);

// Reads and validates a fleet file. Relative paths inside it resolve against
// the file's folder. On error the Status message holds one line per problem,
// each "FILE:LINE: message".
// An empty cache.salt is taken from $TANDEM_CACHE_SALT when that is set.
Result<FleetConfig> LoadFleetConfig(const std::string& path);
inline constexpr const char* kCacheSaltEnv = "TANDEM_CACHE_SALT";

// Same, from text; `name` stands for the file in messages, `base_dir`
// resolves relative paths.
Result<FleetConfig> ParseFleetConfig(const std::string& text, const std::string& name,
                                     const std::string& base_dir);

}  // namespace tandem
