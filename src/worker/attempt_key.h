// The identity of one routing attempt of a request on a worker.
//
// The proxy may route the same request several times (a retry before the
// first token, a migration after it). An abandoned attempt lives on in a
// worker until its cancel lands there (a queued or running prefill, a
// registration whose reservation a prefiller may still write into), and the
// next attempt may reach the same worker before that. So workers key every
// request by its attempt: the decoder's registrations and reservations, the
// prefiller's jobs, the engine's requests and the request id a prefiller
// sends in Reserve and in its KvNotice are all "<request_id>#<attempt>".
// Attempt 0 (callers that do not count attempts) keeps the plain id.
#pragma once

#include <cstdint>
#include <string>

namespace tandem::worker {

inline std::string AttemptKey(const std::string& request_id, uint32_t attempt) {
  return attempt == 0 ? request_id : request_id + "#" + std::to_string(attempt);
}

}  // namespace tandem::worker
