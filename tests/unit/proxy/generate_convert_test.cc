// ParseGenerateRequest (the native front end's parse of a Generate request,
// issue 23) against protobuf's own parse of the same bytes: the same
// requests accepted, the same fields and prompt ids out, whatever the
// encoding of the ids (packed in one or several runs, unpacked, mixed,
// varints up to 10 bytes) and for random corruptions of a valid request.
#include "proxy/generate_convert.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "wire_corrupt.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

std::string Varint(uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s.push_back(static_cast<char>((v & 0x7f) | 0x80));
  s.push_back(static_cast<char>(v));
  return s;
}

// Field 4 as one packed run of `ids` (wire type 2).
std::string PackedIds(const std::vector<uint64_t>& ids) {
  std::string payload;
  for (uint64_t id : ids) payload += Varint(id);
  return Varint((4 << 3) | 2) + Varint(payload.size()) + payload;
}

// Field 4 as one unpacked value (wire type 0).
std::string UnpackedId(uint64_t id) { return Varint(4 << 3) + Varint(id); }

std::string FullRequest(const std::vector<uint32_t>& ids) {
  pb::GenerateRequest r;
  r.set_request_id("req-1");
  r.set_model("m");
  for (uint32_t id : ids) r.add_prompt_token_ids(id);
  r.set_max_tokens(7);
  r.mutable_sampling()->set_temperature(0.5f);
  r.mutable_sampling()->set_seed(42);
  r.add_stop("\n\n");
  r.add_stop_token_ids(3);
  r.set_ignore_eos(true);
  r.set_priority(-2);
  r.set_ttft_slo_ms(900);
  r.set_tpot_slo_ms(40);
  return r.SerializeAsString();
}

struct Parsed {
  bool ok = false;
  std::string rest;  // the other fields, serialized
  std::vector<uint32_t> ids;
};

// What protobuf alone makes of `body`.
Parsed Reference(const std::string& body) {
  pb::wire::GenerateRequestBytes r;
  Parsed p;
  p.ok = r.ParseFromString(body);
  if (!p.ok) return p;
  p.ids.assign(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
  r.clear_prompt_token_ids();
  p.rest = r.SerializeAsString();
  return p;
}

// What ParseGenerateRequest makes of it, through ClientRequestFromProto's
// choice of ids (the parts' vector, or the message's when it kept them).
Parsed Fast(const std::string& body) {
  GenerateRequestParts parts;
  Parsed p;
  p.ok = ParseGenerateRequest(body, parts).ok();
  if (!p.ok) return p;
  pb::wire::GenerateRequestBytes copy = parts.rest;
  p.ids = ClientRequestFromProto(copy, parts.prompt_token_ids).prompt_token_ids;
  parts.rest.clear_prompt_token_ids();
  p.rest = parts.rest.SerializeAsString();
  return p;
}

// The shortest packed encoding of `ids` (what protobuf writes).
std::string ShortestVarints(const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) s += Varint(id);
  return s;
}

// Session 14: bytes kept for the workers (prompt_varints) are exactly the
// shortest encoding of the ids the proxy decoded (so what it validates is
// what the workers read), and lie in the body it keeps.
void ExpectForwardable(const GenerateRequestParts& parts) {
  const PromptVarints& v = parts.prompt_varints;
  if (v.size == 0) return;
  ASSERT_LE(v.at + v.size, v.owner.size());
  EXPECT_EQ(v.bytes(), ShortestVarints(parts.prompt_token_ids));
}

void ExpectSame(const std::string& body) {
  const Parsed want = Reference(body);
  const Parsed got = Fast(body);
  ASSERT_EQ(got.ok, want.ok);
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_EQ(got.rest, want.rest);
  GenerateRequestParts parts;
  if (ParseGenerateRequest(body, parts).ok()) ExpectForwardable(parts);
}

TEST(ParseGenerateRequestTest, PackedIdsAreDecodedIntoThePartsVector) {
  const std::vector<uint32_t> ids = {0, 1, 127, 128, 300, 16383, 16384, 128255, 1u << 28,
                                     0xffffffffu};
  const std::string body = FullRequest(ids);
  GenerateRequestParts parts;
  ASSERT_TRUE(ParseGenerateRequest(body, parts).ok());
  EXPECT_EQ(parts.prompt_token_ids, ids);
  EXPECT_TRUE(parts.rest.prompt_token_ids().empty());  // not parsed twice
  EXPECT_EQ(parts.rest.request_id(), "req-1");
  EXPECT_EQ(parts.rest.max_tokens(), 7u);
  EXPECT_EQ(parts.rest.sampling().seed(), 42u);
  EXPECT_EQ(parts.rest.tpot_slo_ms(), 40u);
  ExpectSame(body);
}

TEST(ParseGenerateRequestTest, EveryEncodingOfTheIdsAsProtobufReadsIt) {
  const std::string head = Varint((1 << 3) | 2) + Varint(2) + "id";
  const struct {
    const char* name;
    std::string body;
  } cases[] = {
      {"empty body", ""},
      {"no ids", head},
      {"an empty packed run", head + PackedIds({})},
      {"two packed runs", PackedIds({1, 2}) + head + PackedIds({3, 400000})},
      {"unpacked", head + UnpackedId(5) + UnpackedId(70000)},
      {"packed then unpacked then packed", PackedIds({1}) + UnpackedId(2) + PackedIds({3})},
      {"64-bit values, truncated to 32", PackedIds({uint64_t{1} << 40, ~uint64_t{0}})},
      {"the ids as fixed32 (a wrong wire type)", head + Varint((4 << 3) | 5) + "abcd"},
      {"a cut-off varint in the run", Varint((4 << 3) | 2) + Varint(2) + "\x81\x82"},
      {"a run longer than the body", Varint((4 << 3) | 2) + Varint(9) + "\x01"},
      {"an 11-byte varint", Varint((4 << 3) | 2) + Varint(11) + std::string(10, '\x80') + "\x01"},
      {"a group", head + Varint((20 << 3) | 3) + Varint((20 << 3) | 4) + PackedIds({9})},
      {"an unknown field", head + Varint((99 << 3) | 0) + Varint(5) + PackedIds({9})},
      {"field 0", Varint(2) + Varint(1) + "x"},
      {"a bad UTF-8 request id, kept as bytes", Varint((1 << 3) | 2) + Varint(1) + "\xff"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    ExpectSame(c.body);
  }
}

// Random corruptions of a valid request (bytes changed, cut, inserted):
// accepted exactly when protobuf accepts them, with the same result.
TEST(ParseGenerateRequestTest, CorruptedRequestsAsProtobufReadsThem) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 64; ++i) ids.push_back(i * 2039 % 130000);
  const std::string valid = FullRequest(ids);
  std::mt19937 rng(23);
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    const std::string body = wire_test::Corrupt(valid, rng);
    SCOPED_TRACE(round);
    ExpectSame(body);
    if (HasFailure()) return;
    accepted += Reference(body).ok;
  }
  EXPECT_GT(accepted, 1000);  // both paths were exercised
  EXPECT_LT(accepted, 19000);
}

// Protobuf reads a tag and a length of at most 5 bytes each and refuses a
// longer (zero-padded) encoding; the prompt's field so encoded was taken
// apart here and the request accepted (session 47, found by the fuzz
// targets' differential check): now refused as protobuf refuses it.
TEST(ParseGenerateRequestTest, TagsAndLengthsPastFiveBytesAreRefusedAsProtobufRefusesThem) {
  const std::string payload = Varint(5) + Varint(300);  // 3 bytes
  for (size_t bytes = 1; bytes <= 7; ++bytes) {
    // Tag 34 (field 4, wire type 2) and length 3, each in `bytes` bytes.
    auto padded = [bytes](uint8_t value) { return wire_test::PaddedVarint(value, bytes); };
    const std::string long_tag = padded(34) + Varint(payload.size()) + payload;
    const std::string long_size = Varint(34) + padded(3) + payload;
    SCOPED_TRACE(bytes);
    EXPECT_EQ(Reference(long_tag).ok, bytes <= 5);
    EXPECT_EQ(Reference(long_size).ok, bytes <= 5);
    ExpectSame(long_tag);
    ExpectSame(long_size);
    // And another field's tag so encoded, before the prompt's.
    ExpectSame(padded(5 << 3) + Varint(7) + PackedIds({5, 300}));
  }
}

// Session 14: the client's packed varints are kept, in the body, when they
// are one run of shortest varints (3-byte ones included), and not kept for
// any other encoding of the same ids, which then go to the workers as the
// proxy re-encodes them. The ids are the same either way.
TEST(ParseGenerateRequestTest, TheClientsVarintsAreKeptOnlyInTheirShortestForm) {
  const std::vector<uint32_t> ids = {0, 1, 127, 128, 300, 16383, 16384, 128255, 2097151};
  const std::string body = FullRequest(ids);
  GenerateRequestParts parts;
  ASSERT_TRUE(ParseGenerateRequest(body, parts).ok());
  EXPECT_EQ(parts.prompt_token_ids, ids);
  ASSERT_EQ(parts.prompt_varints.size, ShortestVarints(ids).size());
  EXPECT_EQ(parts.prompt_varints.bytes(), ShortestVarints(ids));
  EXPECT_EQ(parts.prompt_varints.owner, body);  // the body, kept whole
  ExpectForwardable(parts);

  const std::string head = Varint((1 << 3) | 2) + Varint(2) + "id";
  auto run = [](const std::string& payload) {
    return Varint((4 << 3) | 2) + Varint(payload.size()) + payload;
  };
  const struct {
    const char* name;
    std::string body;
    std::vector<uint32_t> ids;
  } not_kept[] = {
      {"0 as 0x80 0x00", head + run(std::string("\x05\x80\x00", 3)), {5, 0}},
      {"300 in 3 bytes", head + run(std::string("\xac\x82\x00", 3)), {300}},
      {"5 in 5 bytes", head + run(std::string("\x85\x80\x80\x80\x00", 5)), {5}},
      {"5 with bits past 64 (10 bytes)",
       head + run("\x85" + std::string(8, '\x80') + "\x02"), {5}},
      {"a 64-bit value, truncated", head + PackedIds({(uint64_t{1} << 32) + 7}), {7}},
      {"bits 32-34 in a 5-byte varint",
       head + run(std::string("\xd9\xec\xfe\xd0\x28", 5)), {0x8a1fb659u}},
      {"two packed runs", PackedIds({1, 2}) + head + PackedIds({3}), {1, 2, 3}},
      {"an empty run", head + PackedIds({}), {}},
  };
  for (const auto& c : not_kept) {
    SCOPED_TRACE(c.name);
    ASSERT_TRUE(ParseGenerateRequest(c.body, parts).ok());
    EXPECT_EQ(parts.prompt_token_ids, c.ids);
    EXPECT_EQ(parts.prompt_varints.size, 0u);
    ExpectSame(c.body);
  }
  // A 4- or 5-byte varint in its shortest form is kept.
  ASSERT_TRUE(ParseGenerateRequest(head + PackedIds({1u << 21, 0xffffffffu, 9}), parts).ok());
  EXPECT_EQ(parts.prompt_varints.bytes(), ShortestVarints({1u << 21, 0xffffffffu, 9}));
}

// A request with ids and no text is not "empty" because its ids are in
// the parts' vector rather than the message.
TEST(ParseGenerateRequestTest, IdsInThePartsCountAsAPrompt) {
  GenerateRequestParts parts;
  ASSERT_TRUE(ParseGenerateRequest(PackedIds({5, 6}), parts).ok());
  EXPECT_TRUE(ExplainEmptyPrompt(parts.rest, !parts.prompt_token_ids.empty()).ok());
  ASSERT_TRUE(ParseGenerateRequest("", parts).ok());
  EXPECT_FALSE(ExplainEmptyPrompt(parts.rest, !parts.prompt_token_ids.empty()).ok());
}

}  // namespace
}  // namespace tandem::proxy
