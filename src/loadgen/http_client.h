// Client over the OpenAI-compatible HTTP API (POST /v1/completions with
// `stream: true`, server-sent events), for `tandem bench serve --backend
// http` and any OpenAI-compatible server.
//
// What HTTP cannot give, compared with the gRPC client: the reply's token
// ids (so multi-turn workloads, which resend the reply, need gRPC) and the
// number of tokens in each event (each SSE event with text counts as one
// message of one token for ITL, as vLLM's benchmark does; output token
// counts come from the final `usage`).
#pragma once

#include <memory>
#include <string>

#include "loadgen/client.h"

namespace tandem::loadgen {

struct HttpClientOptions {
  std::string address;  // host:port of the HTTP API
  std::string api_key;  // sent as `Authorization: Bearer KEY` when set
  // /v1/models does not list a vocabulary size; synthetic prompts need it.
  uint32_t vocab_size = 0;
};

std::unique_ptr<Client> MakeHttpClient(const HttpClientOptions& o);

}  // namespace tandem::loadgen
