#include "loadgen/workload.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "common/splitmix.h"

namespace tandem::loadgen {
namespace {


std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

std::optional<double> ParseNumber(const std::string& s) {
  double v = 0;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || p != end || !std::isfinite(v)) return std::nullopt;
  return v;
}

class SyntheticSource final : public SessionSource {
 public:
  explicit SyntheticSource(SyntheticOptions o) : o_(std::move(o)), rng_(o_.seed) {}

  std::optional<Session> Next() override {
    Session s;
    s.id = next_id_++;
    // Every token stream gets its own seed derived from the run's seed, the
    // session and the turn, so adding a turn does not change earlier ones.
    for (uint32_t t = 0; t < o_.turns; ++t) {
      Turn turn;
      const uint32_t in = o_.input.Sample(rng_);
      turn.max_tokens = std::max<uint32_t>(1, o_.output.Sample(rng_));
      if (t == 0 && o_.prefix_groups > 0 && o_.prefix_len > 0) {
        const uint64_t group = s.id % o_.prefix_groups;
        turn.new_tokens = SeededTokens(Mix(o_.seed, 0x70726566ULL, group), o_.prefix_len, o_.vocab);
      }
      auto own = SeededTokens(Mix(o_.seed, s.id + 1, t), in, o_.vocab);
      turn.new_tokens.insert(turn.new_tokens.end(), own.begin(), own.end());
      s.turns.push_back(std::move(turn));
    }
    return s;
  }

  std::string Describe() const override {
    std::string d = fmt::format("synthetic: input {}, output {}", o_.input.ToString(),
                                o_.output.ToString());
    if (o_.prefix_groups > 0) {
      d += fmt::format(", {} shared-prefix groups of {} tokens", o_.prefix_groups, o_.prefix_len);
    }
    if (o_.turns > 1) d += fmt::format(", {} turns per conversation", o_.turns);
    return d + fmt::format(", seed {}", o_.seed);
  }

 private:
  static uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t s = a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL);
    const uint64_t x = SplitMix64Next(s);
    s = x ^ (c * 0xd6e8feb86659fd93ULL);
    return SplitMix64Next(s);
  }

  SyntheticOptions o_;
  std::mt19937_64 rng_;
  uint64_t next_id_ = 0;
};

class ListSource final : public SessionSource {
 public:
  ListSource(std::vector<Session> s, std::string d) : sessions_(std::move(s)), desc_(std::move(d)) {}
  std::optional<Session> Next() override {
    if (next_ >= sessions_.size()) return std::nullopt;
    return std::move(sessions_[next_++]);
  }
  std::string Describe() const override { return desc_; }

 private:
  std::vector<Session> sessions_;
  std::string desc_;
  size_t next_ = 0;
};

}  // namespace

Result<LengthDist> LengthDist::Parse(const std::string& spec, const std::string& flag) {
  const auto bad = [&](const std::string& why) {
    return InvalidArgumentError(fmt::format(
        "{} '{}': {} (expected N, fixed:N, uniform:LO:HI or normal:MEAN:STDDEV)", flag, spec,
        why));
  };
  auto parts = Split(spec, ':');
  if (parts.size() == 1) parts.insert(parts.begin(), "fixed");
  LengthDist d;
  std::vector<double> v;
  for (size_t i = 1; i < parts.size(); ++i) {
    auto x = ParseNumber(parts[i]);
    if (!x) return bad(fmt::format("'{}' is not a number", parts[i]));
    v.push_back(*x);
  }
  const auto whole = [](double x) { return x == std::floor(x); };
  if (parts[0] == "fixed") {
    if (v.size() != 1) return bad("fixed takes one value");
    if (v[0] < 1 || !whole(v[0])) return bad("the length must be a whole number >= 1");
    d.kind = Kind::kFixed;
    d.a = v[0];
  } else if (parts[0] == "uniform") {
    if (v.size() != 2) return bad("uniform takes two values");
    if (v[0] < 1 || !whole(v[0]) || !whole(v[1]) || v[1] < v[0]) {
      return bad("needs whole numbers 1 <= LO <= HI");
    }
    d.kind = Kind::kUniform;
    d.a = v[0];
    d.b = v[1];
  } else if (parts[0] == "normal") {
    if (v.size() != 2) return bad("normal takes two values");
    if (v[0] < 1 || v[1] < 0) return bad("needs MEAN >= 1 and STDDEV >= 0");
    d.kind = Kind::kNormal;
    d.a = v[0];
    d.b = v[1];
  } else {
    return bad(fmt::format("unknown distribution '{}'", parts[0]));
  }
  if (d.Max() > 1'000'000) return bad("lengths are limited to 1000000 tokens");
  return d;
}

uint32_t LengthDist::Sample(std::mt19937_64& rng) const {
  switch (kind) {
    case Kind::kFixed:
      return static_cast<uint32_t>(a);
    case Kind::kUniform:
      return static_cast<uint32_t>(
          std::uniform_int_distribution<uint64_t>(uint64_t(a), uint64_t(b))(rng));
    case Kind::kNormal: {
      const double x = std::round(std::normal_distribution<double>(a, b)(rng));
      return static_cast<uint32_t>(std::clamp(x, 1.0, double(Max())));
    }
  }
  return 1;
}

double LengthDist::Mean() const { return kind == Kind::kUniform ? (a + b) / 2 : a; }

uint32_t LengthDist::Max() const {
  switch (kind) {
    case Kind::kFixed:
      return uint32_t(a);
    case Kind::kUniform:
      return uint32_t(b);
    case Kind::kNormal:
      return uint32_t(std::round(2 * a));
  }
  return 1;
}

std::string LengthDist::ToString() const {
  switch (kind) {
    case Kind::kFixed:
      return fmt::format("fixed:{}", a);
    case Kind::kUniform:
      return fmt::format("uniform:{}:{}", a, b);
    case Kind::kNormal:
      return fmt::format("normal:{}:{}", a, b);
  }
  return "";
}

std::vector<uint32_t> SeededTokens(uint64_t seed, uint32_t n, uint32_t vocab) {
  std::vector<uint32_t> out(n);
  uint64_t state = seed;
  const uint64_t span = vocab > kFirstTokenId ? vocab - kFirstTokenId : 1;
  for (uint32_t i = 0; i < n; ++i) {
    // Multiply-shift maps the 64-bit draw onto [0, span) without modulo bias
    // worth mentioning for vocabularies far below 2^32.
    const uint64_t r = SplitMix64Next(state);
    out[i] = kFirstTokenId + static_cast<uint32_t>(((r >> 32) * span) >> 32);
  }
  return out;
}

Status ValidateSynthetic(const SyntheticOptions& o) {
  if (o.vocab <= kFirstTokenId) {
    return InvalidArgumentError(fmt::format("the model's vocabulary ({}) is too small", o.vocab));
  }
  if (o.turns < 1 || o.turns > 1000) {
    return InvalidArgumentError(fmt::format("--turns must be in [1, 1000], got {}", o.turns));
  }
  if (o.prefix_groups > 0 && o.prefix_len == 0) {
    return InvalidArgumentError("--shared-prefix-groups needs --shared-prefix-len >= 1");
  }
  // The last turn of the longest conversation carries everything before it.
  const uint64_t longest = uint64_t(o.prefix_groups > 0 ? o.prefix_len : 0) +
                           uint64_t(o.turns) * (o.input.Max() + o.output.Max());
  if (o.max_model_len > 0 && longest > o.max_model_len) {
    return InvalidArgumentError(fmt::format(
        "the longest conversation needs {} tokens (shared prefix {} + {} turn(s) x (input max {} "
        "+ output max {})); the model accepts at most {} (prompt + completion)",
        longest, o.prefix_groups > 0 ? o.prefix_len : 0, o.turns, o.input.Max(), o.output.Max(),
        o.max_model_len));
  }
  return Status::Ok();
}

std::unique_ptr<SessionSource> MakeSyntheticSource(const SyntheticOptions& o) {
  return std::make_unique<SyntheticSource>(o);
}

std::unique_ptr<SessionSource> MakeListSource(std::vector<Session> sessions,
                                              std::string description) {
  return std::make_unique<ListSource>(std::move(sessions), std::move(description));
}

}  // namespace tandem::loadgen
