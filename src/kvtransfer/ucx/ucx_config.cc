#include "kvtransfer/ucx/ucx_config.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>

namespace tandem::kvtransfer::ucx {

bool IsPeerLoss(ucs_status_t s) {
  return s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_CONNECTION_RESET ||
         s == UCS_ERR_UNREACHABLE || s == UCS_ERR_CANCELED || s == UCS_ERR_REJECTED ||
         s == UCS_ERR_NOT_CONNECTED || s == UCS_ERR_IO_ERROR;
}

Status UcsError(std::string_view what, ucs_status_t s) {
  std::string msg = fmt::format("{}: {} ({})", what, ucs_status_string(s), static_cast<int>(s));
  return IsPeerLoss(s) ? UnavailableError(std::move(msg)) : InternalError(std::move(msg));
}

std::vector<UcxDefault> UcxDefaults(double peer_timeout_s) {
  const int keepalive_ms = std::max(100, static_cast<int>(peer_timeout_s * 1000 / 3));
  return {
      {"KEEPALIVE_INTERVAL",
       fmt::format("{}ms", keepalive_ms),
       {"UCX_KEEPALIVE_INTERVAL"},
       "UCX's 20 s default notices a dead peer late; a third of peer_timeout_s bounds it"},
      // Shared-memory transports do not support UCP_ERR_HANDLING_MODE_PEER
      // unless asked; without this UCX silently picks TCP on one host.
      {"POSIX_ERROR_HANDLING",
       "y",
       {"UCX_POSIX_ERROR_HANDLING", "UCX_MM_ERROR_HANDLING"},
       "lets posix shared memory serve endpoints with peer error handling",
       true},
      {"SYSV_ERROR_HANDLING",
       "y",
       {"UCX_SYSV_ERROR_HANDLING", "UCX_MM_ERROR_HANDLING"},
       "lets sysv shared memory serve endpoints with peer error handling",
       true},
  };
}

namespace {
// Whether UCX_TLS (unset means "all") lets UCX use shared memory.
bool SharedMemoryAllowed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return true;
  const std::string t = tls;
  if (!t.empty() && t[0] == '^') return true;  // an exclusion list
  for (const char* name : {"all", "sm", "shm", "posix", "sysv", "mm"}) {
    if (t.find(name) != std::string::npos) return true;
  }
  return false;
}
}  // namespace

Result<std::vector<std::string>> ApplyUcxDefaults(ucp_config_t* config, double peer_timeout_s) {
  std::vector<std::string> applied;
  const bool shm = SharedMemoryAllowed();
  for (const UcxDefault& d : UcxDefaults(peer_timeout_s)) {
    // Shared-memory keys with UCX_TLS excluding shared memory would only
    // trigger UCX's "unused env variables" warning.
    if (d.via_environment && !shm) continue;
    bool operator_set = false;
    for (const std::string& env : d.env_names) operator_set |= std::getenv(env.c_str()) != nullptr;
    if (operator_set) continue;
    if (d.via_environment) {
      const std::string env = "UCX_" + d.key;
      if (setenv(env.c_str(), d.value.c_str(), /*overwrite=*/0) != 0) {
        return InternalError(fmt::format("setenv({}): {}", env, std::strerror(errno)));
      }
      applied.push_back(fmt::format("{}={}", d.key, d.value));
      continue;
    }
    const ucs_status_t s = ucp_config_modify(config, d.key.c_str(), d.value.c_str());
    if (s != UCS_OK) return UcsError(fmt::format("ucp_config_modify({}={})", d.key, d.value), s);
    applied.push_back(fmt::format("{}={}", d.key, d.value));
  }
  return applied;
}

std::string EndpointTransports(ucp_ep_h ep) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return "unknown (open_memstream failed)";
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string text(buf, size);
  std::free(buf);
  // Lane lines look like "#   lane[0]:  3:posix/memory.0 md[2]  ... rma_bw#0".
  static const std::regex kLane(
      R"(lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+)/([A-Za-z0-9_:.\-]+?)(\.\d+)?\s)");
  std::set<std::string> seen;
  std::string out;
  std::istringstream lines(text);
  std::string line;
  for (int n = 0; n < 1000 && std::getline(lines, line); ++n) {
    std::smatch m;
    if (!std::regex_search(line, m, kLane)) continue;
    std::string tl = m[1].str() + "/" + m[2].str();
    if (seen.insert(tl).second) out += (out.empty() ? "" : " ") + tl;
  }
  return out.empty() ? "unknown" : out;
}

}  // namespace tandem::kvtransfer::ucx
