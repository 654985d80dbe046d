// UCX helpers: Status from ucs_status_t, environment defaults, and a
// readable list of the transports an endpoint uses. Any thread unless noted.
#pragma once

#include <ucp/api/ucp.h>

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::kvtransfer::ucx {

// INTERNAL (or UNAVAILABLE for peer-loss codes) with "what: ucs message".
Status UcsError(std::string_view what, ucs_status_t s);
// Whether `s` means the peer is gone or unreachable.
bool IsPeerLoss(ucs_status_t s);

// A default tandem applies to the UCX configuration: `key` without the UCX_
// prefix. Applied only where none of `env_names` is set in the environment,
// so the operator always wins.
struct UcxDefault {
  std::string key;
  std::string value;
  std::vector<std::string> env_names;
  std::string why;
  // Transport-level keys are not accepted by ucp_config_modify in UCX 1.13
  // ("invalid configurations"); they are set in the environment instead
  // (setenv without overwrite) before the first ucp_config_read.
  bool via_environment = false;
};
std::vector<UcxDefault> UcxDefaults(double peer_timeout_s);
// Applies the defaults the environment does not override to `config` (or
// to the environment, see via_environment); returns "KEY=value" for each
// one applied. Call before any other thread reads the environment.
Result<std::vector<std::string>> ApplyUcxDefaults(ucp_config_t* config, double peer_timeout_s);

// "posix/memory sysv/memory tcp/lo": the distinct transport/device pairs of
// `ep`'s lanes, from ucp_ep_print_info. Call on the worker's thread.
std::string EndpointTransports(ucp_ep_h ep);

}  // namespace tandem::kvtransfer::ucx
