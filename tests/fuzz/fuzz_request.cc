// libFuzzer target: GenerateRequest validation (proxy/request.cc) — every
// field of ClientRequest drawn from the input, checked against fixed limits.
// A request that passes must satisfy those limits.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "proxy/request.h"

namespace {

std::vector<uint32_t> ByteTokens(std::string_view text) {
  std::vector<uint32_t> ids;
  for (char c : text) ids.push_back(static_cast<uint8_t>(c) * 5u);  // some ids past vocab 1000
  return ids;
}

// A broken invariant: says which, then crashes (libFuzzer keeps the input).
void Require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_request: invariant broken: %s\n", what);
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  FuzzedDataProvider in(data, size);
  tandem::proxy::ServingLimits limits;
  limits.model = "tandem-kjv";
  limits.vocab_size = 1000;
  limits.max_model_len = 256;
  limits.default_max_tokens = 16;
  limits.max_tokens_limit = 64;
  // proxy.limits, small so that inputs cross them.
  limits.max_prompt_tokens = in.ConsumeIntegralInRange<uint32_t>(0, 300);
  limits.max_stop_strings = 4;
  limits.max_stop_string_bytes = 32;
  limits.max_stop_token_ids = 8;
  limits.max_request_id_bytes = 64;
  tandem::proxy::ClientRequest r;
  r.request_id = in.ConsumeRandomLengthString(200);
  r.model = in.ConsumeBool() ? "" : in.ConsumeRandomLengthString(40);
  r.has_prompt = in.ConsumeBool();
  if (r.has_prompt) r.prompt = in.ConsumeRandomLengthString(400);
  const size_t n_ids = in.ConsumeIntegralInRange<size_t>(0, 300);
  for (size_t i = 0; i < n_ids && in.remaining_bytes() > 0; ++i) {
    r.prompt_token_ids.push_back(in.ConsumeIntegralInRange<uint32_t>(0, 1200));
  }
  if (in.ConsumeBool()) r.max_tokens = in.ConsumeIntegral<uint32_t>();
  if (in.ConsumeBool()) r.temperature = in.ConsumeFloatingPoint<float>();
  if (in.ConsumeBool()) r.top_p = in.ConsumeFloatingPoint<float>();
  if (in.ConsumeBool()) r.top_k = in.ConsumeIntegral<uint32_t>();
  if (in.ConsumeBool()) r.seed = in.ConsumeIntegral<uint64_t>();
  const size_t n_stop = in.ConsumeIntegralInRange<size_t>(0, 20);
  for (size_t i = 0; i < n_stop; ++i) r.stop.push_back(in.ConsumeRandomLengthString(300));
  const size_t n_stop_ids = in.ConsumeIntegralInRange<size_t>(0, 40);
  for (size_t i = 0; i < n_stop_ids; ++i) {
    r.stop_token_ids.push_back(in.ConsumeIntegralInRange<uint32_t>(0, 1200));
  }
  r.ignore_eos = in.ConsumeBool();
  auto v = tandem::proxy::ValidateRequest(r, limits, ByteTokens, 7);
  if (!v.ok()) {
    if (v.status().message().empty()) __builtin_trap();
    return 0;
  }
  // What passed must respect the limits it was checked against.
  Require(!v->prompt_ids.empty(), "prompt_ids empty");
  Require(v->max_tokens > 0 && v->max_tokens <= limits.max_tokens_limit, "max_tokens");
  Require(v->prompt_ids.size() + v->max_tokens <= limits.max_model_len, "prompt + max_tokens");
  Require(limits.max_prompt_tokens == 0 || v->prompt_ids.size() <= limits.max_prompt_tokens,
          "max_prompt_tokens");
  Require(v->stop.size() <= limits.max_stop_strings, "max_stop_strings");
  for (const std::string& s : v->stop) {
    Require(s.size() <= limits.max_stop_string_bytes, "max_stop_string_bytes");
  }
  Require(v->stop_token_ids.size() <= limits.max_stop_token_ids, "max_stop_token_ids");
  // The fleet id: "<label>~<nonce>" for a named request, the bare nonce
  // (echoed to the client) for an unnamed one; never the client's id.
  Require(!v->request_id.empty(), "fleet request id empty");
  if (r.request_id.empty()) {
    Require(v->client_request_id == v->request_id, "unnamed: echoes its nonce");
  } else {
    Require(v->client_request_id == r.request_id && v->request_id != r.request_id,
            "named: the client's id is only a label");
  }
  Require(v->client_request_id.size() <= limits.max_request_id_bytes, "max_request_id_bytes");
  for (uint32_t id : v->prompt_ids) Require(id < limits.vocab_size, "prompt id past the vocabulary");
  return 0;
}
