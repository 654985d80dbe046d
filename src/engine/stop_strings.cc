#include "engine/stop_strings.h"

#include <algorithm>

namespace tandem::engine {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) max_len_ = std::max(max_len_, s.size());
}

StopStringMatcher::Chunk StopStringMatcher::Push(std::string_view text) {
  Chunk out;
  if (stopped_) return out;
  held_.append(text);
  if (stops_.empty()) {
    out.text.swap(held_);
    return out;
  }
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    out.text = held_.substr(0, first);
    out.stopped = true;
    stopped_ = true;
    held_.clear();
    return out;
  }
  // Hold the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  const size_t max_hold = std::min(held_.size(), max_len_ - 1);
  for (size_t len = max_hold; len > 0 && hold == 0; --len) {
    std::string_view tail(held_.data() + held_.size() - len, len);
    for (const auto& s : stops_) {
      if (s.size() > len && std::string_view(s).substr(0, len) == tail) {
        hold = len;
        break;
      }
    }
  }
  out.text = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringMatcher::Flush() {
  std::string out;
  if (!stopped_) out.swap(held_);
  return out;
}

}  // namespace tandem::engine
