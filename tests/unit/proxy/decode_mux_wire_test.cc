// The decode stream batch reader without protobuf messages
// (proxy/decode_mux_wire.h): every batch it accepts means what protobuf
// reads in it; whatever else it refuses (protobuf reads it then).
#include "proxy/decode_mux_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "wire_corrupt.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

void PutVarint(std::string& out, uint64_t v) {
  uint8_t buf[10];
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(v, buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}
void PutTag(std::string& out, uint32_t field, uint32_t wire_type) {
  PutVarint(out, (uint64_t{field} << 3) | wire_type);
}
void PutLen(std::string& out, uint32_t field, const std::string& bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out += bytes;
}

// The fast reader's items equal protobuf's for the same bytes.
void ExpectSameAsProtobuf(const std::string& bytes) {
  std::vector<DecodeItem> fast;
  std::vector<uint32_t> ids;
  ASSERT_TRUE(ParseDecodeBatch(bytes, &fast, &ids));
  pb::DecodeStreamResponse msg;
  ASSERT_TRUE(msg.ParseFromString(bytes));
  std::vector<DecodeItem> slow;
  ItemsOf(msg, &slow);
  ASSERT_EQ(fast.size(), slow.size());
  for (size_t i = 0; i < fast.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(fast[i].handle, slow[i].handle);
    EXPECT_EQ(fast[i].registered, slow[i].registered);
    EXPECT_EQ(fast[i].first_index, slow[i].first_index);
    EXPECT_EQ(std::vector<uint32_t>(fast[i].token_ids.begin(), fast[i].token_ids.end()),
              std::vector<uint32_t>(slow[i].token_ids.begin(), slow[i].token_ids.end()));
    EXPECT_EQ(fast[i].end, slow[i].end);
    EXPECT_EQ(fast[i].finish_reason, slow[i].finish_reason);
    EXPECT_EQ(fast[i].completion_tokens, slow[i].completion_tokens);
    EXPECT_EQ(fast[i].decoder_cached_prompt_tokens, slow[i].decoder_cached_prompt_tokens);
    EXPECT_EQ(fast[i].prefill_cached_prompt_tokens, slow[i].prefill_cached_prompt_tokens);
    EXPECT_EQ(fast[i].error, nullptr);
  }
}

bool Fast(const std::string& bytes) {
  std::vector<DecodeItem> items;
  std::vector<uint32_t> ids;
  return ParseDecodeBatch(bytes, &items, &ids);
}

TEST(DecodeMuxWireTest, ReadsWhatTheDecoderWritesAsProtobufDoes) {
  std::mt19937_64 rng(23);
  for (int round = 0; round < 300; ++round) {
    pb::DecodeStreamResponse msg;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      auto* it = msg.add_items();
      it->set_handle(rng() >> (rng() % 64));
      if (rng() % 8 == 0) it->set_registered(true);
      it->set_first_index(static_cast<uint32_t>(rng() >> (32 + rng() % 32)));
      const int tokens = static_cast<int>(rng() % 5);
      for (int t = 0; t < tokens; ++t) {
        it->add_token_ids(static_cast<uint32_t>(rng() >> (32 + rng() % 32)));
      }
      if (rng() % 6 == 0) {
        auto* f = it->mutable_finished();
        f->set_finish_reason(static_cast<pb::FinishReason>(rng() % 3));
        f->set_completion_tokens(static_cast<uint32_t>(rng()));
        f->set_decoder_cached_prompt_tokens(static_cast<uint32_t>(rng() % 9000));
        f->set_prefill_cached_prompt_tokens(static_cast<uint32_t>(rng() % 9000));
      }
    }
    SCOPED_TRACE(round);
    ExpectSameAsProtobuf(msg.SerializeAsString());
  }
}

TEST(DecodeMuxWireTest, EmptyBatchAndEmptyItem) {
  ExpectSameAsProtobuf("");
  std::string b;
  PutLen(b, 1, "");  // one item with every field at its default
  ExpectSameAsProtobuf(b);
}

TEST(DecodeMuxWireTest, UnpackedTokensLastScalarAndMergedFinishedAsProtobuf) {
  std::string item;
  PutTag(item, 1, 0);
  PutVarint(item, 7);  // handle 7, then 9: the last wins
  PutTag(item, 4, 0);
  PutVarint(item, 300);  // token_ids not packed
  std::string packed;
  PutVarint(packed, 1);
  PutVarint(packed, 0xffffffffu);
  PutLen(item, 4, packed);  // then packed: appended
  PutTag(item, 4, 0);
  PutVarint(item, 5);
  PutTag(item, 1, 0);
  PutVarint(item, 9);
  PutTag(item, 3, 0);
  PutVarint(item, uint64_t{1} << 40);  // a uint32 takes the low 32 bits
  std::string f1, f2;
  PutTag(f1, 1, 0);
  PutVarint(f1, 2);
  PutTag(f1, 2, 0);
  PutVarint(f1, 64);
  PutTag(f2, 3, 0);
  PutVarint(f2, 16);
  PutLen(item, 5, f1);
  PutLen(item, 5, f2);  // a second `finished` merges into the first
  PutTag(item, 2, 0);
  PutVarint(item, 2);  // registered: any non-zero value
  std::string b;
  PutLen(b, 1, item);
  ExpectSameAsProtobuf(b);

  std::vector<DecodeItem> items;
  std::vector<uint32_t> ids;
  ASSERT_TRUE(ParseDecodeBatch(b, &items, &ids));
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].handle, 9u);
  EXPECT_EQ(std::vector<uint32_t>(items[0].token_ids.begin(), items[0].token_ids.end()),
            (std::vector<uint32_t>{300, 1, 0xffffffffu, 5}));
  EXPECT_EQ(items[0].end, DecodeItem::End::kFinished);
  EXPECT_EQ(items[0].finish_reason, 2);
  EXPECT_EQ(items[0].completion_tokens, 64u);
  EXPECT_EQ(items[0].decoder_cached_prompt_tokens, 16u);
  EXPECT_TRUE(items[0].registered);
}

TEST(DecodeMuxWireTest, LeavesErrorsGroupsAndBadBytesToProtobuf) {
  pb::DecodeStreamResponse msg;
  auto* ok = msg.add_items();
  ok->set_handle(1);
  ok->add_token_ids(42);
  auto* err = msg.add_items();
  err->set_handle(2);
  err->mutable_error()->set_code(14);
  err->mutable_error()->set_message("lost");
  const std::string with_error = msg.SerializeAsString();
  EXPECT_FALSE(Fast(with_error));
  std::vector<DecodeItem> items;
  ItemsOf(msg, &items);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[1].end, DecodeItem::End::kError);
  ASSERT_NE(items[1].error, nullptr);
  EXPECT_EQ(items[1].error->message(), "lost");

  std::string group;  // a group (wire type 3): refused
  PutTag(group, 1, 0);
  PutVarint(group, 3);
  PutTag(group, 9, 3);
  PutTag(group, 9, 4);
  std::string b;
  PutLen(b, 1, group);
  EXPECT_FALSE(Fast(b));

  const std::string good = [] {
    pb::DecodeStreamResponse m;
    m.add_items()->add_token_ids(1u << 30);
    return m.SerializeAsString();
  }();
  ASSERT_TRUE(Fast(good));
  for (size_t cut = 1; cut < good.size(); ++cut) {  // truncated: refused
    EXPECT_FALSE(Fast(good.substr(0, cut))) << cut;
  }
  std::string long_varint;  // 11 bytes: more than a varint may take
  PutTag(long_varint, 1, 0);
  long_varint.append(10, '\x80');
  long_varint.push_back('\x01');
  std::string b4;
  PutLen(b4, 1, long_varint);
  EXPECT_FALSE(Fast(b4));
  EXPECT_FALSE(Fast(std::string(1, '\0')));  // field number 0
}

TEST(DecodeMuxWireTest, SkipsUnknownFieldsAsProtobufDoes) {
  // A newer decoder's fields (any wire type), and known numbers written
  // with another wire type: protobuf keeps them aside, both readers ignore.
  std::string fin;
  PutTag(fin, 7, 0);
  PutVarint(fin, 1);
  PutTag(fin, 2, 0);
  PutVarint(fin, 12);
  PutTag(fin, 1, 5);  // finish_reason as fixed32: unknown
  fin.append(4, '\x01');
  std::string item;
  PutTag(item, 1, 0);
  PutVarint(item, 3);
  PutTag(item, 411, 0);
  PutVarint(item, 99);
  PutLen(item, 412, "abc");
  PutTag(item, 413, 1);
  item.append(8, '\x02');
  PutTag(item, 414, 5);
  item.append(4, '\x03');
  PutTag(item, 1, 1);  // handle as fixed64: unknown, the handle stays 3
  item.append(8, '\x04');
  PutTag(item, 6, 0);  // `error` as a varint: unknown
  PutVarint(item, 5);
  PutTag(item, 5, 0);  // `finished` as a varint: unknown
  PutVarint(item, 5);
  PutTag(item, 4, 0);
  PutVarint(item, 77);
  PutLen(item, 5, fin);
  std::string b;
  PutLen(b, 1, item);
  PutTag(b, 2, 0);  // the batch's own unknown field
  PutVarint(b, 1);
  PutTag(b, 1, 0);  // `items` as a varint: unknown
  PutVarint(b, 1);
  ExpectSameAsProtobuf(b);
  std::vector<DecodeItem> items;
  std::vector<uint32_t> ids;
  ASSERT_TRUE(ParseDecodeBatch(b, &items, &ids));
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].handle, 3u);
  ASSERT_EQ(items[0].token_ids.size(), 1u);
  EXPECT_EQ(items[0].token_ids[0], 77u);
  EXPECT_EQ(items[0].end, DecodeItem::End::kFinished);
  EXPECT_EQ(items[0].completion_tokens, 12u);
  EXPECT_EQ(items[0].finish_reason, 0);
}

// A tag or a length of more than 5 bytes (zero-padded) is refused by
// protobuf; this reader took such a batch (an unknown field skipped) until
// session 47, found by fuzz_worker_frames. Now it refuses it too, and
// takes the same fields in at most 5 bytes as protobuf does.
TEST(DecodeMuxWireTest, TagsAndLengthsPastFiveBytesAreLeftToProtobuf) {
  std::string item;
  PutTag(item, 1, 0);
  PutVarint(item, 77);
  for (size_t bytes = 1; bytes <= 7; ++bytes) {
    auto padded = [bytes](uint8_t value) { return wire_test::PaddedVarint(value, bytes); };
    const std::string long_tag =
        padded(0x0a) + std::string(1, static_cast<char>(item.size())) + item;
    const std::string long_size =
        std::string(1, '\x0a') + padded(static_cast<uint8_t>(item.size())) + item;
    const std::string long_unknown_tag = padded(0x7a) + std::string(1, '\0');  // field 15, empty
    SCOPED_TRACE(bytes);
    pb::DecodeStreamResponse msg;
    for (const std::string& batch : {long_tag, long_size, long_unknown_tag}) {
      EXPECT_EQ(msg.ParseFromString(batch), bytes <= 5);
      EXPECT_EQ(Fast(batch), bytes <= 5);
      if (bytes <= 5) ExpectSameAsProtobuf(batch);
    }
  }
}

TEST(DecodeMuxWireTest, TokenViewsSurviveManyItems) {
  // Spans into one id buffer that grows with the batch stay valid.
  pb::DecodeStreamResponse msg;
  for (uint32_t i = 0; i < 2000; ++i) {
    auto* it = msg.add_items();
    it->set_handle(i + 1);
    it->set_first_index(i);
    it->add_token_ids(i * 3);
    it->add_token_ids(i * 3 + 1);
  }
  ExpectSameAsProtobuf(msg.SerializeAsString());
}

}  // namespace
}  // namespace tandem::proxy
