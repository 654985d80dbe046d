// The Watch stream over framed TCP (issue 23, docs/serving-workers.md "Watch
// transport"): the same WatchRequest / WorkerUpdate messages as
// Worker.Watch, one watch per connection, each message one frame
// (common/frame_conn.h), mutual TLS when the internal plane is TLS (a
// client without a certificate of the fleet CA is refused; docs/security.md).
//
// The proxy's first frame is its WatchRequest; the worker then writes
// WorkerUpdate frames (a snapshot first) from its Watch monitor thread,
// inline: no hand-off to another thread, one TLS record and one send per
// update. A graceful end (the worker leaves) is a last update with
// `watch_ended` set, then the close; a connection that closes without it
// is a broken watch (the proxy takes the worker out of routing and probes
// it, as for a gRPC Watch that fails). A connection the proxy closes runs
// the worker's cancel hook (it registers again at once), as a cancelled
// gRPC Watch does.
#pragma once

#include <memory>

#include "common/frame_server.h"
#include "worker/worker_service.h"

namespace tandem::worker {

using WatchTcpOptions = FrameListenOptions;

// Serves the Watch stream of `service` (borrowed: it must outlive the
// server) on a new listener.
Result<std::unique_ptr<FrameServer>> ServeWatchTcp(WorkerService& service, WatchTcpOptions options);

}  // namespace tandem::worker
