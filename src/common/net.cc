#include "common/net.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

namespace tandem {

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<HostPort> ParseHostPort(std::string_view address) {
  const auto colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return InvalidArgumentError(
        fmt::format("address '{}' must be host:port (e.g. 127.0.0.1:50051)", address));
  }
  std::string_view host = address.substr(0, colon);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string_view port_s = address.substr(colon + 1);
  uint32_t port = 0;
  auto [ptr, ec] = std::from_chars(port_s.data(), port_s.data() + port_s.size(), port);
  if (ec != std::errc() || ptr != port_s.data() + port_s.size() || port > 65535) {
    return InvalidArgumentError(
        fmt::format("address '{}' has port '{}'; it must be an integer in [0, 65535]", address,
                    port_s));
  }
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

Result<uint16_t> PickFreePort(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return InternalError(fmt::format("socket(): {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    return InvalidArgumentError(fmt::format("'{}' is not an IPv4 address", host));
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return UnavailableError(fmt::format("bind({}:0): {}", host, std::strerror(err)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return static_cast<uint16_t>(ntohs(addr.sin_port));
}

}  // namespace tandem
