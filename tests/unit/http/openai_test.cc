// The OpenAI wire format: request bodies to ClientRequest (fields, types,
// refusals naming the field) and responses (shapes clients parse).
#include "http/openai.h"

#include <gtest/gtest.h>

namespace tandem::http {
namespace {

using nlohmann::json;

OpenAiRequest Ok(Endpoint ep, const std::string& body) {
  auto r = ParseRequest(ep, body);
  EXPECT_TRUE(r.ok()) << body << ": " << r.status().ToString();
  return r.ok() ? *r : OpenAiRequest{};
}

std::string Err(Endpoint ep, const std::string& body) {
  auto r = ParseRequest(ep, body);
  EXPECT_FALSE(r.ok()) << body;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return r.status().message();
}

TEST(OpenAiParse, CompletionFields) {
  auto r = Ok(Endpoint::kCompletions,
              R"({"model":"m","prompt":"hi","max_tokens":7,"temperature":0,"top_p":0.5,
                  "top_k":-1,"seed":-3,"stop":"\n","n":1,"ignore_eos":true,"stream":true,
                  "stream_options":{"include_usage":true},"user":"ignored"})");
  EXPECT_EQ(r.request.model, "m");
  EXPECT_TRUE(r.request.has_prompt);
  EXPECT_EQ(r.request.prompt, "hi");
  EXPECT_EQ(r.request.max_tokens, 7u);
  EXPECT_EQ(r.request.temperature, 0.0f);
  EXPECT_EQ(r.request.top_p, 0.5f);
  EXPECT_EQ(r.request.top_k, 0u);
  EXPECT_EQ(r.request.seed, static_cast<uint64_t>(int64_t{-3}));
  EXPECT_EQ(r.request.stop, std::vector<std::string>{"\n"});
  EXPECT_TRUE(r.request.ignore_eos);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  // Unset stays unset (the proxy's defaults apply).
  auto d = Ok(Endpoint::kCompletions, R"({"prompt":"hi","max_tokens":null})");
  EXPECT_FALSE(d.request.max_tokens.has_value());
  EXPECT_FALSE(d.request.temperature.has_value());
  EXPECT_FALSE(d.request.seed.has_value());
  EXPECT_FALSE(d.stream);
  EXPECT_FALSE(d.request.priority.has_value());
}

TEST(OpenAiParse, Priority) {
  auto r = Ok(Endpoint::kCompletions, R"({"prompt":"hi","priority":-3})");
  EXPECT_EQ(r.request.priority, std::optional<int32_t>(-3));
  EXPECT_NE(Err(Endpoint::kCompletions, R"({"prompt":"hi","priority":"high"})").find("priority"),
            std::string::npos);
  EXPECT_NE(Err(Endpoint::kCompletions, R"({"prompt":"hi","priority":3000000000})").find("priority"),
            std::string::npos);
}

TEST(OpenAiParse, PromptForms) {
  EXPECT_EQ(Ok(Endpoint::kCompletions, R"({"prompt":["one"]})").request.prompt, "one");
  auto ids = Ok(Endpoint::kCompletions, R"({"prompt":[1,2,3]})");
  EXPECT_EQ(ids.request.prompt_token_ids, (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_TRUE(ids.prompt_was_ids);
  EXPECT_EQ(Ok(Endpoint::kCompletions, R"({"prompt":[[4,5]]})").request.prompt_token_ids,
            (std::vector<uint32_t>{4, 5}));
  EXPECT_NE(Err(Endpoint::kCompletions, R"({"prompt":["a","b"]})").find("one prompt per request"),
            std::string::npos);
  EXPECT_EQ(Err(Endpoint::kCompletions, R"({"max_tokens":3})"), "prompt is required");
  EXPECT_EQ(Err(Endpoint::kCompletions, R"({"prompt":""})"), "prompt is empty");
  EXPECT_NE(Err(Endpoint::kCompletions, R"({"prompt":[1,-2]})").find("prompt[1]"),
            std::string::npos);
  EXPECT_NE(Err(Endpoint::kCompletions, R"({"prompt":5})").find("prompt must be"),
            std::string::npos);
}

TEST(OpenAiParse, ChatMessages) {
  auto r = Ok(Endpoint::kChat,
              R"({"messages":[{"role":"system","content":"s"},
                              {"role":"user","content":[{"type":"text","text":"a"},
                                                        {"type":"text","text":"b"}]},
                              {"role":"assistant","content":null}],
                  "max_tokens":3,"max_completion_tokens":9})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1].content, "a\nb");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.request.max_tokens, 9u);  // max_completion_tokens wins
  EXPECT_EQ(Err(Endpoint::kChat, R"({"messages":[]})"),
            "messages is empty; give at least one message");
  EXPECT_NE(Err(Endpoint::kChat, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})")
                .find("messages[0].content[0].type"),
            std::string::npos);
  EXPECT_NE(Err(Endpoint::kChat, R"({"messages":[{"content":"x"}]})").find("messages[0].role"),
            std::string::npos);
}

TEST(OpenAiParse, RefusalsNameTheField) {
  const Endpoint c = Endpoint::kCompletions;
  EXPECT_EQ(Err(c, "{not json"), "the request body is not valid JSON");
  EXPECT_EQ(Err(c, "[1]"), "the request body must be a JSON object");
  EXPECT_EQ(Err(c, R"({"prompt":"x","temperature":"hot"})"),
            "temperature must be a number, got a string");
  EXPECT_EQ(Err(c, R"({"prompt":"x","max_tokens":0})"), "max_tokens must be at least 1, got 0");
  EXPECT_EQ(Err(c, R"({"prompt":"x","max_tokens":1.5})"),
            "max_tokens must be an integer, got a fractional number");
  EXPECT_NE(Err(c, R"({"prompt":"x","n":2})").find("n must be 1"), std::string::npos);
  EXPECT_EQ(Err(c, R"({"prompt":"x","stop":[1]})"), "stop[0] must be a string, got an integer");
  EXPECT_NE(Err(c, R"({"prompt":"x","logprobs":2})").find("logprobs"), std::string::npos);
  EXPECT_NE(Err(c, R"({"prompt":"x","presence_penalty":0.5})").find("presence_penalty"),
            std::string::npos);
  EXPECT_NE(Err(c, R"({"prompt":"x","stream_options":{"include_usage":true}})")
                .find("stream_options"),
            std::string::npos);
  // Neutral values of unsupported fields are accepted.
  Ok(c, R"({"prompt":"x","presence_penalty":0,"logprobs":null,"echo":false,"best_of":1})");
}

TEST(OpenAiParse, ValidatorMessagesUseOpenAiNames) {
  OpenAiRequest r;
  EXPECT_EQ(ToOpenAiMessage(r, "sampling.top_p must be in (0, 1], got 2"),
            "top_p must be in (0, 1], got 2");
  r.prompt_was_ids = true;
  EXPECT_EQ(ToOpenAiMessage(r, "prompt_token_ids[0] is 9999"), "prompt[0] is 9999");
}

TEST(OpenAiErrors, StatusesAndShape) {
  EXPECT_EQ(HttpStatus(StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatus(StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatus(StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatus(StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatus(StatusCode::kUnavailable), 503);
  auto e = json::parse(ErrorBody(400, "temperature must be a number, got a string"));
  EXPECT_EQ(e["error"]["param"], "temperature");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(json::parse(ErrorBody(400, "the request body is not valid JSON"))["error"]["param"]
                  .is_null());
  EXPECT_EQ(json::parse(ErrorBody(400, "messages[2].role is 'x'"))["error"]["param"],
            "messages[2].role");
  EXPECT_EQ(json::parse(ErrorBody(429, "full"))["error"]["code"], "rate_limit_exceeded");
}

TEST(OpenAiResponses, Shapes) {
  ResponseMeta m{Endpoint::kChat, "chatcmpl-1", 5, "m"};
  proxy::Usage u{3, 2, 1};
  auto full = json::parse(FullResponse(m, "hi", proxy::Finish::kLength, u));
  EXPECT_EQ(full["object"], "chat.completion");
  EXPECT_EQ(full["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(full["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(full["usage"]["total_tokens"], 5);
  EXPECT_EQ(full["usage"]["prompt_tokens_details"]["cached_tokens"], 1);

  const std::string first = StreamDelta(m, "a", true, false);
  ASSERT_EQ(first.rfind("data: ", 0), 0u);
  ASSERT_EQ(first.substr(first.size() - 2), "\n\n");
  auto j = json::parse(first.substr(6));
  EXPECT_EQ(j["choices"][0]["delta"]["role"], "assistant");
  EXPECT_FALSE(j.contains("usage"));

  const std::string end = StreamEnd(m, proxy::Finish::kStop, u, true);
  EXPECT_NE(end.find(R"("choices":[])"), std::string::npos);
  EXPECT_EQ(end.substr(end.size() - 14), "data: [DONE]\n\n");

  ResponseMeta c{Endpoint::kCompletions, "cmpl-1", 5, "m"};
  auto cj = json::parse(FullResponse(c, "t", proxy::Finish::kStop, u));
  EXPECT_EQ(cj["object"], "text_completion");
  EXPECT_EQ(cj["choices"][0]["text"], "t");
  EXPECT_EQ(cj["choices"][0]["finish_reason"], "stop");
}

}  // namespace
}  // namespace tandem::http
