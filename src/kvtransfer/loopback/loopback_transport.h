// Backend "loopback": peers in the same process, data moved by memcpy on the
// writer's progress thread. For unit tests of everything above the
// transport, with fault injection:
//   - delay: TransportOptions::loopback_delay_per_put_us sleeps before each put;
//   - drop the peer: LoopbackDropPeer makes a live pool unreachable, as if its
//     process died (destroying the transport does the same);
//   - stale handle: LoopbackRestartPeer gives an agent a new generation, as if
//     it restarted, so descriptors and PeerIds issued before are stale.
// Notifications are delivered on the writer's progress thread.
#pragma once

#include <memory>
#include <string>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

Result<std::unique_ptr<Transport>> CreateLoopbackTransport(const TransportOptions& options);

// Any thread. NOT_FOUND if no live loopback transport has that name.
Status LoopbackDropPeer(const std::string& agent_name);
// Any thread. Returns the agent's new generation.
Result<uint64_t> LoopbackRestartPeer(const std::string& agent_name);

}  // namespace tandem::kvtransfer
