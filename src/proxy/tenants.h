// Who may use the public API, and as whom (docs/security.md, "Tenants and
// limits"). The one owner of API-key checks for both front ends (gRPC
// metadata `authorization: Bearer KEY`, HTTP header `Authorization: Bearer
// KEY`).
//
// Keys come from `security.api_keys_file` (a YAML list of {key, tenant,
// group?, rate limits?}; a key may be stored as `sha256:<64 hex>`) and from
// `proxy.api_key` (the tenant "default"). With neither, the API is open and
// every request is the default tenant. A presented key is hashed with
// SHA-256 and compared, in constant time, with every stored digest.
//
// A tenant's cache salt (HashContext::tenant_salt) keeps its cached prefixes
// apart from every other tenant's; tenants naming the same `group` share a
// salt, and so their cache. The default tenant's salt is "" (the hashes of
// a fleet without tenants stay what they were).
//
// Thread-safety: Authenticate and the accessors are const and safe from any
// thread; Charge locks the tenant's buckets.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::proxy {

// A token bucket: `rate` per second, holding at most `burst`. rate 0: no limit.
struct RateLimit {
  double rate = 0;
  double burst = 0;
};

class TokenBucket {
 public:
  using Clock = std::chrono::steady_clock;
  explicit TokenBucket(RateLimit limit = {});
  // Takes `n` when the bucket holds it and returns 0; otherwise takes
  // nothing and returns the seconds until it would hold `n` (infinity when
  // n exceeds the burst).
  double Take(double n, Clock::time_point now);
  const RateLimit& limit() const { return limit_; }

 private:
  RateLimit limit_;
  double level_;
  Clock::time_point last_{};
};

struct Tenant {
  std::string name;
  std::string group;       // "" = none: the tenant shares its cache with no one
  std::string cache_salt;  // HashContext::tenant_salt of its requests
  RateLimit requests;      // requests per second (requests_per_second, burst_requests)
  RateLimit tokens;        // prompt + max_tokens per second (tokens_per_second, burst_tokens)
  // Scheduling (docs/scheduling.md): the priority of requests that name
  // none, the lowest value a request may ask for (lower = served earlier;
  // unset: any), and the fair-share weight within a priority band.
  int32_t priority = 0;
  std::optional<int32_t> min_priority;
  double weight = 1.0;
};

// A refusal by a rate limit: RESOURCE_EXHAUSTED naming the limit, and when
// to retry.
struct RateRefusal {
  Status status;
  double retry_after_seconds = 0;
};

class Tenants {
 public:
  // `api_key`: proxy.api_key ("" = none); `keys_file`: security.api_keys_file
  // ("" = none). Errors name the file, the entry and the field.
  static Result<std::unique_ptr<Tenants>> Load(const std::string& api_key,
                                               const std::string& keys_file);
  // Same, from the keys file's text (`name` stands for the file in messages).
  static Result<std::unique_ptr<Tenants>> Parse(const std::string& api_key,
                                                const std::string& keys_text,
                                                const std::string& name);

  // False when no key is configured: every request is the default tenant.
  bool required() const { return !keys_.empty(); }
  size_t num_tenants() const { return tenants_.size(); }

  // `authorization`: the header / metadata value, "Bearer KEY" (the scheme
  // is case-insensitive).
  // UNAUTHENTICATED when a key is required and this one is missing or wrong.
  Result<const Tenant*> Authenticate(std::string_view authorization) const;

  // Charges one request (`requests` = 1) or `tokens` tokens to the tenant's
  // buckets; nullopt-like empty refusal (ok status) when allowed.
  RateRefusal ChargeRequest(const Tenant& tenant);
  RateRefusal ChargeTokens(const Tenant& tenant, uint32_t tokens);

 private:
  struct Key {
    std::array<unsigned char, 32> digest{};
    size_t tenant = 0;
  };
  struct Buckets {
    std::mutex mu;
    TokenBucket requests;  // guarded by mu
    TokenBucket tokens;    // guarded by mu
  };
  Tenants() = default;
  size_t AddTenant(Tenant t);

  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::vector<std::unique_ptr<Buckets>> buckets_;  // [tenant]
  std::vector<Key> keys_;
  Tenant open_;  // the tenant of every request when no key is configured
};

// SHA-256 of `data` as 64 lowercase hex digits (for `sha256:` entries).
std::string Sha256Hex(std::string_view data);

}  // namespace tandem::proxy
