// The load generator's view of a serving API: one streamed completion per
// call. The gRPC adapter (grpc_client.h) implements it over
// tandem.v1.Generation; an HTTP adapter (OpenAI /v1/completions with SSE)
// fits the same interface.
//
// Threads: Start, CancelAll and GetModelInfo may be called from any thread.
// `done` runs exactly once per Start, on a thread owned by the client; it
// must not block for long. The client must outlive every pending `done`.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::loadgen {

using Clock = std::chrono::steady_clock;

struct ModelInfo {
  std::string id;
  uint32_t max_model_len = 0;
  uint32_t vocab_size = 0;
  uint32_t block_size = 0;
};

struct Request {
  std::string request_id;
  std::string model;                    // empty: the server's default
  std::vector<uint32_t> prompt_token_ids;
  uint32_t max_tokens = 1;
  std::optional<float> temperature;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  std::chrono::milliseconds timeout{300000};
  std::string api_key;              // empty: the client's own (--api-key)
  std::optional<int32_t> priority;  // unset: the tenant's default
};

// One message of the stream as the client saw it.
struct Chunk {
  Clock::time_point at;
  uint32_t tokens = 0;
};

struct Reply {
  Status status;  // OK, or how the call failed
  Clock::time_point sent, done;
  std::vector<Chunk> chunks;           // messages that carried tokens, in order
  std::vector<uint32_t> token_ids;     // every token received
  std::string finish_reason;           // "stop", "length", "" when none
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_prompt_tokens = 0;  // usage
  bool has_usage = false;
};

class Client {
 public:
  virtual ~Client() = default;
  virtual void Start(Request request, std::function<void(Reply)> done) = 0;
  // Cancels every call in flight (each still gets its `done`, CANCELLED).
  virtual void CancelAll() = 0;
  // The server's model (the default one when `model` is empty).
  virtual Result<ModelInfo> GetModelInfo(const std::string& model) = 0;
  virtual std::string Describe() const = 0;
};

}  // namespace tandem::loadgen
