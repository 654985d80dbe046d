// One streamed generation's SSE delta events, framed as HTTP/1.1 chunks,
// without a JSON DOM per token (issue 23).
//
// The event around the text is the same for every delta of a request (id,
// created, model, object; the first chat delta adds the role): the encoder
// renders it once with openai.h's StreamDelta and keeps the bytes before and
// after the text. Each delta then costs one escape of its text and appends
// to a caller's buffer: the bytes are exactly StreamDelta's, framed as
// Chunk(). Text that is not valid UTF-8 is escaped by nlohmann::json (its
// replacement of invalid sequences), so the output never differs.
//
// Thread-safety: none; one generation's deltas come one at a time.
#pragma once

#include <string>
#include <string_view>

#include "http/openai.h"

namespace tandem::http {

// HTTP/1.1 chunked framing of `data`: "<hex size>\r\n<data>\r\n".
std::string Chunk(std::string_view data);
void AppendChunk(std::string& out, std::string_view data);

class SseEncoder {
 public:
  SseEncoder() = default;
  SseEncoder(const ResponseMeta& meta, bool include_usage);

  // Appends the chunk carrying StreamDelta(meta, text, first, include_usage).
  void AppendDelta(std::string& out, std::string_view text, bool first);

 private:
  struct Frame {
    std::string before, after;  // the event's bytes around the escaped text
  };
  Frame first_, later_;
  bool ok_ = false;    // the frames were found (else every delta renders a DOM)
  ResponseMeta meta_;  // for the DOM fallback
  bool include_usage_ = false;
  std::string escaped_;  // scratch: the delta's text as a JSON string body
};

// Appends `text` escaped as the inside of a JSON string, as nlohmann::json's
// dump (ensure_ascii off) does; false (nothing appended) when `text` is not
// valid UTF-8.
bool AppendJsonEscaped(std::string& out, std::string_view text);

}  // namespace tandem::http
