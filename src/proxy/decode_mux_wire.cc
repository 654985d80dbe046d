#include "proxy/decode_mux_wire.h"

#include "proxy/wire_scan.h"

namespace tandem::proxy {
namespace {

// Wire types (protobuf encoding).
constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLen = 2;
constexpr uint32_t kFixed32 = 5;

// A cursor over the bytes of one message. Every read says whether it
// succeeded; a failed read leaves the batch to protobuf.
struct Cursor {
  const uint8_t* p;
  const uint8_t* end;

  bool done() const { return p == end; }

  // At most 10 bytes, as protobuf reads them.
  bool Varint(uint64_t* v) { return wire::ReadVarint(p, end, v); }
  // A field's tag: its number (1 and up) and wire type, where protobuf
  // reads the same tag (wire::ReadTag).
  bool Tag(uint32_t* field, uint32_t* wire_type) {
    uint32_t t = 0;
    if (!wire::ReadTag(p, end, &t)) return false;
    *field = t >> 3;
    *wire_type = t & 7;
    return true;
  }
  // A field this reader does not use (protobuf keeps it as an unknown
  // field: it changes nothing the demultiplexer reads). Groups: refused.
  bool Skip(uint32_t wire_type) {
    uint64_t v = 0;
    Cursor inner;
    switch (wire_type) {
      case kVarint: return Varint(&v);
      case kLen: return Len(&inner);
      case kFixed64: return Bytes(8);
      case kFixed32: return Bytes(4);
      default: return false;
    }
  }
  bool Bytes(size_t n) {
    if (n > static_cast<size_t>(end - p)) return false;
    p += n;
    return true;
  }
  // A length-delimited field's bytes.
  bool Len(Cursor* inner) {
    uint64_t n = 0;
    if (!wire::ReadSize(p, end, &n) || n > static_cast<uint64_t>(end - p)) return false;
    *inner = Cursor{p, p + n};
    p += n;
    return true;
  }
};

// DecodeFinished (fields 1-4, all varints), merged into *item.
bool ParseFinished(Cursor c, DecodeItem* item) {
  while (!c.done()) {
    uint32_t field = 0, wt = 0;
    uint64_t v = 0;
    if (!c.Tag(&field, &wt)) return false;
    if (field > 4 || wt != kVarint) {  // unknown, or a known number of another type
      if (!c.Skip(wt)) return false;
      continue;
    }
    if (!c.Varint(&v)) return false;
    switch (field) {
      case 1: item->finish_reason = static_cast<int32_t>(static_cast<uint32_t>(v)); break;
      case 2: item->completion_tokens = static_cast<uint32_t>(v); break;
      case 3: item->decoder_cached_prompt_tokens = static_cast<uint32_t>(v); break;
      default: item->prefill_cached_prompt_tokens = static_cast<uint32_t>(v); break;
    }
  }
  item->end = DecodeItem::End::kFinished;
  return true;
}

// DecodeStreamItem; its tokens are appended to *ids, which never
// reallocates here (ParseDecodeBatch reserved a slot per byte).
bool ParseItem(Cursor c, DecodeItem* item, std::vector<uint32_t>* ids) {
  const size_t first = ids->size();
  while (!c.done()) {
    uint32_t field = 0, wt = 0;
    if (!c.Tag(&field, &wt)) return false;
    uint64_t v = 0;
    if (field == 4 && wt == kLen) {  // token_ids, packed
      Cursor packed;
      if (!c.Len(&packed)) return false;
      while (!packed.done()) {
        if (!packed.Varint(&v)) return false;
        ids->push_back(static_cast<uint32_t>(v));
      }
      continue;
    }
    if (field == 5 && wt == kLen) {  // finished
      Cursor f;
      if (!c.Len(&f) || !ParseFinished(f, item)) return false;
      continue;
    }
    if (field == 6 && wt == kLen) return false;  // an error item: left to protobuf
    if (field > 4 || wt != kVarint) {  // unknown, or a known number of another type
      if (!c.Skip(wt)) return false;
      continue;
    }
    if (!c.Varint(&v)) return false;
    switch (field) {
      case 1: item->handle = v; break;
      case 2: item->registered = v != 0; break;
      case 3: item->first_index = static_cast<uint32_t>(v); break;
      default: ids->push_back(static_cast<uint32_t>(v)); break;  // token_ids, one value
    }
  }
  item->token_ids = std::span<const uint32_t>(ids->data() + first, ids->size() - first);
  return true;
}

}  // namespace

bool ParseDecodeBatch(std::string_view bytes, std::vector<DecodeItem>* items,
                      std::vector<uint32_t>* ids) {
  items->clear();
  ids->clear();
  // A token takes at least one byte of the batch: with a slot per byte
  // *ids never reallocates, so an item's span stays valid as it grows.
  ids->reserve(bytes.size());
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  Cursor c{p, p + bytes.size()};
  while (!c.done()) {
    uint32_t field = 0, wt = 0;
    Cursor item;
    if (!c.Tag(&field, &wt)) return false;
    if (field != 1 || wt != kLen) {  // unknown, or `items` of another type
      if (!c.Skip(wt)) return false;
      continue;
    }
    if (!c.Len(&item) || !ParseItem(item, &items->emplace_back(), ids)) return false;
  }
  return true;
}

void ItemsOf(const v1::DecodeStreamResponse& batch, std::vector<DecodeItem>* items) {
  items->clear();
  items->reserve(static_cast<size_t>(batch.items_size()));
  for (const v1::DecodeStreamItem& it : batch.items()) {
    DecodeItem& d = items->emplace_back();
    d.handle = it.handle();
    d.registered = it.registered();
    d.first_index = it.first_index();
    d.token_ids = std::span<const uint32_t>(it.token_ids().data(),
                                            static_cast<size_t>(it.token_ids_size()));
    if (it.has_finished()) {
      const v1::DecodeFinished& f = it.finished();
      d.end = DecodeItem::End::kFinished;
      d.finish_reason = f.finish_reason();
      d.completion_tokens = f.completion_tokens();
      d.decoder_cached_prompt_tokens = f.decoder_cached_prompt_tokens();
      d.prefill_cached_prompt_tokens = f.prefill_cached_prompt_tokens();
    } else if (it.has_error()) {
      d.end = DecodeItem::End::kError;
      d.error = &it.error();
    }
  }
}

}  // namespace tandem::proxy
