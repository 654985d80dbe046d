// Reading protobuf's wire format field by field, for the few messages the
// proxy takes apart by hand on its per-request path (issue 23: the public
// request's prompt ids, generate_convert.cc; the Watch batches,
// watch_batch.cc). Each caller accepts only the encodings it expects and
// leaves anything else (a group, a malformed field, an unexpected field) to
// protobuf, so what is accepted and what comes out stay protobuf's.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tandem::proxy::wire {

// A varint at p (at most 10 bytes, before end); false when it does not end there.
inline bool ReadVarint(const uint8_t*& p, const uint8_t* end, uint64_t* v) {
  uint64_t r = 0;
  for (int shift = 0; shift < 70 && p < end; shift += 7) {
    const uint8_t b = *p++;
    r |= uint64_t{b & 0x7fu} << shift;
    if (b < 0x80) {
      *v = r;
      return true;
    }
  }
  return false;
}

// One field: its number and wire type, its value (varint, fixed64,
// fixed32) or its bytes (length-delimited), and where it began.
struct Field {
  uint64_t number = 0;
  uint32_t type = 0;
  uint64_t value = 0;
  std::string_view bytes;
  const uint8_t* begin = nullptr;
};

// Reads the field at p and moves p past it. False when it is cut off or
// its wire type is a group's or invalid (3, 4, 6, 7).
inline bool NextField(const uint8_t*& p, const uint8_t* end, Field* f) {
  f->begin = p;
  uint64_t tag;
  if (!ReadVarint(p, end, &tag)) return false;
  f->number = tag >> 3;
  f->type = static_cast<uint32_t>(tag & 7);
  switch (f->type) {
    case 0: return ReadVarint(p, end, &f->value);
    case 1:
      if (end - p < 8) return false;
      std::memcpy(&f->value, p, 8);  // little-endian hosts only (as the fixed64 hashes)
      p += 8;
      return true;
    case 2: {
      uint64_t len;
      if (!ReadVarint(p, end, &len) || len > static_cast<uint64_t>(end - p)) return false;
      f->bytes = std::string_view(reinterpret_cast<const char*>(p), len);
      p += len;
      return true;
    }
    case 5: {
      uint32_t v;
      if (end - p < 4) return false;
      std::memcpy(&v, p, 4);
      f->value = v;
      p += 4;
      return true;
    }
    default: return false;
  }
}

inline const uint8_t* Begin(std::string_view s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}
inline const uint8_t* End(std::string_view s) { return Begin(s) + s.size(); }

}  // namespace tandem::proxy::wire
