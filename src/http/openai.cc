#include "http/openai.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <limits>

#include "model/tokenizer.h"

namespace tandem::http {
namespace {

using nlohmann::json;

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a fractional number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    default: return "something else";
  }
}

Status WrongType(std::string_view field, std::string_view want, const json& got) {
  return InvalidArgumentError(fmt::format("{} must be {}, got {}", field, want, TypeName(got)));
}

// Present and not null.
const json* Field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

Result<std::optional<float>> OptNumber(const json& body, const char* key) {
  const json* v = Field(body, key);
  if (!v) return std::optional<float>();
  if (!v->is_number()) return WrongType(key, "a number", *v);
  const double d = v->get<double>();
  if (!std::isfinite(d)) return InvalidArgumentError(fmt::format("{} must be finite", key));
  return std::optional<float>(static_cast<float>(d));
}

Result<std::optional<int64_t>> OptInteger(const json& body, const char* key) {
  const json* v = Field(body, key);
  if (!v) return std::optional<int64_t>();
  if (!v->is_number_integer()) return WrongType(key, "an integer", *v);
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
    return InvalidArgumentError(fmt::format("{} is too large", key));
  }
  return std::optional<int64_t>(v->get<int64_t>());
}

Result<bool> OptBool(const json& body, const char* key) {
  const json* v = Field(body, key);
  if (!v) return false;
  if (!v->is_boolean()) return WrongType(key, "true or false", *v);
  return v->get<bool>();
}

Result<std::optional<uint32_t>> OptTokenCount(const json& body, const char* key) {
  TANDEM_ASSIGN_OR_RETURN(auto v, OptInteger(body, key));
  if (!v) return std::optional<uint32_t>();
  if (*v < 1) return InvalidArgumentError(fmt::format("{} must be at least 1, got {}", key, *v));
  if (*v > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgumentError(fmt::format("{} is {}; that is too large", key, *v));
  }
  return std::optional<uint32_t>(static_cast<uint32_t>(*v));
}

Result<std::vector<uint32_t>> TokenIds(const json& arr, std::string_view field) {
  std::vector<uint32_t> ids;
  ids.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const json& t = arr[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
        t.get<int64_t>() > std::numeric_limits<uint32_t>::max()) {
      return InvalidArgumentError(
          fmt::format("{}[{}] must be a token id (an integer >= 0)", field, i));
    }
    ids.push_back(t.get<uint32_t>());
  }
  return ids;
}

Status ParsePrompt(const json& body, OpenAiRequest& out) {
  const json* p = Field(body, "prompt");
  if (!p) return InvalidArgumentError("prompt is required");
  auto& r = out.request;
  if (p->is_string()) {
    r.has_prompt = true;
    r.prompt = p->get<std::string>();
    if (r.prompt.empty()) return InvalidArgumentError("prompt is empty");
    return Status::Ok();
  }
  if (!p->is_array()) return WrongType("prompt", "a string, a list of token ids or a list of one of those", *p);
  if (p->empty()) return InvalidArgumentError("prompt is an empty list");
  if ((*p)[0].is_number()) {
    TANDEM_ASSIGN_OR_RETURN(r.prompt_token_ids, TokenIds(*p, "prompt"));
    out.prompt_was_ids = true;
    return Status::Ok();
  }
  if (p->size() > 1) {
    return InvalidArgumentError(fmt::format(
        "prompt is a list of {} prompts; this server takes one prompt per request (send them "
        "as separate requests)",
        p->size()));
  }
  const json& one = (*p)[0];
  if (one.is_string()) {
    r.has_prompt = true;
    r.prompt = one.get<std::string>();
    if (r.prompt.empty()) return InvalidArgumentError("prompt[0] is empty");
    return Status::Ok();
  }
  if (one.is_array()) {
    if (one.empty()) return InvalidArgumentError("prompt[0] is an empty list");
    TANDEM_ASSIGN_OR_RETURN(r.prompt_token_ids, TokenIds(one, "prompt[0]"));
    out.prompt_was_ids = true;
    return Status::Ok();
  }
  return WrongType("prompt[0]", "a string or a list of token ids", one);
}

Status ParseMessages(const json& body, OpenAiRequest& out) {
  const json* m = Field(body, "messages");
  if (!m) return InvalidArgumentError("messages is required");
  if (!m->is_array()) return WrongType("messages", "a list of messages", *m);
  if (m->empty()) return InvalidArgumentError("messages is empty; give at least one message");
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    if (!msg.is_object()) return WrongType(fmt::format("messages[{}]", i), "an object", msg);
    model::ChatMessage cm;
    const json* role = Field(msg, "role");
    if (!role || !role->is_string()) {
      return InvalidArgumentError(fmt::format("messages[{}].role must be a string", i));
    }
    cm.role = role->get<std::string>();
    const json* content = Field(msg, "content");
    if (content == nullptr) {
      // An assistant turn may carry no content (e.g. only tool calls).
      if (cm.role != "assistant") {
        return InvalidArgumentError(fmt::format("messages[{}].content is required", i));
      }
    } else if (content->is_string()) {
      cm.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j) {
        const json& part = (*content)[j];
        const json* type = part.is_object() ? Field(part, "type") : nullptr;
        if (!type || !type->is_string() || type->get<std::string>() != "text") {
          return InvalidArgumentError(fmt::format(
              "messages[{}].content[{}].type must be 'text'; this server takes text only", i, j));
        }
        const json* text = Field(part, "text");
        if (!text || !text->is_string()) {
          return InvalidArgumentError(
              fmt::format("messages[{}].content[{}].text must be a string", i, j));
        }
        if (j > 0) cm.content += "\n";
        cm.content += text->get<std::string>();
      }
    } else {
      return WrongType(fmt::format("messages[{}].content", i), "a string or a list of parts",
                       *content);
    }
    if (!model::IsValidUtf8(cm.content)) {
      return InvalidArgumentError(fmt::format("messages[{}].content is not valid UTF-8", i));
    }
    out.messages.push_back(std::move(cm));
  }
  return Status::Ok();
}

// Fields OpenAI defines that tandem does not implement: refused when set to
// anything but their neutral value, so a client never silently gets
// something other than what it asked for.
Status RefuseUnsupported(const json& body, Endpoint ep) {
  for (const char* k : {"presence_penalty", "frequency_penalty", "repetition_penalty"}) {
    if (const json* v = Field(body, k)) {
      if (!v->is_number()) return WrongType(k, "a number", *v);
      const double d = v->get<double>();
      if (d != 0.0 && !(std::string_view(k) == "repetition_penalty" && d == 1.0)) {
        return InvalidArgumentError(fmt::format("{} is not supported by this server (got {})", k, d));
      }
    }
  }
  if (const json* v = Field(body, "logprobs")) {
    if (!(v->is_boolean() && !v->get<bool>())) {
      return InvalidArgumentError("logprobs is not supported by this server");
    }
  }
  if (const json* v = Field(body, "top_logprobs"); v && !(v->is_number() && v->get<double>() == 0)) {
    return InvalidArgumentError("top_logprobs is not supported by this server");
  }
  if (const json* v = Field(body, "echo"); v && !(v->is_boolean() && !v->get<bool>())) {
    return InvalidArgumentError("echo is not supported by this server");
  }
  if (const json* v = Field(body, "best_of"); v && !(v->is_number_integer() && v->get<int64_t>() == 1)) {
    return InvalidArgumentError("best_of must be 1 (or unset)");
  }
  if (const json* v = Field(body, "logit_bias"); v && !(v->is_object() && v->empty())) {
    return InvalidArgumentError("logit_bias is not supported by this server");
  }
  if (const json* v = Field(body, "suffix"); v && !(v->is_string() && v->get<std::string>().empty())) {
    return InvalidArgumentError("suffix is not supported by this server");
  }
  if (ep == Endpoint::kChat) {
    if (const json* v = Field(body, "tools"); v && !(v->is_array() && v->empty())) {
      return InvalidArgumentError("tools is not supported by this server");
    }
    if (const json* v = Field(body, "response_format")) {
      const json* t = v->is_object() ? Field(*v, "type") : nullptr;
      if (!t || !t->is_string() || t->get<std::string>() != "text") {
        return InvalidArgumentError("response_format: only {\"type\": \"text\"} is supported");
      }
    }
  }
  return Status::Ok();
}

bool IsFieldChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' ||
         c == ']';
}

}  // namespace

Result<OpenAiRequest> ParseRequest(Endpoint endpoint, std::string_view body_text) {
  json body = json::parse(body_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return InvalidArgumentError("the request body is not valid JSON");
  if (!body.is_object()) return InvalidArgumentError("the request body must be a JSON object");
  OpenAiRequest out;
  out.endpoint = endpoint;
  auto& r = out.request;

  if (const json* v = Field(body, "model")) {
    if (!v->is_string()) return WrongType("model", "a string", *v);
    r.model = v->get<std::string>();
  }
  if (endpoint == Endpoint::kCompletions) {
    TANDEM_RETURN_IF_ERROR(ParsePrompt(body, out));
  } else {
    TANDEM_RETURN_IF_ERROR(ParseMessages(body, out));
  }
  TANDEM_RETURN_IF_ERROR(RefuseUnsupported(body, endpoint));

  if (const json* v = Field(body, "n")) {
    if (!v->is_number_integer() || v->get<int64_t>() != 1) {
      return InvalidArgumentError(fmt::format(
          "n must be 1 (one choice per request), got {}", v->dump()));
    }
  }
  TANDEM_ASSIGN_OR_RETURN(auto max_tokens, OptTokenCount(body, "max_tokens"));
  if (endpoint == Endpoint::kChat) {
    TANDEM_ASSIGN_OR_RETURN(auto mct, OptTokenCount(body, "max_completion_tokens"));
    if (mct) max_tokens = mct;  // the newer name wins when both are sent
  }
  r.max_tokens = max_tokens;
  TANDEM_ASSIGN_OR_RETURN(r.temperature, OptNumber(body, "temperature"));
  TANDEM_ASSIGN_OR_RETURN(r.top_p, OptNumber(body, "top_p"));
  TANDEM_ASSIGN_OR_RETURN(auto top_k, OptInteger(body, "top_k"));
  if (top_k) {
    if (*top_k < -1) return InvalidArgumentError(fmt::format("top_k must be -1 or 0 (off) or positive, got {}", *top_k));
    if (*top_k > std::numeric_limits<uint32_t>::max()) return InvalidArgumentError("top_k is too large");
    r.top_k = *top_k <= 0 ? 0u : static_cast<uint32_t>(*top_k);
  }
  TANDEM_ASSIGN_OR_RETURN(auto seed, OptInteger(body, "seed"));
  if (seed) r.seed = static_cast<uint64_t>(*seed);  // negative seeds are as good as any

  if (const json* v = Field(body, "stop")) {
    if (v->is_string()) {
      r.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (size_t i = 0; i < v->size(); ++i) {
        if (!(*v)[i].is_string()) return WrongType(fmt::format("stop[{}]", i), "a string", (*v)[i]);
        r.stop.push_back((*v)[i].get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or a list of strings", *v);
    }
  }
  if (const json* v = Field(body, "stop_token_ids")) {
    if (!v->is_array()) return WrongType("stop_token_ids", "a list of token ids", *v);
    TANDEM_ASSIGN_OR_RETURN(r.stop_token_ids, TokenIds(*v, "stop_token_ids"));
  }
  TANDEM_ASSIGN_OR_RETURN(r.ignore_eos, OptBool(body, "ignore_eos"));
  // Scheduling priority (vLLM's extra field; docs/scheduling.md).
  TANDEM_ASSIGN_OR_RETURN(auto priority, OptInteger(body, "priority"));
  if (priority) {
    if (*priority < std::numeric_limits<int32_t>::min() ||
        *priority > std::numeric_limits<int32_t>::max()) {
      return InvalidArgumentError(
          fmt::format("priority is {}; it must fit a 32-bit signed integer", *priority));
    }
    r.priority = static_cast<int32_t>(*priority);
  }
  TANDEM_ASSIGN_OR_RETURN(out.stream, OptBool(body, "stream"));
  if (const json* v = Field(body, "stream_options")) {
    if (!v->is_object()) return WrongType("stream_options", "an object", *v);
    TANDEM_ASSIGN_OR_RETURN(out.include_usage, OptBool(*v, "include_usage"));
    if (!out.stream) {
      return InvalidArgumentError("stream_options is only allowed when stream is true");
    }
  }
  return out;
}

std::string ToOpenAiMessage(const OpenAiRequest& r, std::string message) {
  auto replace_prefix = [&](std::string_view from, std::string_view to) {
    if (message.rfind(from, 0) == 0) message = std::string(to) + message.substr(from.size());
  };
  replace_prefix("sampling.", "");
  if (r.prompt_was_ids) replace_prefix("prompt_token_ids", "prompt");
  if (r.endpoint == Endpoint::kChat) {
    replace_prefix("prompt has", "messages have");  // context length, counted after the template
    replace_prefix("prompt_token_ids has", "messages have");  // the rendered chat is given as ids
    replace_prefix("prompt (", "messages (");
  }
  return message;
}

int HttpStatus(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition: return 400;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kAlreadyExists: return 409;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kCancelled: return 499;
    default: return 500;
  }
}

std::string ErrorBody(int http_status, const std::string& message) {
  const char* type = "internal_error";
  json code = nullptr;
  switch (http_status) {
    case 400: type = "invalid_request_error"; break;
    case 401: type = "invalid_request_error"; code = "invalid_api_key"; break;
    case 404: type = "invalid_request_error"; code = "model_not_found"; break;
    case 405: type = "invalid_request_error"; break;
    case 409: type = "invalid_request_error"; break;
    case 413: type = "invalid_request_error"; break;
    case 431: type = "invalid_request_error"; break;
    case 429: type = "rate_limit_error"; code = "rate_limit_exceeded"; break;
    case 503: type = "service_unavailable"; break;
    default: break;
  }
  json param = nullptr;
  if (http_status == 400) {
    size_t n = 0;
    while (n < message.size() && IsFieldChar(message[n])) ++n;
    // "temperature must ...", "messages[1].role is ...": a field name, not an English word.
    static const std::vector<std::string_view> kFields = {
        "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
        "ignore_eos", "logprobs", "echo", "best_of", "logit_bias", "presence_penalty",
        "frequency_penalty", "tools", "response_format", "suffix", "top_logprobs", "priority"};
    const std::string head = message.substr(0, n);
    const std::string base = head.substr(0, head.find_first_of(".["));
    for (auto f : kFields) {
      if (base == f) param = head;
    }
  }
  json j = {{"error", {{"message", message}, {"type", type}, {"param", param}, {"code", code}}}};
  return Dump(j);
}

const char* FinishName(proxy::Finish f) {
  switch (f) {
    case proxy::Finish::kStop: return "stop";
    case proxy::Finish::kLength: return "length";
    default: return "stop";
  }
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json UsageJson(const proxy::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens}}}};
}

namespace {

json Envelope(const ResponseMeta& m, bool chunk) {
  const bool chat = m.endpoint == Endpoint::kChat;
  return {{"id", m.id},
          {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", m.created},
          {"model", m.model}};
}

std::string Event(const json& j) { return "data: " + Dump(j) + "\n\n"; }

}  // namespace

std::string FullResponse(const ResponseMeta& m, const std::string& text, proxy::Finish finish,
                         const proxy::Usage& usage) {
  json j = Envelope(m, false);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", FinishName(finish)}};
  if (m.endpoint == Endpoint::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  j["usage"] = UsageJson(usage);
  return Dump(j);
}

std::string StreamDelta(const ResponseMeta& m, const std::string& text, bool first,
                        bool include_usage) {
  json j = Envelope(m, true);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (m.endpoint == Endpoint::kChat) {
    choice["delta"] = first ? json{{"role", "assistant"}, {"content", text}} : json{{"content", text}};
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  if (include_usage) j["usage"] = nullptr;
  return Event(j);
}

std::string StreamEnd(const ResponseMeta& m, proxy::Finish finish, const proxy::Usage& usage,
                      bool include_usage) {
  json j = Envelope(m, true);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", FinishName(finish)}};
  if (m.endpoint == Endpoint::kChat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  j["choices"] = json::array({choice});
  if (include_usage) j["usage"] = nullptr;
  std::string out = Event(j);
  if (include_usage) {
    json u = Envelope(m, true);
    u["choices"] = json::array();
    u["usage"] = UsageJson(usage);
    out += Event(u);
  }
  out += "data: [DONE]\n\n";
  return out;
}

std::string StreamError(int http_status, const std::string& message) {
  return "data: " + ErrorBody(http_status, message) + "\n\ndata: [DONE]\n\n";
}

}  // namespace tandem::http
