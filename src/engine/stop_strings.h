// Stop strings on streamed text: holds back any tail that could still grow
// into a stop string, and cuts the text before the first stop string found.
// Used by the engine on its detokenized output; the proxy can use it on its
// own incremental detokenizer's output the same way.
//
// Thread-safety: one instance per request stream, used by one thread at a time.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tandem::engine {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);

  struct Chunk {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop string was found; `text` ends just before it
  };
  // Appends newly decoded text. After a stop, further calls return nothing.
  Chunk Push(std::string_view text);
  // End of stream without a stop: whatever was held back.
  std::string Flush();
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace tandem::engine
