// What the default spdlog logger writes while a CapturedLog lives, counted
// by level, for tests that assert how loudly something is logged. Lines
// may come from any thread; they are kept under the sink's own mutex.
#pragma once

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tandem::testing {

class CapturedLog {
 public:
  CapturedLog() : sink_(std::make_shared<LineSink>()) {
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
    std::map<std::string, int> n;
    for (const std::string& line : sink_->TakeLines()) {
      if (line.find(containing) != std::string::npos) ++n[line.substr(0, line.find(' '))];
    }
    return n;
  }

 private:
  class LineSink final : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::vector<std::string> TakeLines() {
      std::lock_guard lock(mutex_);
      return std::exchange(lines_, {});
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& msg) override {
      spdlog::memory_buf_t buf;
      formatter_->format(msg, buf);
      std::string line(buf.data(), buf.size());
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
      lines_.push_back(std::move(line));
    }
    void flush_() override {}

   private:
    std::vector<std::string> lines_;  // guarded by mutex_ (base_sink's)
  };

  std::shared_ptr<LineSink> sink_;
};

}  // namespace tandem::testing
