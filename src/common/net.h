// Small helpers for "host:port" addresses.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem {

struct HostPort {
  std::string host;
  uint16_t port = 0;  // 0 = pick a free port
  std::string ToString() const;
};

// Accepts "host:port" and "[v6]:port"; port 0..65535.
Result<HostPort> ParseHostPort(std::string_view address);

// Asks the kernel for a free TCP port on `host` (bind to port 0, read it
// back, close). Racy by nature: use only where a server cannot take port 0
// itself.
Result<uint16_t> PickFreePort(const std::string& host);

}  // namespace tandem
