#include "prom_text.h"

#include <cstdlib>
#include <sstream>

namespace tandem::testing {
namespace {

bool Matches(const PromSample& s, const std::map<std::string, std::string>& match) {
  for (const auto& [k, v] : match) {
    auto it = s.labels.find(k);
    if (it == s.labels.end() || it->second != v) return false;
  }
  return true;
}

}  // namespace

PromText PromText::Parse(const std::string& text) {
  PromText out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream t(line.substr(7));
      std::string name, type;
      t >> name >> type;
      out.types[name] = type;
      continue;
    }
    if (line[0] == '#') continue;
    PromSample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos) break;
        std::string key = line.substr(i, eq - i);
        std::string value;
        size_t j = eq + 2;  // past ="
        while (j < line.size() && line[j] != '"') {
          if (line[j] == '\\' && j + 1 < line.size()) ++j;
          value.push_back(line[j++]);
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // past }
    }
    s.value = std::strtod(line.c_str() + i, nullptr);
    out.samples.push_back(std::move(s));
  }
  return out;
}

double PromText::Sum(const std::string& name, const std::map<std::string, std::string>& match) const {
  double sum = 0;
  for (const auto& s : samples) {
    if (s.name == name && Matches(s, match)) sum += s.value;
  }
  return sum;
}

size_t PromText::Count(const std::string& name,
                       const std::map<std::string, std::string>& match) const {
  size_t n = 0;
  for (const auto& s : samples) {
    if (s.name == name && Matches(s, match)) ++n;
  }
  return n;
}

std::set<std::string> PromText::QueryableNames() const {
  std::set<std::string> names;
  for (const auto& [name, type] : types) {
    names.insert(name);
    if (type == "histogram" || type == "summary") {
      names.insert(name + "_sum");
      names.insert(name + "_count");
      if (type == "histogram") names.insert(name + "_bucket");
    }
  }
  for (const auto& s : samples) names.insert(s.name);
  return names;
}

}  // namespace tandem::testing
