// The OpenAI wire format, without I/O: JSON request bodies of
// /v1/completions and /v1/chat/completions become the proxy's ClientRequest
// (the same struct the gRPC adapter fills), and results become OpenAI JSON
// (whole responses, SSE chunks, errors). Field-by-field behaviour:
// docs/http-api.md.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/chat_template.h"
#include "proxy/lifecycle.h"
#include "proxy/request.h"

namespace tandem::http {

enum class Endpoint { kCompletions, kChat };

struct OpenAiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  proxy::ClientRequest request;  // completions: prompt or prompt ids; chat: filled by the caller
  std::vector<model::ChatMessage> messages;  // chat only
  bool prompt_was_ids = false;               // completions: prompt given as token ids
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Parses and checks a request body. INVALID_ARGUMENT names the field
// (e.g. "temperature must be a number, got a string").
Result<OpenAiRequest> ParseRequest(Endpoint endpoint, std::string_view body);

// Rewrites a validation message of the shared validator in OpenAI field
// names ("sampling.temperature ..." -> "temperature ...", prompt_token_ids ->
// prompt when the prompt was given as ids).
std::string ToOpenAiMessage(const OpenAiRequest& r, std::string message);

// HTTP status of a tandem status code: 400, 401, 404, 429, 503, 504, 500.
int HttpStatus(StatusCode code);
// {"error": {"message", "type", "param", "code"}}; `param` is the field the
// message starts with, when it starts with one.
std::string ErrorBody(int http_status, const std::string& message);

const char* FinishName(proxy::Finish f);  // "stop" | "length" | null-ish ""

// What a response needs besides the tokens.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // cmpl-... / chatcmpl-...
  int64_t created = 0;
  std::string model;
};

nlohmann::json UsageJson(const proxy::Usage& u);
// A complete non-streaming response.
std::string FullResponse(const ResponseMeta& m, const std::string& text, proxy::Finish finish,
                         const proxy::Usage& usage);
// One SSE event "data: {...}\n\n" carrying `text` (first: chat's role delta);
// with include_usage every chunk has "usage": null, as OpenAI's do.
std::string StreamDelta(const ResponseMeta& m, const std::string& text, bool first,
                        bool include_usage);
// The chunk with finish_reason (empty delta), then, with include_usage, the
// usage-only chunk (choices: []), then "data: [DONE]".
std::string StreamEnd(const ResponseMeta& m, proxy::Finish finish, const proxy::Usage& usage,
                      bool include_usage);
// An error after the stream started: an error event, then "data: [DONE]".
std::string StreamError(int http_status, const std::string& message);

// JSON text that never throws: invalid UTF-8 is replaced.
std::string Dump(const nlohmann::json& j);

}  // namespace tandem::http
