// Reading protobuf's wire format field by field, for the few messages the
// proxy takes apart by hand on its per-request path (issue 23: the public
// request's prompt ids, generate_parse.cc; the Watch batches,
// watch_batch.cc; the decode stream's batches, decode_mux_wire.cc). Each
// caller accepts only the encodings it expects and leaves anything else (a
// group, a malformed field, an unexpected field) to protobuf, so what is
// accepted and what comes out stay protobuf's.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tandem::proxy::wire {

// A varint at p of at most `max_bytes` bytes (protobuf: 10 for a value,
// whose bits past 64 it drops as this does), before end; false when it
// does not end there.
inline bool ReadVarint(const uint8_t*& p, const uint8_t* end, uint64_t* v, int max_bytes = 10) {
  uint64_t r = 0;
  for (int i = 0, shift = 0; i < max_bytes && p < end; ++i, shift += 7) {
    const uint8_t b = *p++;
    r |= uint64_t{b & 0x7fu} << shift;
    if (b < 0x80) {
      *v = r;
      return true;
    }
  }
  return false;
}

// A field's tag, taken only where protobuf reads the same one: at most 5
// bytes (protobuf refuses a longer one), a value below 2^32 (protobuf drops
// the bits past 32 of a fifth byte: refused here rather than dropped), a
// field number of 1 or more (protobuf refuses 0).
inline bool ReadTag(const uint8_t*& p, const uint8_t* end, uint32_t* tag) {
  uint64_t t;
  if (!ReadVarint(p, end, &t, 5) || t > UINT32_MAX || t < 8) return false;
  *tag = static_cast<uint32_t>(t);
  return true;
}

// A length-delimited field's size as protobuf reads it: at most 5 bytes,
// below 2^31 less protobuf's 16 slop bytes.
inline bool ReadSize(const uint8_t*& p, const uint8_t* end, uint64_t* size) {
  return ReadVarint(p, end, size, 5) && *size <= uint64_t{INT32_MAX} - 16;
}

// One field: its number and wire type, its value (varint, fixed64,
// fixed32) or its bytes (length-delimited), and where it began.
struct Field {
  uint32_t number = 0;
  uint32_t type = 0;
  uint64_t value = 0;
  std::string_view bytes;
  const uint8_t* begin = nullptr;
};

// Reads the field at p and moves p past it. False when it is cut off, its
// tag or size is not one protobuf reads as this would (ReadTag, ReadSize)
// or its wire type is a group's or invalid (3, 4, 6, 7).
inline bool NextField(const uint8_t*& p, const uint8_t* end, Field* f) {
  f->begin = p;
  uint32_t tag;
  if (!ReadTag(p, end, &tag)) return false;
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
      if (!ReadSize(p, end, &len) || len > static_cast<uint64_t>(end - p)) return false;
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
