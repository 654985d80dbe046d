// Turns the token stream of one request into what the client sees: tokens
// in completion order exactly once (duplicates from the Prefill reply and
// the decode stream are dropped by index), text that never splits a UTF-8
// character, and stop strings cut out (the request stops there).
//
// Thread-safety: none; the request's lifecycle serializes calls.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/stop_strings.h"
#include "model/tokenizer.h"

namespace tandem::proxy {

class OutputAssembler {
 public:
  OutputAssembler(const model::Tokenizer* tokenizer, std::vector<std::string> stops);

  struct Delta {
    std::vector<uint32_t> token_ids;  // new tokens for the client
    std::string text;                 // new text for the client
    bool stopped = false;             // a stop string ended the completion
    // Empties it, keeping the buffers (a request reuses one Delta).
    void Clear() {
      token_ids.clear();
      text.clear();
      stopped = false;
    }
  };

  // Tokens whose first has completion index `first_index`. Already-seen
  // indices are dropped; a gap (first_index beyond the next expected) is an
  // INTERNAL error. After a stop, everything is dropped.
  Result<Delta> Push(uint32_t first_index, std::span<const uint32_t> ids);
  // The same, appended to *d (the per-token path: no allocation once the
  // caller's Delta is warm).
  Status PushTo(uint32_t first_index, std::span<const uint32_t> ids, Delta* d);
  // End of stream: text still held (by the detokenizer or the stop matcher).
  std::string Flush();

  uint32_t next_index() const { return next_index_; }
  bool stopped() const { return stopped_; }

 private:
  // Every token reads these first (then the detokenizer's state): one line.
  uint32_t next_index_ = 0;
  bool stopped_ = false;
  model::IncrementalDetokenizer detok_;
  model::StopStringMatcher stops_;
  std::string scratch_;  // one token's text before the stop matcher
};

}  // namespace tandem::proxy
