// libFuzzer target: the frames workers send the proxy that it reads without
// protobuf's messages (issue 23) — a decoder's decode stream batch
// (proxy::ParseDecodeBatch) and a worker's Watch batch
// (proxy::ParseWatchBatch). Each may refuse a frame (the proxy then parses
// it with protobuf), but a frame it takes must mean what protobuf reads in
// it: every input goes through both readers and, where one takes it, is
// compared with protobuf's parse of the same bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "proxy/decode_mux_wire.h"
#include "proxy/watch_batch.h"
#include "tandem/v1/worker.pb.h"

namespace {

namespace pb = ::tandem::v1;
using tandem::proxy::DecodeItem;

template <typename T>
bool SameSpan(std::span<const T> a, std::span<const T> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

void CheckDecodeBatch(std::string_view in) {
  std::vector<DecodeItem> fast;
  std::vector<uint32_t> ids;
  if (!tandem::proxy::ParseDecodeBatch(in, &fast, &ids)) return;
  pb::DecodeStreamResponse msg;
  if (!msg.ParseFromArray(in.data(), static_cast<int>(in.size()))) __builtin_trap();
  std::vector<DecodeItem> slow;
  tandem::proxy::ItemsOf(msg, &slow);
  if (fast.size() != slow.size()) __builtin_trap();
  for (size_t i = 0; i < fast.size(); ++i) {
    const DecodeItem& a = fast[i];
    const DecodeItem& b = slow[i];
    if (a.handle != b.handle || a.registered != b.registered || a.first_index != b.first_index ||
        !SameSpan(a.token_ids, b.token_ids) || a.end != b.end ||
        a.finish_reason != b.finish_reason || a.completion_tokens != b.completion_tokens ||
        a.decoder_cached_prompt_tokens != b.decoder_cached_prompt_tokens ||
        a.prefill_cached_prompt_tokens != b.prefill_cached_prompt_tokens ||
        a.error != nullptr) {  // an error item is protobuf's to read
      __builtin_trap();
    }
  }
}

void CheckWatchBatch(std::string_view in) {
  tandem::proxy::WatchBatch fast;
  if (!tandem::proxy::ParseWatchBatch(in, fast)) return;
  pb::WorkerUpdate u;
  if (!u.ParseFromArray(in.data(), static_cast<int>(in.size()))) __builtin_trap();
  // A batch: no other kind of update, not the stream's end.
  if (u.kind_case() != pb::WorkerUpdate::KIND_NOT_SET || u.watch_ended()) __builtin_trap();
  if (fast.epoch != u.epoch() || fast.events.size() != static_cast<size_t>(u.events_size()) ||
      fast.has_load != u.has_batched_load()) {
    __builtin_trap();
  }
  for (int i = 0; i < u.events_size(); ++i) {
    const tandem::router::KvEventView& a = fast.events[static_cast<size_t>(i)];
    const tandem::router::KvEventView b = tandem::proxy::KvEventViewFromProto(u.events(i));
    if (a.kind != b.kind || a.epoch != b.epoch || a.event_id != b.event_id ||
        a.parent_hash != b.parent_hash || a.tier != b.tier || !SameSpan(a.hashes, b.hashes)) {
      __builtin_trap();
    }
  }
  if (fast.has_load && fast.load.SerializeAsString() != u.batched_load().SerializeAsString()) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  CheckDecodeBatch(in);
  CheckWatchBatch(in);
  return 0;
}
