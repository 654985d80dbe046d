#include "worker/advertise.h"

#include <fmt/format.h>

namespace tandem::worker {

Result<HostPort> ParseAdvertise(const std::string& a) {
  const std::string expect = fmt::format(
      "--advertise must be HOST or HOST:PORT (IPv6 in brackets) with a host peers can reach "
      "(not 0.0.0.0 or ::) and a port in [1, 65535], got '{}'",
      a);
  const bool has_port = a.starts_with('[') ? a.find("]:") != std::string::npos
                                           : a.find(':') != std::string::npos;
  HostPort hp;
  if (has_port) {
    auto parsed = ParseHostPort(a);
    if (!parsed.ok() || parsed->port == 0) return InvalidArgumentError(expect);
    hp = *parsed;
  } else {
    hp.host = a.size() > 2 && a.front() == '[' && a.back() == ']' ? a.substr(1, a.size() - 2) : a;
  }
  const bool unbracketed_v6 = !a.starts_with('[') && hp.host.find(':') != std::string::npos;
  const bool bad_char = unbracketed_v6 || hp.host.find_first_of(" \t/[]") != std::string::npos;
  if (hp.host.empty() || hp.host.size() > 253 || bad_char || hp.host == "0.0.0.0" ||
      hp.host == "::") {
    return InvalidArgumentError(expect);
  }
  return hp;
}

std::string Advertised(const std::string& address, const HostPort& advertise, bool use_port) {
  auto bound = ParseHostPort(address);
  if (!bound.ok()) return address;
  HostPort out{advertise.host, bound->port};
  if (use_port && advertise.port != 0) out.port = advertise.port;
  return out.ToString();
}

}  // namespace tandem::worker
