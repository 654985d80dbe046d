// relay-tcp, a channel of `tandem bench proxy`'s prompt-floor (issue 23):
// the least any proxy that splits prefill from decode does per prompt, in
// raw loopback TCP with none of the proxy's protocols, measured in the same
// run as the `prompt` workload. The floor server (`tandem bench
// proxy-floor-server --mode relay`, its own process, one thread sleeping in
// poll) plays the proxy:
//   - woken by the client's request (the prompt's bytes, as many as one
//     framed Prefill request of the run's prompt: the framed-mtls channel's
//     `request_bytes`), it forwards those bytes to the "prefiller" and a
//     64-byte registration to the "decoder", in the same wake-up;
//   - woken by the decoder's 32-byte first token, it sends a 32-byte
//     response to the client.
// Two wake-ups, two reads and three sends per prompt: no TLS, no HTTP/2 or
// gRPC framing, no parsing, hashing, routing, load or KV events, no reply
// from the prefiller. The bench process plays the client, the prefiller and
// the decoder (threads of its own; only the server's CPU is charged): one
// call at a time, back to back, or paced at the `prompt` workload's rate
// with the first token sent half a period after the prompt reached the
// prefiller, so that each of the server's two wake-ups follows an idle gap
// as a lone prompt's do. One call before the measured ones touches the
// server's code and buffers.
// Docs: docs/bench-serve.md, "tandem bench proxy".
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace tandem::cli {

// The server's side, after `listen_fd` (127.0.0.1) is announced: accepts the
// prefiller, the decoder and the client, in that order; relays `calls`
// prompts of `prompt_bytes`; then shuts the connections down for writing
// and waits to be killed. 0 on success.
int ServeRelayFloor(int listen_fd, uint64_t calls, uint32_t prompt_bytes);

struct RelayPass {
  uint32_t ok = 0;      // calls whose response came back
  double server_s = 0;  // the server's CPU over the measured calls
  double wall_s = 0;
};

// The bench's side: spawns `self bench proxy-floor-server --mode relay`,
// makes one unmeasured call, then `calls` measured ones (`rate_per_s` > 0:
// call i leaves at t0 + i / rate; else each after the previous response).
Result<RelayPass> RunRelayFloor(const std::string& self, uint32_t calls, uint32_t prompt_bytes,
                                double rate_per_s);

}  // namespace tandem::cli
