#include "common/yaml_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>

#include "common/config.h"
#include "common/net.h"

namespace tandem {

void YamlErrors::Add(int line, std::string message) {
  if (line > 0) {
    errors_.push_back(fmt::format("{}:{}: {}", file_, line, message));
  } else {
    errors_.push_back(fmt::format("{}: {}", file_, message));
  }
}

std::string YamlErrors::Joined() const {
  std::string out;
  for (const auto& e : errors_) {
    if (!out.empty()) out += '\n';
    out += e;
  }
  return out;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

YamlMap::YamlMap(YamlErrors* errors, YAML::Node node, std::string prefix, int parent_line)
    : errors_(errors), node_(std::move(node)), prefix_(std::move(prefix)), line_(parent_line) {
  if (!node_.IsDefined() || node_.IsNull()) {
    node_ = YAML::Node();
    return;
  }
  line_ = LineOf(node_);
  if (!node_.IsMap()) {
    errors_->Add(line_, fmt::format("'{}' must be a mapping of keys to values",
                                    prefix_.empty() ? "(top level)" : prefix_));
    node_ = YAML::Node();
    return;
  }
  // yaml-cpp keeps duplicate keys; a duplicate is almost always a mistake.
  std::map<std::string, int> seen;
  for (const auto& kv : node_) {
    const std::string key = kv.first.as<std::string>("");
    const int line = LineOf(kv.first);
    auto [it, inserted] = seen.emplace(key, line);
    if (!inserted) {
      errors_->Add(line, fmt::format("duplicate key '{}' (first at line {})", Dotted(key),
                                     it->second));
    }
  }
}

int YamlMap::LineOf(const YAML::Node& n) const {
  const auto mark = n.Mark();
  return mark.line >= 0 ? mark.line + 1 : line_;
}

std::string YamlMap::Dotted(std::string_view key) const {
  return prefix_.empty() ? std::string(key) : fmt::format("{}.{}", prefix_, key);
}

bool YamlMap::Has(std::string_view key) const {
  if (!node_.IsMap()) return false;
  for (const auto& kv : node_) {
    if (kv.first.as<std::string>("") == key) return true;
  }
  return false;
}

bool YamlMap::HasMapping(std::string_view key) const {
  if (!node_.IsMap()) return false;
  for (const auto& kv : node_) {
    if (kv.first.as<std::string>("") == key) return kv.second.IsMap();
  }
  return false;
}

YAML::Node YamlMap::Get(std::string_view key) {
  known_.emplace(key);
  if (!node_.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
  for (const auto& kv : node_) {
    if (kv.first.as<std::string>("") == key) return kv.second;
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

void YamlMap::Require(std::string_view key) {
  known_.emplace(key);
  // An absent or malformed section is reported once, by its parent.
  if (!node_.IsMap()) return;
  if (!Has(key)) errors_->Add(line_, fmt::format("missing required key '{}'", Dotted(key)));
}

void YamlMap::Read(std::string_view key, std::string& out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  if (n.IsNull()) {
    out.clear();
    return;
  }
  if (!n.IsScalar()) {
    errors_->Add(LineOf(n), fmt::format("key '{}' must be a string", Dotted(key)));
    return;
  }
  out = n.Scalar();
}

void YamlMap::Read(std::string_view key, bool& out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  if (s == "true") {
    out = true;
  } else if (s == "false") {
    out = false;
  } else {
    errors_->Add(LineOf(n),
                 fmt::format("key '{}' must be true or false, got '{}'", Dotted(key), s));
  }
}

void YamlMap::Read(std::string_view key, uint64_t& out, uint64_t min, uint64_t max) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || v < min || v > max) {
    errors_->Add(LineOf(n), fmt::format("key '{}' must be an integer in [{}, {}], got '{}'",
                                        Dotted(key), min, max, s));
    return;
  }
  out = v;
}

void YamlMap::Read(std::string_view key, uint32_t& out, uint32_t min, uint32_t max) {
  uint64_t v = out;
  Read(key, v, min, max);
  out = static_cast<uint32_t>(v);
}

void YamlMap::Read(std::string_view key, double& out, double min, double max) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || !(v >= min && v <= max)) {
    errors_->Add(LineOf(n), fmt::format("key '{}' must be a number in [{}, {}], got '{}'",
                                        Dotted(key), min, max, s));
    return;
  }
  out = v;
}

void YamlMap::ReadEnum(std::string_view key, std::string& out,
                       std::initializer_list<std::string_view> allowed) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  if (std::find(allowed.begin(), allowed.end(), s) == allowed.end()) {
    std::string list;
    for (auto a : allowed) list += fmt::format("{}'{}'", list.empty() ? "" : ", ", a);
    errors_->Add(LineOf(n),
                 fmt::format("key '{}' must be one of {}, got '{}'", Dotted(key), list, s));
    return;
  }
  out = s;
}

void YamlMap::ReadAddress(std::string_view key, std::string& out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  auto parsed = ParseHostPort(s);
  if (!parsed.ok()) {
    errors_->Add(LineOf(n), fmt::format("key '{}': {}", Dotted(key), parsed.status().message()));
    return;
  }
  out = s;
}

void YamlMap::ReadLabel(std::string_view key, std::string& out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  std::string s;
  if (!n.IsScalar()) {
    errors_->Add(LineOf(n), fmt::format("key '{}': expected a string", Dotted(key)));
    return;
  }
  s = n.Scalar();
  if (Status st = CheckRouterLabel(fmt::format("key '{}'", Dotted(key)), s); !st.ok()) {
    errors_->Add(LineOf(n), std::string(st.message()));
    return;
  }
  out = s;
}

YamlMap YamlMap::Sub(std::string_view key) {
  YAML::Node n = Get(key);
  return YamlMap(errors_, n, Dotted(key), n.IsDefined() ? LineOf(n) : line_);
}

void YamlMap::Finish() {
  if (!node_.IsMap()) return;
  for (const auto& kv : node_) {
    const std::string key = kv.first.as<std::string>("");
    if (known_.count(key)) continue;
    std::string best;
    size_t best_d = SIZE_MAX;
    for (const auto& k : known_) {
      const size_t d = EditDistance(key, k);
      if (d < best_d) {
        best_d = d;
        best = k;
      }
    }
    const size_t limit = std::max<size_t>(2, key.size() / 3);
    std::string hint;
    if (!best.empty() && best_d <= limit) hint = fmt::format(" (did you mean '{}'?)", best);
    const std::string where = prefix_.empty() ? "" : fmt::format(" in '{}'", prefix_);
    errors_->Add(LineOf(kv.first), fmt::format("unknown key '{}'{}{}", key, where, hint));
  }
}

}  // namespace tandem
