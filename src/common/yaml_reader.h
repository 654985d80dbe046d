// Reads YAML mappings into typed structs with strict validation: every
// error names the file, the line and the dotted key; unknown keys are
// errors (with a "did you mean" suggestion), never silently ignored.
//
// Usage: a struct's loader calls Read*/Sub for every key it knows, then
// Finish() reports the keys nobody asked for. Errors accumulate in a shared
// list so one pass reports every problem in a file.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class YamlErrors {
 public:
  explicit YamlErrors(std::string file) : file_(std::move(file)) {}
  void Add(int line, std::string message);
  bool empty() const { return errors_.empty(); }
  const std::vector<std::string>& errors() const { return errors_; }
  const std::string& file() const { return file_; }
  // All errors, one per line.
  std::string Joined() const;

 private:
  std::string file_;
  std::vector<std::string> errors_;
};

class YamlMap {
 public:
  // `node` may be null/undefined (an absent section): every Read keeps its
  // default. `prefix` is the dotted path of this mapping ("" at top level).
  YamlMap(YamlErrors* errors, YAML::Node node, std::string prefix, int parent_line = 0);

  bool Has(std::string_view key) const;
  // `key` is present and its value is a mapping (keys that take a word or a mapping).
  bool HasMapping(std::string_view key) const;
  void Read(std::string_view key, std::string& out);
  void Read(std::string_view key, bool& out);
  void Read(std::string_view key, uint32_t& out, uint32_t min, uint32_t max);
  void Read(std::string_view key, uint64_t& out, uint64_t min, uint64_t max);
  void Read(std::string_view key, double& out, double min, double max);
  void ReadEnum(std::string_view key, std::string& out,
                std::initializer_list<std::string_view> allowed);
  // "host:port", port 0..65535 (0 = pick a free port).
  void ReadAddress(std::string_view key, std::string& out);
  // A router label value (CheckRouterLabel in common/config.h).
  void ReadLabel(std::string_view key, std::string& out);
  // Marks `key` as required: an error if it is absent.
  void Require(std::string_view key);
  YamlMap Sub(std::string_view key);
  // Reports keys present in the file that no Read/Sub asked for.
  void Finish();

  int line() const { return line_; }
  std::string Dotted(std::string_view key) const;

 private:
  YAML::Node Get(std::string_view key);
  int LineOf(const YAML::Node& n) const;

  YamlErrors* errors_;
  YAML::Node node_;
  std::string prefix_;
  int line_ = 0;
  std::set<std::string, std::less<>> known_;
};

// Edit distance, for "did you mean" suggestions.
size_t EditDistance(std::string_view a, std::string_view b);

}  // namespace tandem
