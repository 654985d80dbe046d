#include "decoder/decode_mux_batch.h"

namespace tandem::decoder {

namespace pb = ::tandem::v1;

pb::DecodeStreamItem* MuxBatcher::Open(uint64_t handle) {
  const int* index = open_.Find(handle);
  return index == nullptr ? nullptr : batch_.mutable_items(*index);
}

pb::DecodeStreamItem* MuxBatcher::Add(uint64_t handle) {
  if (int* index = open_.Find(handle)) {
    *index = batch_.items_size();  // the handle's new open item
  } else if (handle != 0) {
    open_.Insert(handle, batch_.items_size());
  }
  pb::DecodeStreamItem* item = batch_.add_items();
  item->set_handle(handle);
  return item;
}

void MuxBatcher::Registered(uint64_t handle) {
  pb::DecodeStreamItem* item = Open(handle);
  // `registered` comes first in an item: after tokens it needs a new one.
  if (item == nullptr || item->token_ids_size() > 0) item = Add(handle);
  item->set_registered(true);
}

void MuxBatcher::Tokens(uint64_t handle, uint32_t first_index,
                        std::span<const uint32_t> token_ids) {
  if (token_ids.empty()) return;
  pb::DecodeStreamItem* item = Open(handle);
  if (item != nullptr && item->token_ids_size() > 0 &&
      uint64_t{item->first_index()} + static_cast<uint64_t>(item->token_ids_size()) != first_index) {
    item = nullptr;  // not a continuation: its own item
  }
  if (item == nullptr) item = Add(handle);
  if (item->token_ids_size() == 0) item->set_first_index(first_index);
  item->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
}

void MuxBatcher::Finished(uint64_t handle, const pb::DecodeFinished& finished) {
  pb::DecodeStreamItem* item = Open(handle);
  if (item == nullptr) item = Add(handle);
  *item->mutable_finished() = finished;
  open_.Take(handle);
}

void MuxBatcher::Error(uint64_t handle, const Status& status) {
  pb::DecodeStreamItem* item = Open(handle);
  if (item == nullptr) item = Add(handle);
  item->mutable_error()->set_code(static_cast<int>(status.code()));
  item->mutable_error()->set_message(status.message());
  open_.Take(handle);
}

bool MuxBatcher::DropFirstTokenItem(uint64_t handle) {
  const int* found = open_.Find(handle);
  if (found == nullptr) return false;
  const int index = *found;
  const pb::DecodeStreamItem& item = batch_.items(index);
  if (item.token_ids_size() != 1 || item.first_index() != 0) return false;
  open_.Take(handle);
  const bool last = index + 1 == batch_.items_size();
  batch_.mutable_items()->DeleteSubrange(index, 1);
  if (!last) {  // the open items after it moved up by one
    open_.ForEach([index](uint64_t, int& i) {
      if (i > index) --i;
    });
  }
  return true;
}

pb::DecodeStreamResponse MuxBatcher::Take() {
  pb::DecodeStreamResponse out;
  out.Swap(&batch_);
  open_.Clear();
  return out;
}

void MuxBatcher::TakeInto(pb::DecodeStreamResponse* out) {
  out->Swap(&batch_);
  batch_.Clear();  // keeps the cleared items for reuse
  open_.Clear();
}

void MuxBatcher::Clear() {
  batch_.Clear();
  open_.Clear();
}

}  // namespace tandem::decoder
