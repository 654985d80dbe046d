#include "proxy/output_assembler.h"

#include <fmt/format.h>

namespace tandem::proxy {

OutputAssembler::OutputAssembler(const model::Tokenizer* tokenizer, std::vector<std::string> stops)
    : detok_(tokenizer), stops_(std::move(stops)) {}

Result<OutputAssembler::Delta> OutputAssembler::Push(uint32_t first_index,
                                                     std::span<const uint32_t> ids) {
  Delta d;
  if (Status st = PushTo(first_index, ids, &d); !st.ok()) return st;
  return d;
}

Status OutputAssembler::PushTo(uint32_t first_index, std::span<const uint32_t> ids, Delta* d) {
  if (stopped_) return Status::Ok();
  if (first_index > next_index_) {
    return InternalError(fmt::format("token stream skipped from index {} to {}", next_index_,
                                     first_index));
  }
  const size_t skip = next_index_ - first_index;
  for (size_t i = skip; i < ids.size(); ++i) {
    d->token_ids.push_back(ids[i]);
    ++next_index_;
    if (stops_.empty()) {  // nothing to hold back: the text goes out as it completes
      detok_.PushTo(ids[i], &d->text);
      continue;
    }
    scratch_.clear();
    detok_.PushTo(ids[i], &scratch_);
    auto chunk = stops_.Push(scratch_);
    d->text += chunk.text;
    if (chunk.stopped) {
      stopped_ = d->stopped = true;
      break;
    }
  }
  return Status::Ok();
}

std::string OutputAssembler::Flush() {
  if (stopped_) return "";
  auto chunk = stops_.Push(detok_.Flush());
  std::string out = std::move(chunk.text);
  if (chunk.stopped) {
    stopped_ = true;
    return out;
  }
  return out + stops_.Flush();
}

}  // namespace tandem::proxy
