// Request ids inside a fleet (docs/security.md, "Hostile input").
//
// Clients may name their requests (gRPC `request_id`, HTTP `X-Request-Id`),
// but a client's id is only a label: two clients may pick the same one. So
// the proxy gives every request a fleet id, 128 random bits (getrandom) as
// 32 hex digits, and the workers key their state by it (with the attempt,
// worker/attempt_key.h). The label rides along for logs:
//   "<label>~<32 hex>"   a request the client named
//   "<32 hex>"           one it did not (its responses echo the hex)
// Ids of other requests cannot be guessed, so no client can collide with
// another's request, on the proxy or on any worker.
#pragma once

#include <string>
#include <string_view>

namespace tandem {

inline constexpr size_t kFleetNonceChars = 32;
inline constexpr char kFleetIdSeparator = '~';

// 32 hex digits from 16 random bytes of the kernel's CSPRNG (getrandom(2),
// one call per 256 ids, through a per-thread pool; a forked child starts
// with an empty pool). Aborts only if the kernel's random source fails,
// which a running Linux never does.
std::string RandomHex128();

// A new fleet id for a request labelled `client_label` ("" = none).
std::string NewFleetRequestId(std::string_view client_label);

struct FleetIdParts {
  std::string_view label;  // the client's id, or the nonce when it gave none
  std::string_view nonce;  // the 32 hex digits ("" when `id` is not a fleet id)
};
// Splits a fleet id (without the "#attempt" suffix). An id that is not one
// (tests, workers driven directly) is all label.
FleetIdParts SplitFleetRequestId(std::string_view id);

}  // namespace tandem
