// Session 8 (prompt-copy; docs/serving-workers.md, "Prompt and hash encoding"): the
// prompt a proxy puts in DecodeRequest/PrefillRequest reaches the workers'
// specs as the same ids whichever field carries it — fixed32 to a worker
// that advertises WorkerInfo.reads_fixed32_prompt, the packed varints to an
// older one — and a worker still reads a request that has only the varint
// field (what an older proxy sends). Over the wire: the messages are
// serialized and parsed back, as the transports do.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "common/wire_ids.h"
#include "decoder/decode_mux.h"
#include "prefiller/prefiller_service.h"
#include "proxy/decode_mux_client.h"
#include "proxy/prefill_tcp_client.h"
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
  a.request_id = "r";
  a.attempt = 2;
  a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(ids);
  a.deadline = std::chrono::system_clock::time_point::max();
  a.prompt_fixed32 = fixed32;
  return a;
}

proxy::PrefillArgs PrefillArgsFor(const std::vector<uint32_t>& ids, bool fixed32) {
  proxy::PrefillArgs a;
  a.request_id = "r";
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
