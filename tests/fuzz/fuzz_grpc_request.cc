// libFuzzer target: what a public gRPC Generate call brings the native front
// end. The body as it reads it (proxy::ParseGenerateRequest: the prompt's
// packed token ids decoded by hand, issue 23), which promises to read it
// exactly as protobuf would, so it is held to protobuf's parse of the same
// bytes: accepted by both or by neither, the same message, and, where it
// keeps the ids' bytes to forward them to the workers as they came, bytes
// that are those ids in their shortest encoding. The same input as the
// call's header values: `grpc-timeout` (h2::ParseGrpcTimeout, held to the
// header's grammar and the value it names, saturated where int64
// nanoseconds end) and `traceparent` (tracing::ParseTraceparent: what it
// takes is the input's ids, and survives a round trip).
#include <google/protobuf/io/coded_stream.h>

#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "common/tracing.h"
#include "fuzz_util.h"
#include "proxy/generate_parse.h"
#include "proxy/h2/grpc_wire.h"

namespace {

// The ids as protobuf writes packed varints (its shortest encoding).
std::string ShortestVarints(const std::vector<uint32_t>& ids) {
  std::string out;
  uint8_t buf[5];  // a 32-bit varint takes at most 5 bytes
  for (uint32_t v : ids) {
    const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint32ToArray(v, buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
  }
  return out;
}

// The grpc-timeout grammar (1-8 digits, then H M S m u n) and the value it
// names in nanoseconds, computed wide; nullopt when malformed.
std::optional<std::chrono::nanoseconds> TimeoutReference(std::string_view v) {
  if (v.size() < 2 || v.size() > 9) return std::nullopt;
  __int128 n = 0;
  for (char c : v.substr(0, v.size() - 1)) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + (c - '0');
  }
  const std::string_view units = "HMSmun";
  const int64_t unit_ns[] = {3'600'000'000'000, 60'000'000'000, 1'000'000'000, 1'000'000, 1'000, 1};
  const size_t u = units.find(v.back());
  if (u == std::string_view::npos) return std::nullopt;
  const __int128 ns = n * unit_ns[u];
  if (ns > std::numeric_limits<int64_t>::max()) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(static_cast<int64_t>(ns));
}

void CheckTraceparent(std::string_view v) {
  auto c = tandem::tracing::ParseTraceparent(v);
  if (!c.ok()) {
    if (c.status().message().empty()) __builtin_trap();
    return;
  }
  // What it took is the input's: ids and the sampled bit, in lower case.
  std::string want = "00-";
  for (char ch : v.substr(3, 32)) want.push_back(static_cast<char>(std::tolower(ch)));
  want += '-';
  for (char ch : v.substr(36, 16)) want.push_back(static_cast<char>(std::tolower(ch)));
  const char flags_low = static_cast<char>(std::tolower(v[54]));
  const int low = flags_low <= '9' ? flags_low - '0' : flags_low - 'a' + 10;
  want += (low & 1) != 0 ? "-01" : "-00";
  const std::string again = tandem::tracing::FormatTraceparent(*c);
  if (again != want) __builtin_trap();
  auto back = tandem::tracing::ParseTraceparent(again);
  if (!back.ok() || back->trace_id != c->trace_id || back->span_id != c->span_id ||
      back->sampled != c->sampled) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  const std::string body(reinterpret_cast<const char*>(data), size);
  if (tandem::proxy::h2::ParseGrpcTimeout(body) != TimeoutReference(body)) __builtin_trap();
  CheckTraceparent(body);
  tandem::v1::wire::GenerateRequestBytes want;
  const bool proto_ok = want.ParseFromString(body);

  tandem::proxy::GenerateRequestParts got;
  const tandem::Status st = tandem::proxy::ParseGenerateRequest(body, got);
  if (st.ok() != proto_ok) __builtin_trap();
  if (!st.ok()) {
    if (st.message().empty()) __builtin_trap();
    return 0;
  }
  // The ids are either taken apart (then `rest` has none) or left in `rest`.
  tandem::v1::wire::GenerateRequestBytes whole = got.rest;
  if (!got.prompt_token_ids.empty() && whole.prompt_token_ids_size() != 0) __builtin_trap();
  for (uint32_t id : got.prompt_token_ids) whole.add_prompt_token_ids(id);
  // Same known fields, same unknown fields in the same order.
  if (whole.SerializeAsString() != want.SerializeAsString()) __builtin_trap();

  const tandem::proxy::PromptVarints& v = got.prompt_varints;
  if (v.size > 0) {
    if (v.owner != body || v.at > body.size() || v.size > body.size() - v.at) __builtin_trap();
    if (v.bytes() != ShortestVarints(got.prompt_token_ids)) __builtin_trap();
  }
  return 0;
}
