// A small reader of the Prometheus text exposition format, for tests:
// samples with their labels, and the declared type of every family.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

namespace tandem::testing {

struct PromSample {
  std::string name;  // as written, e.g. tandem_ttft_seconds_bucket
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PromText {
  std::vector<PromSample> samples;
  std::map<std::string, std::string> types;  // family -> counter|gauge|histogram|...

  static PromText Parse(const std::string& text);

  // Sum of the samples named `name` whose labels include every pair of `match`.
  double Sum(const std::string& name, const std::map<std::string, std::string>& match = {}) const;
  // Number of samples named `name` whose labels include `match`.
  size_t Count(const std::string& name, const std::map<std::string, std::string>& match = {}) const;
  // Every name a query may use: families, plus _bucket/_sum/_count of histograms.
  std::set<std::string> QueryableNames() const;
};

}  // namespace tandem::testing
