#include "proxy/request.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tandem::proxy {
namespace {

ServingLimits Limits() {
  ServingLimits l;
  l.model = "tandem-kjv";
  l.vocab_size = 4096;
  l.max_model_len = 1024;
  l.default_max_tokens = 128;
  l.max_tokens_limit = 512;
  return l;
}

// One token per byte: enough to count prompt lengths.
std::vector<uint32_t> ByteEncode(std::string_view s) {
  return std::vector<uint32_t>(s.begin(), s.end());
}

Result<ValidatedRequest> V(const ClientRequest& r) {
  return ValidateRequest(r, Limits(), ByteEncode, 777);
}

ClientRequest Text(std::string prompt) {
  ClientRequest r;
  r.has_prompt = true;
  r.prompt = std::move(prompt);
  return r;
}

TEST(ValidateRequest, DefaultsAreResolved) {
  auto v = V(Text("hello"));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  // No client id: the fleet id is 32 random hex digits, echoed to the client.
  EXPECT_EQ(v->request_id.size(), 32u);
  EXPECT_EQ(v->client_request_id, v->request_id);
  EXPECT_EQ(v->model, "tandem-kjv");
  EXPECT_EQ(v->prompt_ids.size(), 5u);
  EXPECT_EQ(v->max_tokens, 128u);
  EXPECT_FLOAT_EQ(v->temperature, 1.0f);
  EXPECT_FLOAT_EQ(v->top_p, 1.0f);
  EXPECT_EQ(v->top_k, 0u);
  EXPECT_EQ(v->seed, 777u);
}

TEST(ValidateRequest, LatencySlosAreKeptAndRangeChecked) {
  ClientRequest r = Text("hi");
  auto unset = V(r);
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->ttft_slo_ms, 0u);  // none: the admission step fills proxy.slo
  r.ttft_slo_ms = 250;
  r.tpot_slo_ms = 40;
  auto v = V(r);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->ttft_slo_ms, 250u);
  EXPECT_EQ(v->tpot_slo_ms, 40u);
  r.ttft_slo_ms = 0;  // 0 is an error, not "none"
  auto zero = V(r);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("ttft_slo_ms is 0"), std::string::npos) << zero.status().message();
  r.ttft_slo_ms = 250;
  r.tpot_slo_ms = kMaxSloMs + 1;
  auto big = V(r);
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("tpot_slo_ms"), std::string::npos) << big.status().message();
}

TEST(ValidateRequest, SetValuesAreKept) {
  ClientRequest r = Text("hi");
  r.request_id = "mine";
  r.model = "tandem-kjv";
  r.max_tokens = 7;
  r.temperature = 0.0f;
  r.top_p = 0.5f;
  r.top_k = 40;
  r.seed = 0;
  r.stop = {"\n\n"};
  r.stop_token_ids = {3};
  r.ignore_eos = true;
  auto v = V(r);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->client_request_id, "mine");
  // The workers see "<label>~<32 hex>": the label for logs, the nonce unique.
  EXPECT_EQ(v->request_id.rfind("mine~", 0), 0u) << v->request_id;
  EXPECT_EQ(v->request_id.size(), 5u + 32u);
  EXPECT_EQ(v->max_tokens, 7u);
  EXPECT_FLOAT_EQ(v->temperature, 0.0f);
  EXPECT_EQ(v->top_k, 40u);
  EXPECT_EQ(v->seed, 0u);  // a set seed of 0 is a seed, not "unset"
  EXPECT_TRUE(v->ignore_eos);
}

TEST(ValidateRequest, UnsetMaxTokensShrinksToFit) {
  auto v = V(Text(std::string(1000, 'a')));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->max_tokens, 24u);
}

struct BadCase {
  const char* name;
  ClientRequest req;
  StatusCode code;
  const char* message;
};

std::vector<BadCase> BadCases() {
  std::vector<BadCase> c;
  auto add = [&](const char* name, ClientRequest r, StatusCode code, const char* msg) {
    c.push_back({name, std::move(r), code, msg});
  };
  add("empty prompt", Text(""), StatusCode::kInvalidArgument, "prompt is empty");
  ClientRequest both = Text("x");
  both.prompt_token_ids = {1};
  add("both", both, StatusCode::kInvalidArgument,
      "give exactly one of prompt and prompt_token_ids, not both");
  add("neither", ClientRequest{}, StatusCode::kInvalidArgument,
      "give exactly one of prompt and prompt_token_ids; neither is set");
  ClientRequest ids;
  ids.prompt_token_ids = {1, 2, 4096};
  add("token out of vocab", ids, StatusCode::kInvalidArgument,
      "prompt_token_ids[2] is 4096; token ids must be below the vocabulary size 4096");
  // The first offender is named, not the largest (a larger one follows it).
  ClientRequest two_bad;
  two_bad.prompt_token_ids = std::vector<uint32_t>(40, 7);
  two_bad.prompt_token_ids[17] = 4097;
  two_bad.prompt_token_ids[31] = 99999;
  add("first token out of vocab", two_bad, StatusCode::kInvalidArgument,
      "prompt_token_ids[17] is 4097; token ids must be below the vocabulary size 4096");
  ClientRequest long_prompt = Text(std::string(1024, 'a'));
  add("prompt too long", long_prompt, StatusCode::kInvalidArgument,
      "prompt has 1024 tokens; this model accepts at most 1024 (prompt + completion; "
      "proxy.limits.max_prompt_tokens)");
  ClientRequest long_ids;
  long_ids.prompt_token_ids.assign(5000, 1);
  add("prompt_token_ids too long", long_ids, StatusCode::kInvalidArgument,
      "prompt_token_ids has 5000 tokens; this model accepts at most 1024 (prompt + completion; "
      "proxy.limits.max_prompt_tokens)");
  ClientRequest over = Text(std::string(1000, 'a'));
  over.max_tokens = 100;
  add("prompt + max_tokens", over, StatusCode::kInvalidArgument,
      "prompt (1000 tokens) + max_tokens (100) = 1100 exceeds the model's context of 1024 tokens");
  ClientRequest zero = Text("x");
  zero.max_tokens = 0;
  add("max_tokens 0", zero, StatusCode::kInvalidArgument, "max_tokens must be at least 1, got 0");
  ClientRequest big = Text("x");
  big.max_tokens = 513;
  add("max_tokens above limit", big, StatusCode::kInvalidArgument,
      "max_tokens is 513; this fleet allows at most 512");
  ClientRequest temp = Text("x");
  temp.temperature = -0.5f;
  add("negative temperature", temp, StatusCode::kInvalidArgument,
      "sampling.temperature must be >= 0 (0 is greedy), got -0.5");
  ClientRequest nan_temp = Text("x");
  nan_temp.temperature = std::nanf("");
  add("NaN temperature", nan_temp, StatusCode::kInvalidArgument,
      "sampling.temperature must be >= 0 (0 is greedy), got nan");
  ClientRequest p0 = Text("x");
  p0.top_p = 0.0f;
  add("top_p 0", p0, StatusCode::kInvalidArgument, "sampling.top_p must be in (0, 1], got 0");
  ClientRequest p2 = Text("x");
  p2.top_p = 1.5f;
  add("top_p 1.5", p2, StatusCode::kInvalidArgument, "sampling.top_p must be in (0, 1], got 1.5");
  add("invalid UTF-8", Text("ab\xC3"), StatusCode::kInvalidArgument, "prompt is not valid UTF-8");
  ClientRequest model = Text("x");
  model.model = "gpt-9";
  add("unknown model", model, StatusCode::kNotFound,
      "model 'gpt-9' is not served here; this fleet serves 'tandem-kjv'");
  ClientRequest bad_stop = Text("x");
  bad_stop.stop = {"ok", "\xC0\xAF"};
  add("invalid UTF-8 stop", bad_stop, StatusCode::kInvalidArgument, "stop[1] is not valid UTF-8");
  ClientRequest bad_id = Text("x");
  bad_id.request_id = "id\xFF";
  add("invalid UTF-8 request_id", bad_id, StatusCode::kInvalidArgument,
      "request_id is not valid UTF-8");
  ClientRequest stop = Text("x");
  stop.stop = {""};
  add("empty stop", stop, StatusCode::kInvalidArgument, "stop[0] is empty");
  ClientRequest many_stops = Text("x");
  many_stops.stop.assign(17, "s");
  add("too many stop strings", many_stops, StatusCode::kInvalidArgument,
      "stop has 17 strings; the limit is 16 (proxy.limits.max_stop_strings)");
  ClientRequest long_stop = Text("x");
  long_stop.stop = {std::string(257, 's')};
  add("stop string too long", long_stop, StatusCode::kInvalidArgument,
      "stop[0] has 257 bytes; the limit is 256 (proxy.limits.max_stop_string_bytes)");
  ClientRequest many_stop_ids = Text("x");
  many_stop_ids.stop_token_ids.assign(65, 3);
  add("too many stop token ids", many_stop_ids, StatusCode::kInvalidArgument,
      "stop_token_ids has 65 ids; the limit is 64 (proxy.limits.max_stop_token_ids)");
  ClientRequest stop_id = Text("x");
  stop_id.stop_token_ids = {99999};
  add("stop id out of vocab", stop_id, StatusCode::kInvalidArgument,
      "stop_token_ids[0] is 99999; token ids must be below the vocabulary size 4096");
  return c;
}

TEST(ValidateRequest, EveryBadInputNamesFieldAndLimit) {
  for (const auto& c : BadCases()) {
    auto v = V(c.req);
    ASSERT_FALSE(v.ok()) << c.name;
    EXPECT_EQ(v.status().code(), c.code) << c.name;
    EXPECT_EQ(v.status().message(), c.message) << c.name;
  }
}

// Found by fuzz_request: a tokenizer whose ids reach past the model's
// vocabulary must not hand them on (regression seed in tests/fuzz/corpus/request).
TEST(ValidateRequest, TextThatEncodesPastTheVocabularyIsRefused) {
  ServingLimits l = Limits();
  l.vocab_size = 100;
  auto r = ValidateRequest(Text("ab"), l, ByteEncode, 1);  // 'a' = 97, 'b' = 98
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto bad = ValidateRequest(Text("abe"), l, ByteEncode, 1);  // 'e' = 101
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("token id 101"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("vocabulary of 100"), std::string::npos);
}

TEST(ValidateRequest, ItsOwnPromptTokenLimitIsNamed) {
  ServingLimits l = Limits();
  l.max_prompt_tokens = 10;
  auto ok = ValidateRequest(Text(std::string(10, 'a')), l, ByteEncode, 1);
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  auto text = ValidateRequest(Text(std::string(11, 'a')), l, ByteEncode, 1);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().message(),
            "prompt has 11 tokens; the limit is 10 (proxy.limits.max_prompt_tokens)");
  ClientRequest ids;
  ids.prompt_token_ids.assign(11, 1);
  auto by_ids = ValidateRequest(ids, l, ByteEncode, 1);
  ASSERT_FALSE(by_ids.ok());
  EXPECT_EQ(by_ids.status().message(),
            "prompt_token_ids has 11 tokens; the limit is 10 (proxy.limits.max_prompt_tokens)");
}

TEST(ValidateRequest, TheSameClientIdGetsADifferentFleetIdEveryTime) {
  ClientRequest r = Text("hi");
  r.request_id = "same";
  auto a = V(r), b = V(r);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->client_request_id, b->client_request_id);
  EXPECT_NE(a->request_id, b->request_id);
}

}  // namespace
}  // namespace tandem::proxy
