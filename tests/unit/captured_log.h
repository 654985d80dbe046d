// What the default spdlog logger writes while a CapturedLog lives, counted
// by level, for tests that assert how loudly something is logged.
#pragma once

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <memory>
#include <sstream>
#include <string>

namespace tandem::testing {

class CapturedLog {
 public:
  CapturedLog() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    sink_->set_pattern("%l %v");
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~CapturedLog() {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;
  // Lines so far by level ("info", "warning"), then forgets them. With
  // `containing`, only the lines that contain it.
  std::map<std::string, int> Take(const std::string& containing = "") {
    sink_->flush();
    std::istringstream in(out_.str());
    out_.str("");
    std::map<std::string, int> n;
    for (std::string line; std::getline(in, line);) {
      if (line.find(containing) != std::string::npos) ++n[line.substr(0, line.find(' '))];
    }
    return n;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

}  // namespace tandem::testing
