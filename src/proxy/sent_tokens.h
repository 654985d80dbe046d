// The completion tokens a request sent to its client, in order (the
// lifecycle's record for a migration and for the last token's stop check).
//
// Appended to once per delivery on the token path (issue 23): a
// std::vector there copied its whole contents at every doubling (11 times
// for 1,000 tokens) and went through memmove for every append. Here the
// ids live in fixed chunks of kChunk ids, allocated as the completion
// grows and never moved; an append writes into the last chunk in place.
//
// Thread-safety: none (the lifecycle's mutex guards it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace tandem::proxy {

class SentTokens {
 public:
  static constexpr size_t kChunk = 256;  // ids per chunk (1 KiB)

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // The last id appended; empty() must be false.
  uint32_t back() const { return tail_[-1]; }
  // The id at `i` (< size()).
  uint32_t operator[](size_t i) const { return chunks_[i / kChunk][i % kChunk]; }

  void Append(std::span<const uint32_t> ids) {
    for (uint32_t id : ids) {
      if (tail_ == end_) Grow();
      *tail_++ = id;
    }
    size_ += ids.size();
  }

  // Appends the first `n` ids (at most size()) to *out.
  void CopyPrefixTo(size_t n, std::vector<uint32_t>* out) const {
    if (n > size_) n = size_;
    out->reserve(out->size() + n);
    for (size_t c = 0; n > 0; ++c) {
      const size_t take = n < kChunk ? n : kChunk;
      out->insert(out->end(), chunks_[c].get(), chunks_[c].get() + take);
      n -= take;
    }
  }

 private:
  void Grow() {
    chunks_.push_back(std::make_unique_for_overwrite<uint32_t[]>(kChunk));
    tail_ = chunks_.back().get();
    end_ = tail_ + kChunk;
  }

  uint32_t* tail_ = nullptr;  // where the next id goes (in the last chunk)
  uint32_t* end_ = nullptr;   // the last chunk's end
  size_t size_ = 0;
  std::vector<std::unique_ptr<uint32_t[]>> chunks_;
};

}  // namespace tandem::proxy
