// A worker's --advertise (worker_runtime.h): the host (and port) peers use
// to reach it, applied to the addresses it bound.
#pragma once

#include <string>

#include "common/net.h"
#include "common/status.h"

namespace tandem::worker {

// --advertise HOST[:PORT]; port 0 when not given. INVALID_ARGUMENT naming
// the flag and what it must be.
Result<HostPort> ParseAdvertise(const std::string& a);

// The bound `address` with its host replaced by --advertise's (and its port
// too when --advertise has one and `use_port`).
std::string Advertised(const std::string& address, const HostPort& advertise, bool use_port);

}  // namespace tandem::worker
