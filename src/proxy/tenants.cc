#include "proxy/tenants.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "common/config.h"
#include "common/yaml_reader.h"

namespace tandem::proxy {
namespace {

using Digest = std::array<unsigned char, 32>;

bool Sha256(std::string_view data, Digest& out) {
  unsigned int len = 0;
  return EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr) == 1 &&
         len == out.size();
}

bool ParseHexDigest(std::string_view hex, Digest& out) {
  if (hex.size() != 64) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < 32; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

bool IEqualsPrefix(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    const char a = s[i] >= 'A' && s[i] <= 'Z' ? static_cast<char>(s[i] - 'A' + 'a') : s[i];
    if (a != prefix[i]) return false;
  }
  return true;
}

constexpr std::string_view kDefaultTenant = "default";

std::string SaltOf(const Tenant& t) {
  if (!t.group.empty()) return "group:" + t.group;
  if (t.name == kDefaultTenant) return "";
  return "tenant:" + t.name;
}

RateLimit MakeLimit(double rate, double burst) {
  if (rate <= 0) return {};
  return {rate, burst > 0 ? burst : std::max(rate, 1.0)};
}

}  // namespace

std::string Sha256Hex(std::string_view data) {
  Digest d{};
  if (!Sha256(data, d)) return "";
  std::string out;
  for (unsigned char c : d) out += fmt::format("{:02x}", c);
  return out;
}

TokenBucket::TokenBucket(RateLimit limit) : limit_(limit), level_(limit.burst) {}

double TokenBucket::Take(double n, Clock::time_point now) {
  if (limit_.rate <= 0) return 0;
  if (last_ != Clock::time_point{}) {
    const double dt = std::chrono::duration<double>(now - last_).count();
    if (dt > 0) level_ = std::min(limit_.burst, level_ + dt * limit_.rate);
  }
  last_ = now;
  if (n <= level_) {
    level_ -= n;
    return 0;
  }
  if (n > limit_.burst) return std::numeric_limits<double>::infinity();
  return (n - level_) / limit_.rate;
}

size_t Tenants::AddTenant(Tenant t) {
  for (size_t i = 0; i < tenants_.size(); ++i) {
    if (tenants_[i]->name == t.name) return i;
  }
  t.cache_salt = SaltOf(t);
  auto b = std::make_unique<Buckets>();
  b->requests = TokenBucket(t.requests);
  b->tokens = TokenBucket(t.tokens);
  tenants_.push_back(std::make_unique<Tenant>(std::move(t)));
  buckets_.push_back(std::move(b));
  return tenants_.size() - 1;
}

Result<std::unique_ptr<Tenants>> Tenants::Load(const std::string& api_key,
                                               const std::string& keys_file) {
  if (keys_file.empty()) return Parse(api_key, "", "");
  std::ifstream in(keys_file);
  if (!in) {
    return NotFoundError(fmt::format(
        "security.api_keys_file: cannot open '{}' (a YAML list of {{key, tenant}})", keys_file));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(api_key, ss.str(), keys_file);
}

Result<std::unique_ptr<Tenants>> Tenants::Parse(const std::string& api_key,
                                                const std::string& keys_text,
                                                const std::string& name) {
  std::unique_ptr<Tenants> t(new Tenants());
  t->open_.name = std::string(kDefaultTenant);
  if (!api_key.empty()) {
    Key k;
    if (!Sha256(api_key, k.digest)) return InternalError("SHA-256 failed (OpenSSL)");
    Tenant d;
    d.name = std::string(kDefaultTenant);
    k.tenant = t->AddTenant(std::move(d));
    t->keys_.push_back(k);
  }
  if (name.empty()) return t;

  YamlErrors errors(name);
  YAML::Node root;
  try {
    root = YAML::Load(keys_text);
  } catch (const YAML::Exception& e) {
    errors.Add(e.mark.line >= 0 ? e.mark.line + 1 : 0, fmt::format("YAML syntax error: {}", e.msg));
    return InvalidArgumentError(errors.Joined());
  }
  if (!root.IsSequence() || root.size() == 0) {
    return InvalidArgumentError(fmt::format(
        "{}: security.api_keys_file must be a non-empty YAML list of {{key, tenant}} entries",
        name));
  }
  for (size_t i = 0; i < root.size(); ++i) {
    const YAML::Node n = root[i];
    const int line = n.Mark().line >= 0 ? n.Mark().line + 1 : 0;
    YamlMap m(&errors, n, fmt::format("[{}]", i), line);
    m.Require("key");
    m.Require("tenant");
    std::string key, tenant, group;
    double rps = 0, burst_requests = 0, tps = 0, burst_tokens = 0;
    m.Read("key", key);
    m.Read("tenant", tenant);
    m.Read("group", group);
    m.Read("requests_per_second", rps, 0.0, 1e9);
    m.Read("burst_requests", burst_requests, 0.0, 1e9);
    m.Read("tokens_per_second", tps, 0.0, 1e12);
    m.Read("burst_tokens", burst_tokens, 0.0, 1e12);
    // Scheduling (docs/scheduling.md); integers, lower = served earlier.
    double priority = 0, min_priority = 0, weight = 1;
    constexpr double kPriorityLimit = 1e6;
    m.Read("priority", priority, -kPriorityLimit, kPriorityLimit);
    const bool has_min = m.Has("min_priority");
    m.Read("min_priority", min_priority, -kPriorityLimit, kPriorityLimit);
    m.Read("weight", weight, 1e-3, 1e6);
    m.Finish();
    for (auto [field, value] : {std::pair{"priority", priority}, {"min_priority", min_priority}}) {
      if (value != std::floor(value)) {
        errors.Add(line, fmt::format("[{}].{} is {}; it must be an integer", i, field, value));
      }
    }
    if (has_min && priority < min_priority) {
      errors.Add(line, fmt::format("[{}].priority {} is below its min_priority {} (lower values "
                                   "are served earlier)", i, priority, min_priority));
    }
    if (key.empty() || tenant.empty()) continue;  // reported by Require, or empty
    if (Status s = CheckRouterLabel(fmt::format("[{}].tenant", i), tenant); !s.ok()) {
      errors.Add(line, std::string(s.message()));
    }
    if (Status s = CheckRouterLabel(fmt::format("[{}].group", i), group); !s.ok()) {
      errors.Add(line, std::string(s.message()));
    }
    Key k;
    if (key.rfind("sha256:", 0) == 0) {
      if (!ParseHexDigest(std::string_view(key).substr(7), k.digest)) {
        errors.Add(line, fmt::format("[{}].key: 'sha256:' must be followed by 64 hex digits "
                                     "(the SHA-256 of the key), got {} characters",
                                     i, key.size() - 7));
        continue;
      }
    } else if (!Sha256(key, k.digest)) {
      return InternalError("SHA-256 failed (OpenSSL)");
    }
    for (const Key& other : t->keys_) {
      if (CRYPTO_memcmp(other.digest.data(), k.digest.data(), k.digest.size()) == 0) {
        errors.Add(line, fmt::format("[{}].key: the same key appears twice (tenants '{}' and "
                                     "'{}')", i, t->tenants_[other.tenant]->name, tenant));
      }
    }
    Tenant te;
    te.name = tenant;
    te.group = group;
    te.requests = MakeLimit(rps, burst_requests);
    te.tokens = MakeLimit(tps, burst_tokens);
    te.priority = static_cast<int32_t>(priority);
    if (has_min) te.min_priority = static_cast<int32_t>(min_priority);
    te.weight = weight;
    const size_t before = t->tenants_.size();
    k.tenant = t->AddTenant(te);
    const Tenant& have = *t->tenants_[k.tenant];
    if (k.tenant < before && (have.group != te.group || have.requests.rate != te.requests.rate ||
                              have.requests.burst != te.requests.burst ||
                              have.tokens.rate != te.tokens.rate ||
                              have.tokens.burst != te.tokens.burst ||
                              have.priority != te.priority ||
                              have.min_priority != te.min_priority || have.weight != te.weight)) {
      errors.Add(line, fmt::format("[{}]: tenant '{}' appears again with another group or other "
                                   "rate limits; give every key of a tenant the same ones",
                                   i, tenant));
    }
    t->keys_.push_back(k);
  }
  if (!errors.empty()) return InvalidArgumentError(errors.Joined());
  return t;
}

Result<const Tenant*> Tenants::Authenticate(std::string_view authorization) const {
  if (keys_.empty()) return &open_;
  constexpr std::string_view kBearer = "bearer ";
  std::string_view key = authorization;
  const bool bearer = IEqualsPrefix(key, kBearer);
  if (bearer) key.remove_prefix(kBearer.size());
  while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
  Digest d{};
  if (bearer && !key.empty() && Sha256(key, d)) {
    // Every stored digest is compared in full (no early exit on content).
    size_t match = tenants_.size();
    for (const Key& k : keys_) {
      if (CRYPTO_memcmp(k.digest.data(), d.data(), d.size()) == 0) match = k.tenant;
    }
    if (match < tenants_.size()) return tenants_[match].get();
  }
  return UnauthenticatedError(
      authorization.empty() ? "missing API key: send 'Authorization: Bearer KEY'"
                            : "wrong API key: send 'Authorization: Bearer KEY' with a key of "
                              "proxy.api_key or security.api_keys_file");
}

namespace {
RateRefusal Refuse(const Tenant& t, std::string_view what, const RateLimit& lim, double after) {
  RateRefusal r;
  r.retry_after_seconds = std::isfinite(after) ? after : 0;
  r.status = ResourceExhaustedError(
      std::isfinite(after)
          ? fmt::format("tenant '{}' is over its rate limit of {} {} per second ({}_per_second, "
                        "burst_{} {}; security.api_keys_file); retry after {:.3f} s",
                        t.name, lim.rate, what, what, what, lim.burst, after)
          : fmt::format("tenant '{}': this request needs more {} than the burst of {} "
                        "(security.api_keys_file, burst_{}) and can never be admitted",
                        t.name, what, lim.burst, what));
  return r;
}
}  // namespace

RateRefusal Tenants::ChargeRequest(const Tenant& tenant) {
  if (tenant.requests.rate <= 0) return {};
  for (size_t i = 0; i < tenants_.size(); ++i) {
    if (tenants_[i].get() != &tenant) continue;
    std::lock_guard lock(buckets_[i]->mu);
    const double after = buckets_[i]->requests.Take(1, TokenBucket::Clock::now());
    if (after == 0) return {};
    return Refuse(tenant, "requests", tenant.requests, after);
  }
  return {};
}

RateRefusal Tenants::ChargeTokens(const Tenant& tenant, uint32_t tokens) {
  if (tenant.tokens.rate <= 0) return {};
  for (size_t i = 0; i < tenants_.size(); ++i) {
    if (tenants_[i].get() != &tenant) continue;
    std::lock_guard lock(buckets_[i]->mu);
    const double after = buckets_[i]->tokens.Take(tokens, TokenBucket::Clock::now());
    if (after == 0) return {};
    return Refuse(tenant, "tokens", tenant.tokens, after);
  }
  return {};
}

}  // namespace tandem::proxy
