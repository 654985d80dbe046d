// libFuzzer target: the HTTP API's request path without sockets — an
// OpenAI JSON body (/v1/completions or /v1/chat/completions, chosen by the
// first byte) through http::ParseRequest, the chat template for chat
// bodies, then the shared validator, as the HTTP server runs them.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "http/openai.h"
#include "model/chat_template.h"

namespace {

std::vector<uint32_t> ByteTokens(std::string_view text) {
  std::vector<uint32_t> ids;
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  if (size == 0) return 0;
  namespace http = tandem::http;
  const auto endpoint = (data[0] & 1) ? http::Endpoint::kChat : http::Endpoint::kCompletions;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto r = http::ParseRequest(endpoint, body);
  if (!r.ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  tandem::proxy::ClientRequest req = r->request;
  if (endpoint == http::Endpoint::kChat) {
    static const auto tmpl = tandem::model::ChatTemplate::FromName("chatml");
    if (!tmpl.ok()) __builtin_trap();
    auto text = tmpl->Render(r->messages);
    if (!text.ok()) return 0;
    req.has_prompt = true;
    req.prompt = *text;
  }
  tandem::proxy::ServingLimits limits;
  limits.model = "tandem-kjv";
  limits.vocab_size = 256;
  limits.max_model_len = 4096;
  auto v = tandem::proxy::ValidateRequest(req, limits, ByteTokens, 1);
  if (!v.ok()) (void)http::ToOpenAiMessage(*r, v.status().message());
  return 0;
}
