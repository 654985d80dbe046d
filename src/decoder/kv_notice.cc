#include "decoder/kv_notice.h"

#include <fmt/format.h>

#include "tandem/v1/worker.pb.h"

namespace tandem::decoder {

Result<KvNoticeInfo> ParseKvNotice(std::string_view payload) {
  ::tandem::v1::KvNotice notice;
  if (!notice.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return InvalidArgumentError(fmt::format("not a KvNotice ({} bytes)", payload.size()));
  }
  KvNoticeInfo info;
  info.request_id = notice.request_id();
  info.reservation_id = notice.reservation_id();
  info.generation = notice.generation();
  info.first_token_id = notice.first_token_id();
  info.prefill_cached_prompt_tokens = notice.prefill_cached_prompt_tokens();
  info.capability = notice.capability();
  info.kv_tags = notice.kv_tags();
  info.block_checksums.assign(notice.block_checksums().begin(), notice.block_checksums().end());
  if (notice.has_error()) {
    const int code = notice.error().code();
    const std::string& message = notice.error().message();
    info.error = Status(code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown,
                        message.empty() ? "prefiller gave up" : message);
  }
  return info;
}

}  // namespace tandem::decoder
