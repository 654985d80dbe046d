#include "proxy/generate_parse.h"

#include "proxy/wire_scan.h"

namespace tandem::proxy {

namespace {

constexpr uint32_t kPromptTokenIdsField = 4;  // GenerateRequest.prompt_token_ids

// Appends the packed varints of [p, end) to `ids` (each truncated to 32
// bits, as protobuf reads a uint32). False when the last one is cut off or
// one is longer than 10 bytes. `*shortest` is cleared when one is not in
// its shortest form (a last byte of 0 after others, e.g. 0x80 0x00 for 0,
// or bits past the 32 kept): protobuf reads it, but never writes it.
bool AppendPackedVarints(const uint8_t* p, const uint8_t* end, std::vector<uint32_t>& ids,
                         bool* shortest) {
  if (p == end) return true;
  if (end[-1] >= 0x80) return false;
  size_t n = 0;  // every varint ends with exactly one byte below 0x80
  for (const uint8_t* q = p; q < end; ++q) n += *q < 0x80;
  const size_t at = ids.size();
  ids.resize(at + n);
  uint32_t* o = ids.data() + at;
  uint32_t zero_last = 0;  // a varint of 2 or 3 bytes whose last one is 0
  // Token ids take 1-3 bytes (below 2^21). A byte >= 0x80 is never the
  // last one (checked above), so the next byte can be read.
  while (p < end) {
    const uint32_t b0 = p[0];
    if (b0 < 0x80) {
      *o++ = b0;
      p += 1;
      continue;
    }
    const uint32_t b1 = p[1];
    if (b1 < 0x80) {
      *o++ = (b0 & 0x7f) | (b1 << 7);
      zero_last |= b1 == 0;
      p += 2;
      continue;
    }
    const uint32_t b2 = p[2];
    if (b2 < 0x80) {
      *o++ = (b0 & 0x7f) | ((b1 & 0x7f) << 7) | (b2 << 14);
      zero_last |= b2 == 0;
      p += 3;
      continue;
    }
    const uint8_t* const begin = p;
    uint64_t v;
    if (!wire::ReadVarint(p, end, &v)) return false;
    const uint32_t id = static_cast<uint32_t>(v);
    *o++ = id;
    // Shortest: no bits past 32 (a 5-byte varint may carry 35) and no
    // more bytes than the value needs.
    const size_t want =
        1 + (id >= 1u << 7) + (id >= 1u << 14) + (id >= 1u << 21) + (id >= 1u << 28);
    if (v > UINT32_MAX || static_cast<size_t>(p - begin) != want) *shortest = false;
  }
  if (zero_last != 0) *shortest = false;
  return true;
}

// Splits `body` into its prompt_token_ids (packed: appended to `ids`) and
// the other fields (appended to `rest`, in their order). False for
// anything else: the caller leaves the body to protobuf. `*varints` is the
// packed field's bytes when they can be forwarded (one field, every varint
// in its shortest form), else empty.
bool SplitPromptIds(std::string_view body, std::string& rest, std::vector<uint32_t>& ids,
                    std::string_view* varints) {
  const uint8_t* p = wire::Begin(body);
  const uint8_t* const end = wire::End(body);
  wire::Field f;
  int fields = 0;
  bool shortest = true;
  while (p < end) {
    if (!wire::NextField(p, end, &f)) return false;
    if (f.number == kPromptTokenIdsField) {
      if (f.type != 2) return false;  // unpacked, or a wrong wire type
      if (!AppendPackedVarints(wire::Begin(f.bytes), wire::End(f.bytes), ids, &shortest)) {
        return false;
      }
      ++fields;
      *varints = f.bytes;
      continue;
    }
    rest.append(reinterpret_cast<const char*>(f.begin), static_cast<size_t>(p - f.begin));
  }
  // Several packed fields concatenate (protobuf's merge): not one range.
  if (fields != 1 || !shortest) *varints = {};
  return true;
}

}  // namespace

Status ParseGenerateRequest(std::string body, GenerateRequestParts& out) {
  std::string rest;
  std::string_view varints;
  out.prompt_token_ids.clear();
  out.prompt_varints = {};
  const bool split = SplitPromptIds(body, rest, out.prompt_token_ids, &varints);
  if (!split) out.prompt_token_ids.clear();
  const std::string_view whole = split ? std::string_view(rest) : std::string_view(body);
  if (!out.rest.ParseFromArray(whole.data(), static_cast<int>(whole.size()))) {
    return InvalidArgumentError("the request is not a valid tandem.v1.GenerateRequest");
  }
  if (split && !varints.empty()) {
    out.prompt_varints.at = static_cast<size_t>(varints.data() - body.data());
    out.prompt_varints.size = varints.size();
    out.prompt_varints.owner = std::move(body);  // an offset, not a pointer: a move may copy
  }
  return Status::Ok();
}

}  // namespace tandem::proxy
