// Session 8 (prompt-copy; docs/serving-workers.md, "Prompt and hash encoding"): the
// prompt a proxy puts in DecodeRequest/PrefillRequest reaches the workers'
// specs as the same ids whichever field carries it — fixed32 to a worker
// that advertises WorkerInfo.reads_fixed32_prompt, the packed varints to an
// older one — and a worker still reads a request that has only the varint
// field (what an older proxy sends). The framed Prefill request written in
// parts (prompt-io, issue 23) is the same frame, and the decode stream's
// start in parts (dec-parts) the same bytes. Over the wire: the messages are
// serialized and parsed back, as the transports do.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/block_hash.h"
#include "common/wire_ids.h"
#include "decoder/decode_mux.h"
#include "prefiller/prefiller_service.h"
#include "proxy/decode_mux_client.h"
#include "proxy/generate_convert.h"
#include "proxy/prefill_tcp_client.h"
#include "proxy/request.h"
#include "tandem/v1/worker.pb.h"

namespace tandem {
namespace {

namespace pb = ::tandem::v1;

// Every varint length (1 to 5 bytes), in no particular order, and 8k of them.
std::vector<uint32_t> Ids() {
  std::vector<uint32_t> ids = {0u, 127u, 128u, 16383u, 16384u, (1u << 21) - 1, 1u << 21,
                               (1u << 28) - 1, 1u << 28, std::numeric_limits<uint32_t>::max()};
  for (uint32_t i = 0; ids.size() < 8000; ++i) ids.push_back((i * 2654435761u) % 128256u);
  return ids;
}

template <typename Msg>
Msg OverTheWire(const Msg& m) {
  Msg parsed;
  EXPECT_TRUE(parsed.ParseFromString(m.SerializeAsString()));
  return parsed;
}

proxy::DecodeArgs DecodeArgsFor(const std::vector<uint32_t>& ids, bool fixed32) {
  proxy::DecodeArgs a;
  a.request_id = std::string("r");  // as in PrefillArgsFor (GCC bug 105329)
  a.attempt = 2;
  a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  a.deadline = std::chrono::system_clock::time_point::max();
  a.prompt_fixed32 = fixed32;
  return a;
}

proxy::PrefillArgs PrefillArgsFor(const std::vector<uint32_t>& ids, bool fixed32) {
  proxy::PrefillArgs a;
  // Moved in, not assigned from the literal: GCC 12 takes that for an
  // overlapping copy here (a false -Wrestrict, GCC bug 105329).
  a.request_id = std::string("r");
  a.attempt = 2;
  a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  a.deadline = std::chrono::system_clock::time_point::max();
  a.decoder_address = "d:1";
  a.prompt_fixed32 = fixed32;
  return a;
}

TEST(PromptEncodingTest, TheDecoderReadsTheSameIdsThroughEitherField) {
  const std::vector<uint32_t> ids = Ids();
  for (const bool fixed32 : {true, false}) {
    SCOPED_TRACE(fixed32 ? "fixed32" : "varint");
    pb::DecodeRequest req;
    proxy::FillDecodeRequest(DecodeArgsFor(ids, fixed32), &req);
    const pb::DecodeRequest got = OverTheWire(req);
    // Exactly one field carries the prompt: never both.
    EXPECT_EQ(got.prompt_token_ids_fixed32_size(), fixed32 ? 8000 : 0);
    EXPECT_EQ(got.prompt_token_ids_size(), fixed32 ? 0 : 8000);
    if (fixed32) {
      EXPECT_LT(req.ByteSizeLong(), 4u * 8000 + 64);
    }
    const decoder::DecodeSpec spec = decoder::DecodeSpecFromProto(got);
    EXPECT_EQ(spec.prompt_ids, ids);
    EXPECT_EQ(spec.request_id, "r#2");
  }
}

TEST(PromptEncodingTest, ThePrefillerReadsTheSameIdsThroughEitherField) {
  const std::vector<uint32_t> ids = Ids();
  for (const bool fixed32 : {true, false}) {
    SCOPED_TRACE(fixed32 ? "fixed32" : "varint");
    pb::PrefillRequest req;
    proxy::FillPrefillRequest(PrefillArgsFor(ids, fixed32), &req);
    const pb::PrefillRequest got = OverTheWire(req);
    EXPECT_EQ(got.prompt_token_ids_fixed32_size(), fixed32 ? 8000 : 0);
    EXPECT_EQ(got.prompt_token_ids_size(), fixed32 ? 0 : 8000);
    const prefiller::PrefillJob job = prefiller::ToPrefillJob(got, "");
    EXPECT_EQ(job.prompt_ids, ids);
    EXPECT_EQ(job.decoder_address, "d:1");
  }
}

// Issue 23 (prompt-io): the framed Prefill request written in parts (the
// call id, the head, the prompt's bytes as the proxy holds them) parses to
// the frame the message way builds, and the prefiller reads the same ids.
// A worker that reads only the varint field, or an empty prompt, gets the
// message.
TEST(PromptEncodingTest, ThePrefillFrameInPartsIsTheFrameTheMessageWayBuilds) {
  const std::vector<uint32_t> ids = Ids();
  proxy::PrefillArgs args = PrefillArgsFor(ids, true);
  args.decoder_reserve_address = "d:2";
  args.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  args.params.max_tokens = 17;
  args.waited = std::chrono::microseconds(2'500'000);  // a retry's (PrefillRequest.waited_us)
  for (const uint64_t timeout_us : {uint64_t{0}, uint64_t{1234567}}) {
    SCOPED_TRACE(timeout_us);
    proxy::PrefillRequestParts parts;
    ASSERT_TRUE(proxy::PrefillRequestInParts(args, timeout_us, &parts));
    EXPECT_EQ(parts.prompt.size(), 4u * ids.size());
    EXPECT_EQ(static_cast<const void*>(parts.prompt.data()),
              static_cast<const void*>(args.prompt_ids->data()));  // not a copy
    std::string wire = proxy::PrefillCallIdField(300);
    wire.append(parts.head);
    wire.append(parts.prompt);
    pb::PrefillFrame got;
    ASSERT_TRUE(got.ParseFromString(wire));
    pb::PrefillFrame want;
    want.set_call_id(300);
    proxy::FillPrefillRequest(args, want.mutable_request());
    want.set_traceparent(args.traceparent);
    want.set_timeout_us(timeout_us);
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
    ASSERT_EQ(got.kind_case(), pb::PrefillFrame::kRequest);
    EXPECT_EQ(got.request().prompt_token_ids_fixed32_size(), 8000);
    const prefiller::PrefillJob job = prefiller::ToPrefillJob(got.request(), "");
    EXPECT_EQ(job.prompt_ids, ids);
    EXPECT_EQ(job.decoder_address, "d:1");
    EXPECT_EQ(job.waited, args.waited);
  }
  // A wait beyond the prefiller's bound counts as the bound.
  {
    pb::PrefillRequest long_wait;
    long_wait.set_waited_us(uint64_t{1} << 60);
    EXPECT_EQ(prefiller::ToPrefillJob(long_wait, "").waited, prefiller::kMaxWaited);
  }
  proxy::PrefillRequestParts parts;
  EXPECT_FALSE(proxy::PrefillRequestInParts(PrefillArgsFor(ids, false), 0, &parts));
  args.prompt_ids = std::make_shared<const std::vector<uint32_t>>();
  EXPECT_FALSE(proxy::PrefillRequestInParts(args, 0, &parts));
  EXPECT_TRUE(parts.head.empty());
}

// Issue 23 (dec-parts): the decode stream's start written in parts (the
// prefix made once the handle is known, the head, the prompt's bytes as the
// proxy holds them, the traceparent) is byte for byte the serialization of
// the message the message way builds, for handles of every varint length
// and with or without a trace context, and the decoder reads the same ids.
// A decoder that reads only the varint field, or an empty prompt, gets the
// message.
TEST(PromptEncodingTest, TheDecodeStartInPartsIsTheMessagesSerialization) {
  const std::vector<uint32_t> ids = Ids();
  proxy::DecodeArgs args = DecodeArgsFor(ids, true);
  args.params.max_tokens = 17;
  args.params.stop_token_ids = {7, 9};
  args.tenant_salt = std::string("salt");
  args.params.tenant = std::string("t");
  args.params.priority = -3;
  const std::string traced = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  for (const std::string& traceparent : {std::string(), traced}) {
    args.traceparent = traceparent;
    for (const uint64_t handle : {uint64_t{1}, uint64_t{300}, uint64_t{1} << 40, ~uint64_t{0}}) {
      SCOPED_TRACE(testing::Message() << "handle " << handle << " traced " << !traceparent.empty());
      proxy::DecodeStartParts parts;
      ASSERT_TRUE(proxy::DecodeStartInParts(args, &parts));
      EXPECT_EQ(parts.prompt.size(), 4u * ids.size());
      EXPECT_EQ(static_cast<const void*>(parts.prompt.data()),
                static_cast<const void*>(args.prompt_ids->data()));  // not a copy
      std::string wire = proxy::DecodeStartPrefix(handle, parts);
      wire.append(parts.head);
      wire.append(parts.prompt);
      wire.append(parts.tail);
      pb::DecodeStreamRequest want;
      auto* start = want.mutable_start();
      start->set_handle(handle);
      proxy::FillDecodeRequest(args, start->mutable_request());
      start->set_traceparent(args.traceparent);
      EXPECT_EQ(wire, want.SerializeAsString());
      pb::DecodeStreamRequest got;
      ASSERT_TRUE(got.ParseFromString(wire));
      ASSERT_EQ(got.kind_case(), pb::DecodeStreamRequest::kStart);
      EXPECT_EQ(got.start().handle(), handle);
      EXPECT_EQ(got.start().traceparent(), traceparent);
      const decoder::DecodeSpec spec = decoder::DecodeSpecFromProto(got.start().request());
      EXPECT_EQ(spec.prompt_ids, ids);
      EXPECT_EQ(spec.request_id, "r#2");
    }
  }
  proxy::DecodeStartParts parts;
  EXPECT_FALSE(proxy::DecodeStartInParts(DecodeArgsFor(ids, false), &parts));
  args.prompt_ids = std::make_shared<const std::vector<uint32_t>>();
  EXPECT_FALSE(proxy::DecodeStartInParts(args, &parts));
  EXPECT_TRUE(parts.head.empty());
  EXPECT_EQ(parts.bytes, 0u);
}

// Session 39 (docs/decode-stream.md, "The prompt goes once"): a start by
// reference carries the prompt's length and digest and none of its tokens,
// in either field and in parts or not; the digest is XXH3-64 (seed 0) of the
// ids' little-endian bytes, so a decoder computes it from the Reserve's
// ids; the decoder's spec holds the reference and no ids. A start not by
// reference carries no reference.
TEST(PromptEncodingTest, AStartByReferenceCarriesTheLengthAndDigestInsteadOfThePrompt) {
  const std::vector<uint32_t> ids = Ids();
  std::string le;
  for (uint32_t id : ids) {
    for (int b = 0; b < 4; ++b) le.push_back(static_cast<char>(id >> (8 * b)));
  }
  const uint64_t want_digest = XXH3_64bits_withSeed(le.data(), le.size(), 0);
  EXPECT_EQ(PromptDigest(ids), want_digest);
  for (const bool fixed32 : {true, false}) {
    SCOPED_TRACE(fixed32);
    proxy::DecodeArgs args = DecodeArgsFor(ids, fixed32);
    args.prompt_varints = "\x01\x02";  // a client's own varints are not sent either
    args.prompt_by_reference = true;
    proxy::DecodeStartParts parts;
    EXPECT_FALSE(proxy::DecodeStartInParts(args, &parts));  // nothing to send apart
    pb::DecodeRequest req;
    proxy::FillDecodeRequest(args, &req);
    const pb::DecodeRequest got = OverTheWire(req);
    EXPECT_EQ(got.prompt_token_ids_size(), 0);
    EXPECT_EQ(got.prompt_token_ids_fixed32_size(), 0);
    EXPECT_EQ(got.prompt_length(), ids.size());
    EXPECT_EQ(got.prompt_digest(), want_digest);
    EXPECT_LT(req.ByteSizeLong(), 64u);  // against 32 kB for the prompt's ids
    const decoder::DecodeSpec spec = decoder::DecodeSpecFromProto(got);
    EXPECT_TRUE(spec.prompt_ids.empty());
    ASSERT_TRUE(spec.prompt_ref.has_value());
    EXPECT_EQ(spec.prompt_ref->length, ids.size());
    EXPECT_EQ(spec.prompt_ref->digest, want_digest);

    args.prompt_by_reference = false;
    pb::DecodeRequest plain;
    proxy::FillDecodeRequest(args, &plain);
    EXPECT_EQ(plain.prompt_length(), 0u);
    EXPECT_EQ(plain.prompt_digest(), 0u);
    EXPECT_FALSE(decoder::DecodeSpecFromProto(OverTheWire(plain)).prompt_ref.has_value());
  }
}

// Session 14 (issue 23): a client's GenerateRequest of 8k ids (1- to
// 3-byte varints, ids >= 2^14 included) goes through the native front
// end's parse and the proxy's validation, and both worker requests in parts
// carry the client's own varint bytes (not a copy, not re-encoded) in
// prompt_token_ids, whichever field the worker advertises; each parses to
// the message the message way builds with the varint field, and the
// decoder's DecodeSpec and the prefiller's PrefillJob hold exactly the ids
// the client sent.
TEST(PromptEncodingTest, TheWorkersReadTheIdsTheClientSentAsItsVarints) {
  constexpr uint32_t kVocab = 128256;
  std::vector<uint32_t> ids = {0, 127, 128, 16383, 16384, kVocab - 1};
  for (uint32_t i = 0; ids.size() < 8000; ++i) ids.push_back((i * 2654435761u) % kVocab);
  v1::GenerateRequest client;
  for (uint32_t id : ids) client.add_prompt_token_ids(id);
  client.set_max_tokens(1);
  const std::string body = client.SerializeAsString();

  proxy::GenerateRequestParts parsed;
  ASSERT_TRUE(proxy::ParseGenerateRequest(body, parsed).ok());
  proxy::ServingLimits limits;
  limits.model = "m";
  limits.vocab_size = kVocab;
  limits.max_model_len = 8192;
  auto v = proxy::ValidateRequest(
      proxy::ClientRequestFromProto(parsed.rest, std::move(parsed.prompt_token_ids),
                                    std::move(parsed.prompt_varints)),
      limits, [](std::string_view) { return std::vector<uint32_t>{}; }, 1);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  ASSERT_EQ(v->prompt_ids, ids);
  const std::string_view varints = v->prompt_varints.bytes();
  // The bytes the client sent in its field 4, after the field's tag (1
  // byte) and length (3 bytes).
  ASSERT_EQ(body.find(varints), 4u);
  EXPECT_LT(varints.size(), 3u * ids.size());
  EXPECT_GT(varints.size(), 2u * ids.size());  // many 3-byte ids

  for (const bool fixed32 : {true, false}) {
    SCOPED_TRACE(fixed32 ? "worker reads fixed32" : "worker reads varints only");
    proxy::PrefillArgs pa = PrefillArgsFor(v->prompt_ids, fixed32);
    pa.prompt_varints = varints;
    proxy::PrefillRequestParts pp;
    ASSERT_TRUE(proxy::PrefillRequestInParts(pa, 0, &pp));
    EXPECT_EQ(static_cast<const void*>(pp.prompt.data()),
              static_cast<const void*>(varints.data()));  // not a copy
    std::string wire = proxy::PrefillCallIdField(7) + pp.head + std::string(pp.prompt);
    pb::PrefillFrame frame;
    ASSERT_TRUE(frame.ParseFromString(wire));
    EXPECT_EQ(frame.request().prompt_token_ids_fixed32_size(), 0);
    EXPECT_EQ(frame.request().prompt_token_ids_size(), 8000);
    pb::PrefillFrame want;
    want.set_call_id(7);
    proxy::FillPrefillRequest(PrefillArgsFor(ids, /*fixed32=*/false), want.mutable_request());
    EXPECT_EQ(frame.SerializeAsString(), want.SerializeAsString());
    EXPECT_EQ(prefiller::ToPrefillJob(frame.request(), "").prompt_ids, ids);

    proxy::DecodeArgs da = DecodeArgsFor(v->prompt_ids, fixed32);
    da.prompt_varints = varints;
    proxy::DecodeStartParts dp;
    ASSERT_TRUE(proxy::DecodeStartInParts(da, &dp));
    EXPECT_EQ(static_cast<const void*>(dp.prompt.data()),
              static_cast<const void*>(varints.data()));
    wire = proxy::DecodeStartPrefix(300, dp) + dp.head + std::string(dp.prompt) + dp.tail;
    pb::DecodeStreamRequest start;
    ASSERT_TRUE(start.ParseFromString(wire));
    EXPECT_EQ(start.start().handle(), 300u);
    EXPECT_EQ(start.start().request().prompt_token_ids_fixed32_size(), 0);
    pb::DecodeStreamRequest want_start;
    want_start.mutable_start()->set_handle(300);
    proxy::FillDecodeRequest(DecodeArgsFor(ids, /*fixed32=*/false),
                             want_start.mutable_start()->mutable_request());
    EXPECT_EQ(start.SerializeAsString(), want_start.SerializeAsString());
    EXPECT_EQ(decoder::DecodeSpecFromProto(start.start().request()).prompt_ids, ids);
  }
}

// An older proxy fills only prompt_token_ids (field 2), element by element.
TEST(PromptEncodingTest, AWorkerReadsARequestWithOnlyTheOldField) {
  const std::vector<uint32_t> ids = {5, 300, 70000, 9};
  pb::DecodeRequest d;
  d.set_request_id("old");
  for (uint32_t t : ids) d.add_prompt_token_ids(t);
  EXPECT_EQ(decoder::DecodeSpecFromProto(OverTheWire(d)).prompt_ids, ids);
  pb::PrefillRequest p;
  p.set_request_id("old");
  for (uint32_t t : ids) p.add_prompt_token_ids(t);
  EXPECT_EQ(prefiller::ToPrefillJob(OverTheWire(p), "").prompt_ids, ids);
}

// The reading rule itself: the fixed field when it is not empty.
TEST(PromptEncodingTest, TheFixedFieldWinsWhenBothAreSet) {
  pb::DecodeRequest d;
  d.add_prompt_token_ids(1);
  EXPECT_EQ(std::vector<uint32_t>(PromptIdsOf(d).begin(), PromptIdsOf(d).end()),
            std::vector<uint32_t>{1});
  d.add_prompt_token_ids_fixed32(2);
  EXPECT_EQ(std::vector<uint32_t>(PromptIdsOf(d).begin(), PromptIdsOf(d).end()),
            std::vector<uint32_t>{2});
  pb::KvEvent::Removed r;
  r.add_block_hashes(7);
  EXPECT_EQ(BlockHashesOf(r).size(), 1u);
  EXPECT_EQ(BlockHashesOf(r)[0], 7u);
  r.add_block_hashes_fixed64(~uint64_t{0});
  EXPECT_EQ(BlockHashesOf(r)[0], ~uint64_t{0});
}

}  // namespace
}  // namespace tandem
