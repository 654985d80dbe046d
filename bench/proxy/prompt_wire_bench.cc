// The proxy's protobuf work per admitted 8k-token prompt on the two paths
// session 8 changed (docs/serving-workers.md, "Prompt and hash encoding"),
// old encoding (arg 0) vs new (arg 1):
//   BM_BuildRequests  FillDecodeRequest + FillPrefillRequest and their
//                     serialization (what FrameConn::Send does: ByteSizeLong,
//                     then serialize into the connection's buffer);
//   BM_ParseEvents    parsing one WorkerUpdate batch holding 1,000 block
//                     hashes (an 8k prompt's stored events from the
//                     prefiller and the decoder) into the reused message
//                     (arena=0, the reader before issue 23's session 9) or
//                     with the Watch reader's WorkerUpdateParser (arena=1);
//   BM_ParseGenerateRequest  the native front end's parse of a client's
//                     GenerateRequest of 8,000 prompt ids drawn from a
//                     vocabulary of `vocab` ids (4,096: the bundled model's,
//                     2-byte varints; 32,000: mostly 2 and 3 bytes; 128,256:
//                     Llama-3's, mostly 3), the body's copy included.
// Ids are spread over a Llama-3 vocabulary (128,256: mostly 3-byte varints);
// hashes are random 64-bit values (10-byte varints).
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "proxy/decode_mux_client.h"
#include "proxy/generate_convert.h"
#include "proxy/prefill_tcp_client.h"
#include "proxy/watch_tcp_client.h"
#include "tandem/v1/generation.pb.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

std::shared_ptr<const std::vector<uint32_t>> Prompt8k() {
  std::mt19937 rng(7);
  std::vector<uint32_t> ids(8000);
  for (auto& t : ids) t = rng() % 128256;
  return std::make_shared<const std::vector<uint32_t>>(std::move(ids));
}

void BM_BuildRequests(benchmark::State& state) {
  const bool fixed32 = state.range(0) != 0;
  DecodeArgs d;
  d.request_id = "req-0123456789";
  d.prompt_ids = Prompt8k();
  d.deadline = std::chrono::system_clock::time_point::max();
  d.attempt = 1;
  d.prompt_fixed32 = fixed32;
  PrefillArgs p;
  p.request_id = d.request_id;
  p.prompt_ids = d.prompt_ids;
  p.deadline = d.deadline;
  p.decoder_address = "127.0.0.1:40001";
  p.decoder_name = "decode-0";
  p.attempt = 1;
  p.prompt_fixed32 = fixed32;
  std::string out;
  size_t bytes = 0;
  for (auto _ : state) {
    pb::DecodeRequest dr;
    FillDecodeRequest(d, &dr);
    pb::PrefillRequest pr;
    FillPrefillRequest(p, &pr);
    out.clear();
    out.resize(dr.ByteSizeLong() + pr.ByteSizeLong());
    auto* end = dr.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out.data()));
    pr.SerializeWithCachedSizesToArray(end);
    bytes = out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["wire_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_BuildRequests)->ArgName("fixed32")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_ParseEvents(benchmark::State& state) {
  const bool fixed64 = state.range(0) != 0;
  const bool arena = state.range(1) != 0;
  std::mt19937_64 rng(11);
  pb::WorkerUpdate u;
  for (int e = 0; e < 8; ++e) {  // 8 stored events of 125 blocks
    auto* ev = u.add_events();
    ev->set_event_id(e + 1);
    ev->set_epoch(42);
    auto* st = ev->mutable_stored();
    for (int i = 0; i < 125; ++i) {
      if (fixed64) {
        st->add_block_hashes_fixed64(rng());
      } else {
        st->add_block_hashes(rng());
      }
    }
  }
  const std::string wire = u.SerializeAsString();
  pb::WorkerUpdate parsed;  // reused, as the watch reader's was
  WorkerUpdateParser parser;
  for (auto _ : state) {
    if (arena) {
      benchmark::DoNotOptimize(parser.Parse(wire)->events_size());
    } else {
      parsed.ParseFromArray(wire.data(), static_cast<int>(wire.size()));
      benchmark::DoNotOptimize(parsed.events_size());
    }
  }
  state.counters["wire_bytes"] = static_cast<double>(wire.size());
}
BENCHMARK(BM_ParseEvents)
    ->ArgNames({"fixed64", "arena"})
    ->Args({0, 0})->Args({1, 0})->Args({1, 1})
    ->Unit(benchmark::kMicrosecond);

void BM_ParseGenerateRequest(benchmark::State& state) {
  const auto vocab = static_cast<uint32_t>(state.range(0));
  std::mt19937 rng(5);
  pb::GenerateRequest req;
  req.set_request_id("req-0123456789");
  req.set_max_tokens(1);
  for (int i = 0; i < 8000; ++i) req.add_prompt_token_ids(rng() % vocab);
  const std::string wire = req.SerializeAsString();
  GenerateRequestParts parts;
  for (auto _ : state) {
    std::string body = wire;
    const Status st = ParseGenerateRequest(std::move(body), parts);
    if (!st.ok() || parts.prompt_token_ids.size() != 8000 || parts.prompt_varints.size == 0) {
      state.SkipWithError("the request did not parse into 8,000 forwardable ids");
      break;
    }
    benchmark::DoNotOptimize(parts.prompt_token_ids.data());
  }
  state.counters["wire_bytes"] = static_cast<double>(wire.size());
}
BENCHMARK(BM_ParseGenerateRequest)
    ->ArgName("vocab")
    ->Arg(4096)
    ->Arg(32000)
    ->Arg(128256)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tandem::proxy

BENCHMARK_MAIN();
